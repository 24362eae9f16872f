"""The third attempt's analysis of the population (docs/reproduction.md, "Third attempt: ... —
analysis plan"): what its report computes from the members' evaluation records.

- Exclusion by format only (``analysis.exclusion = "format"``): a member is left out when more than
  ``analysis.max_no_number_share`` of its lines outputs hold no number of the answer's shape (a
  run of exactly five digits); accuracy at 512 is a covariate. Controls are reported, not analysed.
- Outcome: the composite, the mean of the benchmarks of ``analysis.composite`` each standardised
  over the analysed members (a benchmark without variance there is left out and named).
- Statistics per evaluator (the first is primary): Spearman's rho of its LongPPL and of PPL with
  the composite, with a cluster bootstrap over configurations (``Member.configuration``: an
  extension at one setting with all its members), overall and within each step level; the
  difference rho(LongPPL) - rho(PPL) by the paired cluster bootstrap and by Williams' t on ranks;
  a random-intercept model per configuration (composite on standardised log LongPPL, or log PPL,
  and accuracy at 512) with a cluster-bootstrap interval of the slope.
- :func:`decide`: the plan's decision rule.
"""

from __future__ import annotations

import math

from ..common.run_folder import finite
from .analysis import (
    member_row,
    results_header,
    sensitivity_statistics,
    with_wilson_intervals,
    without_outputs,
)


def exclusion(row: dict, analysis) -> str | None:
    """Why ``row`` is left out of the third attempt's analysis, or ``None``: a control, or (the only
    rule) the answer's format lost."""
    if row.get("control"):
        return "control (reported, not analysed)"
    if row["no_answer_shape_share"] > analysis.max_no_number_share:
        return f"{row['no_answer_shape_share']:.0%} of its lines outputs hold no five-digit number"
    return None


def add_composite(rows: list[dict], parts: tuple[str, ...]) -> dict:
    """Set ``row["composite"]`` of every row: the mean over ``parts`` of ``(row[part] - mean) / sd``,
    mean and sd (``ddof = 1``) over ``rows``. A part that some row lacks or that has no variance is
    left out (named in ``"dropped"``); with no part left every composite is NaN.

    Returns:
        ``{"parts": used, "dropped": {part: reason}, "means", "sds"}``.
    """
    import numpy as np

    used, dropped, means, sds = [], {}, {}, {}
    for part in parts:
        values = [r.get(part) for r in rows]
        if len(rows) < 2 or not all(finite(v) for v in values):
            dropped[part] = "missing or undefined for some member"
            continue
        sd = float(np.std(values, ddof=1))
        if not sd > 0:
            dropped[part] = "no variance over the analysed members"
            continue
        used.append(part)
        means[part], sds[part] = float(np.mean(values)), sd
    for r in rows:
        z = [(r[p] - means[p]) / sds[p] for p in used]
        r["composite"] = float(sum(z) / len(z)) if z else float("nan")
    return {"parts": used, "dropped": dropped, "means": means, "sds": sds}


def _measure_key(config, evaluator: str) -> str:
    return "longppl" if evaluator == config.evaluators[0].name else f"longppl:{evaluator}"


def correlations(rows: list[dict], measure: str, outcome: str, analysis) -> dict:
    """Spearman (primary) and Pearson of ``measure`` and of PPL with ``outcome`` over ``rows``, with
    cluster-bootstrap intervals (clusters: ``row["cluster"]``), the paired cluster-bootstrap
    difference, and Williams' t on the ranks (Spearman's coefficients in Williams' formula)."""
    from ..common import statistics

    usable = [r for r in rows if finite(r.get(measure)) and finite(r["ppl"]) and finite(r.get(outcome))]
    clusters = [r["cluster"] for r in usable]
    found = {"n": len(usable), "clusters": len(set(clusters)), "members": [r["member"] for r in usable]}
    if len(usable) < 4 or len(set(clusters)) < 2:
        found["skipped"] = f"{len(usable)} members in {len(set(clusters))} clusters; 4 in 2 are needed"
        return found
    a, b, y = [r[measure] for r in usable], [r["ppl"] for r in usable], [r[outcome] for r in usable]
    common = {**analysis.bootstrap, "clusters": clusters}
    for method in ("spearman", "pearson"):
        found[method] = {
            "longppl": statistics.bootstrap_correlation(a, y, method, **common),
            "ppl": statistics.bootstrap_correlation(b, y, method, **common),
            "difference": statistics.paired_bootstrap_difference(a, b, y, method, **common),
        }
    r_ay, r_by = found["spearman"]["longppl"]["value"], found["spearman"]["ppl"]["value"]
    r_ab = statistics.correlation(a, b, "spearman")
    if not all(finite(r) for r in (r_ay, r_by, r_ab)) or abs(r_ab) >= 1 - 1e-12:
        found["williams_t_ranks"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "undefined"}
    else:
        found["williams_t_ranks"] = statistics.williams_t(r_ay, r_by, r_ab, len(usable))
    return found


