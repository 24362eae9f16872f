"""The earlier studies' committed records (docs/records/third_attempt, docs/records/longce_settings):
they are the page's tables, and the report rebuilds those tables and the statistics from them alone."""

import filecmp
import os

import pytest
from longppl_reproduce.real_models import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reproduction.md")
RECORDS = os.path.join(ROOT, "docs", "records")


def _page_lines():
    with open(PAGE, encoding="utf-8") as f:
        return f.read().splitlines()


def _holds_block(page, block):
    """Whether ``block``'s lines stand consecutively in ``page``."""
    first = [i for i, line in enumerate(page) if line == block[0]]
    return any(page[i : i + len(block)] == block for i in first)


def test_committed_records_are_the_pages_tables(tmp_path):
    written = records.transcribe(PAGE, str(tmp_path))
    assert len(written) == 10
    for path in written:
        committed = os.path.join(RECORDS, os.path.relpath(path, tmp_path))
        assert os.path.isfile(committed), f"{committed} is not committed"
        assert filecmp.cmp(path, committed, shallow=False), f"{committed} differs from the page's table"


def test_records_hold_every_member_and_run_summary():
    members = records.read_csv(os.path.join(RECORDS, "third_attempt", "members.csv"))
    assert len(members) == 85
    assert sum(not m["excluded"] for m in members) == 74
    assert {m["configuration"] for m in members if not m["excluded"]} == {
        m["configuration"] for m in members if m["excluded"] != "control"
    }
    arms = records.read_csv(os.path.join(RECORDS, "longce_settings", "arms.csv"))
    assert {(a["setting"], a["arm"]) for a in arms} == {
        (s, arm) for s in "abc" for arm in ("start", "ce", "self", "cache", "frozen", "ce-fresh")
    }


@pytest.fixture(scope="module")
def rebuilt():
    return records.report(RECORDS, resamples=2000)


@pytest.mark.slow
def test_report_rebuilds_every_published_table(rebuilt):
    page = _page_lines()
    exact = [name for name in rebuilt["tables"] if "rebuilt" not in name]
    assert len(exact) == 9
    for name in exact:
        assert _holds_block(page, rebuilt["tables"][name]), f"the rebuilt table {name} is not the page's"


@pytest.mark.slow
def test_report_rebuilds_the_third_attempts_statistics(rebuilt):
    """From the records alone (values rounded as printed, so ties can move ranks): the composite, the
    correlations and their cluster-bootstrap intervals near the published ones, and the decision."""
    members = {m["member"]: m for m in records.read_csv(os.path.join(RECORDS, "third_attempt", "members.csv"))}
    for row in rebuilt["third"]["rows"]:
        assert row["composite"] == pytest.approx(float(members[row["member"]]["composite"]), abs=0.004)
    published = records.read_csv(os.path.join(RECORDS, "third_attempt", "published_statistics.csv"))
    assert len(published) == 12
    for row in published:
        found = rebuilt["third"]["by_evaluator"][row["evaluator"]][row["members"]]
        assert (found["n"], found["clusters"]) == (int(row["n"]), int(row["clusters"]))
        for method, tolerance in (("spearman", 0.03), ("pearson", 0.01)):
            for measure in ("longppl", "ppl", "difference"):
                value = found[method][measure]
                assert value["value"] == pytest.approx(float(row[f"{method}_{measure}"]), abs=tolerance)
                for end in ("low", "high"):
                    assert value[end] == pytest.approx(float(row[f"{method}_{measure}_{end}"]), abs=tolerance + 0.04)
    e1 = rebuilt["third"]["by_evaluator"]["E1"]["all analysed"]["spearman"]["longppl"]
    assert e1["low"] > -0.5  # the plan's negative clause holds on the rebuilt interval too


@pytest.mark.slow
def test_longce_decisions_and_fixed_effects_from_the_records(rebuilt):
    found = rebuilt["longce"]["decisions"]
    assert found["claim"] == {"a": "positive", "b": "negative", "c": "positive"}
    assert found["claim_verdict"] == "setting-dependent"
    assert all(found["frozen_beats_ce"].values()) and all(found["frozen_matches_self"].values())
    pooled = records.read_csv(os.path.join(RECORDS, "longce_settings", "published_pooled.csv"))
    for p in pooled:
        fixed = rebuilt["longce"]["fixed_effects"][(p["difference"], p["outcome"])]
        for key, column in (("value", "fixed_effects"), ("low", "fixed_effects_low"), ("high", "fixed_effects_high")):
            assert fixed[key] == pytest.approx(float(p[column]), abs=0.0025)


def test_a_missing_records_folder_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="run `transcribe` first"):
        records.report(str(tmp_path))
