"""`python -m longppl.register`: evaluate.load("longppl") by its bare name, offline, from any directory."""

import importlib
import logging
import os
import shutil
import sys

import evaluate
import pytest
from evaluate.loading import CachedEvaluationModuleFactory, LocalEvaluationModuleFactory, files_to_hash
from helpers import run_guarded

import longppl
from longppl import register

ENTRY = os.path.join("evaluate_modules", "metrics", "evaluate-metric--longppl")


def offline_env(tmp_path, modules_cache):
    """A fresh environment: evaluate offline, its caches under tmp_path."""
    env = dict(
        os.environ,
        HF_EVALUATE_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "home"),
        HF_MODULES_CACHE=str(modules_cache),
    )
    env.pop("HF_EVALUATE_CACHE", None)
    return env


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A module cache filled by the documented command, run as a user would."""
    tmp_path = tmp_path_factory.mktemp("registered")
    modules_cache = tmp_path / "modules"
    env = offline_env(tmp_path, modules_cache)
    done = run_guarded(
        [sys.executable, "-m", "longppl.register"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "Registered the LongPPL metric at" in done.stdout
    return tmp_path, modules_cache, env


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_bare_name_loads_our_metric_offline_from_a_fresh_directory(registered):
    tmp_path, modules_cache, env = registered
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code = "import evaluate, inspect; m = evaluate.load('longppl'); print(type(m).__name__, inspect.getfile(type(m)))"
    done = run_guarded([sys.executable, "-c", code], cwd=fresh, env=env, capture_output=True, text=True)
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


# `import longppl` keeps the registration current, and explains evaluate's cache notice.

LOAD = (
    "import longppl, evaluate, inspect; m = evaluate.load('longppl'); print(type(m).__name__, inspect.getfile(type(m)))"
)
NOTICE = "couldn't be found locally at evaluate-metric--longppl, or remotely on the Hugging Face Hub"


def _python(code, cwd, env):
    return run_guarded([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_import_registers_a_missing_copy_and_the_bare_name_loads_quietly(tmp_path):
    modules_cache = tmp_path / "modules"
    env = offline_env(tmp_path, modules_cache)
    done = _python(LOAD, tmp_path, env)
    assert done.returncode == 0, done.stderr
    name, path = done.stdout.split()
    assert name == "LongPPL"
    assert path == str(modules_cache / ENTRY / files_to_hash(register.module_files()) / "longppl.py")
    assert NOTICE not in done.stderr and "Using the latest cached version" not in done.stderr


def test_import_refreshes_a_stale_copy_once(tmp_path, monkeypatch):
    modules_cache = tmp_path / "modules"
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", modules_cache)  # what evaluate.load reads
    monkeypatch.delenv("LONGPPL_AUTO_REGISTER", raising=False)
    assert register.loaded_copy(str(modules_cache)) is None
    older = tmp_path / "older"
    shutil.copytree(longppl.METRIC_PATH, older, ignore=shutil.ignore_patterns("__pycache__"))
    with open(older / "longppl.py", "a", encoding="utf-8") as handle:
        handle.write("\nOLDER = True\n")
    stale = register.register_metric(str(modules_cache), folder=str(older))
    assert register.loaded_copy(str(modules_cache)) == stale and not register.is_current(stale)
    fresh = register.ensure_registered()
    assert fresh != stale and register.loaded_copy(str(modules_cache)) == fresh and register.is_current(fresh)
    written = os.stat(os.path.join(fresh, "longppl.py")).st_mtime_ns
    assert register.ensure_registered() == fresh
    assert os.stat(os.path.join(fresh, "longppl.py")).st_mtime_ns == written  # current: nothing rewritten


def test_auto_registration_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")
    monkeypatch.setenv("LONGPPL_AUTO_REGISTER", "0")
    assert register.ensure_registered() is None
    assert not (tmp_path / "modules").exists()


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_import_never_fails_on_a_cache_it_cannot_write(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = offline_env(tmp_path, blocker / "modules")
    done = _python("import longppl; print(longppl.METRIC_PATH)", tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == longppl.METRIC_PATH
    assert "longppl could not register its metric for evaluate.load('longppl')" in done.stderr
    assert "is not writable" in done.stderr
    assert "set HF_MODULES_CACHE to a writable folder and run `python -m longppl.register`" in done.stderr
    assert "evaluate.load(longppl.METRIC_PATH) works regardless" in done.stderr


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_an_older_copy_is_named_as_such_instead_of_couldnt_be_found(tmp_path):
    modules_cache = tmp_path / "modules"
    older = tmp_path / "older"
    shutil.copytree(longppl.METRIC_PATH, older, ignore=shutil.ignore_patterns("__pycache__"))
    with open(older / "longppl.py", "a", encoding="utf-8") as handle:
        handle.write("\n# an older version\n")
    stale = register.register_metric(str(modules_cache), folder=str(older))
    env = dict(offline_env(tmp_path, modules_cache), LONGPPL_AUTO_REGISTER="0")  # keep the older copy
    done = _python(LOAD, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == os.path.join(stale, "longppl.py")
    assert NOTICE not in done.stderr
    assert (
        f"evaluate.load is loading the LongPPL metric registered at {stale}, which is not the code of the "
        "installed longppl package"
    ) in done.stderr
    assert "run `python -m longppl.register` to refresh it, or load longppl.METRIC_PATH." in done.stderr


def test_other_log_records_pass_the_filter():
    notice = register.CachedCopyNotice()
    record = logging.LogRecord("evaluate.loading", logging.WARNING, __file__, 1, "Using %s", ("accuracy",), None)
    assert notice.filter(record) and record.getMessage() == "Using accuracy"


@pytest.mark.parametrize(
    "variables",
    [
        {},
        {"HF_HOME": "/somewhere/hf"},
        {"XDG_CACHE_HOME": "/xdg"},
        {"HF_HOME": "/somewhere/hf", "HF_MODULES_CACHE": "/modules/here"},
    ],
)
def test_cache_location_without_evaluate_is_evaluates(variables, monkeypatch):
    for name in ("HF_HOME", "HF_MODULES_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    try:
        importlib.reload(evaluate.config)  # evaluate reads the environment when its config is imported
        assert register.modules_cache_location(dict(os.environ)) == str(evaluate.config.HF_MODULES_CACHE)
        assert register.DYNAMIC_MODULES == evaluate.config.MODULE_NAME_FOR_DYNAMIC_MODULES
    finally:
        monkeypatch.undo()
        importlib.reload(evaluate.config)
