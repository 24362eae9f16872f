"""The committed records of the real-evaluator benchmarks rebuild the committed report exactly
(``scripts/bench/bench_real_models.py report``), and its statistics are what they say."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest
from helpers import run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "docs", "records", "real_models")


@pytest.mark.slow  # a fresh interpreter
def test_the_report_is_rebuilt_from_the_committed_records(tmp_path):
    out = tmp_path / "results.json"
    records = sorted(glob.glob(os.path.join(RECORDS, "*.jsonl")))
    assert [os.path.basename(path) for path in records] == ["precision.jsonl", "speed.jsonl"]
    done = run_guarded(
        [sys.executable, os.path.join(REPO, "scripts", "bench", "bench_real_models.py"), "report", "--records", *records,
         "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with open(os.path.join(RECORDS, "results.json"), encoding="utf-8") as handle:
        committed = json.load(handle)
    assert json.loads(out.read_text()) == committed
    assert "| smollm2-135m | 8k | fp8 | 8 |" in done.stdout


def test_jaccard_and_the_bootstrap_interval_against_plain_formulas():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_real_models", os.path.join(REPO, "scripts", "bench", "bench_real_models.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.jaccard([1, 2, 3], [2, 3, 4]) == 2 / 4
    assert bench.jaccard([], []) == 1.0
    mean, low, high = bench.bootstrap_mean([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and 1.0 <= low < mean < high <= 4.0
    assert bench.bootstrap_mean([5.0, 5.0]) == (5.0, 5.0, 5.0)
