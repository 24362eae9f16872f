"""The analysis of the LongPPL study on real models, by its plan (docs/reproduction.md, "LongPPL on
real models — analysis plan"), from the phases' records alone (``<run>/records/*.jsonl``).

- The calibration (``calibration.jsonl``): each evaluator's alpha, or the finding that no alpha of
  the grid qualified. Then, by the plan's "Deviations", that evaluator's LongPPL (scored at the
  paper's alpha = 2) is description only and the decision under it is inconclusive.
- Member rows from ``members.jsonl``: the composite's parts (each beyond-K task's accuracy, the
  mean over the task lengths), the covariate (lines within K), each task at each length, the
  lines beyond-K minus within-K accuracy, LongPPL under each evaluator on its corpora (and at the
  paper's alpha = 2 where recorded) and the member's own PPL on the same text.
- Exclusion by format only: more than half of a member's lines outputs (beyond and within K, all
  lengths) hold no five-digit number.
- Statistics (``claim_statistics.correlations``: Spearman and Pearson with cluster bootstraps, the
  paired difference, Williams' t), the partial Spearman given the covariate, overall and within
  the levels (families, SmolLM2 step levels); the random-intercept model
  (``claim_statistics.mixed_models``) of the composite on z(log LongPPL), and on z(log PPL), with
  the within-K accuracy as covariate.
- The secondary statistics: the SmolLM2 evaluator, the paper's alpha = 2, GovReport, each task
  alone and the beyond-minus-within accuracy as outcomes, and the cross-family view.
- The instrument checks (``instrument.jsonl``) and the decision rule with the plan's extra
  conditions.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from longppl.settings import DEFAULT_ALPHA

from ..common.run_folder import finite
from .members import FULL  # Gemma 3 270M's context: the released model's window-order row

_ANSWER_SHAPE = re.compile(r"(?<!\d)\d{5}(?!\d)")
PARTS = ("lines_beyond", "needle", "recall")
BEYOND_TASKS = ("lines-beyond", "needle", "recall")  # the tasks of the composite, as the records name them
EVALUATORS = ("gemma", "smollm2")
# measure -> (evaluator, corpus, at the paper's alpha); a measure's PPL is the member's own on that corpus
MEASURES = {"longppl": ("gemma", "books-gemma", False), "longppl:smollm2": ("smollm2", "books-smollm2", False)}
SECONDARY_MEASURES = {
    "longppl:govreport": ("gemma", "govreport-gemma", False),
    "longppl:alpha2": ("gemma", "books-gemma", True),
    "longppl:smollm2:alpha2": ("smollm2", "books-smollm2", True),
    "longppl:tasks": ("gemma", "tasks-gemma", False),
    "longppl:smollm2:tasks": ("smollm2", "tasks-smollm2", False),
}
CALIBRATION_FAILS = "the instrument fails its calibration"
# the paper's fixed alpha (2): a sensitivity beside the calibrated one (``phases`` scores it)
PAPER_ALPHA = DEFAULT_ALPHA

PLAN_RULES = SimpleNamespace(
    bootstrap={"resamples": 10000, "seed": 0, "level": 0.95},
    mixed_model_resamples=10000,  # claim_statistics.mixed_models reads these three
    seed=0,
    level=0.95,
    positive_max_high=-0.3,
    negative_min_low=-0.5,
    equivalence_margin=0.15,
    min_members=40,
    min_clusters=10,
    min_key_tokens=1000,
    max_order_rho=-0.8,
    max_no_number_share=0.5,
)


def plan_rules(resamples: int = 10000):
    """:data:`PLAN_RULES` with ``resamples`` for every bootstrap (the plan's 10,000 by default; fewer
    only for a quick look, never for the study's report)."""
    if resamples < 1:
        raise ValueError(f"--resamples must be a positive count, got {resamples}; the plan's is 10000.")
    return SimpleNamespace(
        **{
            **vars(PLAN_RULES),
            "bootstrap": {**PLAN_RULES.bootstrap, "resamples": resamples},
            "mixed_model_resamples": resamples,
        }
    )


def mean_over_lengths(tasks: dict, prefix: str) -> float:
    """The mean accuracy of the task sets named ``<prefix>-<length>`` in ``tasks`` (``{name: {"accuracy"}}``,
    a record's ``tasks``); NaN when there is none."""
    values = [found["accuracy"] for name, found in tasks.items() if name.startswith(prefix + "-")]
    return float(np.mean(values)) if values else float("nan")


def with_task_documents(records: list[dict], documents: list[dict]) -> list[dict]:
    """Copies of the ``score`` rows whose ``longppl`` also holds each member's corpora of the
    ``documents`` phase (``task_documents.jsonl``: ``tasks-gemma``, ``tasks-smollm2``); a member
    without such a row keeps its own. A member's later row wins, as a unit scored again does."""
    found = {row["member"]: row["longppl"] for row in documents}
    return [{**r, "longppl": {**r["longppl"], **found.get(r["member"], {})}} for r in records]


def member_rows(records: list[dict], scored_alpha: dict | None = None) -> list[dict]:
    """One analysis row per member record (``phases.score``'s rows).

    Columns: the composite's parts and the covariate (means over the lengths), every task set's
    accuracy under its record name (``needle-8192``), ``beyond_minus_within`` (lines beyond K minus
    within K, the mean over the lengths) and ``lines-beyond-minus-within-<L>`` per length, each
    measure of :data:`MEASURES` and :data:`SECONDARY_MEASURES` with its PPL as ``ppl:<corpus>``
    (``ppl``: on the Gemma evaluator's books). LongPPL at the paper's alpha is the record's
    ``paper_alpha``, or, in records without it, the LongPPL itself where ``scored_alpha`` (evaluator
    -> the alpha it was scored at) says that was 2; NaN otherwise.
    """
    scored_alpha = scored_alpha or {}
    rows = []
    for record in records:
        tasks = record["tasks"]
        outputs = [o for name, found in tasks.items() if name.startswith("lines-") for o in found.get("outputs", [])]
        row = {
            "member": record["member"],
            "cluster": record["cluster"],
            "base": record["base"],
            "steps": record["steps"],
            "lines_beyond": mean_over_lengths(tasks, "lines-beyond"),
            "lines_within": mean_over_lengths(tasks, "lines-within"),
            "needle": mean_over_lengths(tasks, "needle"),
            "recall": mean_over_lengths(tasks, "recall"),
            "no_answer_shape_share": (
                sum(not _ANSWER_SHAPE.search(o) for o in outputs) / len(outputs) if outputs else float("nan")
            ),
            # how the generated answers were read (greedy_answers' prefill); rows before it was
            # recorded were read by generate on the padded batch
            "prefill": record.get("prefill", "batch"),
        }
        row.update({name: found["accuracy"] for name, found in tasks.items()})
        row["beyond_minus_within"] = row["lines_beyond"] - row["lines_within"]
        for name in tasks:
            length = name.removeprefix("lines-beyond-")
            if name.startswith("lines-beyond-") and f"lines-within-{length}" in tasks:
                row[f"lines-beyond-minus-within-{length}"] = row[name] - row[f"lines-within-{length}"]
        for corpus, found in record["longppl"].items():
            row[f"ppl:{corpus}"] = found.get("ppl", float("nan"))
        row["ppl"] = row.get("ppl:books-gemma", float("nan"))
        for key, (evaluator, corpus, paper) in {**MEASURES, **SECONDARY_MEASURES}.items():
            found = record["longppl"].get(corpus, {})
            if not paper:
                row[key] = found.get("longppl", float("nan"))
            elif "paper_alpha" in found:
                row[key] = found["paper_alpha"]["longppl"]
            else:
                row[key] = (
                    found.get("longppl", float("nan")) if scored_alpha.get(evaluator) == PAPER_ALPHA else float("nan")
                )
        rows.append(row)
    return rows


def view(rows: list[dict], measure: str) -> list[dict]:
    """Copies of ``rows`` whose ``ppl`` is the member's own on ``measure``'s corpus (the plan: each
    member's PPL on the same text as the LongPPL it is compared with)."""
    corpus = {**MEASURES, **SECONDARY_MEASURES}[measure][1]
    return [{**r, "ppl": r.get(f"ppl:{corpus}", float("nan"))} for r in rows]


def calibration_outcomes(calibration: list[dict]) -> dict:
    """Per evaluator of :data:`EVALUATORS`, from ``calibration.jsonl`` (``phases.calibrate``'s rows):
    ``{"qualified", "alpha" (None when none qualified), "scored_at" (the alpha its LongPPL is at:
    the calibrated one, else the paper's 2), "failed" (why, when not qualified), "table"}``. An
    evaluator without a row is not qualified ("no calibration record")."""
    rows = {r["evaluator"]: r for r in calibration}
    found = {}
    for name in EVALUATORS:
        row = rows.get(name)
        if row is None:
            found[name] = {"qualified": False, "alpha": None, "scored_at": None, "failed": "no calibration record"}
        elif row.get("alpha") is None:
            found[name] = {
                "qualified": False,
                "alpha": None,
                "scored_at": PAPER_ALPHA,
                "failed": row.get("failed", "no alpha of the grid qualified"),
                "table": row.get("table", []),
            }
        else:
            found[name] = {
                "qualified": True,
                "alpha": row["alpha"],
                "scored_at": row["alpha"],
                "table": row.get("table", []),
            }
    return found


def _ranks(values) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(np.asarray(values, dtype=np.float64))


def partial_spearman(rows: list[dict], measure: str, rules) -> dict:
    """Spearman's partial correlation of ``measure`` with the composite given the within-K lines
    accuracy (Pearson's partial correlation of the ranks), with the cluster bootstrap."""
    from ..common import statistics

    usable = [r for r in rows if all(finite(r.get(k)) for k in (measure, "composite", "lines_within"))]
    if len(usable) < 5 or len({r["cluster"] for r in usable}) < 2:
        return {"skipped": f"{len(usable)} members; 5 in 2 clusters are needed"}
    ranks = [_ranks([r[k] for r in usable]) for k in (measure, "composite", "lines_within")]
    return statistics.bootstrap_partial_correlation(*ranks, **rules.bootstrap, clusters=[r["cluster"] for r in usable])


def window_series(instrument: list[dict]) -> dict:
    """The plan's third check, from the ``window-order`` rows of ``instrument.jsonl``: per series
    (``window``: attention limited to w; ``context``: every prediction limited to w; the released
    model, the 32k attention member, in both) its members and Spearman's rho of w with LongPPL and
    with PPL. The plan expects a wider window to give a lower LongPPL (rho negative).

    Returns ``{"window" | "context": {"members", "spearman_longppl", "spearman_ppl", "by_window":
    [(w, LongPPL, PPL), ...] widest first}}``; a series of fewer than 3 members is ``{"members",
    "skipped"}``."""
    from ..common.statistics import correlation

    rows = [r for r in instrument if r["check"] == "window-order"]
    found = {}
    for kind in ("window", "context"):
        chosen = [r for r in rows if r["kind"] == kind or (r["kind"] == "window" and r["window"] >= FULL)]
        if len(chosen) < 3:
            found[kind] = {"members": len(chosen), "skipped": "fewer than 3 members scored"}
            continue
        windows = [r["window"] for r in chosen]
        found[kind] = {
            "members": len(chosen),
            "spearman_longppl": correlation(windows, [r["longppl"] for r in chosen], "spearman"),
            "spearman_ppl": correlation(windows, [r["ppl"] for r in chosen], "spearman"),
            "by_window": sorted(((r["window"], r["longppl"], r["ppl"]) for r in chosen), reverse=True),
        }
    return found


def instrument_checks(instrument: list[dict], rules) -> dict:
    """The plan's checks from ``instrument.jsonl``: Gemma's key tokens over its books, the answer
    shares, and the order of both window series (:func:`window_series`); the decision reads the
    context-limited series' rho of w and LongPPL."""
    shares = {r["corpus"]: r for r in instrument if r["check"] == "key-share"}
    gemma = shares.get("books-gemma")
    key_tokens = sum(gemma["key_tokens"]) if gemma else None
    series = window_series(instrument)
    rho = series["context"].get("spearman_longppl")
    return {
        "key_tokens": key_tokens,
        "enough_key_tokens": key_tokens is not None and key_tokens >= rules.min_key_tokens,
        "context_series_rho": rho,
        "window_series": series,
        "ordered_by_window": rho is not None and rho <= rules.max_order_rho,
        "answer_shares": [
            {k: r[k] for k in ("evaluator", "length", "share_of_answer_tokens_key")}
            for r in instrument
            if r["check"] == "answer-share"
        ],
    }


def task_outcomes(rows: list[dict]) -> list[str]:
    """The secondary outcomes of "each task alone", in order: each beyond-K task (the mean over the
    lengths), each beyond-K task at each length, then the lines beyond-K minus within-K accuracy
    (the mean, then each length); only the columns every row has."""
    lengths = sorted({int(k.rsplit("-", 1)[1]) for r in rows for k in r if k.startswith("lines-beyond-")})
    chosen = [*PARTS, "beyond_minus_within"]
    chosen += [f"{task}-{length}" for task in BEYOND_TASKS for length in lengths]
    chosen += [f"lines-beyond-minus-within-{length}" for length in lengths]
    return [c for c in chosen if rows and all(c in r for r in rows)]


def analyse(records: list[dict], instrument: list[dict], calibration: list[dict], rules=PLAN_RULES) -> dict:
    """Everything the plan decides and reports, from the records (see the module docstring).

    Args:
        records, instrument, calibration: the rows of ``members.jsonl``, ``instrument.jsonl`` and
            ``calibration.jsonl``.

    Returns:
        ``{"calibration", "rows", "excluded", "composite", "statistics": {level: {measure:
        correlations}}, "partial", "mixed_model": {measure: mixed_models}, "secondary",
        "instrument", "decision", "decision_by_level"}``.
    """
    from ..common import claim_statistics

    calibrated = calibration_outcomes(calibration)
    rows = member_rows(records, {name: c["scored_at"] for name, c in calibrated.items()})
    for r in rows:
        share = r["no_answer_shape_share"]
        r["excluded"] = finite(share) and share > rules.max_no_number_share
    analysed = [r for r in rows if not r["excluded"]]
    composite = claim_statistics.add_composite(analysed, PARTS)
    levels = {"all": analysed}
    levels["gemma"] = [r for r in analysed if r["base"] == "gemma-3-270m"]
    levels["smollm2"] = [r for r in analysed if r["base"] != "gemma-3-270m"]
    for steps in sorted({r["steps"] for r in levels["smollm2"]}):
        levels[f"smollm2, {steps} steps"] = [r for r in levels["smollm2"] if r["steps"] == steps]
    statistics = {
        level: {m: claim_statistics.correlations(view(chosen, m), m, "composite", rules) for m in MEASURES}
        for level, chosen in levels.items()
    }
    checks = instrument_checks(instrument, rules)
    partial = partial_spearman(analysed, "longppl", rules)
    mixed = {
        m: claim_statistics.mixed_models(view(analysed, m), m, "composite", rules, covariate="lines_within")
        for m in MEASURES
    }
    decision = decide(statistics["all"], partial, checks, rules, calibrated)
    by_level = {
        level: _outcome(*_evaluator_conditions(found, calibrated, rules))
        for level, found in statistics.items()
        if level != "all"
    }
    return {
        "calibration": calibrated,
        "rows": rows,
        "excluded": [r["member"] for r in rows if r["excluded"]],
        "composite": composite,
        "statistics": statistics,
        "partial": partial,
        "mixed_model": mixed,
        "secondary": secondary_statistics(analysed, statistics, rules),
        "instrument": checks,
        "decision": decision,
        "decision_by_level": by_level,
    }


def secondary_statistics(analysed: list[dict], statistics: dict, rules) -> dict:
    """The plan's secondary statistics over the analysed rows (with their composite):

    - ``smollm2``: the SmolLM2 evaluator's partial Spearman (its correlations are in ``statistics``
      and its mixed model beside the primary's);
    - ``paper_alpha``: each evaluator's LongPPL at the paper's alpha = 2 with the composite, or
      ``{"unavailable": why}`` when no member's record holds it;
    - ``govreport``: LongPPL and PPL on GovReport (Gemma evaluator) with the composite;
    - ``task_documents``: LongPPL and PPL on the task documents themselves, under each evaluator,
      with the composite (``{"unavailable": why}`` without ``documents`` rows);
    - ``tasks``: the Gemma evaluator's LongPPL and PPL with each outcome of :func:`task_outcomes`;
    - ``cross_family``: each family under the other family's evaluator only (the within-family
      entries of ``statistics``).
    """
    from ..common import claim_statistics

    def measured(measure: str, outcome: str = "composite") -> dict:
        if not any(finite(r.get(measure)) for r in analysed):
            return {"unavailable": f"no analysed member's record holds {measure}"}
        return claim_statistics.correlations(view(analysed, measure), measure, outcome, rules)

    primary = view(analysed, "longppl")
    return {
        "smollm2": {"partial": partial_spearman(analysed, "longppl:smollm2", rules)},
        "paper_alpha": {m: measured(m) for m in ("longppl:alpha2", "longppl:smollm2:alpha2")},
        "govreport": measured("longppl:govreport"),
        "task_documents": {m: measured(m) for m in ("longppl:tasks", "longppl:smollm2:tasks")},
        "tasks": {
            outcome: claim_statistics.correlations(primary, "longppl", outcome, rules)
            for outcome in task_outcomes(analysed)
        },
        "cross_family": {
            "Gemma members under the SmolLM2 evaluator": statistics["gemma"]["longppl:smollm2"],
            "SmolLM2 members under the Gemma evaluator": statistics["smollm2"]["longppl"],
        },
    }


def _evaluator_conditions(found: dict, calibrated: dict, rules, min_members: int | None = None) -> tuple:
    """The ``(conditions, reasons)`` of ``claim_statistics.decide`` on ``{measure: correlations}`` of one level, Gemma primary and
    SmolLM2 the second evaluator, with the plan's calibration Deviation: a Gemma evaluator with no
    qualifying alpha makes the decision inconclusive ("the instrument fails its calibration"); a
    SmolLM2 evaluator with none cannot confirm the direction, so its positive condition does not
    hold (marked ``"calibration": True``: a result positive by every other condition is then
    inconclusive, not negative)."""
    from ..common import claim_statistics

    evaluators = {"gemma": found["longppl"]}
    if calibrated["smollm2"]["qualified"]:
        evaluators["smollm2"] = found["longppl:smollm2"]
    decided = claim_statistics.decide(evaluators, "gemma", rules, min_members)
    conditions, reasons = list(decided["conditions"]), list(decided["reasons"])
    if not calibrated["smollm2"]["qualified"]:
        conditions.append(
            {
                "rule": "positive",
                "condition": f"smollm2: same direction (not judged: {CALIBRATION_FAILS})",
                "holds": False,
                "calibration": True,
            }
        )
    if not calibrated["gemma"]["qualified"]:
        reasons.insert(
            0,
            f"{CALIBRATION_FAILS}: Gemma evaluator, {calibrated['gemma']['failed']} Its LongPPL is at "
            f"alpha {calibrated['gemma']['scored_at']}, description only",
        )
    return conditions, reasons


def _outcome(conditions: list[dict], reasons: list[str]) -> str:
    """The rule's outcome from its conditions; appends to ``reasons`` when a positive result is
    stopped only by a calibration condition."""
    from ..common.claim_statistics import outcome_of

    outcome = outcome_of(conditions, reasons)
    stopped_by_calibration = all(c["holds"] for c in conditions if c["rule"] == "positive" and not c.get("calibration"))
    if outcome != "positive" and not reasons and stopped_by_calibration:
        reasons.append(f"positive by every other condition, but {CALIBRATION_FAILS} (SmolLM2 evaluator)")
        return "inconclusive"
    return outcome


def decide(overall: dict, partial: dict, checks: dict, rules, calibrated: dict) -> dict:
    """The plan's rule: ``claim_statistics.decide`` (Gemma primary, SmolLM2 the second evaluator)
    with the calibration Deviation (:func:`_evaluator_conditions`) and the plan's additions:
    positive also needs the partial Spearman's upper bound below 0 and LongPPL ordering the
    context-limited series; inconclusive below 40 members or 10 clusters, or without the key
    tokens the plan asks.

    Args:
        overall: ``{measure: correlations}`` over every analysed member; partial: the Gemma
            evaluator's partial Spearman; checks: :func:`instrument_checks`; calibrated:
            :func:`calibration_outcomes`.
    """
    conditions, reasons = _evaluator_conditions(overall, calibrated, rules, rules.min_members)
    partial_holds = "high" in partial and finite(partial["high"]) and partial["high"] < 0
    conditions.append(
        {
            "rule": "positive",
            "condition": "partial Spearman given within-K accuracy: upper bound < 0",
            "holds": partial_holds,
        }
    )
    conditions.append(
        {
            "rule": "positive",
            "condition": f"LongPPL orders the context-limited series: rho {checks['context_series_rho']} <= {rules.max_order_rho}",
            "holds": bool(checks["ordered_by_window"]),
        }
    )
    clusters = overall["longppl"].get("clusters", 0)
    if clusters < rules.min_clusters:
        reasons.append(f"{clusters} clusters, fewer than the {rules.min_clusters} the plan needs")
    if not checks["enough_key_tokens"]:
        reasons.append(
            f"{checks['key_tokens']} key tokens over the Gemma evaluator's books, fewer than {rules.min_key_tokens}"
        )
    return {"outcome": _outcome(conditions, reasons), "conditions": conditions, "reasons": reasons}


def _interval(found: dict | None) -> str:
    from ..common.report_text import fmt

    if not found or "value" not in found:
        return "n/a"
    return f"{fmt(found['value'])} [{fmt(found['low'])}, {fmt(found['high'])}]"


def _correlation_table(entries: list[tuple[str, dict]]) -> list[str]:
    """Markdown rows of ``correlations`` results: ``(label, found)``; an unavailable or skipped
    entry says why."""
    out = [
        "| what | n (clusters) | Spearman LongPPL | Spearman PPL | difference | Pearson LongPPL | Pearson PPL |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, c in entries:
        if "unavailable" in c:
            out.append(f"| {label} | | not in the records: {c['unavailable']} | | | | |")
        elif "skipped" in c:
            out.append(f"| {label} | {c['n']} | skipped: {c['skipped']} | | | | |")
        else:
            s, p = c["spearman"], c["pearson"]
            out.append(
                f"| {label} | {c['n']} ({c['clusters']}) | {_interval(s['longppl'])} | {_interval(s['ppl'])} | "
                f"{_interval(s['difference'])} | {_interval(p['longppl'])} | {_interval(p['ppl'])} |"
            )
    return out


def _calibration_lines(calibrated: dict) -> list[str]:
    out = []
    for name, c in calibrated.items():
        if c["qualified"]:
            out.append(f"- {name}: alpha {c['alpha']:g}")
        else:
            at = f"; its LongPPL is at alpha {c['scored_at']:g}, description only" if c["scored_at"] else ""
            out.append(f"- {name}: no alpha qualified ({c['failed']}){at}; the decision under it: {CALIBRATION_FAILS}")
        table = c.get("table") or []
        if table:
            out.append(
                "  - null / real key tokens: " + ", ".join(f"{t['alpha']:g}: {t['null']}/{t['real']}" for t in table)
            )
    return out


def format_report(found: dict) -> str:
    """``report.md`` of the study: the calibration first, the instrument checks, the decision and the
    statistics per level, the mixed model, the secondary statistics, then every member."""
    from ..common.report_text import fmt

    out = ["# LongPPL on real models", "", "## Calibration of the evaluators (alpha by the null-document rule)", ""]
    out += _calibration_lines(found["calibration"])
    checks = found["instrument"]
    out += ["", "## The instrument (before the correlation)", ""]
    out.append(f"- key tokens over the Gemma evaluator's books: {checks['key_tokens']}")
    out.append(f"- Spearman rho of window and LongPPL, context-limited series: {fmt(checks['context_series_rho'])}")
    for kind, found_series in checks["window_series"].items():
        if "skipped" in found_series:
            out.append(f"- {kind}-limited series: {found_series['members']} members, {found_series['skipped']}")
            continue
        rows = ", ".join(f"w {w}: {fmt(lp)} / {fmt(p)}" for w, lp, p in found_series["by_window"])
        out.append(
            f"- {kind}-limited series ({found_series['members']} members): rho(w, LongPPL) "
            f"{fmt(found_series['spearman_longppl'])}, rho(w, PPL) {fmt(found_series['spearman_ppl'])}; "
            f"LongPPL / PPL by w: {rows}"
        )
    out += [
        f"- answer tokens that are key ({a['evaluator']}, {a['length']} tokens): {fmt(a['share_of_answer_tokens_key'])}"
        for a in checks["answer_shares"]
    ]
    decision = found["decision"]
    out += ["", f"## Decision by the plan: **{decision['outcome']}**", ""]
    out += [
        f"- {c['rule']}: {c['condition']}: {'holds' if c['holds'] else 'does not hold'}" for c in decision["conditions"]
    ]
    out += [f"- inconclusive: {reason}" for reason in decision["reasons"]]
    out += [f"- partial Spearman (LongPPL, composite | within-K lines): {_interval(found['partial'])}"]
    described = [name for name, c in found["calibration"].items() if not c["qualified"]]
    if described:
        out.append(f"- description only (no qualifying alpha): the LongPPL of {', '.join(described)}")
    out += ["", "| level | measure | n (clusters) | Spearman LongPPL | Spearman PPL | difference | decision |"]
    out.append("|---|---|---|---|---|---|---|")
    for level, measures in found["statistics"].items():
        for measure, c in measures.items():
            if "skipped" in c:
                out.append(f"| {level} | {measure} | {c['n']} | skipped: {c['skipped']} | | | |")
                continue
            s = c["spearman"]
            outcome = decision["outcome"] if level == "all" else found["decision_by_level"].get(level, "")
            out.append(
                f"| {level} | {measure} | {c['n']} ({c['clusters']}) | {_interval(s['longppl'])} | "
                f"{_interval(s['ppl'])} | {_interval(s['difference'])} | {outcome if measure == 'longppl' else ''} |"
            )
    out += ["", "## Mixed model", ""]
    out.append(
        "composite = b0 + b1 z(log measure) + c (within-K lines accuracy) + u_cluster + e; b1 with its "
        "cluster-bootstrap interval."
    )
    out += ["", "| evaluator | slope of z(log LongPPL) | slope of z(log PPL) | covariates | n (clusters) |"]
    out.append("|---|---|---|---|---|")
    for measure, mixed in found["mixed_model"].items():
        if "skipped" in mixed:
            out.append(f"| {measure} | skipped: {mixed['skipped']} | | | |")
            continue
        slopes = [_interval(mixed[k]) if "skipped" not in mixed[k] else mixed[k]["skipped"] for k in ("longppl", "ppl")]
        out.append(
            f"| {measure} | {slopes[0]} | {slopes[1]} | {', '.join(mixed['covariates']) or 'none'} | "
            f"{mixed['n']} ({mixed['clusters']}) |"
        )
    secondary = found["secondary"]
    out += ["", "## Secondary statistics", "", "### The SmolLM2 evaluator", ""]
    out.append(
        "Its correlations are in the table of the decision (measure `longppl:smollm2`, its PPL on its own books)."
    )
    out.append(
        f"- partial Spearman (LongPPL under SmolLM2, composite | within-K lines): "
        f"{_interval(secondary['smollm2']['partial'])}"
    )
    out += [
        "",
        "### The paper's alpha = 2, GovReport, the task documents, the cross-family view (with the composite)",
        "",
    ]
    out += _correlation_table(
        [
            ("Gemma evaluator, alpha = 2", secondary["paper_alpha"]["longppl:alpha2"]),
            ("SmolLM2 evaluator, alpha = 2", secondary["paper_alpha"]["longppl:smollm2:alpha2"]),
            ("GovReport, Gemma evaluator", secondary["govreport"]),
            ("Task documents, Gemma evaluator", secondary["task_documents"]["longppl:tasks"]),
            ("Task documents, SmolLM2 evaluator", secondary["task_documents"]["longppl:smollm2:tasks"]),
            *secondary["cross_family"].items(),
        ]
    )
    out += ["", "### Each task alone (Gemma evaluator's LongPPL and PPL with each outcome)", ""]
    out += _correlation_table(list(secondary["tasks"].items()))
    out += [
        "",
        "## Members",
        "",
        "Excluded: by format only, when more than half of a member's lines outputs hold no number of the "
        "answer's shape; the share is given for every member. Answers read: `batch` (generate on the padded "
        "batch) or `rows` (each prompt read alone, then decoded together).",
        "",
        "| member | cluster | steps | lines beyond | lines within | needle | recall | composite | PPL | LongPPL | "
        "LongPPL (SmolLM2) | lines outputs without a number | excluded | answers read |",
    ]
    out.append("|---" * 14 + "|")
    for r in found["rows"]:
        out.append(
            f"| {r['member']} | {r['cluster']} | {r['steps']} | {fmt(r['lines_beyond'])} | {fmt(r['lines_within'])} | "
            f"{fmt(r['needle'])} | {fmt(r['recall'])} | {fmt(r.get('composite'))} | {fmt(r['ppl'])} | "
            f"{fmt(r['longppl'])} | {fmt(r['longppl:smollm2'])} | {fmt(r['no_answer_shape_share'])} | "
            f"{'format' if r['excluded'] else ''} | {r['prefill']} |"
        )
    return "\n".join(out) + "\n"
