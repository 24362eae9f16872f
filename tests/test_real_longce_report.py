"""The report of "LongCE from a real start" (``longce-report``, longppl_reproduce.real_models.longce_report)
on records made up here in the phases' format: the stage reads them alone; its paired t intervals,
p-values, Holm adjustments and pooled fixed-effects means equal plain computations written here;
the void rule, the decisions and a failed gate act as the plan says."""

import json
import math

import numpy as np
import pytest
from longppl_reproduce.real_models import longce_report
from longppl_reproduce.real_models.cli import main
from longppl_reproduce.real_models.longce_start import ARMS, PLAN, task_sets
from scipy import stats

SEEDS = PLAN.seeds
CHECKPOINTS = PLAN.checkpoints
STARTS = {s.name: s for s in PLAN.starts}
T_975_3 = 3.182446305284263  # t_{0.975, 3}, from the tables
#: The primary outcome's ce per seed, and every arm's per-seed difference to it (s1): self far ahead,
#: frozen ahead with p about 0.018 (below 0.05 alone, not after Holm over four), shuffled and ce-fresh
#: near ce.
CE = (0.30, 0.34, 0.27, 0.31)
AHEAD = {
    "ce": (0.0, 0.0, 0.0, 0.0),
    "self": (0.10, 0.12, 0.09, 0.11),
    "frozen": (0.06, 0.02, 0.045, 0.035),
    "shuffled": (0.05, -0.03, 0.04, 0.02),
    "ce-fresh": (0.05, 0.13, 0.02, 0.12),
}
NULL_SELF = (0.03, -0.04, 0.02, -0.01)  # self - ce with no effect


def craft(self_ahead=None, gate_passed=None) -> dict:
    """``{(start, arm, seed, step): outcomes}`` (the start model at ``(start, "start", None, 0)``) and the
    gates. ``self_ahead``: per start ``self - ce`` per seed (default :data:`AHEAD`'s)."""
    rng = np.random.default_rng(11)
    values = {}
    for index, start in enumerate(STARTS):
        values[start, "start", None, 0] = {
            "lines_beyond": 0.2,
            "recall": 0.3,
            "needle": 0.4,
            "lines_within": 0.9,
            "ppl": 20.0,
            "longppl": 4.0,
        }
        for arm in ARMS:
            ahead = (self_ahead or {}).get(start, AHEAD[arm]) if arm == "self" else AHEAD[arm]
            for seed in SEEDS:
                primary = CE[seed] + ahead[seed] + 0.05 * index
                for step in CHECKPOINTS:
                    shift = (step - CHECKPOINTS[-1]) / 1000  # lower earlier in fine-tuning
                    values[start, arm, seed, step] = {
                        "lines_beyond": primary + shift,
                        "recall": 0.35 + ahead[seed] / 2 + rng.normal(0, 0.01) + shift,
                        "needle": 0.5 + rng.normal(0, 0.02),
                        "lines_within": 0.85 + rng.normal(0, 0.01),
                        "ppl": 18.0 - ahead[seed] + rng.normal(0, 0.05),
                        "longppl": 3.5 - ahead[seed] + rng.normal(0, 0.02),
                    }
    gates = {start: True for start in STARTS}
    gates.update(gate_passed or {})
    return {"values": values, "gates": gates}


def tasks_of(start: str, v: dict) -> dict:
    """The task sets of ``start`` (``task_sets``' names) with accuracies spread about ``v``'s outcomes
    (each outcome's mean over its lengths is the value)."""
    names = {}
    for name, kind, _, _ in task_sets(PLAN, STARTS[start]):
        names.setdefault(kind, []).append(name)
    found = {}
    for kind, key in (
        ("lines-beyond", "lines_beyond"),
        ("recall", "recall"),
        ("needle", "needle"),
        ("lines-within", "lines_within"),
    ):
        offsets = np.linspace(-0.02, 0.02, len(names[kind]))
        for name, offset in zip(names[kind], offsets):
            found[name] = {"accuracy": v[key] + float(offset), "per_case": []}
    return found