def mixed_models(rows: list[dict], measure: str, outcome: str, analysis) -> dict:
    """The random-intercept models (clusters: configurations) of ``outcome`` on the standardised
    log of ``measure`` and, apart, of PPL, each with accuracy at 512 as a covariate; slopes with
    cluster-bootstrap intervals."""
    import numpy as np

    from ..common import statistics

    usable = [r for r in rows if finite(r.get(measure)) and finite(r["ppl"]) and finite(r.get(outcome))]
    if len(usable) < 6 or len({r["cluster"] for r in usable}) < 3:
        return {"skipped": f"{len(usable)} members; 6 in 3 clusters are needed"}
    y = [r[outcome] for r in usable]
    clusters = [r["cluster"] for r in usable]
    acc512 = [r["acc512"] for r in usable]
    # a constant covariate would make the design singular (and says nothing): left out, and named
    covariate = acc512 if len(set(acc512)) > 1 else None
    found = {"covariates": ["acc512"] if covariate else []}
    for name, key in (("longppl", measure), ("ppl", "ppl")):
        x = np.log([r[key] for r in usable])
        sd = float(np.std(x, ddof=1))
        if not sd > 0:
            found[name] = {"skipped": "no variance"}
            continue
        found[name] = statistics.bootstrap_random_intercept_slope(
            y,
            (x - x.mean()) / sd,
            clusters,
            covariates=covariate,
            resamples=analysis.mixed_model_resamples,
            seed=analysis.seed,
            level=analysis.level,
        )
    return found


def evaluator_statistics(rows: list[dict], measure: str, steps: list[int], analysis) -> dict:
    """:func:`correlations` overall and within each step level, and :func:`mixed_models`, for the
    composite; each part of the composite (and accuracy at 512) overall as secondary outcomes."""
    found = {
        "overall": correlations(rows, measure, "composite", analysis),
        "by_steps": {
            str(s): correlations([r for r in rows if r["steps"] == s], measure, "composite", analysis) for s in steps
        },
        "mixed_model": mixed_models(rows, measure, "composite", analysis),
    }
    found["parts"] = {part: correlations(rows, measure, part, analysis) for part in (*analysis.composite, "acc512")}
    return found


