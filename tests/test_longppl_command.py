"""The `longppl` command (`longppl score`, `longppl train`, ...; `python -m longppl`): each subcommand
runs its console script's tool under the name `longppl <command>`, and the tools' long options take
both spellings (`--key-tokens` and `--key_tokens`)."""

import configparser
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from helpers import assert_same_cache, byte_level_bpe, communicate_guarded, govreport_texts, run_guarded, tiny_model
from longppl_reproduce.longce_comparison import pipeline as longce_comparison
from longppl_reproduce.population import pipeline as population

from longppl.cache.key_token_cache import KeyTokenCache
from longppl.commandline.running import ToolParser, other_spelling
from longppl.tools import (
    compute_key_tokens,
    evaluate_models,
    quickstart,
    visualize_key_tokens,
)
from longppl.tools import main as longppl_command

# {subcommand: the old command it stands for}, in the order of `longppl --help`: longppl's own, then the
# packages registered through the entry-point group in the order of their names (longce, longppl_reproduce)
OLD_NAMES = {
    "score": "longppl-score",
    "evaluate": "longppl-evaluate",
    "visualize": "longppl-visualize",
    "cache": "longppl-cache",
    "quickstart": "longppl-quickstart",
    "train": "longce-train",
    "reproduce": "longppl-reproduce",
    "reproduce-longce": "longppl-reproduce-longce",
}


def console_scripts() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """evaluate's module cache with the metric registered: a child's `import longppl` then skips registering."""
    from longppl import register

    cache = tmp_path_factory.mktemp("modules")
    register.register_metric(str(cache))
    return str(cache)