def records(crafted: dict) -> dict:
    """The four record files' rows, as the phases write them."""
    begun, weights, trained, evaluated = [], [], [], []
    for start, spec in STARTS.items():
        passed = crafted["gates"][start]
        begun.append(
            {
                "key": start,
                "start": start,
                "factor": spec.factor,
                "length": spec.length,
                "gate_set": "lines-within-8192",
                "gate_accuracy": 0.8 if passed else 0.3,
                "gate_passed": passed,
                "primary": "lines-beyond" if passed else "recall",
            }
        )
        begun.append({"key": f"pilot/{start}", "start": start, "r": 1.6 + 0.1 * len(start), "step_seconds": {}})
        weights.append({"key": start, "start": start, "scoring_seconds": 30.0})
    for (start, arm, seed, step), v in crafted["values"].items():
        key = f"{start}/start" if arm == "start" else f"{start}/{arm}-s{seed}/{step}"
        row = {"key": key, "start": start, "arm": arm, "seed": seed, "step": step}
        row["tasks"] = tasks_of(start, v)
        row["books"] = {"ppl": v["ppl"], "longppl": v["longppl"], "key_tokens": 10}
        evaluated.append(row)
        if arm != "start" and step == CHECKPOINTS[-1]:
            seconds = 100.0 * (1.7 if arm in ("self", "ce-fresh") else 1.0) + seed
            scoring = 30.0 if arm in ("frozen", "shuffled") else 0.0
            trained.append(
                {
                    "key": f"{start}/{arm}-s{seed}",
                    "start": start,
                    "arm": arm,
                    "seed": seed,
                    "steps": 200,
                    "seconds": seconds,
                    "scoring_seconds": scoring,
                    "compute_seconds": seconds + scoring,
                    "step_seconds": {"median": seconds / 200, "all": []},
                    "checkpoints": {str(c): c for c in CHECKPOINTS},
                }
            )
    return {"longce_start": begun, "longce_weights": weights, "longce_train": trained, "longce_evaluate": evaluated}


def write_run(root, rows: dict) -> None:
    folder = root / "records"
    folder.mkdir(parents=True)
    for name, found in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in found))


def analyse(crafted: dict, drop=()) -> dict:
    rows = records(crafted)
    rows["longce_evaluate"] = [r for r in rows["longce_evaluate"] if r["key"] not in drop]
    return longce_report.analyse(rows, list(STARTS), ARMS, SEEDS, CHECKPOINTS)


def plain_t(differences) -> dict:
    d = np.asarray(differences, dtype=float)
    se = d.std(ddof=1) / math.sqrt(len(d))
    half = stats.t.ppf(0.975, len(d) - 1) * se
    return {
        "value": d.mean(),
        "low": d.mean() - half,
        "high": d.mean() + half,
        "p": 2 * stats.t.sf(abs(d.mean() / se), len(d) - 1),
    }


def diffs(crafted, start, arm, baseline, outcome, seeds=SEEDS, step=CHECKPOINTS[-1]) -> list[float]:
    v = crafted["values"]
    return [v[start, arm, s, step][outcome] - v[start, baseline, s, step][outcome] for s in seeds]


def check(found: dict, expected: dict) -> None:
    for key in ("value", "low", "high"):
        assert found[key] == pytest.approx(expected[key], abs=1e-9), key


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    crafted = craft()
    root = tmp_path_factory.mktemp("longce-report") / "run"
    write_run(root, records(crafted))
    assert main(["longce-report", "--run", str(root)]) == 0
    results = json.loads((root / "longce_results.json").read_text())
    return {"crafted": crafted, "root": root, "results": results, "text": (root / "longce_report.md").read_text()}


def test_the_stage_reads_the_records_alone_and_writes_both_files(staged):
    root = staged["root"]
    assert sorted(p.name for p in root.iterdir()) == ["longce_report.md", "longce_results.json", "records"]
    assert not list(root.glob("*.tmp-*"))
    assert staged["text"].startswith("# LongCE from a real start")
    assert set(staged["results"]["starts"]) == {"s1", "s2"}