def decide(by_evaluator: dict, primary: str, analysis, min_members: int | None = None) -> dict:
    """The plan's decision from the overall correlations of each evaluator (``{name:
    correlations(...)}``, ``primary`` one of the names).

    - **positive**: under ``primary``, the upper bound of LongPPL's Spearman interval is below
      ``analysis.positive_max_high`` and the interval of rho(LongPPL) - rho(PPL) lies below 0; and
      under every other evaluator both point values are below 0 (the same direction).
    - else **negative**: under ``primary``, LongPPL's lower bound is above
      ``analysis.negative_min_low``, or the difference's interval lies within
      ``+-analysis.equivalence_margin``.
    - else **inconclusive** (the plan's second block follows). Also inconclusive when fewer than
      ``min_members`` members are analysed or a statistic is undefined.

    Returns:
        ``{"outcome", "conditions": [{"condition", "holds"}], "reasons": [...]}``.
    """
    found = by_evaluator[primary]
    if "skipped" in found:
        return {"outcome": "inconclusive", "conditions": [], "reasons": [found["skipped"]]}
    rho, difference = found["spearman"]["longppl"], found["spearman"]["difference"]
    margin = analysis.equivalence_margin
    positive = [
        (
            f"{primary}: Spearman rho(LongPPL, composite) upper bound {rho['high']:.3f} < {analysis.positive_max_high}",
            rho["high"] < analysis.positive_max_high,
        ),
        (f"{primary}: rho(LongPPL) - rho(PPL) upper bound {difference['high']:.3f} < 0", difference["high"] < 0),
    ]
    for name, other in by_evaluator.items():
        if name == primary:
            continue
        if "skipped" in other:
            positive.append((f"{name}: same direction (skipped: {other['skipped']})", False))
            continue
        value, diff = other["spearman"]["longppl"]["value"], other["spearman"]["difference"]["value"]
        positive.append(
            (f"{name}: same direction, rho {value:.3f} < 0 and difference {diff:.3f} < 0", value < 0 and diff < 0)
        )
    negative = [
        (
            f"{primary}: Spearman rho(LongPPL, composite) lower bound {rho['low']:.3f} > {analysis.negative_min_low}",
            rho["low"] > analysis.negative_min_low,
        ),
        (
            f"{primary}: rho(LongPPL) - rho(PPL) interval [{difference['low']:.3f}, {difference['high']:.3f}] "
            f"within +-{margin}",
            -margin <= difference["low"] and difference["high"] <= margin,
        ),
    ]
    reasons = []
    if min_members is not None and found["n"] < min_members:
        reasons.append(f"{found['n']} members analysed, fewer than the {min_members} the plan needs")
    if not all(math.isfinite(v) for v in (rho["low"], rho["high"], difference["low"], difference["high"])):
        reasons.append("an interval is undefined")
    if reasons:
        outcome = "inconclusive"
    elif all(held for _, held in positive):
        outcome = "positive"
    elif any(held for _, held in negative):
        outcome = "negative"
    else:
        outcome = "inconclusive"
    conditions = [{"rule": "positive", "condition": t, "holds": bool(h)} for t, h in positive]
    conditions += [{"rule": "negative", "condition": t, "holds": bool(h)} for t, h in negative]
    return {"outcome": outcome, "conditions": conditions, "reasons": reasons}


def analyse(config, rows: list[dict]) -> dict:
    """Everything the third attempt's report states, from the member rows (``member_row``
    with ``configuration``, ``control``, ``no_answer_shape_share`` and ``two_hop``): exclusions,
    the composite, the statistics under every evaluator, the decision overall and within each
    step level."""
    analysis = config.analysis
    for r in rows:
        r["cluster"] = r["configuration"] if analysis.cluster == "configuration" else r["method"]
        reason = exclusion(r, analysis)
        r.update(excluded=reason is not None, exclusion_reason=reason)
    analysed = [r for r in rows if not r["excluded"]]
    composite = add_composite(analysed, analysis.composite)
    steps = sorted({r["steps"] for r in rows})
    evaluators = [e.name for e in config.evaluators if e.enabled]
    by_evaluator = {e: evaluator_statistics(analysed, _measure_key(config, e), steps, analysis) for e in evaluators}
    primary = evaluators[0]
    decision = decide({e: s["overall"] for e, s in by_evaluator.items()}, primary, analysis, analysis.min_members)
    by_level = {
        str(s): decide({e: by_evaluator[e]["by_steps"][str(s)] for e in evaluators}, primary, analysis) for s in steps
    }
    return {
        "analysed": len(analysed),
        "clusters": len({r["cluster"] for r in analysed}),
        "composite": composite,
        "statistics": by_evaluator,
        "primary_evaluator": primary,
        "decision": decision,
        "decision_by_steps": by_level,
    }


