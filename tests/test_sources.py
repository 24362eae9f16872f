"""Local path or Hub repository (longppl.models.sources): the one rule every entry point uses for a model, a
corpus or a key-token cache. A Hub stand-in on 127.0.0.1 answers for the Hub (no network); the
commands run in a child Python, whose stderr and imports are checked (one line, before torch)."""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
from conftest import REPO

from longppl.models import sources
from longppl.models.sources import HUB_TIMEOUT_S, check_model_source, locate


@pytest.fixture(autouse=True)
def empty_hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face cache, online, and no Hub answer remembered from another test."""
    for name in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_DATASETS_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(sources, "_FOUND_ON_HUB", set())
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path / "hf"


@pytest.fixture
def hub_asked(monkeypatch):
    """The repositories the Hub is asked about, as ``(repo_id, repo_type, timeout)``; the stand-in
    raises what ``hub_asked.answer`` holds (a connection error by default)."""
    from huggingface_hub import HfApi

    asked = []

    def repo_info(self, repo_id, *, repo_type=None, timeout=None, **kwargs):
        asked.append((repo_id, repo_type, timeout))
        raise asked_answer[0]

    asked_answer = [ConnectionError("no route to host")]
    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    return asked


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def hub_stand_in(monkeypatch):
    """An HTTP server on 127.0.0.1 that answers the Hub's repository API: repositories whose name
    contains 'missing' do not exist, all others do. Yields the request paths it got."""
    paths = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            if "missing" in self.path:
                body = b'{"error": "Repository not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
            else:
                body = json.dumps({"id": self.path.split("/", 3)[-1], "sha": "0" * 40, "private": False}).encode()
                self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield paths
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.parametrize("name", ["./no_such_dir", "../no_such_dir", "/no/such/dir", "~/no_such_dir", "a/b/c", "a\\b"])
@pytest.mark.parametrize("repo_type", ["model", "dataset"])
def test_a_missing_path_is_never_looked_up_on_the_hub(name, repo_type, hub_asked, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^--corpus {re.escape(repr(name))} is not an existing directory \(no such path here\), "
        r"nor a Hub id \('name' or 'org/name'\), so it was not looked up on the Hub: pass X\.$",
    ):
        locate(name, repo_type, "--corpus", "pass X.")
    assert hub_asked == []


def test_an_existing_path_is_local_even_when_it_reads_as_a_hub_id(tmp_path, monkeypatch, hub_asked):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert locate("org/name", "dataset") == sources.Location("org/name", True, "org/name")
    assert hub_asked == []


@pytest.mark.parametrize(
    "repo_type, download", [("model", "hf download org/nope`"), ("dataset", "--repo-type dataset`")]
)
def test_offline_a_hub_id_not_in_the_cache_fails_at_once(repo_type, download, hub_asked, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError,
        match=rf"^key_tokens='org/nope' is not an existing directory \(no such path here\), and as a Hub {repo_type} "
        r"id it is not in the local Hugging Face cache .*offline \(HF_HUB_OFFLINE=1\).*" + download,
    ):
        locate("org/nope", repo_type, "key_tokens")
    assert hub_asked == []


@pytest.mark.parametrize(
    "repo_type, folder",
    [
        ("model", "hub/models--org--cached/snapshots/" + "0" * 40),
        ("dataset", "hub/datasets--org--cached/snapshots/" + "0" * 40),
        ("dataset", "datasets/org___cached/default/0.0.0/abc"),  # datasets' own cache of a prepared dataset
    ],
)
def test_a_hub_id_in_the_local_cache_goes_on_without_asking(repo_type, folder, empty_hf_home, hub_asked, monkeypatch):
    for offline in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        with pytest.raises(ValueError, match="org/cached"):
            locate("org/cached", repo_type)
    (empty_hf_home / folder).mkdir(parents=True)
    for offline in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        assert locate("org/cached", repo_type) == sources.Location("org/cached", False, "org/cached")
    assert hub_asked == [("org/cached", repo_type, HUB_TIMEOUT_S)]  # the one online call while not cached


def test_an_unreachable_hub_is_asked_once_with_a_short_timeout(hub_asked):
    with pytest.raises(
        ValueError,
        match=r"^--evaluator 'models/nope' is not an existing directory \(no such path here\), and the Hub could "
        r"not be reached to look it up as a model id \(https?://\S+: ConnectionError: no route to host\), nor is "
        r"it in the local Hugging Face cache; check the name, or the network \(a proxy: HTTPS_PROXY\): pass X\.$",
    ):
        locate("models/nope", "model", "--evaluator", "pass X.")
    assert hub_asked == [("models/nope", "model", HUB_TIMEOUT_S)]
    assert HUB_TIMEOUT_S <= 10


def test_the_real_http_client_failing_to_connect_is_one_error(monkeypatch):
    """huggingface_hub's own client (whose error classes change across its versions) against a
    port where nothing listens."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"^corpus='org/corpus' .* the Hub could not be reached .*dataset id"):
        locate("org/corpus", "dataset", "corpus")


