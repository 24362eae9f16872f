"""The analysis of the LongPPL study on real models, by its plan (docs/reproduction.md, "LongPPL on
real models — analysis plan"), from the phases' records alone (``<run>/records/*.jsonl``).

- Member rows from ``members.jsonl``: the composite's parts (each beyond-K task's accuracy, the
  mean over the task lengths), the covariate (lines within K), LongPPL under each evaluator on its
  books and the member's own PPL on the Gemma evaluator's books.
- Exclusion by format only: more than half of a member's lines outputs (beyond and within K, all
  lengths) hold no five-digit number.
- Statistics (``claim_statistics.correlations``: Spearman and Pearson with cluster bootstraps, the
  paired difference, Williams' t), the partial Spearman given the covariate, overall and within
  the levels (families, SmolLM2 step levels).
- The instrument checks (``instrument.jsonl``) and the decision rule with the plan's extra
  conditions.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from ..common.run_folder import finite

_ANSWER_SHAPE = re.compile(r"(?<!\d)\d{5}(?!\d)")
PARTS = ("lines_beyond", "needle", "recall")
MEASURES = {"longppl": ("books-gemma", "longppl"), "longppl:smollm2": ("books-smollm2", "longppl")}

PLAN_RULES = SimpleNamespace(
    bootstrap={"resamples": 10000, "seed": 0, "level": 0.95},
    positive_max_high=-0.3,
    negative_min_low=-0.5,
    equivalence_margin=0.15,
    min_members=40,
    min_clusters=10,
    min_key_tokens=1000,
    max_order_rho=-0.8,
    max_no_number_share=0.5,
)


def _mean_over(tasks: dict, prefix: str) -> float:
    values = [found["accuracy"] for name, found in tasks.items() if name.startswith(prefix + "-")]
    return float(np.mean(values)) if values else float("nan")


def member_rows(records: list[dict]) -> list[dict]:
    """One analysis row per member record (``phases.score``'s rows)."""
    rows = []
    for record in records:
        tasks = record["tasks"]
        outputs = [o for name, found in tasks.items() if name.startswith("lines-") for o in found.get("outputs", [])]
        row = {
            "member": record["member"],
            "cluster": record["cluster"],
            "base": record["base"],
            "steps": record["steps"],
            "lines_beyond": _mean_over(tasks, "lines-beyond"),
            "lines_within": _mean_over(tasks, "lines-within"),
            "needle": _mean_over(tasks, "needle"),
            "recall": _mean_over(tasks, "recall"),
            "no_answer_shape_share": (
                sum(not _ANSWER_SHAPE.search(o) for o in outputs) / len(outputs) if outputs else float("nan")
            ),
            "ppl": record["longppl"].get("books-gemma", {}).get("ppl", float("nan")),
        }
        for key, (corpus, value) in MEASURES.items():
            row[key] = record["longppl"].get(corpus, {}).get(value, float("nan"))
        rows.append(row)
    return rows


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


def instrument_checks(instrument: list[dict], rules) -> dict:
    """The plan's checks from ``instrument.jsonl``: Gemma's key tokens over its books, and the order
    of the context-limited series by window (``phases.window_order``'s statistic)."""
    from ..common.statistics import correlation

    shares = {r["corpus"]: r for r in instrument if r["check"] == "key-share"}
    gemma = shares.get("books-gemma")
    key_tokens = sum(gemma["key_tokens"]) if gemma else None
    series = [
        r for r in instrument if r["check"] == "window-order" and (r["kind"] == "context" or r["window"] >= 32768)
    ]
    rho = (
        correlation([r["window"] for r in series], [r["longppl"] for r in series], "spearman")
        if len(series) >= 3
        else None
    )
    return {
        "key_tokens": key_tokens,
        "enough_key_tokens": key_tokens is not None and key_tokens >= rules.min_key_tokens,
        "context_series_rho": rho,
        "ordered_by_window": rho is not None and rho <= rules.max_order_rho,
        "answer_shares": [
            {k: r[k] for k in ("evaluator", "length", "share_of_answer_tokens_key")}
            for r in instrument
            if r["check"] == "answer-share"
        ],
    }


def analyse(records: list[dict], instrument: list[dict], rules=PLAN_RULES) -> dict:
    """Everything the plan decides and reports, from the records (see the module docstring).

    Returns:
        ``{"rows", "excluded", "composite", "statistics": {level: {measure: correlations}},
        "partial", "instrument", "decision", "decision_by_level"}``.
    """
    from ..common import claim_statistics

    rows = member_rows(records)
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
        level: {m: claim_statistics.correlations(chosen, m, "composite", rules) for m in MEASURES}
        for level, chosen in levels.items()
    }
    checks = instrument_checks(instrument, rules)
    partial = partial_spearman(analysed, "longppl", rules)
    decision = decide(statistics["all"], partial, checks, rules)
    by_level = {
        level: claim_statistics.decide(
            {"gemma": found["longppl"], "smollm2": found["longppl:smollm2"]}, "gemma", rules
        )["outcome"]
        for level, found in statistics.items()
        if level != "all"
    }
    return {
        "rows": rows,
        "excluded": [r["member"] for r in rows if r["excluded"]],
        "composite": composite,
        "statistics": statistics,
        "partial": partial,
        "instrument": checks,
        "decision": decision,
        "decision_by_level": by_level,
    }


