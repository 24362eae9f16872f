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

from ..common.claim_statistics import (  # noqa: F401 - the analysis's functions, named here as before
    _measure_key,
    add_composite,
    correlations,
    decide,
    evaluator_statistics,
    exclusion,
    mixed_models,
)
from ..common.run_folder import finite
from .analysis import (
    member_row,
    results_header,
    sensitivity_statistics,
    with_wilson_intervals,
    without_outputs,
)


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
