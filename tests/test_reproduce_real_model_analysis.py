"""The real-models LongPPL study's analysis by its plan, on records made up here: a LongPPL that tracks
the long-context outcome is positive, one that does not is negative, and the instrument checks and
the format exclusion act as the plan says."""

import json

import numpy as np
import pytest
from longppl_reproduce.real_models import analysis
from longppl_reproduce.real_models.cli import main


def rules(**changes):
    from types import SimpleNamespace

    fields = dict(vars(analysis.PLAN_RULES))
    fields["bootstrap"] = {"resamples": 400, "seed": 0, "level": 0.95}
    fields.update(changes)
    return SimpleNamespace(**fields)


def member_records(tracking, seed: int = 0, lost_format: int = 0):
    """48 members in 12 clusters; their long-context ability drives the three tasks; LongPPL falls
    with it when ``tracking`` is True, rises with it when it is ``"reversed"``, and is noise when
    False; PPL is noise throughout. The first ``lost_format`` members answer without numbers."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(48):
        cluster = f"c{i // 4}"
        ability = (i // 4) / 11 + 0.1 * rng.standard_normal()
        sign = {True: -1.0, "reversed": 1.0, False: 0.0}[tracking]
        longppl = float(np.exp(2 + sign * ability + 0.05 * rng.standard_normal())) if sign else float(rng.uniform(5, 9))
        tasks = {}
        for length in (8192, 16384):
            right = [bool(rng.random() < min(1.0, max(0.0, ability))) for _ in range(10)]
            answer = "no number here" if i < lost_format else "The number is <12345>."
            tasks[f"lines-beyond-{length}"] = {
                "accuracy": float(np.mean(right)),
                "per_case": right,
                "outputs": [answer] * 10,
            }
            tasks[f"lines-within-{length}"] = {
                "accuracy": 0.9,
                "per_case": [True] * 9 + [False],
                "outputs": [answer] * 10,
            }
            tasks[f"needle-{length}"] = {"accuracy": float(np.clip(ability + 0.1 * rng.standard_normal(), 0, 1))}
            tasks[f"recall-{length}"] = {"accuracy": float(np.clip(0.3 + ability / 3, 0, 1))}
        tasks["lines-within-8192"]["accuracy"] = float(rng.uniform(0.7, 1.0))  # the covariate varies
        records.append(
            {
                "member": f"m{i}",
                "cluster": cluster,
                "base": "gemma-3-270m" if i < 24 else "smollm2-135m",
                "steps": 0 if i < 24 else (0, 50, 200)[i % 3],
                "tasks": tasks,
                "longppl": {
                    "books-gemma": {"longppl": longppl, "ppl": float(rng.uniform(15, 25))},
                    "books-smollm2": {"longppl": longppl * float(rng.uniform(0.9, 1.1))},
                },
            }
        )
    return records


def instrument_records(key_tokens=2000, ordered=True):
    rows = [
        {"check": "key-share", "corpus": "books-gemma", "key_tokens": [key_tokens // 2, key_tokens - key_tokens // 2]}
    ]
    windows = [1024, 2048, 4096, 8192, 16384, 32768]
    for rank, w in enumerate(windows):
        longppl = 10.0 - rank if ordered else float([3, 9, 4, 8, 5, 7][rank])
        rows.append(
            {"check": "window-order", "kind": "context" if w < 32768 else "window", "window": w, "longppl": longppl}
        )
    rows.append({"check": "answer-share", "evaluator": "gemma", "length": 8192, "share_of_answer_tokens_key": 0.4})
    return rows


def test_a_longppl_that_tracks_the_outcome_is_positive():
    found = analysis.analyse(member_records(True), instrument_records(), rules())
    assert found["decision"]["outcome"] == "positive", found["decision"]
    assert found["statistics"]["all"]["longppl"]["spearman"]["longppl"]["value"] < -0.6
    assert found["partial"]["high"] < 0


def test_a_longppl_that_ranks_the_wrong_way_is_negative_and_noise_is_not_positive():
    found = analysis.analyse(member_records("reversed"), instrument_records(), rules())
    assert found["decision"]["outcome"] == "negative", found["decision"]
    noise = analysis.analyse(member_records(False), instrument_records(), rules())
    assert noise["decision"]["outcome"] != "positive"


def test_the_instrument_checks_bound_the_decision():
    tracking = member_records(True)
    unordered = analysis.analyse(tracking, instrument_records(ordered=False), rules())
    assert unordered["decision"]["outcome"] != "positive"
    assert unordered["instrument"]["ordered_by_window"] is False
    few = analysis.analyse(tracking, instrument_records(key_tokens=20), rules())
    assert few["decision"]["outcome"] == "inconclusive"
    assert any("key tokens" in reason for reason in few["decision"]["reasons"])


def test_the_format_exclusion_and_the_minimum_size():
    found = analysis.analyse(member_records(True, lost_format=10), instrument_records(), rules())
    assert found["excluded"] == [f"m{i}" for i in range(10)]
    assert found["statistics"]["all"]["longppl"]["n"] == 38
    assert found["decision"]["outcome"] == "inconclusive"  # 38 analysed, fewer than 40
    assert any("fewer than the 40" in reason for reason in found["decision"]["reasons"])


@pytest.mark.slow
def test_the_report_stage_reads_only_the_records(tmp_path):
    records = tmp_path / "run" / "records"
    records.mkdir(parents=True)
    with open(records / "members.jsonl", "w") as f:
        f.writelines(json.dumps({"key": r["member"], **r}) + "\n" for r in member_records(True))
    with open(records / "instrument.jsonl", "w") as f:
        f.writelines(json.dumps({"key": str(i), **r}) + "\n" for i, r in enumerate(instrument_records()))
    assert main(["report-real", "--run", str(tmp_path / "run"), "--gemma", "missing", "--smollm2", "missing"]) == 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Decision by the plan: **positive**" in report
    assert json.loads((tmp_path / "run" / "results.json").read_text())["decision"]["outcome"] == "positive"
