"""The report of "LongCE beyond one setting" (longppl_reproduce.longce_comparison's ``report`` stage with
``settings``, longppl_reproduce.longce_settings_report): crafted records of 3 settings x 4 seeds x 5
arms and the start models, written in the pipeline's format, checked against plain computations
written here (paired t intervals, the balanced random-intercept ML fit, the fixed-effects mean), the
void rule, missing settings, seeds and arms, and the plan's decisions on crafted intervals."""

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
from conftest import REPO
from longppl_reproduce.longce_comparison import pipeline as comparison_pipeline
from longppl_reproduce.longce_comparison import settings_report as analysis
from scipy import stats

H100X4 = os.path.join(REPO, "configs", "reproduce", "longce_settings_h100x4.yaml")
METHODS = ("ce", "self", "cache", "frozen", "ce-fresh")
SEEDS = (0, 1, 2, 3)
LENGTHS = {"a": (640, 768, 896, 992), "b": (640, 768, 896, 992), "c": (1280, 1536, 1792, 1984)}
#: The true effect of each arm over ce on the accuracies, per setting (the noise is added below).
EFFECT = {
    "a": {"ce": 0.0, "self": 0.10, "cache": 0.03, "frozen": 0.10, "ce-fresh": -0.02},
    "b": {"ce": 0.0, "self": 0.14, "cache": 0.10, "frozen": 0.06, "ce-fresh": 0.13},
    "c": {"ce": 0.0, "self": 0.08, "cache": 0.01, "frozen": 0.075, "ce-fresh": 0.0},
}
START = {"a": 0.70, "b": 0.02, "c": 0.80}  # the start models' accuracies (b: the paper's regime, near 0)
#: The report's command on records alone: the books are named (the config needs them) but not read.
REPORT = ["--config", H100X4, "--corpus", "books/train.jsonl.gz", "--stages", "report"]
OUTCOMES = ("primary_accuracy", "recall", "acc_start", "needle", "log_likelihood", "ppl", "longppl", "beyond_start")


def _crafted() -> dict:
    """``{(setting, method, seed): {outcome: value}}`` and ``{setting: {outcome: value}}`` (start)."""
    rng = np.random.default_rng(7)
    runs, start = {}, {}
    for setting, effects in EFFECT.items():
        base = START[setting] * 0.5 + 0.3
        for seed in SEEDS:
            seed_shift = rng.normal(0, 0.02)  # a seed's data order moves every arm a little alike
            for method, effect in effects.items():
                v = {
                    "primary_accuracy": base + effect + seed_shift + rng.normal(0, 0.01),
                    "recall": 0.4 + effect / 2 + rng.normal(0, 0.01),
                    "acc_start": 0.85 + rng.normal(0, 0.01),
                    "needle": 0.5 + effect + rng.normal(0, 0.02),
                    "log_likelihood": -1.2 + effect + rng.normal(0, 0.05),
                    "ppl": 30.0 + 2 * effect + rng.normal(0, 0.05),
                    "longppl": None if method == "cache" else 3.0 - effect + rng.normal(0, 0.02),
                    "beyond_start": 0.3 + effect + rng.normal(0, 0.01) if setting == "c" else None,
                }
                runs[setting, method, seed] = v
        start[setting] = {
            "primary_accuracy": START[setting],
            "recall": 0.35,
            "acc_start": 0.9,
            "needle": 0.4,
            "log_likelihood": -1.5,
            "ppl": 31.0,
            "longppl": 3.3,
            "beyond_start": 0.1 if setting == "c" else None,
        }
    return {"runs": runs, "start": start}


def _write(path, record) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle)


