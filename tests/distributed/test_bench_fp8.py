"""scripts/bench/bench_fp8.py's own checks: its fidelity statistics against hand counts, and its three parts'
CPU smoke runs end to end (tiny shapes, float32; the fp8 variants are recorded as skipped with the
library's refusal). The fp8 figures themselves need a GPU of compute capability 8.9 or newer
(docs/benchmarks.md, "An fp8 evaluator")."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, one_torch_thread, run_guarded, tiny_model

from longppl.core.scoring import EvaluatorScores
from longppl.settings import KeyTokenRule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "scripts", "bench")
sys.path.insert(0, BENCH)

import bench_fp8  # noqa: E402  (scripts/bench/ is not a package)

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
    from common import random_parameter

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


def test_the_scoring_estimate_counts_the_products_and_the_short_windows():
    import torch
    from transformers import AutoModelForCausalLM

    config = bench_fp8.config_of("tiny")
    model = AutoModelForCausalLM.from_config(config)
    products = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # 10,000 tokens, K=4096, d=1024: windows from s = 1024, 2048, 3072, 4096 (5,120 tokens each) and 5120
    # (to the end: 4,880); the first window (s = 0) is the full pass's
    windows = [5120] * 4 + [4880]
    found = bench_fp8.scoring_estimate(config, 10_000, 4096, 1024)
    assert found["product_parameters"] == products
    assert found["short_window_token_factor"] == pytest.approx(sum(windows) / 10_000, abs=1e-3)
    attention = 2 * 2 * 4 * 16 * (10_000**2 + sum(n * n for n in windows))  # layers, heads, head_dim
    assert found["flops_per_document"] == 2 * products * (10_000 + sum(windows)) + attention
    # the run's seconds: its timed documents and the first call's short one (bf16: eager), at the assumed
    # rate, over its GPUs
    run = dict(bench_fp8.PARALLEL_RUNS["123b-tp4"], shape="tiny")
    short = bench_fp8.scoring_estimate(config, 4096 + 2048 + 7, 4096, 1024)["flops_per_document"]
    flops = (run["repeats"] + run["corpus_docs"]) * found["flops_per_document"] + short
    seconds = bench_fp8.run_estimate(run, 10_000, 4096, 1024)["estimated_scoring_seconds"]
    assert seconds == pytest.approx(flops / (400e12 * 4), abs=0.05)
    # a compiled run (fp8): its first call scores a document of the timed length, and the estimate counts it
    run = dict(bench_fp8.PARALLEL_RUNS["123b-tp2-fp8"], shape="tiny")
    estimate = bench_fp8.run_estimate(run, 10_000, 4096, 1024)
    assert estimate["first_call_tokens"] == 10_000
    flops = (run["repeats"] + run["corpus_docs"] + 1) * found["flops_per_document"]
    assert estimate["estimated_scoring_seconds"] == pytest.approx(flops / (700e12 * 2), abs=0.05)


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
    command = [sys.executable, os.path.join(BENCH, "bench_fp8.py"), "parallel", "--smoke"]
    command += ["--out-dir", str(tmp_path), "--runs", "8b-one", "8b-tp4", "123b-tp2-fp8", "--repeats", "1"]
    done = run_guarded(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "parallel.json").read_text())
    assert [len(out["runs"][name]["ranks"]) for name in ("8b-one", "8b-tp4")] == [1, 2]
    assert out["runs"]["123b-tp2-fp8"]["skipped"].startswith(CPU_REFUSAL)
    for name in ("8b-one", "8b-tp4"):  # every rank's phases, in order, and the run's estimate
        run = out["runs"][name]
        assert run["status"] == 0 and run["estimate"]["flops_per_document"] > 0
        for lines in run["progress"].values():
            phases = ["start pid=", "weights built seconds=", "first call done", "document 1/1 done", "record written"]
            found = [next(i for i, line in enumerate(lines) if phase in line) for phase in phases]
            assert found == sorted(found), lines
    assert out["tp4_vs_one_document"] > 0 and out["tp4_rows_vs_one"]["max_abs_logprob_diff"] < 1e-4
    assert "TP=4 / one GPU at 8B" in done.stdout


@pytest.mark.slow
def test_a_parallel_run_past_its_timeout_is_stopped_whole(tmp_path):
    # a run that cannot end in its 40 s (100,000 timed repeats: hours): the parent ends launcher and ranks
    # and returns (a parent that waited for the run would meet the hang guard), its stdout (a pipe, as
    # under `| tail`) closed by every process; the run's record says where the ranks were
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.join(BENCH, "bench_fp8.py"), "parallel", "--smoke", "--out-dir"]
    command += [str(tmp_path), "--work", str(tmp_path / "work"), "--runs", "8b-tp4", "--repeats", "100000"]
    try:
        done = run_guarded([*command, "--timeout", "40"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        run = json.loads((tmp_path / "parallel.json").read_text())["runs"]["8b-tp4"]
        assert run["status"] == "timeout" and run["ranks"] == []
        assert len(run["rank_pids"]) == 2
        assert not any(alive(pid) for pid in [run["launcher_pid"], *run["rank_pids"]])
        for rank in ("0", "1"):
            lines = run["progress"][rank]
            assert "start pid=" in lines[0] and any("weights built" in line for line in lines), lines
        assert "scoring estimated at" in done.stdout and "rank 1, last:" in done.stdout
    finally:  # whatever failed, leave no rank running
        for path in (tmp_path / "work").glob("progress-*.txt"):
            for pid in [int(word[4:]) for word in path.read_text().split() if word.startswith("pid=")]:
                if alive(pid):
                    os.kill(pid, 9)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped by the process that adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
