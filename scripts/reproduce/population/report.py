"""The ``report`` stage: ``results.json``, ``report.md`` and the figure, under the config's analysis plan
(``second`` here, ``third`` in :mod:`.third_attempt`).
"""

from __future__ import annotations

import os

from ..common.config import Population
from ..common.report_text import closing_sections, fmt
from ..common.run_folder import RunFolder, finite
from ..common.stages import (
    gate_specs,
)
from . import third_attempt
from .analysis import (
    exclusion,
    member_row,
    results_header,
    sensitivity_statistics,
    statistics_of,
    verdict,
    with_wilson_intervals,
    without_outputs,
)

# ------------------------------------------------------------------ report


def stage_report(config: Population, run: RunFolder, members=None) -> dict:
    if config.analysis.plan == "third":
        return third_attempt.report(config, run)
    rows = []
    base_gate = run.read_json("eval", "gates", f"{config.base.name}.json")
    for member in config.members():
        row = member_row(member, run.read_json("eval", "members", f"{member.name}.json"), config.analysis)
        reason = exclusion(row, base_gate["accuracy"], config.analysis)
        row.update(excluded=reason is not None, exclusion_reason=reason)
        rows.append(row)
    analysed = [r for r in rows if not r["excluded"]]
    results = {
        **results_header(config),
        "gates": {
            spec.name: without_outputs(run.read_json("eval", "gates", f"{spec.name}.json"))
            for spec in gate_specs(config)
        },
        "calibration": run.read_json("eval", "calibration.json"),
        "members": rows,
        "statistics": {
            "analysed": statistics_of(analysed, config.analysis),
            "all": statistics_of(rows, config.analysis),
        },
        # secondary: no success claim rests on these
        "secondary_statistics": {
            "needle": statistics_of(analysed, config.analysis, benchmark="needle"),
            "log_likelihood": statistics_of(analysed, config.analysis, benchmark="mean_log_likelihood", share=False),
            **{
                f"longppl:{e.name}": statistics_of(analysed, config.analysis, measure=f"longppl:{e.name}")
                for e in config.evaluators[1:]
                if e.enabled
            },
        },
        "answer_tokens": with_wilson_intervals(run.read_json("eval", "answer_tokens.json"), config.analysis.level),
        "timings": run.timings(),
    }
    results["sensitivity"] = sensitivity_statistics(analysed, config.analysis)
    results["verdict"] = verdict(results["statistics"]["analysed"], config.analysis)
    results["figures"] = draw_figure(run, analysed)
    return run.write_report(results, format_report(results))


def draw_figure(run: RunFolder, rows: list[dict]) -> list[str]:
    """The Figure 1(b) scatter of the analysed members (none without matplotlib or with < 2 members)."""
    rows = [r for r in rows if finite(r["longppl"]) and finite(r["ppl"])]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    if len(rows) < 2:
        return []
    from longppl.commandline.figures import correlation_scatter

    path = run.path("figures", "correlation.png")
    names = [r["member"] for r in rows]
    correlation_scatter(
        path,
        names,
        [r["longppl"] for r in rows],
        [r["ppl"] for r in rows],
        [r["primary_accuracy"] for r in rows],
        "primary lines accuracy",
    )
    return [os.path.relpath(path, run.root)]


def _pair(bounds) -> str:
    return f"[{fmt(bounds[0])}, {fmt(bounds[1])}]" if bounds else "[n/a]"


def _interval(found: dict) -> str:
    return f"{fmt(found['value'], 2)} [{fmt(found['low'], 2)}, {fmt(found['high'], 2)}]"


