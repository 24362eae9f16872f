"""Arms of a fine-tuning study compared across seeds: the paired t intervals of each pair of arms (and
of each arm against its start model) within a setting, void runs out of the accuracy outcomes, the
paired differences pooled over settings (random intercept and fixed effects), and their markdown
tables.

Shared by the LongCE studies of the reproduction (``longce_comparison.settings_report``, "LongCE
beyond one setting"; ``real_models.longce_report``, "LongCE from a real start"), each with its own
plan's pairs, outcomes and void rule. Pure: rows in, numbers out.

Rows: one dict per evaluated run with ``method`` (the arm), ``seed``, ``void`` (bool), a value (or
``None``) per outcome and ``step_seconds``; the primary outcome is keyed ``primary_accuracy``.
"""

from __future__ import annotations

from .report_text import fmt, spread
from .run_folder import finite
from .statistics import fixed_effects_mean, paired_t_interval, random_intercept_mean


def pair_name(arm: str, baseline: str) -> str:
    return f"{arm} - {baseline}"


def void_arms(rows: list[dict], seeds: int, arm_rule: bool = True) -> dict:
    """Per arm (method) of one setting: its void runs and whether the arm is void, i.e. void in more
    than half of the setting's ``seeds`` configured seeds (the plan: more than 2 of 4). Without
    ``arm_rule`` (a plan with no arm-level void) no arm is void.

    Returns ``{method: {"void_seeds": [seed, ...], "void": bool}}`` for the methods in ``rows``."""
    found = {}
    for row in rows:
        entry = found.setdefault(row["method"], {"void_seeds": [], "void": False})
        if row["void"]:
            entry["void_seeds"].append(row["seed"])
    for entry in found.values():
        entry["void_seeds"].sort()
        entry["void"] = arm_rule and len(entry["void_seeds"]) > seeds // 2
    return found


def _usable(row: dict | None, measure: str, arm_void: bool, accuracy: tuple[str, ...]) -> bool:
    """Whether ``row``'s ``measure`` enters the comparisons: defined, and for an accuracy measure
    (one of ``accuracy``) neither the run nor its arm void."""
    if row is None or not finite(row.get(measure)):
        return False
    return not (measure in accuracy and (row["void"] or arm_void))


def _interval(a: list[float], b: list[float], seeds: list[int], level: float) -> dict:
    """The paired t interval of ``a[i] - b[i]`` over ``seeds``, with the per-seed differences kept
    (the pooled model reads them); fewer than 2 pairs: ``{"skipped": why}``."""
    if len(a) < 2:
        return {"skipped": f"{len(a)} seed(s) with values of both; 2 are needed", "seeds": seeds}
    found = paired_t_interval(a, b, level)
    return {**found, "seeds": seeds, "per_seed": [x - y for x, y in zip(a, b)]}