def test_intervals_are_plain_paired_t_intervals(staged):
    crafted, results = staged["crafted"], staged["results"]
    for start in STARTS:
        found = results["starts"][start]
        for arm, baseline in longce_report.PAIRS:
            for outcome in ("primary_accuracy", "lines_beyond", "recall", "needle", "lines_within", "ppl", "longppl"):
                source = "lines_beyond" if outcome == "primary_accuracy" else outcome
                entry = found["differences"][f"{arm} - {baseline}"][outcome]
                expected = plain_t(diffs(crafted, start, arm, baseline, source))
                check(entry, expected)
                assert entry["p_two_sided"] == pytest.approx(expected["p"], rel=1e-6)
        for arm in ARMS:
            start_value = crafted["values"][start, "start", None, 0]["recall"]
            values = [crafted["values"][start, arm, s, CHECKPOINTS[-1]]["recall"] for s in SEEDS]
            check(found["against_start"][f"{arm} - start"]["recall"], plain_t([v - start_value for v in values]))
    # the same interval by the table's t quantile: mean +- 3.182 sd / 2
    d = np.asarray(diffs(crafted, "s1", "self", "ce", "lines_beyond"))
    half = T_975_3 * d.std(ddof=1) / 2
    entry = results["starts"]["s1"]["differences"]["self - ce"]["primary_accuracy"]
    assert (entry["low"], entry["high"]) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-9)
    assert entry["df"] == 3


def test_the_pooled_fixed_effects_mean_has_six_degrees_of_freedom(staged):
    crafted, pooled = staged["crafted"], staged["results"]["pooled"]
    lows = {}
    for arm, baseline in longce_report.PAIRS:
        groups = [diffs(crafted, s, arm, baseline, "lines_beyond") for s in STARTS]
        fixed = pooled[f"{arm} - {baseline}"]["primary_accuracy"]["fixed_effects"]
        within = sum(((np.asarray(g) - np.mean(g)) ** 2).sum() for g in groups) / 6
        se = math.sqrt(within * (1 / 4 + 1 / 4)) / 2
        mean = np.mean([np.mean(g) for g in groups])
        half = stats.t.ppf(0.975, 6) * se
        assert fixed["df"] == 6
        check(fixed, {"value": mean, "low": mean - half, "high": mean + half})
        assert pooled[f"{arm} - {baseline}"]["primary_accuracy"]["random_intercept"]["df"] == 1
        lows[f"{arm} - {baseline}"] = mean - half
    # the pooled decisions read these intervals, unadjusted (frozen - self: self - frozen mirrored)
    decided = staged["results"]["decisions"]["pooled"]
    for key, pair in (
        ("self_beats_ce", "self - ce"),
        ("frozen_beats_ce", "frozen - ce"),
        ("information_carries_frozen", "frozen - shuffled"),
        ("distribution_helps", "shuffled - ce"),
        ("not_bought_with_compute", "self - ce-fresh"),
    ):
        assert decided[key] == (lows[pair] > 0), key
    high = pooled["self - frozen"]["primary_accuracy"]["fixed_effects"]["high"]
    assert decided["frozen_minus_self"]["low"] == pytest.approx(-high)
    assert decided["frozen_matches_self"] == (-high > -0.03)
    assert decided["frozen_beats_ce"] is True and decided["not_bought_with_compute"] is False  # both branches


def test_holm_keeps_a_contrast_that_is_below_005_only_unadjusted(staged):
    crafted, results = staged["crafted"], staged["results"]
    tests = results["starts"]["s1"]["holm"]
    p = {f"{a} - {b}": plain_t(diffs(crafted, "s1", a, b, "lines_beyond"))["p"] for a, b in longce_report.DECIDED_PAIRS}
    # the crafting: frozen - ce is below 0.05 alone, self - ce far below
    assert p["frozen - ce"] < 0.05 < 3 * p["frozen - ce"] and p["self - ce"] < 0.05 / 4
    order = sorted(p, key=p.get)
    running = 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (4 - i) * p[name]))
        assert tests[name]["p"] == pytest.approx(p[name], rel=1e-6)
        assert tests[name]["p_holm"] == pytest.approx(running, rel=1e-6)
    assert tests["self - ce"]["rejected"] and tests["self - ce"]["positive"]
    assert not tests["frozen - ce"]["rejected"] and tests["frozen - ce"]["positive"] is False
    decided = results["decisions"]["per_start"]["s1"]
    assert decided["frozen_beats_ce"] is False and decided["self_beats_ce"] is True
    assert decided["information_carries_frozen"] is False and decided["not_bought_with_compute"] is False
    assert plain_t(diffs(crafted, "s1", "shuffled", "ce", "lines_beyond"))["low"] < 0
    assert decided["distribution_helps"] is False
    frozen_self = plain_t(diffs(crafted, "s1", "frozen", "self", "lines_beyond"))
    check(decided["frozen_minus_self"], frozen_self)
    assert frozen_self["low"] < -0.03 and decided["frozen_matches_self"] is False
    text = staged["text"]
    assert f"| frozen − ce | {frozen_text(tests['frozen - ce'])} | " in text


