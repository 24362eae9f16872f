"""The statistics and decisions of "LongCE beyond one setting" (docs/reproduction.md, its analysis
plan: "Void rule", "Statistics", "What counts as what"), from the runs' rows alone.

``longce_comparison.settings_report`` reads the records into rows (one per run, one per start model,
see ``longce_comparison.setting_row``) and hands them here:

- :func:`analyse_setting`: one setting's void runs and void arms, mean and sd per arm, the plan's
  paired differences across seeds (each arm against ``ce``, ``self - frozen``, ``self - ce-fresh``)
  and every arm against the start model, each with its t interval;
- :func:`pool_settings`: the per-seed paired differences of the settings pooled by a random
  intercept per setting (t on S - 1 degrees of freedom) and by the fixed-effects mean (n - S);
- :func:`decide`: the plan's decisions on those intervals;
- :func:`format_settings_report`: ``report.md``.

The comparison of arms itself (paired intervals, void runs, pooling, tables) is
``longppl_reproduce.common.arm_comparison``, shared with "LongCE from a real start"; this module holds
this plan's pairs, outcomes, void rule and decisions. Everything here is pure: numbers in, numbers
out, so the tests can craft them.
"""

from __future__ import annotations

from ..common.arm_comparison import (
    analyse_arms,
    answer_text,
    difference_table,
    excludes_zero_positive,
    interval_text,
    lies_above,
    mirrored,
    pool_clusters,
    pooled_table,
    summary_table,
)
from ..common.report_text import closing_sections, fmt
from ..common.run_folder import finite

#: The outcomes per run (the first is the primary one), with their report labels and decimals.
OUTCOMES = {
    "primary_accuracy": ("primary", 3),
    "recall": ("passage recall", 3),
    "acc_start": ("acc at start length", 3),
    "needle": ("needle", 3),
    "log_likelihood": ("answer LL", 3),
    "ppl": ("PPL", 2),
    "longppl": ("LongPPL (outside evaluator)", 2),
    "beyond_start": ("primary beyond start length", 3),
}
#: The outcomes a void run leaves (the plan: void runs leave the accuracy comparisons); PPL and
#: LongPPL keep every run.
ACCURACY_MEASURES = ("primary_accuracy", "recall", "acc_start", "needle", "log_likelihood", "beyond_start")
#: The plan's paired differences across seeds, ``(arm, baseline)``.
SETTING_PAIRS = (
    ("self", "ce"),
    ("cache", "ce"),
    ("frozen", "ce"),
    ("ce-fresh", "ce"),
    ("self", "frozen"),
    ("self", "ce-fresh"),
)
#: The differences pooled over settings, and the outcomes they are pooled on.
POOLED_PAIRS = (("self", "ce"), ("frozen", "ce"), ("self", "frozen"), ("self", "ce-fresh"))
POOLED_MEASURES = ("primary_accuracy", "recall")
#: "Frozen matches self": the interval of ``frozen - self`` above minus this (the plan's margin).
NON_INFERIORITY_MARGIN = 0.03

CLAIM_REPRODUCED = "reproduced beyond one setting"
CLAIM_SETTING_DEPENDENT = "setting-dependent"
CLAIM_NOT_REPRODUCED = "not reproduced"


def analyse_setting(rows: list[dict], start: dict | None, methods: list[str], seeds: int, level: float) -> dict:
    """One setting's statistics by this plan (:func:`arm_comparison.analyse_arms` with its pairs,
    :data:`SETTING_PAIRS`, outcomes, :data:`OUTCOMES`, the accuracy outcomes void runs leave,
    :data:`ACCURACY_MEASURES`, and its arm-level void rule: an arm void in more than half the seeds)."""
    return analyse_arms(
        rows, start, methods, seeds, level, pairs=SETTING_PAIRS, outcomes=OUTCOMES, accuracy=ACCURACY_MEASURES,
        arm_void_rule=True,
    )  # fmt: skip


def pool_settings(analysed: dict, level: float) -> dict:
    """This plan's pooled statistics (:func:`arm_comparison.pool_clusters` over :data:`POOLED_PAIRS`
    and :data:`POOLED_MEASURES`, clusters = settings)."""
    return pool_clusters(analysed, level, pairs=POOLED_PAIRS, measures=POOLED_MEASURES)