def _evaluation(setting: str, name: str, method: str, seed: int, v: dict) -> dict:
    """An evaluation record as ``evaluate_setting_arms`` writes it: the primary lengths' accuracies
    spread about the primary value (their mean is it), the answer LL per length likewise."""
    lengths = LENGTHS[setting]
    offsets = np.linspace(0.03, -0.03, len(lengths))
    record = {
        "run": name,
        "setting": setting,
        "method": method,
        "seed": seed,
        "lines": {str(n): {"accuracy": v["primary_accuracy"] + o} for n, o in zip(lengths, offsets)},
        "acc_start": {"accuracy": v["acc_start"]},
        "needle": {"accuracy": v["needle"]},
        "log_likelihood": {
            str(n): [v["log_likelihood"] + o, v["log_likelihood"] - o] for n, o in zip(lengths, offsets)
        },
        "recall": {"accuracy": v["recall"], "cases": 300},
        "ppl": v["ppl"],
        "longppl": v["longppl"],
        "longppl_evaluator": None if v["longppl"] is None else "E1",
    }
    if v["beyond_start"] is not None:
        record["beyond_start"] = {str(n): {"accuracy": v["beyond_start"]} for n in lengths}
    return record


def _write_records(root, crafted: dict, void=(), skip=()) -> None:
    """The records of ``crafted`` in a run folder's layout: ``eval/finetuned/<run>.json`` and each run's
    ``models/finetuned/<run>/training.json`` (with its void rule: void for the names in ``void``);
    the names in ``skip`` (runs, or ``<setting>-start``) are not written."""
    for setting, v in crafted["start"].items():
        name = f"{setting}-start"
        if name not in skip:
            _write(os.path.join(root, "eval", "finetuned", f"{name}.json"), _evaluation(setting, name, "start", 0, v))
    for (setting, method, seed), v in crafted["runs"].items():
        name = f"{setting}-{method}-s{seed}"
        if name in skip:
            continue
        _write(os.path.join(root, "eval", "finetuned", f"{name}.json"), _evaluation(setting, name, method, seed, v))
        acc = 0.1 if name in void else 0.8
        curve = [
            {"step": 0, "acc_start": 0.9, "primary": {}, "mean": START[setting]},
            {"step": 125, "acc_start": acc, "primary": {}, "mean": v["primary_accuracy"] - 0.02},
            {"step": 500, "acc_start": 0.85, "primary": {}, "mean": v["primary_accuracy"]},
        ]
        training = {
            "name": name,
            "setting": setting,
            "method": method,
            "seed": seed,
            "steps": 1650 if method == "ce-fresh" else 500,
            "fresh": {"planned": 1650, "run": 1650} if method == "ce-fresh" else None,
            "step_seconds": {"median": 0.2 if method in ("self", "ce-fresh") else 0.06},
            "curve": curve,
            "void": {"at_step": 125, "acc_start": acc, "start_acc_start": 0.9, "threshold": 0.45, "void": acc < 0.45},
        }
        _write(os.path.join(root, "models", "finetuned", name, "training.json"), training)


