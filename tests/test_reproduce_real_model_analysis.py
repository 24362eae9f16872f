"""The real-models LongPPL study's analysis by its plan, on records made up here: a LongPPL that tracks
the long-context outcome is positive, one that does not is negative, and the instrument checks, the
calibration and the format exclusion act as the plan says; the mixed model and the secondary
statistics against plain references."""

import functools
import json
import math

import numpy as np
import pytest
from longppl_reproduce.real_models import analysis
from longppl_reproduce.real_models.cli import main


def rules(**changes):
    from types import SimpleNamespace

    fields = dict(vars(analysis.PLAN_RULES))
    fields["bootstrap"] = {"resamples": 400, "seed": 0, "level": 0.95}
    fields["mixed_model_resamples"] = 20
    fields.update(changes)
    return SimpleNamespace(**fields)


def member_records(tracking, seed: int = 0, lost_format: int = 0, paper_alpha: bool = False):
    """48 members in 12 clusters; their long-context ability drives the three tasks; LongPPL falls
    with it when ``tracking`` is True, rises with it when it is ``"reversed"``, and is noise when
    False; PPL is noise throughout (on each corpus its own). The first ``lost_format`` members answer
    without numbers. With ``paper_alpha``, LongPPL at alpha = 2 is recorded beside (noise)."""
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
        if i % 2:  # rows from the fifth session on say how their answers were read
            records[-1]["prefill"] = "rows"
        corpora = records[-1]["longppl"]
        corpora["books-smollm2"]["ppl"] = float(rng.uniform(10, 30))
        corpora["govreport-gemma"] = {"longppl": float(rng.uniform(3, 6)), "ppl": float(rng.uniform(8, 12))}
        if paper_alpha:
            for corpus in ("books-gemma", "books-smollm2"):
                corpora[corpus]["paper_alpha"] = {"alpha": 2.0, "longppl": float(rng.uniform(5, 9))}
    return records


def calibration_records(gemma=1.5, smollm2=1.0):
    """``calibration.jsonl``'s rows; ``None``: no alpha of the grid qualified (``phases.calibrate``)."""
    rows = []
    for name, alpha in (("gemma", gemma), ("smollm2", smollm2)):
        row = {"key": name, "evaluator": name, "alpha": alpha, "table": [{"alpha": 2.0, "real": 206, "null": 156}]}
        if alpha is None:
            row["failed"] = "No alpha of grid [0.5, 2.0] keeps null key tokens within max_null_ratio=0.1."
        rows.append(row)
    return rows


