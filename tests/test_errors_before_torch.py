"""Mistakes a command can see without torch are answered before torch is imported: a missing or
misspelled recipe, option or field, a corpus or data file that is not there, an fp8 evaluator on a
device named that is no GPU. Each runs in a fresh interpreter whose ``import torch`` fails, so an
answer that waited for torch would be that ImportError instead of the command's one line."""

import json
import os
import sys

import pytest
from helpers import DATA, run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")

# Runs each `longppl` command line of argv[1] (JSON) in this interpreter, and prints per command its
# exit status (or the message it exited with), its stderr, and whether torch was imported by then.
DRIVER = """
import contextlib, io, json, sys
from longppl.tools.main import main

answers = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        except BaseException as error:  # torch's import failing: what this test is about
            code = f"{type(error).__name__}: {error}"
    answers.append([code, err.getvalue(), "torch" in sys.modules])
print(json.dumps(answers))
"""


@pytest.fixture()
def without_torch(tmp_path):
    """An environment in which `import torch` raises (a package of that name first on the path)."""
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    path = os.pathsep.join(p for p in [str(tmp_path / "poison"), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "LONGPPL_DEBUG": "0", "HF_HUB_OFFLINE": "1"}


def answers(commands: list[list[str]], env: dict, cwd) -> list:
    done = run_guarded(
        [sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_train_answers_before_torch(tmp_path, without_torch):
    typo = tmp_path / "typo.yaml"
    typo.write_text(open(TINY, encoding="utf-8").read() + "learnig_rate: 1.0e-3\n")
    out = ["--output_dir", str(tmp_path / "run")]
    expected = {
        ("--config", str(tmp_path / "none.yaml")): f"Config file '{tmp_path / 'none.yaml'}' not found (--config takes "
        "a YAML recipe, e.g. configs/tiny_cpu.yaml).",
        ("--config", str(typo)): f"Unknown field(s) ['learnig_rate'] in '{typo}'; see `longppl train --help-all` for "
        "the valid ones (ModelArguments, DataArguments, LongCEConfig).",
        ("--config", TINY, *out, "--max_stesp", "5"): "unknown option(s) --max_stesp (did you mean --max_steps?); "
        "`longppl train --help-all` lists every field.",
        ("--config", TINY, *out, "--data_files", "none.jsonl"): "data_files: 'none.jsonl' not found (on the command "
        f"line relative paths are relative to the current directory, {tmp_path}; in a recipe, to the recipe's folder).",
        ("--config", TINY, *out, "--eval_data_files", "eval.txt"): "eval_data_files: 'eval.txt' not found (on the "
        f"command line relative paths are relative to the current directory, {tmp_path}; in a recipe, to the recipe's "
        "folder).",
        ("--config", TINY, *out, "--longce_weights", "cache", "--key_tokens", "none"): "key_tokens: no key-token "
        f"cache folder at 'none' (on the command line relative paths are relative to the current directory, {tmp_path}; "
        "in a recipe, to the recipe's folder). Score the training and evaluation texts into it first: longppl-score "
        "--corpus <the texts> --evaluator <model> --output none",
    }
    got = answers([["train", *argv] for argv in expected], without_torch, tmp_path)
    for (code, err, torch_loaded), message in zip(got, expected.values()):
        assert (code, err, torch_loaded) == (f"longppl train: error: {message}", "", False)


@pytest.mark.slow
def test_score_and_evaluate_answer_before_torch(tmp_path, without_torch):
    evaluator = tmp_path / "evaluator"  # a folder that looks like a saved model: it is never loaded
    evaluator.mkdir()
    (evaluator / "config.json").write_text("{}")
    score = ["score", "--corpus", DATA, "--evaluator", str(evaluator), "--output", str(tmp_path / "cache")]
    commands = [
        ["score", "--corpus", "none.jsonl", "--evaluator", str(evaluator), "--output", str(tmp_path / "cache")],
        [*score, "--evaluator-precision", "fp8", "--device", "cpu"],
        [*score, "--evaluator-precision", "fp8", "--device", "cuda", "--torch-dtype", "float16"],
        [*score, "--trunk-len", "64"],
        ["evaluate", "--key-tokens", str(tmp_path), "--models", str(evaluator), "--alhpa", "1"],
    ]
    got = answers(commands, without_torch, tmp_path)
    assert [torch_loaded for _, _, torch_loaded in got] == [False] * len(commands)
    assert got[0][0] == "longppl score: error: No JSONL file at 'none.jsonl'."
    assert got[1][0] == (
        "longppl score: error: --evaluator-precision='fp8' runs the evaluator's products on a CUDA GPU's float8 "
        "tensor cores, but its device is 'cpu': use --evaluator-precision='bf16' there, or run on a GPU of compute "
        "capability 8.9 or newer."
    )
    assert got[2][0] == (
        "longppl score: error: --evaluator-precision='fp8' converts a bfloat16 evaluator (torchao's per-row float8 "
        "scales take bfloat16 weights), but it would be loaded in float16: leave the dtype unset (bfloat16 on a GPU) "
        "or pass bfloat16."
    )
    assert got[3][:2] == [
        2,
        "longppl score: error: unknown option(s) --trunk-len (did you mean --trunc-len?); "
        "`longppl score --help` lists the options.\n",
    ]
    assert got[4][0] == 2 and got[4][1].startswith("longppl evaluate: error: unknown option(s) --alhpa (did you mean ")


def test_fp8_without_torchao_on_a_gpu_named_is_refused_before_torch(monkeypatch):
    from longppl.models import precision

    monkeypatch.setattr(precision, "torchao_version", lambda: None)
    with pytest.raises(
        ValueError, match=r"^--evaluator-precision='fp8' converts the evaluator with torchao, which is "
    ):
        precision.check_precision_request("fp8", "cuda", None, "--evaluator-precision")
    # no device named: whether there is a GPU comes first, and only torch can tell
    assert precision.check_precision_request("fp8", None, None, "--evaluator-precision") == "fp8"
    monkeypatch.setattr(precision, "torchao_version", lambda: "0.18.0")
    assert precision.check_precision_request("fp8", "cuda:1", "bfloat16", "--evaluator-precision") == "fp8"
    assert precision.check_precision_request("bf16", "cpu", "float32", "--evaluator-precision") == "bf16"
    with pytest.raises(ValueError, match=r"with device 'auto' \(accelerate's layer split"):
        precision.check_precision_request("fp8", "auto", None, "--evaluator-precision")