def _report(root) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        comparison_pipeline.main([*REPORT, "--output-dir", str(root)])
    with open(os.path.join(root, "results.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _t_interval(differences: list[float]) -> tuple[float, float, float]:
    d = np.asarray(differences, dtype=float)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean(), d.mean() - half, d.mean() + half


def _check(found: dict, differences: list[float]) -> None:
    mean, low, high = _t_interval(differences)
    assert found["n"] == len(differences)
    assert found["value"] == pytest.approx(mean, abs=1e-9)
    assert found["low"] == pytest.approx(low, abs=1e-9) and found["high"] == pytest.approx(high, abs=1e-9)


def _balanced_random_intercept(groups: list[list[float]]) -> tuple[float, float, float]:
    """mu's ML estimate and its 95% interval for a balanced one-way random-intercept model, by its
    closed form: mu = grand mean, var(mu) = (SSB / G) / (n G) when the ML tau2 is positive (t on G - 1)."""
    y = np.asarray(groups, dtype=float)
    count, n = y.shape
    means = y.mean(axis=1)
    between = n * ((means - y.mean()) ** 2).sum() / count  # sigma2 + n tau2, by ML
    within = ((y - means[:, None]) ** 2).sum() / (count * (n - 1))
    assert between > within, "crafted so that the ML tau2 is positive (the closed form's case)"
    se = math.sqrt(between / (n * count))
    half = stats.t.ppf(0.975, count - 1) * se
    return y.mean(), y.mean() - half, y.mean() + half


def _fixed_effects(groups: list[list[float]]) -> tuple[float, float, float, int]:
    means = [np.mean(g) for g in groups]
    df = sum(len(g) for g in groups) - len(groups)
    within = sum(((np.asarray(g) - np.mean(g)) ** 2).sum() for g in groups) / df
    se = math.sqrt(within * sum(1 / len(g) for g in groups)) / len(groups)
    half = stats.t.ppf(0.975, df) * se
    return np.mean(means), np.mean(means) - half, np.mean(means) + half, df


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    crafted = _crafted()
    root = tmp_path_factory.mktemp("settings-report") / "run"
    _write_records(root, crafted)
    return {"crafted": crafted, "root": root, "results": _report(root)}


def _diffs(crafted, setting, arm, baseline, outcome, seeds=SEEDS):
    runs = crafted["runs"]
    return [runs[setting, arm, s][outcome] - runs[setting, baseline, s][outcome] for s in seeds]


def test_per_setting_intervals_are_plain_paired_t_intervals(full):
    crafted, results = full["crafted"], full["results"]
    for setting in EFFECT:
        found = results["settings"][setting]
        for arm, baseline in analysis.SETTING_PAIRS:
            for outcome in OUTCOMES:
                entry = found["differences"][f"{arm} - {baseline}"][outcome]
                if outcome == "longppl" and "cache" in (arm, baseline) or outcome == "beyond_start" and setting != "c":
                    assert "skipped" in entry  # no LongPPL for cache; beyond-start only in c
                    continue
                _check(entry, _diffs(crafted, setting, arm, baseline, outcome))
        for arm in METHODS:
            for outcome in ("primary_accuracy", "recall", "ppl"):
                values = [crafted["runs"][setting, arm, s][outcome] for s in SEEDS]
                start = crafted["start"][setting][outcome]
                _check(found["against_start"][f"{arm} - start"][outcome], [v - start for v in values])
                summary = found["summary"][arm][outcome]
                assert summary["mean"] == pytest.approx(np.mean(values)) and summary["n"] == 4
                assert summary["sd"] == pytest.approx(np.std(values, ddof=1))


def test_pooled_statistics_are_the_plain_random_intercept_and_fixed_effects_fits(full):
    crafted, pooled = full["crafted"], full["results"]["pooled"]
    for arm, baseline in analysis.POOLED_PAIRS:
        for outcome in analysis.POOLED_MEASURES:
            groups = [_diffs(crafted, s, arm, baseline, outcome) for s in EFFECT]
            item = pooled[f"{arm} - {baseline}"][outcome]
            assert item["settings"] == ["a", "b", "c"] and item["n"] == 12
            fixed = item["fixed_effects"]
            mean, low, high, df = _fixed_effects(groups)
            assert fixed["df"] == df == 9
            assert (fixed["value"], fixed["low"], fixed["high"]) == pytest.approx((mean, low, high), abs=1e-9)
            if outcome == "primary_accuracy" and (arm, baseline) in (("self", "ce"), ("self", "ce-fresh")):
                # the settings' effects differ a lot: the ML tau2 is positive, the closed form holds
                mu = item["random_intercept"]
                assert mu["df"] == 2
                expected = _balanced_random_intercept(groups)
                assert (mu["value"], mu["low"], mu["high"]) == pytest.approx(expected, abs=1e-6)


def test_decisions_of_the_crafted_run_follow_the_plain_intervals(full):
    crafted, results = full["crafted"], full["results"]
    decisions = results["decisions"]
    positive = [s for s in EFFECT if _t_interval(_diffs(crafted, s, "self", "ce", "primary_accuracy"))[1] > 0]
    assert positive == ["a", "b", "c"]
    _, pooled_low, _ = _balanced_random_intercept(
        [_diffs(crafted, s, "self", "ce", "primary_accuracy") for s in EFFECT]
    )
    assert pooled_low > 0  # with positive settings, the pooled interval on 2 df excludes 0 as well
    assert decisions["claim"]["decision"] == "reproduced beyond one setting"
    for setting in EFFECT:
        _, low, high = _t_interval(_diffs(crafted, setting, "frozen", "self", "primary_accuracy"))
        assert decisions["frozen"][setting]["matches_self"] == (low > -0.03)
        assert decisions["frozen"][setting]["frozen_minus_self"]["low"] == pytest.approx(low)
        low_ce = _t_interval(_diffs(crafted, setting, "frozen", "ce", "primary_accuracy"))[1]
        assert decisions["frozen"][setting]["beats_ce"] == (low_ce > 0)
        low_fresh = _t_interval(_diffs(crafted, setting, "self", "ce-fresh", "primary_accuracy"))[1]
        assert decisions["compute"][setting]["not_bought_with_compute"] == (low_fresh > 0)
    # b: frozen is 8 points behind self, a level with it: the crafted answers differ by setting
    assert [decisions["frozen"][s]["matches_self"] for s in "ab"] == [True, False]
    assert decisions["compute"]["a"]["not_bought_with_compute"] is True
    assert decisions["compute"]["b"]["not_bought_with_compute"] is False
    text = open(os.path.join(full["root"], "report.md"), encoding="utf-8").read()
    assert "LongCE's claim (`self − ce`, primary): reproduced beyond one setting." in text
    mean, low, high = _t_interval(_diffs(crafted, "a", "self", "ce", "primary_accuracy"))
    assert f"| **self − ce** | 4 | {mean:+.3f} [{low:+.3f}, {high:+.3f}] |" in text
    assert "## Pooled over the settings" in text and "Not in the records" not in text
    assert os.path.isfile(os.path.join(full["root"], "figures", "accuracy_vs_steps-c.png"))


def test_void_runs_leave_the_accuracy_comparisons_and_an_arm_void_in_three_seeds_has_none(tmp_path):
    crafted = _crafted()
    void = {"a-ce-s1", "b-frozen-s0", "b-frozen-s1", "b-frozen-s2"}
    _write_records(tmp_path, crafted, void=void)
    results = _report(tmp_path)
    a, b = results["settings"]["a"], results["settings"]["b"]
    # a: ce's seed 1 is out of every accuracy comparison against ce, not out of PPL
    kept = (0, 2, 3)
    _check(
        a["differences"]["self - ce"]["primary_accuracy"], _diffs(crafted, "a", "self", "ce", "primary_accuracy", kept)
    )
    _check(a["differences"]["frozen - ce"]["recall"], _diffs(crafted, "a", "frozen", "ce", "recall", kept))
    _check(a["differences"]["self - ce"]["ppl"], _diffs(crafted, "a", "self", "ce", "ppl"))
    _check(
        a["differences"]["self - frozen"]["primary_accuracy"],
        _diffs(crafted, "a", "self", "frozen", "primary_accuracy"),
    )
    assert a["summary"]["ce"]["primary_accuracy"]["n"] == 3 and a["summary"]["ce"]["ppl"]["n"] == 4
    assert a["void"]["ce"] == {"void_seeds": [1], "void": False}
    # b: frozen void in 3 of 4 seeds: no accuracy comparison for it, PPL kept
    assert b["void"]["frozen"] == {"void_seeds": [0, 1, 2], "void": True}
    for pair in ("frozen - ce", "self - frozen"):
        assert "skipped" in b["differences"][pair]["primary_accuracy"]
        _check(b["differences"][pair]["ppl"], _diffs(crafted, "b", *pair.split(" - "), "ppl"))
    assert results["decisions"]["frozen"]["b"] == {
        "matches_self": None,
        "beats_ce": None,
        "frozen_minus_self": b["differences"]["self - frozen"]["primary_accuracy"],
    }
    # the pooled frozen - ce leaves b out; self - ce pools a's 3 seeds with b's and c's 4
    assert results["pooled"]["frozen - ce"]["primary_accuracy"]["settings"] == ["a", "c"]
    assert results["pooled"]["self - ce"]["primary_accuracy"]["n"] == 11
    values = _diffs(crafted, "a", "self", "ce", "primary_accuracy", kept) + sum(
        (_diffs(crafted, s, "self", "ce", "primary_accuracy") for s in "bc"), []
    )
    fixed = results["pooled"]["self - ce"]["primary_accuracy"]["fixed_effects"]
    assert fixed["df"] == 8 and fixed["value"] == pytest.approx(
        np.mean([np.mean(values[:3]), np.mean(values[3:7]), np.mean(values[7:])])
    )
    text = (tmp_path / "report.md").read_text()
    assert "a-ce-s1 (at the start length 0.100 at step 125, threshold 0.450)" in text
    assert "**No accuracy comparison for frozen** (void in more than half the seeds)." in text
    assert "| b-frozen-s0 |" in text and "**void** |" in text


def test_a_missing_setting_pools_the_others_with_one_degree_of_freedom_and_says_so(tmp_path):
    crafted = _crafted()
    skip = {f"c-{m}-s{s}" for m in METHODS for s in SEEDS} | {"c-start", "a-self-s3", "b-cache-s2"}
    _write_records(tmp_path, crafted, skip=skip)
    results = _report(tmp_path)
    assert results["settings"]["c"]["runs"] == [] and results["settings"]["c"]["start"] is None
    mu = results["pooled"]["self - ce"]["primary_accuracy"]["random_intercept"]
    assert mu["df"] == 1 and results["pooled"]["self - ce"]["primary_accuracy"]["settings"] == ["a", "b"]
    # a missing seed of an arm leaves that seed's pair out, and is listed
    _check(
        results["settings"]["a"]["differences"]["self - ce"]["primary_accuracy"],
        _diffs(crafted, "a", "self", "ce", "primary_accuracy", (0, 1, 2)),
    )
    assert "a-self-s3" in results["settings"]["a"]["missing"] and "b-cache-s2" in results["settings"]["b"]["missing"]
    assert set(results["decisions"]["frozen"]) == {"a", "b", "c"}
    assert results["decisions"]["frozen"]["c"]["matches_self"] is None
    text = (tmp_path / "report.md").read_text()
    assert "**Not in the records: setting(s) c** (not run or not evaluated)." in text
    assert (
        "LongCE's claim (`self − ce`, primary): setting-dependent (on the records of a, b alone: c not in them).**"
        in text
    )
    assert "The pooled model is fitted over a and b only, so its interval has 1 degree of freedom" in text
    assert "Not in the records: a-self-s3." in text


def test_a_report_without_any_record_is_one_error_line(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        comparison_pipeline.cli([*REPORT, "--output-dir", str(tmp_path / "empty")])
    lines = str(stopped.value.code).splitlines()
    assert len(lines) == 1 and ": error: " in lines[0]
    assert "No evaluation records of settings a, b, c" in lines[0] and "untar" in lines[0]
    assert not (tmp_path / "empty" / "report.md").exists()


def _interval(low: float, high: float) -> dict:
    return {"value": (low + high) / 2, "low": low, "high": high}


def _differences(self_ce: dict, others: dict | None = None) -> dict:
    """Per setting, ``self - ce`` on the primary outcome (a ``(low, high)`` or ``None``: skipped) and others."""
    out = {}
    for setting, bounds in self_ce.items():
        entry = {"self - ce": {"primary_accuracy": _interval(*bounds) if bounds else {"skipped": "void"}}}
        for pair, by_setting in (others or {}).items():
            if setting in by_setting:
                entry[pair] = {"primary_accuracy": _interval(*by_setting[setting])}
        out[setting] = entry
    return out


def _pooled(low: float | None, high: float | None = None) -> dict:
    mu = _interval(low, high) if low is not None else {"skipped": "1 setting"}
    return {"self - ce": {"primary_accuracy": {"random_intercept": mu}}}


@pytest.mark.parametrize(
    "self_ce, pooled, decision",
    [
        # two settings positive and the pooled interval excluding 0
        ({"a": (0.02, 0.10), "b": (0.01, 0.30), "c": (-0.05, 0.08)}, (0.01, 0.2), "reproduced beyond one setting"),
        # two positive, but the pooled interval (2 df) takes in 0: setting-dependent
        ({"a": (0.02, 0.10), "b": (0.01, 0.30), "c": (-0.05, 0.08)}, (-0.1, 0.3), "setting-dependent"),
        # one positive only, pooled excluding 0 or not
        ({"a": (0.02, 0.10), "b": (-0.01, 0.30), "c": (-0.05, 0.08)}, (0.01, 0.2), "setting-dependent"),
        # one positive, one negative excluding 0
        ({"a": (0.02, 0.10), "b": (-0.3, -0.1), "c": None}, (-0.5, 0.5), "setting-dependent"),
        # none positive: a negative interval excluding 0 is not the claim
        ({"a": (-0.02, 0.10), "b": (-0.3, -0.1), "c": (-0.05, 0.0)}, (-0.2, -0.01), "not reproduced"),
        # no comparison at all (void everywhere), no pooled fit
        ({"a": None, "b": None}, None, "not reproduced"),
        # two positive settings with no pooled fit cannot be "beyond one setting" by the plan's rule
        ({"a": (0.02, 0.10), "b": (0.01, 0.30)}, None, "setting-dependent"),
    ],
)
def test_the_claim_decision_on_crafted_intervals(self_ce, pooled, decision):
    found = analysis.decide(_differences(self_ce), _pooled(*(pooled or (None,))))
    assert found["claim"]["decision"] == decision
    assert found["claim"]["positive_settings"] == [s for s, b in self_ce.items() if b and b[0] > 0]


def test_frozen_and_compute_decisions_on_crafted_intervals():
    others = {
        # frozen - self = -(self - frozen): low end -0.025 in a (matches), -0.035 in b (does not)
        "self - frozen": {"a": (-0.01, 0.025), "b": (0.0, 0.035), "c": (0.04, 0.08)},
        "frozen - ce": {"a": (0.001, 0.05), "b": (-0.01, 0.05), "c": (-0.08, -0.02)},
        "self - ce-fresh": {"a": (0.002, 0.04), "b": (-0.03, 0.01), "c": (-0.09, -0.01)},
    }
    found = analysis.decide(_differences({"a": (0.1, 0.2), "b": (0.1, 0.2), "c": (0.1, 0.2), "d": None}, others), {})
    assert [found["frozen"][s]["matches_self"] for s in "abcd"] == [True, False, False, None]
    assert found["frozen"]["a"]["frozen_minus_self"]["low"] == pytest.approx(-0.025)
    assert found["frozen"]["a"]["frozen_minus_self"]["high"] == pytest.approx(0.01)
    assert [found["frozen"][s]["beats_ce"] for s in "abcd"] == [True, False, False, None]
    assert [found["compute"][s]["not_bought_with_compute"] for s in "abcd"] == [True, False, False, None]
    # the margin is the plan's 3 points
    assert (
        analysis.decide(_differences({"a": (0.1, 0.2)}, {"self - frozen": {"a": (0.0, 0.031)}}), {})["frozen"]["a"][
            "matches_self"
        ]
        is False
    )