def instrument_records(key_tokens=2000, ordered=True):
    rows = [
        {"check": "key-share", "corpus": "books-gemma", "key_tokens": [key_tokens // 2, key_tokens - key_tokens // 2]}
    ]
    windows = [1024, 2048, 4096, 8192, 16384, 32768]
    for rank, w in enumerate(windows):
        longppl = 10.0 - rank if ordered else float([3, 9, 4, 8, 5, 7][rank])
        ppl = float([6, 5, 7, 4, 3, 2][rank])
        kind = "context" if w < 32768 else "window"
        rows.append({"check": "window-order", "kind": kind, "window": w, "longppl": longppl, "ppl": ppl})
        if w < 32768:  # the attention-limited member of the same window
            rows.append(
                {"check": "window-order", "kind": "window", "window": w, "longppl": 20.0 - w / 4096, "ppl": ppl + 1}
            )
    rows.append({"check": "answer-share", "evaluator": "gemma", "length": 8192, "share_of_answer_tokens_key": 0.4})
    return rows


@functools.cache
def analysed(tracking=True, gemma=1.5, smollm2=1.0, calibrated=True, paper_alpha=False, lost_format=0, **instrument):
    """``analysis.analyse`` of the made-up records (each set analysed once in this module; the
    results are read, never changed)."""
    records = member_records(tracking, lost_format=lost_format, paper_alpha=paper_alpha)
    calibration = calibration_records(gemma, smollm2) if calibrated else []
    return analysis.analyse(records, instrument_records(**instrument), calibration, rules())


def test_a_longppl_that_tracks_the_outcome_is_positive():
    found = analysed()
    assert found["decision"]["outcome"] == "positive", found["decision"]
    assert found["statistics"]["all"]["longppl"]["spearman"]["longppl"]["value"] < -0.6
    assert found["partial"]["high"] < 0


def test_a_longppl_that_ranks_the_wrong_way_is_negative_and_noise_is_not_positive():
    found = analysed("reversed")
    assert found["decision"]["outcome"] == "negative", found["decision"]
    noise = analysed(False)
    assert noise["decision"]["outcome"] != "positive"


def test_the_instrument_checks_bound_the_decision():
    unordered = analysed(ordered=False)
    assert unordered["decision"]["outcome"] != "positive"
    assert unordered["instrument"]["ordered_by_window"] is False
    few = analysed(key_tokens=20)
    assert few["decision"]["outcome"] == "inconclusive"
    assert any("key tokens" in reason for reason in few["decision"]["reasons"])


def test_both_window_series_are_reported_with_their_rank_correlations():
    from scipy.stats import spearmanr

    rows = instrument_records()
    found = analysis.window_series(rows)
    full = [r for r in rows if r["check"] == "window-order" and r["window"] == 32768]
    for kind in ("window", "context"):
        series = [r for r in rows if r.get("kind") == kind and r["window"] < 32768] + full
        assert found[kind]["members"] == len(series) == 6
        for measure in ("longppl", "ppl"):
            expected = spearmanr([r["window"] for r in series], [r[measure] for r in series]).statistic
            assert found[kind][f"spearman_{measure}"] == pytest.approx(expected)
        assert [w for w, _, _ in found[kind]["by_window"]] == sorted((r["window"] for r in series), reverse=True)
    assert analysed()["instrument"]["context_series_rho"] == pytest.approx(found["context"]["spearman_longppl"])
    assert "window-limited series (6 members)" in analysis.format_report(analysed())
    few = analysis.window_series(rows[:3])
    assert few["window"]["skipped"] == "fewer than 3 members scored"


def test_the_format_exclusion_and_the_minimum_size():
    found = analysed(lost_format=10)
    assert found["excluded"] == [f"m{i}" for i in range(10)]
    assert found["statistics"]["all"]["longppl"]["n"] == 38
    assert found["decision"]["outcome"] == "inconclusive"  # 38 analysed, fewer than 40
    assert any("fewer than the 40" in reason for reason in found["decision"]["reasons"])
    # every member's share of lines outputs without a number is listed, the excluded ones marked, and
    # how its answers were read (a row without the field: generate on the padded batch)
    lines = {line.split(" | ")[0][2:]: line for line in analysis.format_report(found).splitlines() if line[:3] == "| m"}
    assert lines["m0"].endswith("| 1.000 | format | batch |") and lines["m10"].endswith("| 0.000 |  | batch |")
    assert lines["m11"].endswith("| 0.000 |  | rows |")


@pytest.mark.slow
def test_the_report_stage_reads_only_the_records(tmp_path):
    records = tmp_path / "run" / "records"
    records.mkdir(parents=True)
    with open(records / "members.jsonl", "w") as f:
        f.writelines(json.dumps({"key": r["member"], **r}) + "\n" for r in member_records(True))
    with open(records / "instrument.jsonl", "w") as f:
        f.writelines(json.dumps({"key": str(i), **r}) + "\n" for i, r in enumerate(instrument_records()))
    with open(records / "calibration.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in calibration_records(gemma=None))
    command = ["report-real", "--run", str(tmp_path / "run"), "--gemma", "missing", "--smollm2", "missing"]
    assert main([*command, "--resamples", "200"]) == 0
    report = (tmp_path / "run" / "report.md").read_text()
    # the calibration comes first, and Gemma's failure is read from the run's records
    assert report.index("## Calibration") < report.index("## The instrument") < report.index("## Decision")
    assert "- gemma: no alpha qualified (No alpha of grid" in report and "- smollm2: alpha 1" in report
    assert "## Decision by the plan: **inconclusive**" in report
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["decision"]["reasons"][0].startswith("the instrument fails its calibration")
    assert set(results["secondary"]) == {
        "smollm2",
        "paper_alpha",
        "govreport",
        "task_documents",
        "tasks",
        "cross_family",
    }
    # no 'documents' rows in this run: the task documents' statistics say so instead of a number
    assert "unavailable" in results["secondary"]["task_documents"]["longppl:tasks"]
    assert "| Task documents, Gemma evaluator | | not in the records" in report
    assert set(results["mixed_model"]) == {"longppl", "longppl:smollm2"}


@pytest.mark.slow
def test_a_failed_calibration_makes_the_decision_inconclusive_with_that_reason():
    found = analysed(gemma=None)
    assert found["decision"]["outcome"] == "inconclusive"
    assert found["decision"]["reasons"][0].startswith("the instrument fails its calibration: Gemma evaluator")
    assert found["calibration"]["gemma"] == {
        "qualified": False,
        "alpha": None,
        "scored_at": 2.0,
        "failed": calibration_records(gemma=None)[0]["failed"],
        "table": [{"alpha": 2.0, "real": 206, "null": 156}],
    }
    assert set(found["decision_by_level"].values()) == {"inconclusive"}  # every level is under Gemma
    report = analysis.format_report(found)
    assert report.index("- gemma: no alpha qualified") < report.index("## Decision by the plan: **inconclusive**")
    assert "- inconclusive: the instrument fails its calibration" in report
    # a SmolLM2 evaluator that fails cannot confirm the direction: positive by every other
    # condition is inconclusive, not negative; a negative under Gemma stays negative
    second = analysed(smollm2=None)
    assert second["decision"]["outcome"] == "inconclusive"
    assert second["decision"]["reasons"] == [
        "positive by every other condition, but the instrument fails its calibration (SmolLM2 evaluator)"
    ]
    reversed_ = analysed("reversed", smollm2=None)
    assert reversed_["decision"]["outcome"] == "negative"
    # no calibration record at all: not calibrated, so not decided
    missing = analysed(calibrated=False)
    assert missing["decision"]["outcome"] == "inconclusive"
    assert "no calibration record" in missing["decision"]["reasons"][0]


def plain_rows(records, ppl_corpus="books-gemma"):
    """The analysis rows written plainly from the records: every task set's accuracy by name, the
    lines beyond-K minus within-K mean, and LongPPL (Gemma books) with the PPL of ``ppl_corpus``."""
    rows = []
    for r in records:
        row = {"member": r["member"], "cluster": r["cluster"], "longppl": r["longppl"]["books-gemma"]["longppl"]}
        row["ppl"] = r["longppl"][ppl_corpus]["ppl"]
        row["longppl:smollm2"] = r["longppl"]["books-smollm2"]["longppl"]
        row.update({name: t["accuracy"] for name, t in r["tasks"].items()})
        beyond = [t["accuracy"] for name, t in r["tasks"].items() if name.startswith("lines-beyond")]
        within = [t["accuracy"] for name, t in r["tasks"].items() if name.startswith("lines-within")]
        row["beyond_minus_within"] = sum(beyond) / len(beyond) - sum(within) / len(within)
        rows.append(row)
    return rows


def test_each_task_alone_is_correlations_on_that_column_and_smollm2_uses_its_own_ppl():
    from longppl_reproduce.common import claim_statistics

    records, chosen = member_records(True), rules()
    found = analysed()
    tasks = found["secondary"]["tasks"]
    assert list(tasks)[:4] == ["lines_beyond", "needle", "recall", "beyond_minus_within"]
    assert {"needle-8192", "recall-16384", "lines-beyond-8192", "lines-beyond-minus-within-16384"} <= set(tasks)
    plain = plain_rows(records)
    for outcome in ("needle-8192", "lines-beyond-16384", "beyond_minus_within"):
        assert tasks[outcome] == claim_statistics.correlations(plain, "longppl", outcome, chosen)
    # the SmolLM2 evaluator's LongPPL is compared with PPL on its own books, not on Gemma's
    ours = found["statistics"]["all"]["longppl:smollm2"]
    assert ours["spearman"]["ppl"]["value"] != found["statistics"]["all"]["longppl"]["spearman"]["ppl"]["value"]
    composite = {r["member"]: r["composite"] for r in found["rows"]}
    plain_smollm2 = plain_rows(records, "books-smollm2")
    for r in plain_smollm2:
        r["composite"] = composite[r["member"]]
    assert ours == claim_statistics.correlations(plain_smollm2, "longppl:smollm2", "composite", chosen)
    cross = found["secondary"]["cross_family"]
    assert cross["Gemma members under the SmolLM2 evaluator"] == found["statistics"]["gemma"]["longppl:smollm2"]
    assert cross["SmolLM2 members under the Gemma evaluator"] == found["statistics"]["smollm2"]["longppl"]


@pytest.mark.slow
def test_the_paper_alpha_and_govreport_are_read_where_the_records_hold_them():
    from longppl_reproduce.common import claim_statistics

    chosen = rules()
    without = analysed()
    assert "unavailable" in without["secondary"]["paper_alpha"]["longppl:alpha2"]
    assert "not in the records" in analysis.format_report(without)
    records = member_records(True, paper_alpha=True)
    found = analysed(paper_alpha=True)
    plain = plain_rows(records)
    composite = {r["member"]: r["composite"] for r in found["rows"]}
    for r, record in zip(plain, records):
        r["composite"] = composite[r["member"]]
        r["at2"] = record["longppl"]["books-gemma"]["paper_alpha"]["longppl"]
        r["gov"], r["ppl_gov"] = (record["longppl"]["govreport-gemma"][k] for k in ("longppl", "ppl"))
    assert found["secondary"]["paper_alpha"]["longppl:alpha2"] == claim_statistics.correlations(
        plain, "at2", "composite", chosen
    )
    gov = [{**r, "ppl": r["ppl_gov"]} for r in plain]
    assert found["secondary"]["govreport"] == claim_statistics.correlations(gov, "gov", "composite", chosen)
    # an evaluator scored at alpha 2 (its calibration failed) is its own alpha-2 LongPPL
    failed = analysed(gemma=None)
    assert failed["secondary"]["paper_alpha"]["longppl:alpha2"] == failed["statistics"]["all"]["longppl"]


def crafted_rows(slope: float, within_weight: float, seed: int = 0):
    """48 rows in 12 clusters: ``composite = 0.2 + slope z(log longppl) + within_weight lines_within +
    e``, ``e`` orthogonal to the design and to every cluster's indicator (no cluster effect, and the
    least-squares fit is exact); LongPPL correlated with the covariate."""
    rng = np.random.default_rng(seed)
    n, clusters = 48, np.arange(48) // 4
    within = rng.uniform(0.5, 1.0, n)
    log_longppl = 2.0 - 1.5 * within + 0.3 * rng.standard_normal(n)
    z = (log_longppl - log_longppl.mean()) / log_longppl.std(ddof=1)
    blocks = np.column_stack([np.ones(n), z, within, np.eye(12)[clusters]])
    noise = rng.standard_normal(n)
    noise -= blocks @ np.linalg.lstsq(blocks, noise, rcond=None)[0]
    composite = 0.2 + slope * z + within_weight * within + 0.5 * noise / noise.std()
    rows = [
        {
            "member": f"m{i}",
            "cluster": f"c{clusters[i]}",
            "longppl": float(np.exp(log_longppl[i])),
            "ppl": float(np.exp(rng.uniform(2, 3))),
            "lines_within": float(within[i]),
            "composite": float(composite[i]),
        }
        for i in range(n)
    ]
    return rows, np.column_stack([np.ones(n), z, within]), composite


def test_the_mixed_model_slope_against_least_squares():
    from longppl_reproduce.common import claim_statistics

    rows, design, composite = crafted_rows(slope=-0.4, within_weight=1.0)
    found = claim_statistics.mixed_models(rows, "longppl", "composite", rules(), covariate="lines_within")
    reference = np.linalg.lstsq(design, composite, rcond=None)[0]
    assert found["covariates"] == ["lines_within"] and (found["n"], found["clusters"]) == (48, 12)
    assert found["longppl"]["value"] == pytest.approx(reference[1], abs=1e-9)
    assert found["longppl"]["value"] == pytest.approx(-0.4, abs=1e-9)
    # with the covariate the slope is LongPPL's own: none here, although LongPPL tracks the covariate
    confounded, design, composite = crafted_rows(slope=0.0, within_weight=4.0, seed=1)
    held = claim_statistics.mixed_models(confounded, "longppl", "composite", rules(), covariate="lines_within")
    assert held["longppl"]["value"] == pytest.approx(0.0, abs=1e-9)
    naive = np.linalg.lstsq(design[:, :2], composite, rcond=None)[0][1]
    assert naive < -0.2  # left out, the covariate would show as a slope
    # the report fits it for each evaluator, the within-K accuracy as covariate, on its own PPL
    tracked = analysed()
    mixed = tracked["mixed_model"]["longppl"]
    assert mixed["covariates"] == ["lines_within"] and mixed["longppl"]["value"] < 0
    assert mixed["longppl"]["low"] <= mixed["longppl"]["value"] <= mixed["longppl"]["high"]
    assert "## Mixed model" in analysis.format_report(tracked)


def test_task_document_rows_join_their_members_as_a_secondary_measure():
    records = member_records(True)
    # the documents phase's rows: LongPPL on the task documents falls with the member's index (its
    # ability), for all members but the last, which has no row
    documents = [
        {"member": r["member"], "longppl": {"tasks-gemma": {"longppl": 100.0 - i, "ppl": 10.0}}}
        for i, r in enumerate(records[:-1])
    ]
    joined = analysis.with_task_documents(records, documents)
    assert joined[0]["longppl"]["tasks-gemma"]["longppl"] == 100.0
    assert joined[0]["longppl"]["books-gemma"] == records[0]["longppl"]["books-gemma"]  # kept
    assert "tasks-gemma" not in joined[-1]["longppl"] and "tasks-gemma" not in records[0]["longppl"]
    found = analysis.analyse(joined, instrument_records(), calibration_records(), analysis.plan_rules(200))
    rows = {r["member"]: r for r in found["rows"]}
    assert rows["m0"]["longppl:tasks"] == 100.0 and math.isnan(rows["m47"]["longppl:tasks"])
    tasks = found["secondary"]["task_documents"]["longppl:tasks"]
    assert tasks["n"] == 47 and tasks["spearman"]["longppl"]["value"] < -0.5
    assert "unavailable" in found["secondary"]["task_documents"]["longppl:smollm2:tasks"]


def test_an_outcome_the_same_for_every_member_is_skipped_with_its_value():
    from longppl_reproduce.common import claim_statistics

    rows = [
        {"member": f"m{i}", "cluster": f"c{i // 2}", "longppl": 5.0 + i, "ppl": 20.0 - i, "y": 0.0} for i in range(8)
    ]
    found = claim_statistics.correlations(rows, "longppl", "y", rules())
    assert found["skipped"] == "the outcome is 0 for every one of the 8 members" and "spearman" not in found
    assert (found["n"], found["clusters"]) == (8, 4)
    rows[3]["y"] = 0.5  # one member differs: correlated as usual
    assert "spearman" in claim_statistics.correlations(rows, "longppl", "y", rules())
