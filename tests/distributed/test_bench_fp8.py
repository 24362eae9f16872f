"""scripts/bench_fp8.py's own checks: its fidelity statistics against hand counts, and its three parts'
CPU smoke runs end to end (tiny shapes, float32; the fp8 variants are recorded as skipped with the
library's refusal). The fp8 figures themselves need a GPU of compute capability 8.9 or newer
(docs/benchmarks.md, "An fp8 evaluator")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, one_torch_thread, tiny_model

from longppl.core.scoring import EvaluatorScores
from longppl.settings import KeyTokenRule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_fp8  # noqa: E402  (scripts/ is not a package)

NAN = float("nan")
CPU_REFUSAL = "evaluator_precision='fp8' runs the evaluator's products on a CUDA GPU"


def scores(lp_long, lp_short) -> EvaluatorScores:
    n = len(lp_long)
    return EvaluatorScores(np.arange(n), np.zeros((n, 2), dtype=np.int64), np.array(lp_long), np.array(lp_short))


def test_the_fidelity_statistics_are_the_hand_counts():
    # Rule: LSD > 1 and LCL > -5. Document 1: bf16 keys {2, 3}, fp8 keys {3, 4} (token 2 falls to LSD 0.5,
    # token 4 rises to 1.5); 4 tokens with a short score. Document 2: no key tokens in either.
    rule = KeyTokenRule(alpha=1.0, beta=-5.0)
    a1 = scores([NAN, -1.0, -1.0, -2.0, -1.0, -3.0], [NAN, NAN, -3.0, -4.0, -1.5, -3.0])
    b1 = scores([NAN, -1.0, -2.5, -2.0, -1.0, -3.0], [NAN, NAN, -3.0, -4.0, -2.5, -3.0])
    a2 = scores([NAN, -1.0, -1.0], [NAN, NAN, -1.0])
    sums = [bench_fp8.document_sums(a1, b1, rule), bench_fp8.document_sums(a2, a2, rule)]
    stats = bench_fp8.bootstrap(sums, bench_fp8.STATISTICS, samples=200, seed=0)
    assert stats["jaccard_pooled"]["value"] == pytest.approx(1 / 3)
    assert stats["jaccard_mean"]["value"] == pytest.approx(1 / 3)  # document 2 has no key token: left out
    assert stats["flips_per_1000_scored"]["value"] == pytest.approx(1000 * 2 / 5)  # 2 flips of 4 + 1 scored
    # the evaluator's own LongPPL, pooled: bf16 over tokens 2 and 3 (lp -1, -2), fp8 over 3 and 4 (-2, -1)
    assert stats["longppl_rel_change"]["value"] == pytest.approx(0.0, abs=1e-12)
    ppl_a = np.exp(-np.mean([-1.0, -1.0, -2.0, -1.0, -3.0, -1.0, -1.0]))
    ppl_b = np.exp(-np.mean([-1.0, -2.5, -2.0, -1.0, -3.0, -1.0, -1.0]))
    assert stats["ppl_rel_change"]["value"] == pytest.approx(ppl_b / ppl_a - 1)
    # no token lies above the 95th percentile of these few LSDs (2, 2, 0.5, 0; and 0): undefined, not 0 or 1
    assert np.isnan(stats.pop("top5pct_lsd_jaccard_pooled")["value"])
    for name, stat in stats.items():
        assert stat["low"] <= stat["value"] <= stat["high"], name
    # one document: every resample is that document, so the interval is the value
    alone = bench_fp8.bootstrap(sums[:1], bench_fp8.STATISTICS, samples=50, seed=1)["jaccard_pooled"]
    assert alone["low"] == alone["high"] == pytest.approx(1 / 3)


def test_a_random_parameter_part_is_the_part_of_the_whole():
    # a tensor-parallel rank draws its slice alone: it must equal the slice of the whole one GPU draws
    import torch

    from longppl.tools.benchmarking import random_parameter

    def draw(index=None):
        return random_parameter("model.layers.0.mlp.up_proj.weight", (300, 64), torch.float32, "cpu", 0.02, 3, index)

    whole = draw()
    assert whole.shape == (300, 64) and 0.018 < float(whole.std()) < 0.022
    for parts in (2, 4):
        for dim in (0, 1):
            width = whole.shape[dim] // parts
            for rank in range(parts):
                index = [slice(None), slice(None)]
                index[dim] = slice(rank * width, (rank + 1) * width)
                assert torch.equal(draw(tuple(index)), whole[tuple(index)]), (parts, dim, rank)
    odd = (slice(7, 203), slice(3, 61))  # not on the tiles' grid: still the same values
    assert torch.equal(draw(odd), whole[odd])


@pytest.mark.slow
def test_speed_smoke(tmp_path):
    with one_torch_thread():
        out = bench_fp8.main(["speed", "--smoke", "--out-dir", str(tmp_path), "--lengths", "300", "--repeats", "1"])
    assert json.loads((tmp_path / "speed.json").read_text()) == json.loads(json.dumps(out))
    rows = {row["variant"]: row for row in out["rows"]}
    assert list(rows) == ["bf16 eager", "bf16 compiled", "fp8 eager", "fp8 compiled"]
    assert rows["bf16 eager"]["time_vs_bf16_eager"] == 1.0 and rows["bf16 compiled"]["seconds"] > 0
    assert all(rows[v]["skipped"].startswith(CPU_REFUSAL) for v in ("fp8 eager", "fp8 compiled"))
    assert out["comparisons"]["bf16 compiled vs bf16 eager, 300 tokens"]["max_abs_logprob_diff"] < 1e-4


@pytest.mark.slow
def test_fidelity_smoke(tmp_path):
    tokenizer = byte_level_bpe()
    tiny_model("llama", len(tokenizer), seed=1).save_pretrained(tmp_path / "E1")
    tokenizer.save_pretrained(tmp_path / "E1")
    texts = tmp_path / "docs.jsonl"
    texts.write_text("".join(json.dumps({"text": t[:700]}) + "\n" for t in govreport_texts()[:3]), encoding="utf-8")
    argv = ["fidelity", "--smoke", "--out-dir", str(tmp_path), "--models", str(tmp_path / "E1"), "--texts", str(texts)]
    argv += ["--trunc-len", "64", "--sliding-window", "16", "--alpha", "0.005", "--beta", "-50", "--bootstrap", "100"]
    with one_torch_thread():
        out = bench_fp8.main([*argv, "--random-init", "--evaluated", str(tmp_path / "E1")])
    assert [m["model"] for m in out["models"]] == [str(tmp_path / "E1"), f"{tmp_path / 'E1'} (random init)"]
    for model in out["models"]:  # bf16 against bf16 on the CPU: nothing moves
        assert model["key_tokens"]["bf16"] == model["key_tokens"]["other"] > 0
        assert model["statistics"]["jaccard_pooled"]["value"] == 1.0
        assert model["statistics"]["flips_per_1000_scored"]["value"] == 0.0
    assert out["models"][0]["evaluated"][str(tmp_path / "E1")]["longppl_rel_change"]["value"] == 0.0


@pytest.mark.slow
def test_parallel_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.join(REPO, "scripts", "bench_fp8.py"), "parallel", "--smoke"]
    command += ["--out-dir", str(tmp_path), "--runs", "8b-one", "8b-tp4", "123b-tp2-fp8", "--repeats", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "parallel.json").read_text())
    assert [len(out["runs"][name]["ranks"]) for name in ("8b-one", "8b-tp4")] == [1, 2]
    assert out["runs"]["123b-tp2-fp8"]["skipped"].startswith(CPU_REFUSAL)
    assert out["tp4_vs_one_document"] > 0 and out["tp4_rows_vs_one"]["max_abs_logprob_diff"] < 1e-4
    assert "TP=4 / one GPU at 8B" in done.stdout