def python_m_longppl(*args, modules_cache):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", HF_MODULES_CACHE=modules_cache)
    return run_guarded([sys.executable, "-m", "longppl", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_setup_cfg_installs_longppl_beside_the_old_names():
    scripts = console_scripts()
    assert scripts["longppl"] == "longppl.tools.main:main"
    module, function = scripts["longppl"].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    # every subcommand runs what its old name runs
    assert {command: scripts[old] for command, old in OLD_NAMES.items()} == {
        command: target for command, (target, _) in longppl_command.commands().items()
    }


def test_a_package_registering_a_taken_command_is_refused(monkeypatch):
    from importlib.metadata import EntryPoint

    import longce.commands

    clash = dict(longce.commands.COMMANDS, score=("longce.cli:main", "not the scorer"))
    monkeypatch.setattr(longce.commands, "CLASH", clash, raising=False)
    points = [EntryPoint("other", "longce.commands:CLASH", longppl_command.COMMAND_GROUP)]
    monkeypatch.setattr(
        "importlib.metadata.entry_points", lambda group: points if group == longppl_command.COMMAND_GROUP else []
    )
    with pytest.raises(
        RuntimeError,
        match=r"entry point 'other' .* registers the command 'score', which runs longppl\.tools\.compute_key_tokens:cli",
    ):
        longppl_command.commands()


def test_help_lists_every_subcommand_on_one_line(modules_cache):
    done = python_m_longppl("--help", modules_cache=modules_cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: longppl <command> ")
    listed = done.stdout.split("commands:\n", 1)[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in listed] == list(OLD_NAMES)
    assert all(len(line.split()) > 2 for line in listed)  # a name and what it does


@pytest.mark.slow  # fresh interpreters or processes: seconds each
@pytest.mark.parametrize("command", list(OLD_NAMES))
def test_subcommand_help_is_the_tools_help_under_its_new_name(command, modules_cache):
    done = python_m_longppl(command, "--help", modules_cache=modules_cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: longppl {command} ")
    # the same text as the old command's help, but for the program's name in the usage line
    module, function = console_scripts()[OLD_NAMES[command]].split(":")
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", HF_MODULES_CACHE=modules_cache)
    code = (
        f"import sys, importlib; sys.argv = ['{OLD_NAMES[command]}', '--help']; "
        f"getattr(importlib.import_module('{module}'), '{function}')(['--help'])"
    )
    direct = run_guarded([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.startswith(f"usage: {OLD_NAMES[command]} ")
    assert done.stdout.split("\n\n", 1)[1] == direct.stdout.split("\n\n", 1)[1]


def test_unknown_subcommand_is_one_error_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        longppl_command.main(["scroe"])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1
    assert errors[0].startswith("longppl: error: ") and "'scroe'" in errors[0]
    assert all(f"'{name}'" in errors[0] for name in OLD_NAMES)


def test_bad_input_is_one_error_line_named_after_the_subcommand(tmp_path, modules_cache):
    missing = str(tmp_path / "missing")
    done = python_m_longppl(
        "visualize", "--key_tokens", missing, "--html", str(tmp_path / "x.html"), modules_cache=modules_cache
    )
    assert done.returncode == 1
    assert done.stderr.startswith("longppl visualize: error: ") and missing in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_longppl_does_not_import_longce_until_train_runs(modules_cache):
    code = (
        "import sys; from longppl.tools import main\n"
        "try:\n    main.main(['score', '--help'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in sys.modules if m == 'longce' or m.startswith('longce.')])"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=modules_cache)
    done = run_guarded([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_dispatcher_restores_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["longppl", "quickstart", "--help"])
    with pytest.raises(SystemExit):
        longppl_command.main(["quickstart", "--help"])
    assert sys.argv == ["longppl", "quickstart", "--help"]


def test_longppl_score_writes_the_cache_longppl_score_writes(tmp_path, monkeypatch):
    from accelerate import PartialState

    texts = [t[700:1300] for t in govreport_texts()[3:5]]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    tok = byte_level_bpe()
    tiny_model("llama", len(tok), seed=1).save_pretrained(tmp_path / "evaluator")
    tok.save_pretrained(tmp_path / "evaluator")

    def args(output):
        # the new spellings on one side, the declared ones on the other: the same run
        return [
            "--corpus",
            str(corpus),
            "--evaluator",
            str(tmp_path / "evaluator"),
            "--output",
            str(tmp_path / output),
            "--trunc-len" if output == "old" else "--trunc_len",
            "47",
            "--sliding-window" if output == "old" else "--sliding_window",
            "13",
        ]

    try:
        monkeypatch.setattr(sys, "argv", ["longppl-score"])
        assert compute_key_tokens.cli(args("old")) == 0  # longppl-score's entry point
        assert longppl_command.main(["score", *args("new")]) == 0
    finally:
        PartialState._reset_state()  # compute_key_tokens set up accelerate's (process-wide) state
    assert len(KeyTokenCache.load(str(tmp_path / "old"))) == 2
    assert_same_cache(str(tmp_path / "old"), str(tmp_path / "new"))


# {tool: (required arguments, (multi-word option, its value or None for a flag), ...)}
SPELLINGS = {
    compute_key_tokens: (
        ["--corpus", "c", "--evaluator", "e", "--output", "o"],
        [("--text-column", "body"), ("--trunc-len", "64"), ("--max-tokens-per-batch", "9"), ("--window-bos", None)],
    ),
    evaluate_models: (
        ["--models", "m"],
        [("--key-tokens", "k"), ("--output-dir", "d"), ("--benchmark-name", "b"), ("--no-lcl", None)],
    ),
    visualize_key_tokens: ([], [("--key-tokens", "k"), ("--lsd-cap", "5"), ("--sliding-window", "16")]),
    quickstart: ([], [("--max-length", "128"), ("--sliding-window", "16"), ("--trunc-len", "64")]),
    population: (["--config", "c"], [("--output-dir", "d"), ("--validation-corpus", "v"), ("--export-dir", "e")]),
    longce_comparison: (["--config", "c"], [("--output-dir", "d"), ("--base-model", "b"), ("--second-evaluator", "s")]),
}


def declared_options(parser):
    """The long options of ``parser`` with two or more words, as declared (help shows these)."""
    return sorted(
        option for action in parser._actions for option in action.option_strings if other_spelling(option) is not None
    )


@pytest.mark.parametrize(
    "tool", list(SPELLINGS), ids=lambda tool: tool.__name__.removesuffix(".pipeline").rsplit(".", 1)[1]
)
def test_both_spellings_parse_to_the_same_namespace(tool):
    required, pairs = SPELLINGS[tool]
    parser = tool.build_parser("tool")
    assert isinstance(parser, ToolParser)
    options = declared_options(parser)
    for option, _ in pairs:
        assert option in options, option
    declared = [*required, *(item for option, value in pairs for item in (option, value) if item is not None)]
    other = [*required, *(item for option, value in pairs for item in (other_spelling(option), value) if item)]
    assert other != declared
    assert parser.parse_args(other) == parser.parse_args(declared)
    # with `=` too
    joined = [*required, *(f"{other_spelling(o)}={v}" if v else other_spelling(o) for o, v in pairs)]
    assert parser.parse_args(joined) == parser.parse_args(declared)


@pytest.mark.parametrize(
    "tool", list(SPELLINGS), ids=lambda tool: tool.__name__.removesuffix(".pipeline").rsplit(".", 1)[1]
)
def test_help_shows_each_option_once_in_its_declared_spelling(tool):
    text = tool.build_parser("tool").format_help()
    for option in declared_options(tool.build_parser("tool")):
        # an option's line lists its spellings ("--torch-compile, --no-torch-compile", "--alpha ALPHA")
        lines = [
            line
            for line in text.split("options:", 1)[1].splitlines()
            if option in [item.split(" ")[0] for item in line.strip().split("  ")[0].split(", ")]
        ]
        assert len(lines) == 1, (option, lines)
        assert f"{other_spelling(option)} " not in text and f"{other_spelling(option)}," not in text


def test_the_other_spelling_of_an_option():
    assert other_spelling("--key-tokens") == "--key_tokens"
    assert other_spelling("--key_tokens") == "--key-tokens"
    assert other_spelling("--alpha") is None and other_spelling("-h") is None


def test_either_spelling_declared_takes_the_other_and_errors_name_the_declared_one(capsys):
    parser = ToolParser(prog="tool")
    parser.add_argument("--max_length", type=int, required=True)
    parser.add_argument("--no-lcl", action="store_true")
    assert parser.parse_args(["--max-length", "3", "--no_lcl"]) == parser.parse_args(["--max_length", "3", "--no-lcl"])
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --max_length" in capsys.readouterr().err


def test_an_abbreviation_of_both_spellings_is_the_one_option(capsys):
    parser = ToolParser(prog="tool")
    parser.add_argument("--trunc-len", type=int)
    parser.add_argument("--trunc-side")
    assert parser.parse_args(["--trunc-l", "5"]).trunc_len == 5
    assert parser.parse_args(["--trunc_l", "5"]).trunc_len == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--trunc", "5"])  # still ambiguous: two options
    err = capsys.readouterr().err
    assert "ambiguous option: --trunc could match --trunc-len, --trunc-side" in err


# --- what every command's values share: `~`, non-UTF-8 names, Ctrl-C ----------------------------------


def test_a_leading_tilde_is_the_home_folder_in_every_path_option(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = str(tmp_path)
    args = evaluate_models.parse_args(
        ["--key-tokens", "~/cache", "--models", "~/m", "Qwen/Qwen2-7B", "--output-dir", "~"]
    )
    assert (args.key_tokens, args.models, args.output_dir) == (f"{home}/cache", [f"{home}/m", "Qwen/Qwen2-7B"], home)
    args = evaluate_models.parse_args(["--key-tokens=~/cache", "--models", "m", "--output-dir=~/results"])
    assert (args.key_tokens, args.output_dir) == (f"{home}/cache", f"{home}/results")
    args = compute_key_tokens.parse_args(["--corpus", "~/c.jsonl", "--evaluator", "~/ev", "--output", "~/out"])
    assert (args.corpus, args.evaluator, args.output) == (f"{home}/c.jsonl", f"{home}/ev", f"{home}/out")
    args = visualize_key_tokens.parse_args(["--key-tokens", "~/k", "--html", "~/a.html", "--histogram", "~/h.png"])
    assert (args.key_tokens, args.html, args.histogram) == (f"{home}/k", f"{home}/a.html", f"{home}/h.png")
    args = population.build_parser().parse_args(["--config", "~/c.yaml", "--output-dir", "~/run"])
    assert (args.config, args.output_dir) == (f"{home}/c.yaml", f"{home}/run")
    # a value that only contains a tilde is not a home folder
    assert evaluate_models.parse_args(["--key-tokens", "k", "--models", "a~b", "--output-dir", "x/~"]).models == ["a~b"]


def test_an_argument_that_is_not_utf8_is_one_usage_line(capsys):
    name = os.fsdecode(b"results-\xff")  # what a terminal passes for a Latin-1 name
    with pytest.raises(SystemExit) as exited:
        evaluate_models.main(["--key-tokens", "k", "--models", "m", "--output-dir", name], prog="longppl evaluate")
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("longppl evaluate: error: argument 'results-\\xff' is not valid UTF-8")


@pytest.mark.parametrize("option", ["--steps", "--documents", "--window", "--trunc-len", "--sliding-window"])
@pytest.mark.parametrize("value", ["-5", "0"])
def test_quickstart_refuses_counts_that_are_not_positive(option, value, monkeypatch, capsys):
    monkeypatch.setattr(quickstart, "toy_demo", lambda args: pytest.fail("ran the demo"))
    with pytest.raises(SystemExit) as exited:
        quickstart.main([option, value], prog="longppl quickstart")
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("longppl quickstart: error: ") and last.endswith(f"must be an integer >= 1, got {value}.")


def interrupted_run(args, wait, env, ready=None):
    """Start ``python -m longppl *args``, send it SIGINT after ``wait`` seconds (or once ``ready`` is
    on its stdout), and return its exit status and stderr."""
    # The child starts with SIGINT at its default, as under a terminal: a test suite started in the
    # background of a non-interactive shell ignores SIGINT, every child would inherit that, and Python
    # keeps an inherited SIG_IGN (no KeyboardInterrupt ever comes).
    process = subprocess.Popen(
        [sys.executable, "-m", "longppl", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    if ready is not None:
        for line in process.stdout:
            if ready in line:
                break
    else:
        time.sleep(wait)
    process.send_signal(signal.SIGINT)
    _, err = communicate_guarded(process)
    return process.returncode, err


@pytest.mark.slow  # a fresh interpreter
def test_ctrl_c_inside_an_extensions_run_string_still_ends_with_status_130(tmp_path):
    # CPython remembers a KeyboardInterrupt that escaped code run by PyRun_String (C extensions run
    # code so while they import) and, under `python -m`, ends the process by SIGINT (status -2) after
    # shutting down, whatever sys.exit asked for. Here the interrupt is raised there on purpose.
    (tmp_path / "interrupted_in_run_string.py").write_text(
        "import ctypes\n"
        "from longppl.commandline.interrupts import end_interrupted\n"
        "run = ctypes.pythonapi.PyRun_String\n"
        "run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]\n"
        "try:\n"
        "    run(b'raise KeyboardInterrupt', 257, {}, {})  # 257: Py_file_input\n"
        "except KeyboardInterrupt:\n"
        "    end_interrupted('longppl demo')\n"
    )
    result = run_guarded(
        [sys.executable, "-m", "interrupted_in_run_string"], cwd=tmp_path, capture_output=True, text=True
    )
    assert (result.returncode, result.stderr) == (130, "longppl demo: interrupted\n")


@pytest.mark.slow  # fresh interpreters or processes: seconds each
@pytest.mark.parametrize("moment", ["registering the metric", "importing torch", "training"])
def test_ctrl_c_is_one_line_and_status_130(moment, tmp_path, modules_cache):
    # a fresh module cache: `import longppl` registers the metric (imports evaluate: seconds) first
    cache = str(tmp_path / "modules") if moment == "registering the metric" else modules_cache
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=cache, LONGPPL_CACHE_DIR=str(tmp_path / "models"))
    env.pop("LONGPPL_DEBUG", None)
    args = ["quickstart", "--retrain", "--steps", "100000"]
    ready = "Training a tiny model" if moment == "training" else None
    status, err = interrupted_run(args, 1.0, env, ready)
    assert "Traceback" not in err and status == 130, err[-3000:]
    assert err.strip().splitlines()[-1] in ("longppl: interrupted", "longppl quickstart: interrupted")
    assert not os.path.exists(tmp_path / "models") or not os.listdir(tmp_path / "models")


@pytest.mark.slow  # a fresh interpreter that imports torch: seconds
def test_a_second_ctrl_c_while_the_command_ends_keeps_status_130(tmp_path, modules_cache):
    # Python gives SIGINT its default action back while it shuts down: a second Ctrl-C there (an
    # impatient user, or a Ctrl-C given again after a finalizer swallowed it) would kill the process
    # by the signal (status -2) instead of the command's 130.
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=modules_cache, LONGPPL_CACHE_DIR=str(tmp_path / "models")
    )
    env.pop("LONGPPL_DEBUG", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "longppl", "quickstart", "--retrain", "--steps", "100000"], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    for line in process.stdout:
        if "Training a tiny model" in line:
            break
    process.send_signal(signal.SIGINT)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "interrupted" in line:
            break
    while process.poll() is None:  # Ctrl-C again and again while the command ends
        process.send_signal(signal.SIGINT)
        time.sleep(0.002)
    _, rest = communicate_guarded(process)
    err = "".join(lines) + rest
    assert process.returncode == 130 and "Traceback" not in err, (process.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == "longppl quickstart: interrupted"


@pytest.mark.parametrize(
    "tool, argv, hint",
    [
        (
            compute_key_tokens,
            ["--corpus", "c.jsonl", "--evaluator", "e", "--output", "o", "--trunk-len", "8"],
            "--trunc-len",
        ),
        (compute_key_tokens, ["--trunk-len", "4096"], "--trunc-len"),  # before the missing required options
        (evaluate_models, ["--key-tokens", "k", "--models", "m", "--output-dir", "d", "--evaluater=x"], "--evaluator"),
        (visualize_key_tokens, ["--key-tokens", "k", "--histogram", "h.png", "--alhpa", "1"], "--alpha"),
        (quickstart, ["--step", "5", "--retrian"], "--retrain"),
    ],
)
def test_a_mistyped_option_is_one_line_with_the_closest_option_in_every_command(tool, argv, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        tool.main(argv, prog="longppl x")
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()  # no usage block before it
    assert line.startswith("longppl x: error: unknown option(s) --") and f"(did you mean {hint}?)" in line
    assert line.endswith("`longppl x --help` lists the options.")


@pytest.mark.parametrize("argv", [["--texts", "docs.jsonl"], ["--column", "body"], ["--max-length", "512"]])
def test_quickstart_refuses_options_for_your_texts_without_models(argv, monkeypatch, capsys):
    monkeypatch.setattr(quickstart, "toy_demo", lambda args: pytest.fail("ran the toy demo, ignoring " + argv[0]))
    with pytest.raises(SystemExit) as exited:
        quickstart.main(argv, prog="longppl quickstart")
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"longppl quickstart: error: {argv[0]} need(s) --model and --evaluator (the models to score your texts "
        "with); without them the quickstart runs its toy demo on synthetic documents."
    ]


def test_a_parser_with_subcommands_leaves_their_options_to_them(capsys):
    parser = ToolParser(prog="tool")
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("score").add_argument("--gpus", type=int)
    assert parser.parse_args(["score", "--gpus", "4"]).gpus == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["score", "--gpsu", "4"])
    assert "unknown option(s) --gpsu (did you mean --gpus?)" in capsys.readouterr().err


def test_a_ctrl_c_raised_inside_a_finalizer_still_ends_the_command(tmp_path):
    # Python's SIGINT handler raises KeyboardInterrupt wherever the main thread is; inside a __del__
    # (garbage collection while a library imports) Python only prints it and runs on. The finalizer
    # here raises it as that handler would.
    script = tmp_path / "finalizer.py"
    script.write_text(
        "import time\n"
        "from longppl.commandline.running import interruptible\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        raise KeyboardInterrupt\n"
        "with interruptible('demo'):\n"
        "    Finalized()\n"
        "    time.sleep(20)\n"
        "print('ran on')\n"
    )
    env = dict(os.environ, LONGPPL_AUTO_REGISTER="0")
    env.pop("LONGPPL_DEBUG", None)
    done = run_guarded(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert done.returncode == 130 and "ran on" not in done.stdout, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == ["demo: interrupted"], done.stderr
