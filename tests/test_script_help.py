"""Every script answers `--help` without loading torch (or transformers, datasets, evaluate, accelerate),
and every option says what it is, and its default where it takes a value."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

HEAVY = ("torch", "transformers", "datasets", "evaluate", "accelerate", "gradio")
# A child Python runs the script's main module with `--help`, stdout captured, and reports what
# was imported: an assertion on imports, not on a machine-dependent time.
RUNNER = r"""
import contextlib, io, json, runpy, sys
path, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, sys.argv[1].rsplit("/", 1)[0])  # as when the script runs: its folder first
sys.argv = [path, *args]
out = io.StringIO()
code = None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"code": code, "help": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""
CACHE_CLI = r"""
import argparse, json, sys
from longppl.tools.cache_cli import add_cache_arguments
parser = argparse.ArgumentParser(prog="shared")
add_cache_arguments(parser)
print(json.dumps({"code": 0, "help": parser.format_help(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""
SCRIPTS = [
    ("quickstart.py",),
    ("compute_key_tokens.py",),
    ("bench_longce.py",),
    ("bench_longppl.py",),
    ("bench_multi_gpu.py",),
    ("bench_multi_gpu.py", "score"),
    ("bench_multi_gpu.py", "train"),
    ("push_metric_to_hub.py",),
]
# Options whose help another change rewrites (compute_key_tokens' --max-length): they must have a
# help text, but its default is that change's to state.
NOT_OURS = {("compute_key_tokens.py", "--max-length")}


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """evaluate's module cache with the metric registered, as after the README's first command: the
    first `import longppl` into a missing or stale cache registers it, a one-off that loads evaluate."""
    from longppl import register

    cache = tmp_path_factory.mktemp("modules")
    register.register_metric(str(cache))
    return str(cache)


def _run(code: str, *args: str, modules_cache: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", HF_MODULES_CACHE=modules_cache)
    done = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{code}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def option_helps(text: str) -> dict[str, str]:
    """``{option or positional: its help text}`` from argparse's help (the help may start on the next line)."""
    helps, current = {}, None
    section = False
    for line in text.splitlines():
        if re.match(r"^(options|positional arguments):$", line):
            section = True
            continue
        if not section or not line.strip():
            section = section and bool(line.strip())
            continue
        entry = re.match(r"^  (\S.*?)(?:\s{2,}(.*))?$", line)
        if entry and not line.startswith(" " * 6):
            current = entry.group(1).split(",")[-1].split()[0]
            helps[current] = entry.group(2) or ""
        elif current is not None:
            helps[current] = (helps[current] + " " + line.strip()).strip()
    return helps


@pytest.mark.parametrize("script", SCRIPTS, ids=" ".join)
def test_help_is_light_and_complete(script, modules_cache):
    name, *command = script
    result = _run(RUNNER, os.path.join(REPO, "scripts", name), *command, "--help", modules_cache=modules_cache)
    assert result["code"] in (0, None)
    assert result["heavy"] == [], f"{name} --help imported {result['heavy']}: move those imports after parsing"
    helps = option_helps(result["help"])
    assert "--help" in helps and len(helps) > 1
    for option, text in helps.items():
        assert text, f"{name} {option} has no help text"
        takes_value = re.search(rf"\s{re.escape(option)} [A-Z{{]", result["help"].split("options:")[-1])
        if option.startswith("--") and takes_value and (name, option) not in NOT_OURS:
            assert "default" in text or "required" in text, f"{name} {option}: say its default ({text!r})"


def test_shared_cache_options_are_light_and_complete(modules_cache):
    result = _run(CACHE_CLI, modules_cache=modules_cache)
    assert result["heavy"] == []
    helps = option_helps(result["help"])
    assert {
        "--key-tokens",
        "--split",
        "--evaluator",
        "--trunc-len",
        "--sliding-window",
        "--alpha",
        "--beta",
        "--no-lcl",
    } <= set(helps)
    for option, text in helps.items():
        assert text, f"{option} has no help text"
        if option not in ("--help", "--no-lcl"):
            assert "default" in text or "required" in text, f"{option}: say its default ({text!r})"


def test_the_help_parser_sees_missing_help():
    text = "options:\n  -h, --help  show this help message and exit\n  --gamma GAMMA\n  --tiny      a smoke run\n"
    assert option_helps(text) == {"--help": "show this help message and exit", "--gamma": "", "--tiny": "a smoke run"}