def frozen_text(test: dict) -> str:
    return f"{test['value']:+.3f} [{test['low']:+.3f}, {test['high']:+.3f}]"


def test_the_report_names_the_decision_gate_r_and_compute(staged):
    text, results = staged["text"], staged["results"]
    assert "**LongCE's claim (`self − ce`, primary, Holm-adjusted): reproduced.**" in text
    assert results["runs"] == {"planned": 40, "entered": 40} and "Provisional" not in text
    assert results["decisions"]["claim"] == {
        "decision": "reproduced",
        "positive_starts": ["s1", "s2"],
        "compared_starts": ["s1", "s2"],
    }
    assert "| s1 | lines-within-8192 | 0.800 | passed | lines-beyond | 1.800 |" in text
    compute = results["starts"]["s1"]["compute"]
    # frozen's compute counts the one-off scoring: its 100 + seed seconds plus 30
    assert compute["frozen"]["compute_seconds"]["mean"] == pytest.approx(np.mean([130.0 + s for s in SEEDS]))
    assert compute["self"]["over_ce"] == pytest.approx(
        np.mean([170.0 + s for s in SEEDS]) / np.mean([100.0 + s for s in SEEDS])
    )
    along = results["starts"]["s1"]["along"]["self"]["50"]
    expected = [CE[s] + AHEAD["self"][s] - 0.15 for s in SEEDS]
    assert along["mean"] == pytest.approx(np.mean(expected)) and along["n"] == 4
    assert "## Pooled over the starts" in text and "## Compute per arm" in text


def test_the_exploratory_case_interval_sits_beside_the_t_interval_and_decides_nothing(staged):
    # the staged records carry no per-case answers: every contrast says so, the decisions stand
    cases = staged["results"]["starts"]["s1"]["cases"]
    assert set(cases) == {
        "self - ce",
        "frozen - ce",
        "frozen - shuffled",
        "self - ce-fresh",
        "self - frozen",
        "shuffled - ce",
    }
    assert all("no per-case answers" in entry["skipped"] for entry in cases.values())
    assert "### Exploratory: the cases resampled (decides nothing)" in staged["text"]
    # each case answered as its set's accuracy: no spread over cases, so the interval is the point,
    # and the point is the plan's mean of the paired differences
    rows = records(staged["crafted"])
    for r in rows["longce_evaluate"]:
        for task in r["tasks"].values():
            task["per_case"] = [task["accuracy"]] * 3
    found = longce_report.analyse(rows, list(STARTS), ARMS, SEEDS, CHECKPOINTS)
    s1 = found["starts"]["s1"]
    entry = s1["cases"]["self - ce"]
    t = s1["differences"]["self - ce"]["primary_accuracy"]
    assert entry["value"] == pytest.approx(np.mean(diffs(staged["crafted"], "s1", "self", "ce", "lines_beyond")))
    assert entry["value"] == pytest.approx(t["value"])
    assert entry["low"] == pytest.approx(entry["value"]) and entry["high"] == pytest.approx(entry["value"])
    assert entry["holds_under_both"] is (t["low"] > 0)
    assert found["decisions"] == staged["results"]["decisions"]


def test_a_run_below_half_the_starts_within_k_at_the_first_checkpoint_is_void():
    crafted = craft()
    values = crafted["values"]
    values["s1", "ce", 1, 50]["lines_within"] = 0.40  # start 0.9: threshold 0.45 -> void
    values["s1", "self", 2, 50]["lines_within"] = 0.46  # above the threshold: kept
    values["s1", "frozen", 3, 200]["lines_within"] = 0.10  # low only at the last checkpoint: kept
    found = analyse(crafted)["starts"]["s1"]
    void = {r["run"]: r["void"] for r in found["runs"]}
    assert [run for run, v in void.items() if v] == ["s1/ce-s1"]
    rule = next(r["void_rule"] for r in found["runs"] if r["run"] == "s1/ce-s1")
    assert rule == {
        "at_step": 50,
        "lines_within": pytest.approx(0.40),
        "threshold": pytest.approx(0.45),
        "checked": True,
    }
    kept = (0, 2, 3)
    for outcome, source in (
        ("primary_accuracy", "lines_beyond"),
        ("recall", "recall"),
        ("lines_within", "lines_within"),
    ):
        entry = found["differences"]["self - ce"][outcome]
        assert entry["seeds"] == list(kept)
        check(entry, plain_t(diffs(crafted, "s1", "self", "ce", source, kept)))
    for outcome in ("ppl", "longppl"):  # PPL and LongPPL keep the void run
        check(found["differences"]["self - ce"][outcome], plain_t(diffs(crafted, "s1", "self", "ce", outcome)))
    assert found["summary"]["ce"]["primary_accuracy"]["n"] == 3 and found["summary"]["ce"]["ppl"]["n"] == 4
    assert found["void"]["ce"] == {"void_seeds": [1], "void": False}  # no arm-level void
    assert "self - ce" in found["holm"] and found["holm"]["self - ce"]["p"] is not None
    text = longce_report.format_report(analyse(crafted))
    assert "Void runs: s1/ce-s1 (lines within K 0.400 at step 50, threshold 0.450)." in text


