"""The exploratory case-resampled interval of "LongCE from a real start"
(longppl_reproduce.real_models.longce_cases): its value and percentile interval equal a plain loop
over the documented draws written here; the draws are shared by every run (a constant per-case gap
gives a zero-width interval); void runs and runs without per-case answers are left out, with why."""

import numpy as np
import pytest
from longppl_reproduce.real_models.longce_cases import case_resampled, holds_under_both, per_case

LENGTHS = {12288: 5, 16384: 7}  # cases a length: unequal on purpose


def row(arm: str, seed: int, cases: dict, step: int = 200, kind: str = "recall") -> dict:
    tasks = {f"{kind}-{length}": {"accuracy": float(np.mean(v)), "per_case": list(v)} for length, v in cases.items()}
    tasks["lines-within-4096"] = {"accuracy": 0.0, "per_case": [False] * 3}  # another prefix: not read
    return {"key": f"s1/{arm}-s{seed}/{step}", "tasks": tasks}


def crafted(arms=("self", "ce"), seeds=(0, 1, 2), rng_seed=3):
    rng = np.random.default_rng(rng_seed)
    evaluated, runs = {}, []
    for arm in arms:
        for seed in seeds:
            cases = {length: rng.integers(0, 17, size=n) / 16 for length, n in LENGTHS.items()}
            r = row(arm, seed, cases)
            evaluated[r["key"]] = r
            runs.append({"run": f"s1/{arm}-s{seed}", "method": arm, "seed": seed, "void": False})
    return evaluated, runs


def plain_reference(evaluated, runs, a, b, resamples, seed, step=200, level=0.95):
    """The statistic over the documented draws, by loops: one generator; per length in ascending
    order, ``integers(n, size=(resamples, n))``."""
    rng = np.random.default_rng(seed)
    draws = {length: rng.integers(n, size=(resamples, n)) for length, n in sorted(LENGTHS.items())}

    def outcome(arm, s, r=None):
        tasks = evaluated[f"s1/{arm}-s{s}/{step}"]["tasks"]
        means = []
        for length in sorted(LENGTHS):
            values = tasks[f"recall-{length}"]["per_case"]
            chosen = values if r is None else [values[i] for i in draws[length][r]]
            means.append(sum(chosen) / len(chosen))
        return sum(means) / len(means)

    seeds = sorted({x["seed"] for x in runs if x["method"] == a and not x["void"]})
    seeds = [s for s in seeds if any(x["method"] == b and x["seed"] == s and not x["void"] for x in runs)]
    value = sum(outcome(a, s) - outcome(b, s) for s in seeds) / len(seeds)
    samples = [sum(outcome(a, s, r) - outcome(b, s, r) for s in seeds) / len(seeds) for r in range(resamples)]
    low, high = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return {"value": value, "low": low, "high": high, "seeds": seeds}


def test_the_interval_equals_a_plain_loop_over_the_documented_draws():
    evaluated, runs = crafted()
    found = case_resampled(evaluated, runs, "recall", 200, [("self", "ce")], resamples=300, seed=5)["self - ce"]
    expected = plain_reference(evaluated, runs, "self", "ce", 300, 5)
    for key in ("value", "low", "high"):
        assert found[key] == pytest.approx(expected[key], abs=1e-12), key
    assert found["seeds"] == expected["seeds"] == [0, 1, 2]
    assert found["low"] < found["value"] < found["high"]
    assert found["resamples"] == 300


def test_every_run_shares_the_draw_so_a_constant_gap_has_no_width():
    evaluated, runs = crafted(arms=("ce",))
    for seed in (0, 1, 2):
        ce = evaluated[f"s1/ce-s{seed}/200"]["tasks"]
        shifted = {length: np.asarray(ce[f"recall-{length}"]["per_case"]) + 0.25 for length in LENGTHS}
        r = row("self", seed, shifted)
        evaluated[r["key"]] = r
        runs.append({"run": f"s1/self-s{seed}", "method": "self", "seed": seed, "void": False})
    found = case_resampled(evaluated, runs, "recall", 200, [("self", "ce")], resamples=200)["self - ce"]
    assert found["value"] == pytest.approx(0.25)
    assert found["low"] == pytest.approx(0.25, abs=1e-12)
    assert found["high"] == pytest.approx(0.25, abs=1e-12)


def test_void_runs_are_left_out_and_a_pair_without_answers_is_skipped_with_why():
    evaluated, runs = crafted(arms=("self", "ce", "frozen"))
    runs[1]["void"] = True  # self seed 1
    evaluated["s1/frozen-s0/200"]["tasks"]["recall-12288"]["per_case"] = []
    for seed in (1, 2):
        del evaluated[f"s1/frozen-s{seed}/200"]
    found = case_resampled(evaluated, runs, "recall", 200, [("self", "ce"), ("frozen", "ce")], resamples=50)
    assert found["self - ce"]["seeds"] == [0, 2]
    assert found["self - ce"]["value"] == pytest.approx(plain_reference(evaluated, runs, "self", "ce", 50, 0)["value"])
    assert "skipped" in found["frozen - ce"]
    assert "recall-12288 has no per-case answers" in found["frozen - ce"]["skipped"]


def test_runs_answering_different_numbers_of_cases_are_refused():
    evaluated, runs = crafted()
    evaluated["s1/ce-s2/200"]["tasks"]["recall-16384"]["per_case"].append(1.0)
    with pytest.raises(ValueError, match="recall-16384 has 8 cases where other runs have 7"):
        case_resampled(evaluated, runs, "recall", 200, [("self", "ce")], resamples=10)


def test_per_case_reads_only_its_prefix_and_names_a_missing_one():
    r = row("ce", 0, {12288: [True, False], 16384: [1.0]}, kind="lines-beyond")
    found = per_case(r, "lines-beyond")
    assert sorted(found) == [12288, 16384]
    assert found[12288].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="no task set named recall-<length>"):
        per_case(r, "recall")


@pytest.mark.parametrize(
    ("t", "cases", "expected"),
    [
        ((0.01, 0.03), (0.002, 0.04), True),
        ((-0.03, -0.01), (-0.04, -0.002), True),
        ((0.01, 0.03), (-0.001, 0.04), False),
        ((-0.01, 0.03), (0.01, 0.04), False),
        ((-0.03, -0.01), (0.01, 0.04), False),
    ],
)
def test_holds_under_both_needs_both_intervals_on_one_side_of_zero(t, cases, expected):
    assert holds_under_both({"low": t[0], "high": t[1]}, {"low": cases[0], "high": cases[1]}) is expected


def test_holds_under_both_is_undecided_without_an_interval():
    assert holds_under_both({"low": 0.1, "high": 0.2}, {"skipped": "no answers"}) is None
    assert holds_under_both({"value": 0.1}, {"low": 0.1, "high": 0.2}) is None