def test_the_hub_answer_decides_and_is_asked_once_per_repository(hub_stand_in):
    assert locate("org/corpus", "dataset") == sources.Location("org/corpus", False, "org/corpus")
    assert locate("org/corpus", "dataset").local is False  # remembered: not asked again
    assert check_model_source("gpt2") == "gpt2"
    with pytest.raises(
        ValueError,
        match=r"^--key-tokens 'org/missing' is not an existing directory \(no such path here\), nor a dataset on "
        r"the Hub \(http://127\.0\.0\.1:\d+ has no dataset repository 'org/missing', or it is private",
    ):
        locate("org/missing", "dataset", "--key-tokens")
    assert hub_stand_in == ["/api/datasets/org/corpus", "/api/models/gpt2", "/api/datasets/org/missing"]


def test_a_model_folder_without_model_or_tokenizer_files_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError,
        match=r"^--evaluator '.*empty' is a folder with no model or tokenizer files \(no tokenizer\.json or "
        r"tokenizer_config\.json, no config\.json, no weights; it holds nothing\): pass the directory",
    ):
        check_model_source(str(empty), "--evaluator")
    (empty / "config.json").write_text("{}")
    assert check_model_source(str(empty)) == str(empty)  # a model's config: loading says what else is missing
    with pytest.raises(
        ValueError,
        match=r"'.*empty' is a folder with no tokenizer files \(no tokenizer\.json or tokenizer_config\.json; "
        r"it holds config\.json\)",
    ):
        check_model_source(str(empty), "model_id", tokenizer=True)


# The command runs as its console script does (prog from argv[0]); the child reports, on stdout at
# exit, which heavy modules it imported.
COMMAND = r"""
import atexit, json, runpy, sys
HEAVY = ("torch", "transformers", "datasets", "accelerate")
atexit.register(lambda: print(json.dumps([m for m in HEAVY if m in sys.modules])))
module, sys.argv = sys.argv[1], sys.argv[2:]
runpy.run_module(module, run_name="__main__")  # argv[0] stays the command's name
"""


def run_command(module, args, cwd, **env):
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.lower().endswith("_proxy") and key != "HF_HUB_OFFLINE"
    }
    environment.update(
        PYTHONPATH=os.pathsep.join([os.path.join(REPO, "metrics"), os.path.join(REPO, "trainer")]),
        HF_HOME=str(cwd / "hf"),
        LONGPPL_AUTO_REGISTER="0",
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",  # an unreachable Hub, without the network
        **env,
    )
    done = subprocess.run(
        [sys.executable, "-c", COMMAND, module, *args], cwd=cwd, env=environment, capture_output=True, text=True
    )
    return done.returncode, done.stderr, json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "module, args, env, message",
    [
        (
            "longppl.tools.compute_key_tokens",
            ["longppl-score", "--corpus", "./no_such_dir", "--evaluator", "x", "--output", "o"],
            {},
            r"--corpus './no_such_dir' is not an existing directory \(no such path here\), nor a Hub id",
        ),
        (
            "longppl.tools.evaluate_models",
            ["longppl-evaluate", "--key-tokens", "./no_such_cache", "--models", "x"],
            {},
            r"--key-tokens './no_such_cache' is not an existing directory \(no such path here\), nor a Hub id",
        ),
        (
            "longppl.tools.compute_key_tokens",
            ["longppl-score", "--corpus", "c.jsonl", "--evaluator", "models/nope", "--output", "o"],
            {},
            r"--evaluator 'models/nope' .*the Hub could not be reached to look it up as a model id",
        ),
        (
            "longppl.tools.evaluate_models",
            ["longppl-evaluate", "--key-tokens", "not_a_cache", "--models", "x"],
            {},
            r"--key-tokens 'not_a_cache' .*the Hub could not be reached to look it up as a dataset id",
        ),
        (
            "longppl.tools.evaluate_models",
            ["longppl-evaluate", "--key-tokens", "not_a_cache", "--models", "x"],
            {"HF_HUB_OFFLINE": "1"},
            r"--key-tokens 'not_a_cache' .*as a Hub dataset id it is not in the local Hugging Face cache",
        ),
        (
            "longppl.tools.compute_key_tokens",
            ["longppl-score", "--corpus", "c.jsonl", "--evaluator", "empty", "--output", "o"],
            {},
            r"--evaluator 'empty' is a folder with no model or tokenizer files .*it holds nothing",
        ),
    ],
)
def test_commands_refuse_a_name_in_one_line_before_loading_torch(tmp_path, module, args, env, message):
    (tmp_path / "c.jsonl").write_text('{"text": "a text"}\n', encoding="utf-8")
    (tmp_path / "empty").mkdir()
    code, stderr, heavy = run_command(module, args, tmp_path, **env)
    assert code == 1
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"{args[0]}: error: ")
    assert re.search(message, stderr), stderr
    assert heavy == []  # decided before torch, datasets or transformers load: in about a second
    assert not (tmp_path / "o").exists()