def analyse_arms(
    rows: list[dict],
    start: dict | None,
    methods: list[str],
    seeds: int,
    level: float,
    *,
    pairs: tuple[tuple[str, str], ...],
    outcomes,
    accuracy: tuple[str, ...],
    arm_void_rule: bool,
) -> dict:
    """One setting's (one start's) statistics from its rows: the arms of a fine-tuning study compared
    in pairs across seeds.

    Args:
        rows: one dict per evaluated run: ``method``, ``seed``, ``void`` (bool) and a value (or
            ``None``) per measure of ``outcomes`` and ``step_seconds``.
        start: the start model's row (same measures; ``None`` when not evaluated).
        methods: the configured arms, in config order.
        seeds: the number of configured seeds (the void rule's denominator).
        level: the intervals' coverage.
        pairs: the paired differences ``(arm, baseline)``.
        outcomes: the outcomes compared (their keys).
        accuracy: the outcomes a void run leaves.
        arm_void_rule: whether an arm void in more than half the seeds loses its accuracy
            comparisons (a plan without such a rule passes False).

    Returns:
        ``{"void": void_arms(...), "summary": {method: {measure: mean, sd, n}}, "differences":
        {"arm - baseline": {outcome: interval}}, "against_start": {"arm - start": {outcome:
        interval}}}``. An interval is :func:`statistics.paired_t_interval`'s dict plus ``seeds`` and
        ``per_seed`` (the differences, in seed order), or ``{"skipped": why}``. Void runs are out of
        the accuracy measures, and (with ``arm_void_rule``) an arm void in more than half the seeds
        has none of them.
    """
    void = void_arms(rows, seeds, arm_void_rule)
    by = {m: {r["seed"]: r for r in rows if r["method"] == m} for m in methods}
    arm_void = {m: void.get(m, {}).get("void", False) for m in methods}
    summary = {
        m: {
            k: spread([r[k] for r in by[m].values() if _usable(r, k, arm_void[m], accuracy)])
            for k in (*outcomes, "step_seconds")
        }
        for m in methods
    }
    differences = {}
    for arm, baseline in pairs:
        if arm not in by or baseline not in by:
            continue
        entry = {}
        for measure in outcomes:
            gone = [m for m in (arm, baseline) if arm_void[m]]
            if measure in accuracy and gone:
                entry[measure] = {"skipped": f"{' and '.join(gone)} void in more than {seeds // 2} of {seeds} seeds"}
                continue
            both = [
                s
                for s in sorted(set(by[arm]) & set(by[baseline]))
                if _usable(by[arm][s], measure, False, accuracy) and _usable(by[baseline][s], measure, False, accuracy)
            ]
            entry[measure] = _interval(
                [by[arm][s][measure] for s in both], [by[baseline][s][measure] for s in both], both, level
            )
        differences[pair_name(arm, baseline)] = entry
    against_start = {}
    for arm in methods:
        entry = {}
        for measure in outcomes:
            if start is None or not finite(start.get(measure)):
                entry[measure] = {"skipped": "no start model value"}
                continue
            if measure in accuracy and arm_void[arm]:
                entry[measure] = {"skipped": f"{arm} void in more than {seeds // 2} of {seeds} seeds"}
                continue
            kept = sorted(s for s, r in by[arm].items() if _usable(r, measure, False, accuracy))
            # one start model per setting: the interval is the arm's spread over seeds about that value
            values = [by[arm][s][measure] for s in kept]
            entry[measure] = _interval(values, [start[measure]] * len(values), kept, level)
        against_start[pair_name(arm, "start")] = entry
    return {"void": void, "summary": summary, "differences": differences, "against_start": against_start}


def pool_clusters(
    analysed: dict, level: float, *, pairs: tuple[tuple[str, str], ...], measures: tuple[str, ...]
) -> dict:
    """Pooled statistics over the settings (or starts) in ``analysed`` (``{setting: analyse_arms(...)}``).

    For each pair of ``pairs`` and outcome of ``measures``, the per-seed paired differences of every setting that has that
    comparison (``per_seed``), clusters = settings:

    - ``random_intercept``: :func:`statistics.random_intercept_mean` (ML fit, GLS standard error,
      t on S - 1 degrees of freedom; needs 2 settings);
    - ``fixed_effects``: :func:`statistics.fixed_effects_mean` (t on n - S degrees of freedom).

    Returns ``{"arm - baseline": {outcome: {"settings": [...], "n", "random_intercept",
    "fixed_effects"}}}``; a fit that cannot be made is ``{"skipped": why}``.
    """
    pooled = {}
    for arm, baseline in pairs:
        name = pair_name(arm, baseline)
        entry = {}
        for measure in measures:
            values, clusters, used = [], [], []
            for setting, found in analysed.items():
                per_seed = found["differences"].get(name, {}).get(measure, {}).get("per_seed")
                if per_seed:
                    values += per_seed
                    clusters += [setting] * len(per_seed)
                    used.append(setting)
            item = {"settings": used, "n": len(values)}
            if len(used) < 2:
                why = f"{len(used)} setting(s) with this comparison; pooling needs 2"
                item["random_intercept"] = item["fixed_effects"] = {"skipped": why}
            else:
                item["random_intercept"] = random_intercept_mean(values, clusters, level)
                item["fixed_effects"] = fixed_effects_mean(values, clusters, level)
            entry[measure] = item
        pooled[name] = entry
    return pooled


def lies_above(interval: dict, bound: float) -> bool | None:
    """``low > bound``; ``None`` when there is no interval (a skipped comparison)."""
    return interval["low"] > bound if "low" in interval else None