def test_an_arm_void_in_three_seeds_keeps_its_fourth_and_one_seed_left_is_skipped():
    crafted = craft()
    for seed in (0, 1, 2):
        crafted["values"]["s1", "frozen", seed, 50]["lines_within"] = 0.1
    found = analyse(crafted)
    s1 = found["starts"]["s1"]
    assert s1["void"]["frozen"] == {"void_seeds": [0, 1, 2], "void": False}
    entry = s1["differences"]["frozen - ce"]["primary_accuracy"]
    assert "skipped" in entry and "1 seed(s)" in entry["skipped"]
    check(s1["differences"]["frozen - ce"]["ppl"], plain_t(diffs(crafted, "s1", "frozen", "ce", "ppl")))
    assert s1["holm"]["frozen - ce"]["positive"] is None and "skipped" in s1["holm"]["frozen - ce"]
    assert found["decisions"]["per_start"]["s1"]["frozen_beats_ce"] is None
    # the family stays four: self - ce's adjusted p carries the multiplier 4
    p = plain_t(diffs(crafted, "s1", "self", "ce", "lines_beyond"))["p"]
    assert s1["holm"]["self - ce"]["p_holm"] == pytest.approx(4 * p, rel=1e-6)
    assert "n/a (1 seed(s) with values of both; 2 are needed) | n/a | 1.0000 (counted with p = 1)" in (
        longce_report.format_report(found)
    )


@pytest.mark.parametrize(
    "self_ahead, decision, positive",
    [
        ({}, "reproduced", ["s1", "s2"]),
        ({"s2": NULL_SELF}, "setting-dependent", ["s1"]),
        ({"s1": NULL_SELF, "s2": NULL_SELF}, "not reproduced", []),
    ],
)
def test_the_claim_counts_the_starts_positive_after_holm(self_ahead, decision, positive):
    crafted = craft(self_ahead=self_ahead)
    found = analyse(crafted)
    for start in STARTS:
        p = plain_t(diffs(crafted, start, "self", "ce", "lines_beyond"))
        assert found["starts"][start]["holm"]["self - ce"]["positive"] == (start in positive)
        assert (p["p"] * 4 < 0.05 and p["value"] > 0) == (start in positive)  # the crafting
    assert found["decisions"]["claim"]["decision"] == decision
    assert found["decisions"]["claim"]["positive_starts"] == positive
    assert f"Holm-adjusted): {decision}.**" in longce_report.format_report(found)


def test_a_significant_negative_difference_is_not_positive():
    crafted = craft(self_ahead={"s2": tuple(-d for d in AHEAD["self"])})
    found = analyse(crafted)
    assert found["starts"]["s2"]["holm"]["self - ce"]["rejected"] is True
    assert found["starts"]["s2"]["holm"]["self - ce"]["positive"] is False
    assert found["decisions"]["claim"]["decision"] == "setting-dependent"