def decide(differences: dict, pooled: dict, margin: float = NON_INFERIORITY_MARGIN) -> dict:
    """The plan's decisions ("What counts as what"), on the primary outcome.

    Args:
        differences: ``{setting: {"arm - baseline": {"primary_accuracy": interval}}}``, an interval
            ``{"value", "low", "high", ...}`` or ``{"skipped": why}`` (no comparison).
        pooled: :func:`pool_settings`'s dict (its ``"self - ce"`` primary random-intercept interval).
        margin: the non-inferiority margin of "frozen matches self".

    Returns:
        ``{"claim": {"decision", "positive_settings", "compared_settings", "pooled_excludes_0"},
        "frozen": {setting: {"matches_self", "beats_ce", "frozen_minus_self"}}, "compute": {setting:
        {"not_bought_with_compute"}}}``; a per-setting answer is ``None`` where the setting has no
        such comparison.

    - LongCE's claim (``self - ce``): *reproduced beyond one setting* if the pooled mu's interval
      excludes 0 and at least two settings' intervals exclude 0 on the positive side;
      *setting-dependent* if at least one setting's does (and the first does not hold); *not
      reproduced* if none does.
    - Frozen self weights, per setting: *match self* if ``frozen - self``'s interval lies above
      ``-margin`` (its low end is minus ``self - frozen``'s high end, the same t interval mirrored);
      *beat CE* if ``frozen - ce``'s interval excludes 0 on the positive side.
    - Compute, per setting: *not bought with compute* if ``self - ce-fresh``'s interval excludes 0 on
      the positive side.
    """

    def primary(setting: str, pair: str) -> dict:
        return differences[setting].get(pair, {}).get("primary_accuracy", {"skipped": "not run"})

    claim = {s: excludes_zero_positive(primary(s, "self - ce")) for s in differences}
    positive = [s for s, v in claim.items() if v]
    mu = pooled.get("self - ce", {}).get("primary_accuracy", {}).get("random_intercept", {})
    pooled_excludes = (mu["low"] > 0 or mu["high"] < 0) if "low" in mu else None
    if pooled_excludes and len(positive) >= 2:
        decision = CLAIM_REPRODUCED
    elif positive:
        decision = CLAIM_SETTING_DEPENDENT
    else:
        decision = CLAIM_NOT_REPRODUCED
    frozen, compute = {}, {}
    for setting in differences:
        frozen_self = mirrored(primary(setting, "self - frozen"))
        frozen[setting] = {
            "matches_self": lies_above(frozen_self, -margin),
            "beats_ce": excludes_zero_positive(primary(setting, "frozen - ce")),
            "frozen_minus_self": frozen_self,
        }
        compute[setting] = {"not_bought_with_compute": excludes_zero_positive(primary(setting, "self - ce-fresh"))}
    return {
        "claim": {
            "decision": decision,
            "positive_settings": positive,
            "compared_settings": [s for s, v in claim.items() if v is not None],
            "pooled_excludes_0": pooled_excludes,
        },
        "frozen": frozen,
        "compute": compute,
        "margin": margin,
    }


# ------------------------------------------------------------------ report.md


def setting_rows(found: dict) -> list[dict]:
    """A setting's rows (``settings[name]`` of ``results.json``): its start model's, if evaluated,
    then its runs'."""
    return ([found["start"]] if found["start"] else []) + found["runs"]


def absent_settings(settings: dict) -> list[str]:
    """The settings (``{name: found}``, in order) without a row in the records."""
    return [name for name, found in settings.items() if not setting_rows(found)]


def decision_lines(results: dict) -> list[str]:
    """The decisions in words, one bullet each, with the intervals they rest on."""
    decisions, settings = results["decisions"], results["settings"]
    claim = decisions["claim"]
    pooled = results["pooled"]["self - ce"]

    def pooled_text(item: dict) -> str:
        mu = item["random_intercept"]
        if "low" not in mu:
            return f"not fitted ({mu['skipped']})"
        return f"{interval_text(mu)} (random intercept, {mu['df']} df, over {', '.join(item['settings'])})"

    def primary(name: str, pair: str, measure: str = "primary_accuracy") -> str:
        return interval_text(settings[name]["differences"].get(pair, {}).get(measure, {}))

    absent = absent_settings(settings)
    # The plan decides over the settings that ran; until every setting is in, say whose records the
    # decision rests on, so that a decision from one setting does not read as the study's.
    scope = f" (on the records of {', '.join(n for n in settings if n not in absent)} alone: {', '.join(absent)} not in them)"
    out = [
        f"- **LongCE's claim (`self − ce`, primary): {claim['decision']}{scope if absent else ''}.** Settings whose "
        "interval excludes 0 "
        f"on the positive side: {', '.join(claim['positive_settings']) or 'none'} (of "
        f"{', '.join(claim['compared_settings']) or 'none'} with a comparison). Pooled μ "
        + pooled_text(pooled["primary_accuracy"])
        + "."
    ]
    for name in settings:
        frozen, compute = decisions["frozen"][name], decisions["compute"][name]
        out.append(
            f"- **Setting {name}:** frozen matches `self`: {answer_text(frozen['matches_self'])} (`frozen − self` "
            f"{interval_text(frozen['frozen_minus_self'])}, margin −{decisions['margin']:g}); frozen beats CE: "
            f"{answer_text(frozen['beats_ce'])} (`frozen − ce` {primary(name, 'frozen - ce')}); not bought with "
            f"compute: {answer_text(compute['not_bought_with_compute'])} (`self − ce-fresh` "
            f"{primary(name, 'self - ce-fresh')})."
        )
    held_out = "; ".join(f"{name} {primary(name, 'self - ce', 'recall')}" for name in settings)
    out.append(
        f"- **Held-out task (passage recall, `self − ce`; reported, not decided):** {held_out}; pooled μ "
        + pooled_text(pooled["recall"])
        + "."
    )
    return out