def excludes_zero_positive(interval: dict) -> bool | None:
    """``low > 0``; ``None`` when there is no interval."""
    return lies_above(interval, 0.0)


def answer_text(value: bool | None) -> str:
    """A decision's answer in a report: **yes**, no, or "no comparison" (``None``)."""
    return "no comparison" if value is None else ("**yes**" if value else "no")


def mirrored(interval: dict) -> dict:
    """The interval of ``b - a`` from that of ``a - b`` (the same t interval, negated and its ends
    swapped); a skipped comparison stays as it is."""
    if "low" not in interval:
        return interval
    return {"value": -interval["value"], "low": -interval["high"], "high": -interval["low"]}


# ------------------------------------------------------------------ markdown


def signed(value, digits: int = 3) -> str:
    """``value`` with its sign (``n/a`` when undefined)."""
    return f"{value:+.{digits}f}" if finite(value) else "n/a"


def interval_text(found: dict, digits: int = 3) -> str:
    """``+0.077 [+0.052, +0.102]``, or ``n/a`` for a comparison that was skipped."""
    if "low" not in found:
        return "n/a"
    return f"{signed(found['value'], digits)} [{signed(found['low'], digits)}, {signed(found['high'], digits)}]"


def summary_table(found: dict, outcomes: list[str], labels: dict) -> list[str]:
    """Markdown rows: mean ± sd per arm of ``found["summary"]`` (:func:`analyse_arms`'s) for each
    of ``outcomes`` (``labels[k]``: its column title and decimals), the start model's row first."""
    head = ["arm", "n (primary)"] + [labels[k][0] for k in outcomes] + ["step ms"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    if found["start"]:
        start = found["start"]
        out.append("| start model | 1 | " + " | ".join(fmt(start[k], labels[k][1]) for k in outcomes) + " | |")
    for method, summary in found["summary"].items():
        cells = [
            f"{fmt(summary[k]['mean'], labels[k][1])} ± {fmt(summary[k]['sd'], labels[k][1])}"
            if summary[k]["n"]
            else "n/a"
            for k in outcomes
        ]
        ms = summary["step_seconds"]
        step = f"{fmt(ms['mean'] * 1e3, 1)} ± {fmt(ms['sd'] * 1e3, 1)}" if ms["n"] else "n/a"
        n = summary["primary_accuracy"]["n"]
        out.append(f"| {method} | {n} | " + " | ".join(cells) + f" | {step} |")
    return out


def difference_table(entries: dict, outcomes: list[str], labels: dict) -> list[str]:
    """Markdown rows: per difference of ``entries`` (``{"arm - baseline": {outcome: interval}}``) its
    interval on each of ``outcomes`` (``labels[k]``: column title and decimals); ``self - ce`` in bold."""
    head = ["difference", "seeds (primary)"] + [labels[k][0] for k in outcomes]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for pair, entry in entries.items():
        seeds = len(entry["primary_accuracy"].get("seeds", []))
        cells = [interval_text(entry[k], labels[k][1]) for k in outcomes]
        label = f"**{pair.replace(' - ', ' − ')}**" if pair == "self - ce" else pair.replace(" - ", " − ")
        out.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    return out


def pooled_table(pooled: dict, labels: dict, clusters: str = "settings") -> list[str]:
    """Markdown rows of :func:`pool_clusters`'s dict: per difference and outcome (``labels``' title)
    the random-intercept and fixed-effects means with their intervals; ``clusters`` names the
    clusters' column (the settings, or the starts)."""
    out = [
        f"| difference | outcome | {clusters} | random-intercept μ [95%] | df | τ² | fixed effects [95%] | df |",
        "|---|---|---|---|---:|---:|---|---:|",
    ]
    for pair, entry in pooled.items():
        for measure, item in entry.items():
            mu, fixed = item["random_intercept"], item["fixed_effects"]
            out.append(
                f"| {pair.replace(' - ', ' − ')} | {labels[measure][0]} | {', '.join(item['settings']) or 'none'} "
                f"({item['n']} pairs) | {interval_text(mu)} | {mu.get('df', 'n/a')} | {fmt(mu.get('tau2'), 5)} | "
                f"{interval_text(fixed)} | {fixed.get('df', 'n/a')} |"
            )
    return out
