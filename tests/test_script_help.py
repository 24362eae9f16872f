"""Every command-line tool (the console scripts, run here as their modules) and every script answers
`--help` without loading torch (or transformers, datasets, evaluate, accelerate), and every option says
what it is, and its default where it takes a value. Each console script of setup.cfg is installed and
answers `--help`; each wrapper in scripts/ runs the same tool as its command."""

import configparser
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys

import pytest
from conftest import REPO
from helpers import run_guarded

HEAVY = ("torch", "transformers", "datasets", "evaluate", "accelerate", "gradio")
# A child Python runs a script (a path) or a tool (a module, as `python -m` does) as __main__ with
# `--help`, stdout captured, and reports what was imported: an assertion on imports, not on a
# machine-dependent time.
RUNNER = r"""
import contextlib, io, json, runpy, sys
target, args = sys.argv[1], sys.argv[2:]
sys.argv = [target, *args]
out = io.StringIO()
code = None
with contextlib.redirect_stdout(out):
    try:
        if target.endswith(".py"):
            sys.path.insert(0, target.rsplit("/", 1)[0])  # as when the script runs: its folder first
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"code": code, "help": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""
CACHE_OPTIONS = r"""
import argparse, json, sys
from longppl.commandline.cache_options import add_cache_arguments
parser = argparse.ArgumentParser(prog="shared")
add_cache_arguments(parser)
print(json.dumps({"code": 0, "help": parser.format_help(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""
# The tools (modules of longppl.tools, behind the console scripts), and scripts of scripts/ and scripts/bench/.
TOOLS = ["quickstart", "compute_key_tokens", "evaluate_models", "visualize_key_tokens"]
SCRIPTS = [
    *((f"longppl.tools.{tool}",) for tool in TOOLS),
    ("bench/bench_longce.py",),
    ("bench/bench_longppl.py",),
    ("bench/bench_multi_gpu.py",),
    ("bench/bench_multi_gpu.py", "score"),
    ("bench/bench_multi_gpu.py", "train"),
    ("check_context_parallel.py",),
    ("push_metric_to_hub.py",),
]
# Options whose help another change rewrites (compute_key_tokens' --max-length): they must have a
# help text, but its default is that change's to state.
NOT_OURS = {("longppl.tools.compute_key_tokens", "--max-length")}


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
    done = run_guarded(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{code}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
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
    target = os.path.join(REPO, "scripts", name) if name.endswith(".py") else name
    result = _run(RUNNER, target, *command, "--help", modules_cache=modules_cache)
    assert result["code"] in (0, None)
    assert result["heavy"] == [], f"{name} --help imported {result['heavy']}: move those imports after parsing"
    assert "``" not in result["help"], f"{name} --help shows raw ``markup``: build its parser with tool_parser"
    helps = option_helps(result["help"])
    assert "--help" in helps and len(helps) > 1
    for option, text in helps.items():
        assert text, f"{name} {option} has no help text"
        takes_value = re.search(rf"\s{re.escape(option)} [A-Z{{]", result["help"].split("options:")[-1])
        if option.startswith("--") and takes_value and (name, option) not in NOT_OURS:
            assert "default" in text or "required" in text, f"{name} {option}: say its default ({text!r})"


def test_shared_cache_options_are_light_and_complete(modules_cache):
    result = _run(CACHE_OPTIONS, modules_cache=modules_cache)
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


def console_scripts() -> dict[str, str]:
    """``{command: "module:function"}`` of setup.cfg's ``[options.entry_points] console_scripts``."""
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def test_setup_cfg_names_the_longppl_commands():
    assert {"longppl-score", "longppl-evaluate", "longppl-visualize", "longppl-quickstart"} <= set(console_scripts())
    assert console_scripts()["longppl-score"] == "longppl.tools.compute_key_tokens:cli"


@pytest.mark.slow  # fresh interpreters or processes: seconds each
@pytest.mark.parametrize("command, target", sorted(console_scripts().items()))
def test_console_script_is_installed_and_answers_help(command, target, modules_cache):
    installed = {e.name: e for e in importlib.metadata.entry_points(group="console_scripts")}
    hint = "reinstall the project (pip install -e .): the installed metadata predates setup.cfg's entry points"
    assert command in installed and installed[command].value == target, hint
    assert callable(installed[command].load())
    # the executable the install wrote beside this interpreter, as a user's shell finds it
    executable = shutil.which(command, path=os.path.dirname(sys.executable))
    assert executable is not None, hint
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", HF_MODULES_CACHE=modules_cache)
    done = run_guarded([executable, "--help"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {command} ")


@pytest.mark.parametrize(
    "wrapper, tool",
    [
        ("quickstart.py", "longppl.tools.quickstart"),
        ("compute_key_tokens.py", "longppl.tools.compute_key_tokens"),
        ("evaluate_longppl.py", "longppl.tools.evaluate_models"),
        ("visualize_key_tokens.py", "longppl.tools.visualize_key_tokens"),
        ("reproduce_longppl.py", "longppl_reproduce.population"),
        ("reproduce_longce.py", "longppl_reproduce.longce_comparison"),
    ],
)
def test_wrapper_in_scripts_runs_its_tool(wrapper, tool, modules_cache):
    from_wrapper = _run(RUNNER, os.path.join(REPO, "scripts", wrapper), "--help", modules_cache=modules_cache)
    from_module = _run(RUNNER, tool, "--help", modules_cache=modules_cache)
    assert from_wrapper["heavy"] == [] and from_wrapper["code"] in (0, None)
    # the same parser: the usage line names the program it was started by, and what follows it (the
    # description and every option) is the same text
    assert from_wrapper["help"].startswith(f"usage: {wrapper} ")
    # `python -m` runs a module by its file, a package (an experiment of the reproduction) by its __main__.py
    is_package = importlib.util.find_spec(tool).submodule_search_locations is not None
    assert from_module["help"].startswith(f"usage: {'__main__' if is_package else tool.rsplit('.', 1)[1]}.py ")
    description_and_options = [run["help"].split("\n\n", 1)[1] for run in (from_wrapper, from_module)]
    assert description_and_options[0] == description_and_options[1]
    assert len(option_helps(description_and_options[0])) > 2


# Runs a console script's entry point ("module:function" of setup.cfg) with `--help`, as its
# executable does, under the command's own name (argparse's usage line shows it).
ENTRY_POINT = r"""
import contextlib, importlib, io, json, sys
command, target = sys.argv[1], sys.argv[2]
module, function = target.split(":")
sys.argv = [command, "--help"]
out = io.StringIO()
code = None
with contextlib.redirect_stdout(out):
    try:
        getattr(importlib.import_module(module), function)(["--help"])
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"code": code, "help": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


@pytest.mark.slow  # fresh interpreters or processes: seconds each
@pytest.mark.parametrize("command, target", sorted(console_scripts().items()))
def test_command_help_is_rendered_for_the_terminal_and_names_no_issue(command, target, modules_cache):
    """The module docstrings behind the descriptions are reStructuredText (``x``): --help shows `x`."""
    result = _run(ENTRY_POINT, command, target, modules_cache=modules_cache)
    assert result["code"] in (0, None) and result["help"].startswith(f"usage: {command} ")
    lines = result["help"].splitlines()
    assert not [line for line in lines if "``" in line], f"{command} --help shows raw ``markup``"
    assert not [line for line in lines if re.search(r"\bissues?\b", line, re.I)], f"{command} --help names an issue"


def test_help_text_renders_restructuredtext_literals_and_roles():
    from longppl.commandline.running import help_text

    doc = 'Run ``longppl-score`` (see :func:`run_command`, ``a="x"``).\n\n    python x.py \\\n        --y\n'
    assert help_text(doc) == 'Run `longppl-score` (see `run_command`, `a="x"`).\n\n    python x.py \\\n        --y\n'
    assert help_text(None) == ""
