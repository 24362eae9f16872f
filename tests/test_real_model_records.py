"""The committed records of the real-evaluator benchmarks rebuild the committed report exactly
(``scripts/bench/bench_real_models.py report``), and its statistics are what they say; the committed
records of the real-models LongPPL study give its committed results.json and report.md, and those
of the LongCE study its longce_results.json and longce_report.md."""

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


def _without_intervals(found):
    """``found`` with every bootstrap interval's bounds, count and p-value taken out (they depend on
    the number of resamples), and the decision kept to what no bound decides (outcome and reasons)."""
    if isinstance(found, dict):
        bootstrap = "resamples" in found
        kept = {
            key: _without_intervals(value)
            for key, value in found.items()
            if not (bootstrap and key in ("low", "high", "resamples", "dropped", "p_two_sided"))
        }
        if "conditions" in kept and "reasons" in kept:
            kept.pop("conditions")  # each condition's text quotes a bound
        return kept
    if isinstance(found, list):
        return [_without_intervals(value) for value in found]
    return found


def test_the_committed_study_report_is_what_its_committed_records_give():
    """docs/records/real_models_study/results.json (made with 10,000 resamples) against the analysis of
    the committed records with 200: every member row, exclusion, calibration, instrument check, point
    estimate and reason equal; report.md is that results.json formatted."""
    from longppl_reproduce.real_models import analysis

    folder = os.path.join(REPO, "docs", "records", "real_models_study")

    def rows(name):
        with open(os.path.join(folder, "records", f"{name}.jsonl"), encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    found = analysis.analyse(
        analysis.with_task_documents(rows("members"), rows("task_documents")),
        rows("instrument"),
        rows("calibration"),
        analysis.plan_rules(200),
    )
    found = json.loads(json.dumps(found, default=str))
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as handle:
        committed = json.load(handle)
    assert committed["statistics"]["all"]["longppl"]["spearman"]["longppl"]["resamples"] == 10000
    assert len(committed["rows"]) == len(rows("members"))
    assert _without_intervals(found) == _without_intervals(committed)
    with open(os.path.join(folder, "report.md"), encoding="utf-8") as handle:
        assert handle.read() == analysis.format_report(committed)


def test_the_committed_longce_report_is_what_its_committed_records_give(tmp_path):
    """docs/records/real_models_study/longce_{report.md,results.json}: ``longce-report`` on a copy of
    the committed LongCE records writes them byte for byte (the case resampling is seeded)."""
    import shutil

    from longppl_reproduce.real_models.cli import main

    folder = os.path.join(REPO, "docs", "records", "real_models_study")
    (tmp_path / "records").mkdir()
    for path in glob.glob(os.path.join(folder, "records", "longce_*.jsonl")):
        shutil.copy(path, tmp_path / "records")
    assert main(["longce-report", "--run", str(tmp_path)]) == 0
    for name in ("longce_results.json", "longce_report.md"):
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            assert (tmp_path / name).read_text(encoding="utf-8") == handle.read(), name
    committed = json.loads((tmp_path / "longce_results.json").read_text())
    assert committed["runs"] == {"planned": 40, "entered": 40}