def _run_table(found: dict) -> list[str]:
    rows = setting_rows(found)
    beyond = any(finite(r.get("beyond_start")) for r in rows)
    lengths = sorted({n for r in rows for n in r["accuracy"]}, key=int)
    head = ["run", "steps", "primary", " / ".join(lengths), "acc start", *(["beyond start"] if beyond else [])]
    head += ["recall", "needle", "answer LL", "PPL", "LongPPL", "step ms", "void"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [
            r["run"],
            str(r.get("steps", 0)),
            fmt(r["primary_accuracy"]),
            " / ".join(fmt(r["accuracy"].get(n)) for n in lengths),
            fmt(r["acc_start"]),
            *([fmt(r.get("beyond_start"))] if beyond else []),
            fmt(r["recall"]),
            fmt(r["needle"]),
            fmt(r["log_likelihood"]),
            fmt(r["ppl"], 2),
            fmt(r["longppl"], 2),
            fmt(r["step_seconds"] * 1e3, 1) if finite(r["step_seconds"]) else "n/a",
            "**void**" if r["void"] else "",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _outcomes(found: dict) -> list[str]:
    """The outcomes with a value in this setting (beyond-start only where configured)."""
    rows = setting_rows(found)
    return [k for k in OUTCOMES if any(finite(r.get(k)) for r in rows)]


def format_settings_report(results: dict) -> str:
    """``report.md`` of a config with settings: the decisions by the plan; per setting the start model
    and every run, void runs, mean ± sd per arm, the paired differences against ``ce`` (and ``self −
    frozen``, ``self − ce-fresh``) and against the start model with their t intervals; the pooled
    statistics; wall times and figures."""
    settings, pooled = results["settings"], results["pooled"]
    level = round(results["config"]["level"] * 100)
    out = ["# LongCE beyond one setting", "", "```", results["command"], "```", ""]
    out.append(f"Seeds: {', '.join(map(str, results['seeds']))}.")
    absent = absent_settings(settings)
    if absent:
        out.append(f"**Not in the records: setting(s) {', '.join(absent)}** (not run or not evaluated).")
    used = pooled["self - ce"]["primary_accuracy"]["settings"]
    if len(used) == 2:
        out.append(
            f"The pooled model is fitted over {' and '.join(used)} only, so its interval has 1 degree of freedom "
            "(the plan: if a setting is not run, pool the others and say so)."
        )
    out += ["", "## Decisions by the plan", "", *decision_lines(results)]
    out += [
        "",
        f"Intervals are paired {level}% t intervals across seeds. A run is void when its accuracy at the "
        "start length at the void rule's step is below half the start model's: void runs leave every "
        "accuracy comparison (PPL and LongPPL keep them), and an arm void in more than half its setting's "
        "seeds has no accuracy comparison there.",
    ]
    for name, found in settings.items():
        out += ["", f"## Setting {name}", ""]
        spec = found["setting"]
        out.append(
            f"Start model {spec['start']}, extended by {spec['extension']['method']} ×{spec['extension']['factor']:g}; "
            f"fine-tuned at L = {spec['seq_len']}, start length {spec['start_length']}, outside evaluator "
            f"{spec['evaluator']}."
        )
        if name in absent:
            out.append("No records of this setting.")
            continue
        if found["missing"]:
            out.append(f"Not in the records: {', '.join(found['missing'])}.")
        void_runs = [r for r in found["runs"] if r["void"]]
        out.append(
            "Void runs: "
            + (
                ", ".join(
                    f"{r['run']} (at the start length {fmt(r['void_rule']['acc_start'])} at step "
                    f"{r['void_rule']['at_step']}, threshold {fmt(r['void_rule']['threshold'])})"
                    for r in void_runs
                )
                if void_runs
                else "none"
            )
            + "."
        )
        gone = [m for m, v in found["void"].items() if v["void"]]
        if gone:
            out.append(f"**No accuracy comparison for {', '.join(gone)}** (void in more than half the seeds).")
        outcomes = _outcomes(found)
        out += ["", "### Every run", "", *_run_table(found)]
        out += ["", "### Mean ± sd over seeds (void runs out of the accuracy columns)", ""]
        out += summary_table(found, outcomes, OUTCOMES)
        out += ["", f"### Paired differences across seeds, with the {level}% t interval", ""]
        out += difference_table(found["differences"], outcomes, OUTCOMES)
        out += ["", "### Against the start model (gain or avoided forgetting)", ""]
        out.append(
            "The start model is one model, evaluated once: each interval is the arm's spread over seeds about "
            "the start model's value."
        )
        out.append("")
        out += difference_table(found["against_start"], outcomes, OUTCOMES)
    out += ["", "## Pooled over the settings", ""]
    out.append(
        "Per-seed paired differences, a random intercept per setting (maximum likelihood; μ's interval from "
        "the GLS standard error with t on S − 1 degrees of freedom), and the fixed-effects mean over these "
        "settings (t on n − S)."
    )
    out += ["", *pooled_table(pooled, OUTCOMES)]
    return "\n".join(out + closing_sections(results)) + "\n"
