"""The scripts' CPU thread policy (longppl.commandline.threads): one torch thread for tiny models, unless the user set OMP_NUM_THREADS."""

import os
import sys

import pytest
import torch
from helpers import run_guarded

from longppl.commandline.threads import child_thread_env, choose_torch_threads, requested_threads


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_empty_uses_the_workloads_count(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    torch.set_num_threads(2)  # torch's default on this two-core machine
    assert choose_torch_threads(1) == 1
    assert torch.get_num_threads() == 1


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(1)
    assert choose_torch_threads(1) == 2
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_a_bad_setting_says_what_to_set(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{value}' is not a positive integer.*or unset it"):
        choose_torch_threads(1)


def test_a_bad_count_is_refused():
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        choose_torch_threads(0)


def test_child_processes_get_the_count_unless_the_user_chose():
    assert child_thread_env({"PATH": "/bin"})["OMP_NUM_THREADS"] == "1"
    assert child_thread_env({"OMP_NUM_THREADS": ""}, threads=2)["OMP_NUM_THREADS"] == "2"
    assert child_thread_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert requested_threads({"OMP_NUM_THREADS": "3"}) == 3


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_quickstart_says_what_to_set_instead_of_a_traceback(repo_root, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="abc", HF_MODULES_CACHE=str(tmp_path / "modules"), LONGPPL_AUTO_REGISTER="0")
    done = run_guarded(
        [sys.executable, os.path.join(repo_root, "scripts", "quickstart.py"), "--steps", "1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "quickstart.py: error: OMP_NUM_THREADS='abc' is not a positive integer" in done.stderr
    assert "Traceback" not in done.stderr