def decide(overall: dict, partial: dict, checks: dict, rules) -> dict:
    """The plan's rule: ``claim_statistics.decide`` (Gemma primary, SmolLM2 the second evaluator) with
    the plan's additions: positive also needs the partial Spearman's upper bound below 0 and LongPPL
    ordering the context-limited series; inconclusive below 40 members or 10 clusters, or without
    the key tokens the plan asks."""
    from ..common import claim_statistics

    found = claim_statistics.decide(
        {"gemma": overall["longppl"], "smollm2": overall["longppl:smollm2"]}, "gemma", rules, rules.min_members
    )
    conditions, reasons = list(found["conditions"]), list(found["reasons"])
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
    positive = all(c["holds"] for c in conditions if c["rule"] == "positive")
    negative = any(c["holds"] for c in conditions if c["rule"] == "negative")
    if reasons:
        outcome = "inconclusive"
    elif positive:
        outcome = "positive"
    elif negative:
        outcome = "negative"
    else:
        outcome = "inconclusive"
    return {"outcome": outcome, "conditions": conditions, "reasons": reasons}


def _interval(found: dict | None) -> str:
    from ..common.report_text import fmt

    if not found or "value" not in found:
        return "n/a"
    return f"{fmt(found['value'])} [{fmt(found['low'])}, {fmt(found['high'])}]"


def format_report(found: dict) -> str:
    """``report.md`` of the study: the instrument checks first, then the decision and the statistics
    per level, then every member."""
    from ..common.report_text import fmt

    checks = found["instrument"]
    out = ["# LongPPL on real models", "", "## The instrument (before the correlation)", ""]
    out.append(f"- key tokens over the Gemma evaluator's books: {checks['key_tokens']}")
    out.append(f"- Spearman rho of window and LongPPL, context-limited series: {fmt(checks['context_series_rho'])}")
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
    out += [
        "",
        "| member | cluster | steps | lines beyond | lines within | needle | recall | composite | PPL | LongPPL | LongPPL (SmolLM2) | excluded |",
    ]
    out.append("|---" * 12 + "|")
    for r in found["rows"]:
        out.append(
            f"| {r['member']} | {r['cluster']} | {r['steps']} | {fmt(r['lines_beyond'])} | {fmt(r['lines_within'])} | "
            f"{fmt(r['needle'])} | {fmt(r['recall'])} | {fmt(r.get('composite'))} | {fmt(r['ppl'])} | "
            f"{fmt(r['longppl'])} | {fmt(r['longppl:smollm2'])} | {'format' if r['excluded'] else ''} |"
        )
    return "\n".join(out) + "\n"