def format_report(results: dict) -> str:
    """``report.md``: the members' table, exclusions, the statistics, the answer tokens, wall times."""
    out = ["# LongPPL over a population of context extensions", "", "```", results["command"], "```", ""]
    out += [f"Calibrated alpha: **{results['calibration']['alpha']}**.", ""]
    out += ["PPL and LongPPL with their bootstrap intervals over documents; LongPPL (K2): the secondary window.", ""]
    out += [
        "| member | method | steps | seed | acc512 | primary acc | needle | PPL | LongPPL | LongPPL (K2) | key tokens | excluded |"
    ]
    out += ["|---" * 12 + "|"]
    for r in results["members"]:
        out.append(
            f"| {r['member']} | {r['method']} | {r['steps']} | {r['seed']} | {fmt(r['acc512'])} | "
            f"{fmt(r['primary_accuracy'])} | {fmt(r['needle'])} | {_interval(r['intervals']['ppl'])} | "
            f"{_interval(r['intervals']['longppl'])} | "
            f"{fmt(r['longppl_secondary'], 2)} | {r['key_tokens']:.0f} | {r['exclusion_reason'] or ''} |"
        )
    sections = [(f"{label} members, primary accuracy", found) for label, found in results["statistics"].items()]
    sections += [(f"secondary: {label}", found) for label, found in results["secondary_statistics"].items()]
    for label, found in sections:
        out += ["", f"## Statistics ({label})", ""]
        if "skipped" in found:
            out.append(f"Skipped: {found['skipped']}.")
            continue
        out += ["| correlation | LongPPL | PPL | LongPPL - PPL (p) |", "|---|---|---|---|"]
        for method in ("pearson", "spearman"):
            for suffix, label_ in (("", "members"), ("_by_method", "clusters: methods")):
                lp, p, d = (found[method][k + suffix] for k in ("longppl", "ppl", "difference"))
                out.append(
                    f"| {method} ({label_}) | {fmt(lp['value'])} [{fmt(lp['low'])}, {fmt(lp['high'])}] | "
                    f"{fmt(p['value'])} [{fmt(p['low'])}, {fmt(p['high'])}] | {fmt(d['value'])} ({fmt(d['p_two_sided'])}) |"
                )
        w, partial = found["williams_t"], found["partial_given_acc512"]
        out += [
            "",
            f"Williams' t {fmt(w['t'])} (p {fmt(w['p_two_sided'])}); partial r given acc512 "
            f"{fmt(partial['value'])} [{fmt(partial['low'])}, {fmt(partial['high'])}].",
        ]
        reasons = "; ".join(found["inconclusive_reasons"]) or "no rule applies"
        out.append(f"Inconclusive: {found['inconclusive']} ({reasons}).")
    out += ["", "## Sensitivity (analysed members, primary accuracy)", ""]
    out += ["| measure | Pearson | Spearman |", "|---|---|---|"]
    for name, found in results["sensitivity"].items():
        out.append(f"| {name} | {_interval(found['pearson'])} | {_interval(found['spearman'])} |")
    decided = results["verdict"]
    out += ["", f"## Outcome by the analysis plan: **{decided['outcome']}**", ""]
    out += [f"- {c['condition']}: {'holds' if c['holds'] else 'does not hold'}" for c in decided["conditions"]]
    out += [f"- inconclusive: {reason}" for reason in decided["reasons"]]
    answer = results["answer_tokens"]
    out += [
        "",
        f"## Answer tokens (evaluator {answer['evaluator']}, {answer['answer_tokens']} of {answer['tokens']} tokens)",
        "",
    ]
    for alpha, found in answer["by_alpha"].items():
        for rule in ("lsd", "lsd+lcl"):
            got = found[rule]
            recall, specificity = got.get("recall_interval"), got.get("specificity_interval")
            out.append(
                f"- alpha {alpha}, {rule}: balanced accuracy {fmt(got['balanced_accuracy'])}; recall "
                f"{fmt(got['recall'])} {_pair(recall)}, specificity {fmt(got['specificity'])} {_pair(specificity)} "
                f"({found['n_answer']} answer, {found['n_other']} other tokens)"
            )
    return "\n".join(out + closing_sections(results)) + "\n"