def test_a_failed_gate_makes_passage_recall_the_primary_outcome():
    crafted = craft(gate_passed={"s2": False})
    found = analyse(crafted)
    s1, s2 = found["starts"]["s1"], found["starts"]["s2"]
    assert s1["primary"] == "lines_beyond" and s2["primary"] == "recall"
    check(s2["differences"]["self - ce"]["primary_accuracy"], plain_t(diffs(crafted, "s2", "self", "ce", "recall")))
    check(
        s1["differences"]["self - ce"]["primary_accuracy"], plain_t(diffs(crafted, "s1", "self", "ce", "lines_beyond"))
    )
    assert s2["start"]["primary_accuracy"] == pytest.approx(0.3)  # the start model's recall
    p = plain_t(diffs(crafted, "s2", "frozen", "ce", "recall"))["p"]
    assert s2["holm"]["frozen - ce"]["p"] == pytest.approx(p, rel=1e-6)
    text = longce_report.format_report(found)
    assert "| s2 | lines-within-8192 | 0.300 | **failed**: recall is primary | recall |" in text
    assert "**Start s2** (primary: passage recall beyond)" in text


def test_the_void_rule_is_not_applied_to_a_start_that_failed_the_gate():
    crafted = craft(gate_passed={"s2": False})
    for start in ("s1", "s2"):  # below half the start's 0.9 at the first checkpoint
        crafted["values"][start, "ce", 1, 50]["lines_within"] = 0.10
    found = analyse(crafted)
    s1, s2 = found["starts"]["s1"], found["starts"]["s2"]
    assert [r["run"] for r in s1["runs"] if r["void"]] == ["s1/ce-s1"]
    assert not any(r["void"] for r in s2["runs"])
    assert {r["void_rule"]["why"] for r in s2["runs"]} == {longce_report.FAILED_GATE}
    assert s2["differences"]["self - ce"]["primary_accuracy"]["seeds"] == [0, 1, 2, 3]
    text = longce_report.format_report(found)
    assert f"Void runs: none; void rule not applied to any run ({longce_report.FAILED_GATE})." in text
    assert "Void runs: s1/ce-s1 (lines within K 0.100 at step 50, threshold 0.450)." in text


def test_missing_pieces_are_skipped_not_a_crash():
    crafted = craft()
    rows = records(crafted)
    # s2 never ran; s1's ce-fresh has one seed evaluated at step 200
    rows["longce_start"] = [r for r in rows["longce_start"] if r["start"] != "s2"]
    drop = {f"s1/ce-fresh-s{s}/200" for s in (1, 2, 3)}
    rows["longce_evaluate"] = [r for r in rows["longce_evaluate"] if r["start"] != "s2" and r["key"] not in drop]
    found = longce_report.analyse(rows, list(STARTS), ARMS, SEEDS, CHECKPOINTS)
    assert "skipped" in found["starts"]["s2"] and "longce-start" in found["starts"]["s2"]["skipped"]
    s1 = found["starts"]["s1"]
    assert s1["missing"] == [f"s1/ce-fresh-s{s} (not evaluated at step 200)" for s in (1, 2, 3)]
    assert "skipped" in s1["differences"]["self - ce-fresh"]["primary_accuracy"]
    assert found["decisions"]["claim"]["decision"] == "setting-dependent"  # positive in one of the two starts
    assert "skipped" in found["pooled"]["self - ce"]["primary_accuracy"]["fixed_effects"]
    assert found["decisions"]["pooled"]["self_beats_ce"] is None
    text = longce_report.format_report(found)
    assert "## Start s2\n\nSkipped: no gate record of s2" in text
    assert "Holm-adjusted): setting-dependent (on the records of s1: s2 not in them).**" in text
    # 17 of the 40 runs entered (s2's 20 absent, three of s1's not evaluated at step 200): provisional
    assert found["runs"] == {"planned": 40, "entered": 17}
    assert (
        "- **Provisional: 17 of the 40 planned runs are in the records** (a run enters once evaluated at step 200)"
        in text
    )
    # no start model evaluation: the void rule cannot be checked, and says so
    rows["longce_evaluate"] = [r for r in rows["longce_evaluate"] if r["key"] != "s1/start"]
    found = longce_report.analyse(rows, list(STARTS), ARMS, SEEDS, CHECKPOINTS)
    assert not any(r["void"] for r in found["starts"]["s1"]["runs"])
    assert "void rule not checked: s1/ce-s0 (no start model evaluation)" in longce_report.format_report(found)
    assert "no start model value" in found["starts"]["s1"]["against_start"]["self - start"]["ppl"]["skipped"]


def test_a_run_folder_without_longce_records_is_one_error_line(tmp_path, capsys):
    assert main(["longce-report", "--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No LongCE records" in err[0] and "longce-start" in err[0]
    assert not (tmp_path / "run").exists()