def report(config, run) -> dict:
    """The ``report`` stage under the third plan: ``results.json``, ``report.md`` and a scatter per
    step level, from the evaluation records in ``run`` (members without a record are listed as not
    evaluated, so a report can be made from what a cut-short run left)."""
    from ..common import stages

    rows, missing = [], []
    for member in config.members():
        if run.has("eval", "members", f"{member.name}.json"):
            record = run.read_json("eval", "members", f"{member.name}.json")
            rows.append(member_row(member, record, config.analysis))
        else:
            missing.append(member.name)
    found = analyse(config, rows)
    enabled = [e for e in config.evaluators if e.enabled]
    results = {
        **results_header(config),
        "gates": {
            spec.name: without_outputs(run.read_json("eval", "gates", f"{spec.name}.json"))
            for spec in stages.gate_specs(config)
            if run.has("eval", "gates", f"{spec.name}.json")
        },
        "calibration": {
            e.name: run.read_json(*stages.calibration_parts(config, e.name))
            for e in enabled
            if run.has(*stages.calibration_parts(config, e.name))
        },
        "members": rows,
        "not_evaluated": missing,
        "analysis": found,
        "answer_tokens": (
            with_wilson_intervals(run.read_json("eval", "answer_tokens.json"), config.analysis.level)
            if run.has("eval", "answer_tokens.json")
            else None
        ),
        "timings": run.timings(),
    }
    # E1's sensitivity grid, secondary window and soft weights against the composite (members
    # bootstrap, as in the second attempt; secondary)
    analysed = [r for r in rows if not r["excluded"]]
    results["sensitivity"] = sensitivity_statistics(analysed, config.analysis, benchmark="composite")
    results["figures"] = draw_figures(run, rows)
    return run.write_report(results, format_report(results))


