"""scripts/bench/bench_tensor_parallel.py's own checks: the row comparison between layouts, the refusal of bad
counts, and its CPU smoke mode (two gloo processes) end to end with warm-up, repeats, the profile
summary and the all-reduce probe. The figures themselves need GPUs (docs/benchmarks.md, "Evaluators
larger than one GPU").
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from helpers import DATA, run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "scripts", "bench")
sys.path.insert(0, BENCH)

import bench_tensor_parallel  # noqa: E402  (scripts/bench/ is not a package)

NAN = float("nan")


def _rows(path, lp_long, lp_short):
    np.savez(path, lp_long_0=np.array(lp_long, dtype=np.float32), lp_short_0=np.array(lp_short, dtype=np.float32))


def test_comparison_counts_key_tokens_and_the_top_lsd_tokens_both_layouts_share(tmp_path):
    # LSD = long - short: [nan, nan, 3, 0.5, 4]; LCL = long. The default rule (LSD > 2 and LCL > -2)
    # takes token 2 only (token 4's LCL is -5). The 95th percentile of [0.5, 3, 4] is 3.9, so the top
    # tokens by LSD are {4}, which the second layout moves below it (its LSD there is 3.5).
    for part in ("document", "corpus"):
        _rows(tmp_path / f"s-one-{part}.npz", [NAN, -1, -1, -1, -5], [NAN, NAN, -4, -1.5, -9])
        _rows(tmp_path / f"s-tp-{part}.npz", [NAN, -1, -1, -0.9, -5], [NAN, NAN, -4, -1.5, -8.5])
    found = bench_tensor_parallel.compare(str(tmp_path), "s", "tp", "one")
    for part in ("document", "corpus"):
        assert found[part]["max_abs_logprob_diff"] == pytest.approx(0.5)
        assert found[part]["default_rule_key_tokens"] == 1 and found[part]["default_rule_identical"] is True
        assert found[part]["top5pct_lsd_tokens"] == 1 and found[part]["top5pct_lsd_shared"] == 0
    assert bench_tensor_parallel.compare(str(tmp_path), "s", "device_map", "one") is None


def test_the_gpu_profile_counts_each_collective_once():
    # On the GPU, torch's profiler lists a collective twice: its kernel, and ProcessGroupNCCL's
    # annotation ("nccl:all_reduce"), a user annotation timing the same range. Only kernels count.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, microseconds, annotation=False):
        return SimpleNamespace(
            key=key, device_type=device_type, count=1, is_user_annotation=annotation,
            self_device_time_total=microseconds, device_time_total=microseconds,
            self_cpu_time_total=microseconds, cpu_time_total=microseconds,
        )  # fmt: skip

    events = [
        event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", DeviceType.CUDA, 100.0),
        event("nccl:all_reduce", DeviceType.CUDA, 100.0, annotation=True),
        event("nvjet_sm90_tst_320x128", DeviceType.CUDA, 300.0),
        event("aten::mm", DeviceType.CPU, 50.0),
    ]
    summary = bench_tensor_parallel.profile_summary(SimpleNamespace(key_averages=lambda: events), 0.001, True)
    assert summary["groups_ms"]["collectives"] == pytest.approx(0.1)
    assert summary["groups_ms"]["matmul"] == pytest.approx(0.3) and summary["busy_ms"] == pytest.approx(0.4)
    assert [op["name"] for op in summary["top"]] == [
        "nvjet_sm90_tst_320x128",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
    ]
    assert summary["cpu_groups_ms"]["matmul"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--repeats", "0"], "error: --repeats must be an integer >= 1, got 0."),
        (["--warmup", "-1"], "error: --warmup must be an integer >= 0, got -1."),
    ],
)
def test_counts_below_their_minimum_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_tensor_parallel.main(["--cpu", "--shapes", "tiny", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_smoke_run_warms_up_repeats_profiles_and_probes_the_all_reduce(tmp_path):
    result_path = tmp_path / "bench.json"
    command = [sys.executable, os.path.join(BENCH, "bench_tensor_parallel.py"), "--cpu", "--shapes", "tiny"]
    command += [
        "--layouts",
        "one",
        "tp",
        "tp_plain",
        "--doc-tokens",
        "400",
        "--corpus-docs",
        "2",
        "--corpus-tokens",
        "200",
    ]
    command += ["--warmup", "1", "--repeats", "2", "--profile", "--probe-allreduce", "--data", DATA]
    command += ["--work", str(tmp_path / "work"), "--json", str(result_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = run_guarded(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["warmup"] == 1 and result["repeats"] == 2
    assert {run["status"] for run in result["runs"].values()} == {0}
    records = {(record["layout"], record["rank"]): record for record in result["records"]}
    assert set(records) == {("one", 0), ("tp", 0), ("tp", 1), ("tp_plain", 0), ("tp_plain", 1)}
    for (layout, rank), record in records.items():
        assert record["warmup"] == 1
        for part, tokens, documents in (("document", 400, 1), ("corpus", 400, 2)):
            timing = record[part]
            assert len(timing["repeats"]) == 2 and timing["seconds"] == pytest.approx(
                np.median(timing["repeats"]), abs=1e-3
            )
            # Documents shorter than K = 4096 have no short windows: one forward pass each, over their tokens.
            assert timing["tokens"] == timing["forward_tokens"] == tokens and timing["forwards"] == documents
        profile = record["profile"]
        assert json.loads((tmp_path / "work" / f"profile-tiny-{layout}-{rank}.json").read_text()) == profile
        for groups, total in (
            (profile["groups_ms"], profile["busy_ms"]),
            (profile["cpu_groups_ms"], profile["cpu_ops_ms"]),
        ):
            assert 0 < sum(groups.values()) <= total + 0.01
        assert profile["groups_ms"]["matmul"] > 0 and profile["groups_ms"]["lm_head_side"] > 0
        assert (profile["groups_ms"]["collectives"] > 0) == (layout != "one")  # one process has no collective
        assert len(profile["top"]) == bench_tensor_parallel.TOP_OPS
        assert all(op["self_ms"] <= profile["busy_ms"] for op in profile["top"])
        assert profile["wall_ms"] > 0 and profile["busy_share"] == pytest.approx(
            profile["busy_ms"] / profile["wall_ms"], abs=1e-3
        )
        assert result["profiles"][f"tiny {layout} rank {rank}"]["groups_ms"] == profile["groups_ms"]
    # The probe times all-reduces: the split without sequence parallelism makes them, tp (reduce-scatters) does not.
    assert "allreduce_probe" not in records["one", 0] and "allreduce_probe" not in records["tp", 0]
    layers = bench_tensor_parallel.SHAPES["tiny"]["num_hidden_layers"]
    for rank in (0, 1):
        probe = records["tp_plain", rank]["allreduce_probe"]
        assert probe["all_reduces_per_forward"] == 2 * layers  # o_proj and down_proj of each layer
        for part, rows in (("document", 400), ("corpus", 200)):
            assert probe[part]["tokens"] == rows and probe[part]["bus_gbps"] > 0
            assert probe[part]["all_reduces"] == 2 * layers * records["tp_plain", rank][part]["forwards"]
            assert 0 < probe[part]["estimate_seconds"] and "all-reduce alone would take" in probe[part]["says"]
    assert set(result["comparisons"]) == {"tiny: tp vs one", "tiny: tp_plain vs one"}
    for layout in ("tp", "tp_plain"):  # the split layouts draw the one layout's weights and keep their slices
        for part in ("document", "corpus"):
            assert result["comparisons"][f"tiny: {layout} vs one"][part]["max_abs_logprob_diff"] < 1e-5
