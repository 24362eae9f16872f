"""`python -m longppl.register`: evaluate.load("longppl") by its bare name, offline, from any directory."""

import os
import shutil
import subprocess
import sys

import evaluate
import pytest
from evaluate.loading import CachedEvaluationModuleFactory, LocalEvaluationModuleFactory, files_to_hash

import longppl
from longppl import register

ENTRY = os.path.join("evaluate_modules", "metrics", "evaluate-metric--longppl")


def offline_env(tmp_path, modules_cache):
    """A fresh environment: evaluate offline, its caches under tmp_path."""
    env = dict(os.environ, HF_EVALUATE_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"),
               HF_MODULES_CACHE=str(modules_cache))
    env.pop("HF_EVALUATE_CACHE", None)
    return env


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A module cache filled by the documented command, run as a user would."""
    tmp_path = tmp_path_factory.mktemp("registered")
    modules_cache = tmp_path / "modules"
    env = offline_env(tmp_path, modules_cache)
    done = subprocess.run([sys.executable, "-m", "longppl.register"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Registered the LongPPL metric at" in done.stdout
    return tmp_path, modules_cache, env


def test_bare_name_loads_our_metric_offline_from_a_fresh_directory(registered):
    tmp_path, modules_cache, env = registered
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code = ("import evaluate, inspect; m = evaluate.load('longppl'); "
            "print(type(m).__name__, inspect.getfile(type(m)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=fresh, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    name, path = done.stdout.split()
    code_hash = files_to_hash(register.module_files())
    assert name == "LongPPL"
    assert path == str(modules_cache / ENTRY / code_hash / "longppl.py")


def test_copy_is_what_evaluate_itself_makes_of_the_module(registered, tmp_path):
    _, modules_cache, _ = registered
    ours = sorted((modules_cache / ENTRY).glob("?" * 64))
    assert len(ours) == 1
    # evaluate's own copy of the same module (as it does for a local path or a Hub download)
    theirs_root = tmp_path / "theirs"
    theirs_root.mkdir()
    module = LocalEvaluationModuleFactory(
        os.path.join(longppl.METRIC_PATH, "longppl.py"), dynamic_modules_path=str(theirs_root)
    ).get_module()
    theirs = theirs_root / "metrics" / "longppl" / module.hash
    assert ours[0].name == module.hash
    assert sorted(os.listdir(ours[0])) == sorted(os.listdir(theirs) + ["README.md"])
    for name in os.listdir(theirs):
        if name.endswith(".py"):
            assert (ours[0] / name).read_bytes() == (theirs / name).read_bytes(), name
    assert not [p for p in (modules_cache / ENTRY).iterdir() if p.name.startswith(".")]  # no staging left


def test_registering_again_makes_that_copy_the_one_loaded(tmp_path):
    modules_cache = tmp_path / "modules"
    other = tmp_path / "other"
    shutil.copytree(longppl.METRIC_PATH, other, ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "longppl.py", "a", encoding="utf-8") as handle:
        handle.write("\n# another version\n")
    first = register.register_metric(str(modules_cache))
    second = register.register_metric(str(modules_cache), folder=str(other))
    assert first != second
    dynamic = str(modules_cache / "evaluate_modules")
    picked = CachedEvaluationModuleFactory("evaluate-metric--longppl", dynamic_modules_path=dynamic).get_module()
    assert picked.hash == os.path.basename(second)
    for folder in (first, second):  # both older than the next registration, whatever the clock's grain
        os.utime(os.path.join(folder, "longppl.py"), (1, 1))
    assert register.register_metric(str(modules_cache)) == first
    picked = CachedEvaluationModuleFactory("evaluate-metric--longppl", dynamic_modules_path=dynamic).get_module()
    assert picked.hash == os.path.basename(first)


def test_cache_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    # A path under a regular file: mkdir fails even for root (chmod does not stop root).
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = blocker / "modules"
    with pytest.raises(OSError, match=f"module cache {cache} is not writable.*Set HF_MODULES_CACHE"):
        register.register_metric(str(cache))
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", cache)  # what the command reads
    with pytest.raises(SystemExit) as exit_info:
        register.main([])
    assert f"module cache {cache} is not writable" in str(exit_info.value.code)
    assert "Set HF_MODULES_CACHE to a writable folder" in str(exit_info.value.code)


def test_failed_copy_leaves_nothing_half_written(tmp_path, monkeypatch):
    modules_cache = tmp_path / "modules"
    real_copy = shutil.copyfile
    copied = []

    def copy_then_fail(source, destination):
        if copied:
            raise OSError(28, "No space left on device", destination)
        copied.append(destination)
        return real_copy(source, destination)

    monkeypatch.setattr(register.shutil, "copyfile", copy_then_fail)
    with pytest.raises(OSError, match="not writable \\(No space left on device\\)"):
        register.register_metric(str(modules_cache))
    entry = modules_cache / ENTRY
    assert copied and not [p.name for p in entry.iterdir() if p.is_dir()]