def draw_figures(run, rows: list[dict]) -> list[str]:
    """One LongPPL / PPL scatter against the composite per step level (analysed members); none
    without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    import os

    from longppl.commandline.figures import correlation_scatter

    paths = []
    for steps in sorted({r["steps"] for r in rows}):
        chosen = [
            r
            for r in rows
            if r["steps"] == steps and not r["excluded"] and all(finite(r[k]) for k in ("longppl", "ppl", "composite"))
        ]
        if len(chosen) < 2:
            continue
        path = run.path("figures", f"correlation-s{steps}.png")
        names = [r["member"] for r in chosen]
        values = [[r[k] for r in chosen] for k in ("longppl", "ppl", "composite")]
        correlation_scatter(path, names, *values, f"composite ({steps} fine-tuning steps)")
        paths.append(os.path.relpath(path, run.root))
    return paths


def _interval(found: dict | None) -> str:
    from ..common.report_text import fmt

    if not found or "value" not in found:
        return "n/a"
    return f"{fmt(found['value'])} [{fmt(found['low'])}, {fmt(found['high'])}]"


def _correlation_lines(label: str, found: dict) -> list[str]:
    from ..common.report_text import fmt

    if "skipped" in found:
        return [f"| {label} | {found['n']} | skipped: {found['skipped']} | | | | |"]
    s, p, w = found["spearman"], found["pearson"], found["williams_t_ranks"]
    return [
        f"| {label} | {found['n']} ({found['clusters']}) | {_interval(s['longppl'])} | {_interval(s['ppl'])} | "
        f"{_interval(s['difference'])} | {fmt(w['t'])} (p {fmt(w['p_two_sided'])}) | "
        f"{fmt(p['longppl']['value'])} / {fmt(p['ppl']['value'])} |"
    ]


def format_report(results: dict) -> str:
    """``report.md`` of the third attempt: members, gates and alphas, the statistics under every
    evaluator (overall, per step level, parts, mixed model), the decision."""
    from ..common.report_text import closing_sections, fmt

    found = results["analysis"]
    evaluators = list(found["statistics"])
    out = ["# LongPPL over a population of context extensions (third attempt)", "", "```", results["command"], "```"]
    out += [""] + [
        f"- gate {name}: accuracy {fmt(g['accuracy'])} ({'passed' if g['passed'] else 'FAILED'})"
        for name, g in results["gates"].items()
    ]
    out += [f"- {name}: alpha {c['alpha']}" for name, c in results["calibration"].items()]
    if results["not_evaluated"]:
        out.append(f"- not evaluated (no record): {', '.join(results['not_evaluated'])}")
    composite = found["composite"]
    dropped = "; ".join(f"{p}: {why}" for p, why in composite["dropped"].items()) or "none"
    out += [f"- composite of {', '.join(composite['parts']) or 'nothing'} (left out: {dropped})", ""]
    extra = [e for e in evaluators[1:]]
    out.append(
        "| member | configuration | steps | seed | acc512 | lines | needle | two-hop | composite | PPL | LongPPL "
        + "".join(f"| LongPPL {e} " for e in extra)
        + "| excluded |"
    )
    out.append("|---" * (11 + len(extra) + 1) + "|")
    for r in results["members"]:
        out.append(
            f"| {r['member']} | {r['configuration']} | {r['steps']} | {r['seed']} | {fmt(r['acc512'])} | "
            f"{fmt(r['primary_accuracy'])} | {fmt(r['needle'])} | {fmt(r['two_hop'])} | {fmt(r.get('composite'))} | "
            f"{_interval(r['intervals']['ppl'])} | {_interval(r['intervals']['longppl'])} "
            + "".join(f"| {fmt(r.get(f'longppl:{e}'))} " for e in extra)
            + f"| {r['exclusion_reason'] or ''} |"
        )
    head = [
        "| members | n (clusters) | Spearman LongPPL | Spearman PPL | difference | Williams' t, ranks | Pearson LongPPL / PPL |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in evaluators:
        stats = found["statistics"][name]
        out += ["", f"## Evaluator {name}{' (primary)' if name == found['primary_evaluator'] else ''}", ""]
        out += head + _correlation_lines("all analysed, composite", stats["overall"])
        out += [line for s, f in stats["by_steps"].items() for line in _correlation_lines(f"{s} steps, composite", f)]
        out += [line for part, f in stats["parts"].items() for line in _correlation_lines(f"all, {part}", f)]
        mixed = stats["mixed_model"]
        if "skipped" in mixed:
            out.append(f"\nMixed model: skipped ({mixed['skipped']}).")
        else:
            out.append("")
            covariates = "".join(f" + {c}" for c in mixed["covariates"])
            for key, label in (("longppl", "log LongPPL"), ("ppl", "log PPL")):
                if "skipped" in mixed[key]:
                    continue
                fit = mixed[key]["fit"]
                out.append(
                    f"Mixed model, composite on standardised {label}{covariates} + (1 | configuration): slope "
                    f"{_interval(mixed[key])}; intercept variance {fmt(fit['intercept_variance'])}, residual "
                    f"{fmt(fit['sigma2'])}."
                )
    out += ["", f"## Sensitivity ({evaluators[0]}, composite; bootstrap over members)", ""]
    out += ["| measure | Pearson | Spearman |", "|---|---|---|"]
    out += [
        f"| {name} | {_interval(f['pearson'])} | {_interval(f['spearman'])} |"
        for name, f in results["sensitivity"].items()
    ]
    answer = results["answer_tokens"]
    if answer:
        out += ["", f"Answer tokens ({answer['evaluator']}): {answer['answer_tokens']} of {answer['tokens']} tokens; "]
        out[-1] += "; ".join(
            f"alpha {a}: balanced accuracy LSD {fmt(f['lsd']['balanced_accuracy'])}, LSD + LCL "
            f"{fmt(f['lsd+lcl']['balanced_accuracy'])}"
            for a, f in answer["by_alpha"].items()
        )
    decision = found["decision"]
    out += ["", f"## Decision by the analysis plan: **{decision['outcome']}**", ""]
    out += [
        f"- {c['rule']}: {c['condition']}: {'holds' if c['holds'] else 'does not hold'}" for c in decision["conditions"]
    ]
    out += [f"- inconclusive: {reason}" for reason in decision["reasons"]]
    out += ["", "Within each step level (the equal-budget strata; the same rule):", ""]
    out += [f"- {s} steps: {d['outcome']}" for s, d in found["decision_by_steps"].items()]
    return "\n".join(out + closing_sections(results)) + "\n"
