"""The statistics of a claim that LongPPL tracks long-context ability, shared by the experiments that
test it (the third attempt's population, the real models): exclusion by format, the composite
outcome, Spearman and Pearson with cluster bootstraps (overall and within a level), the
random-intercept model, and the plans' decision rule (:func:`decide`)."""

from __future__ import annotations

import math

from .run_folder import finite


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
    from . import statistics

    usable = [r for r in rows if finite(r.get(measure)) and finite(r["ppl"]) and finite(r.get(outcome))]
    clusters = [r["cluster"] for r in usable]
    found = {"n": len(usable), "clusters": len(set(clusters)), "members": [r["member"] for r in usable]}
    if len(usable) < 4 or len(set(clusters)) < 2:
        found["skipped"] = f"{len(usable)} members in {len(set(clusters))} clusters; 4 in 2 are needed"
        return found
    a, b, y = [r[measure] for r in usable], [r["ppl"] for r in usable], [r[outcome] for r in usable]
    if len(set(y)) == 1:  # no ordering to correlate with: say so instead of an undefined coefficient
        found["skipped"] = f"the outcome is {y[0]:.4g} for every one of the {len(usable)} members"
        return found
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


def mixed_models(rows: list[dict], measure: str, outcome: str, analysis, covariate: str = "acc512") -> dict:
    """The random-intercept models (clusters: ``row["cluster"]``) of ``outcome`` on the standardised
    log of ``measure`` and, apart, of PPL (``row["ppl"]``), each with ``row[covariate]`` (the third
    attempt's accuracy at 512; the real models' within-K lines accuracy) as a covariate:
    ``outcome = b0 + b1 z(log measure) + c covariate + u_cluster + e``; slopes ``b1`` with
    cluster-bootstrap intervals (``analysis.mixed_model_resamples``, ``.seed``, ``.level``)."""
    import numpy as np

    from . import statistics

    usable = [
        r
        for r in rows
        if finite(r.get(measure)) and finite(r["ppl"]) and finite(r.get(outcome)) and finite(r.get(covariate))
    ]
    if len(usable) < 6 or len({r["cluster"] for r in usable}) < 3:
        return {"skipped": f"{len(usable)} members; 6 in 3 clusters are needed"}
    y = [r[outcome] for r in usable]
    clusters = [r["cluster"] for r in usable]
    values = [r[covariate] for r in usable]
    # a constant covariate would make the design singular (and says nothing): left out, and named
    chosen = values if len(set(values)) > 1 else None
    found = {"covariates": [covariate] if chosen else [], "n": len(usable), "clusters": len(set(clusters))}
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
            covariates=chosen,
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
    conditions = [{"rule": "positive", "condition": t, "holds": bool(h)} for t, h in positive]
    conditions += [{"rule": "negative", "condition": t, "holds": bool(h)} for t, h in negative]
    return {"outcome": outcome_of(conditions, reasons), "conditions": conditions, "reasons": reasons}


def outcome_of(conditions: list[dict], reasons: list[str]) -> str:
    """The rule's outcome from its conditions (``{"rule": "positive" | "negative", "holds"}``):
    *inconclusive* when there is any reason to be; else *positive* when every positive condition
    holds; else *negative* when any negative one does; else *inconclusive*."""
    if reasons:
        return "inconclusive"
    if all(c["holds"] for c in conditions if c["rule"] == "positive"):
        return "positive"
    if any(c["holds"] for c in conditions if c["rule"] == "negative"):
        return "negative"
    return "inconclusive"
