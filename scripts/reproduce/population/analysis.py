"""The analysis of the second plan, from the evaluation records: a member's row, its exclusion, the
bootstrap statistics, the sensitivity grid and the verdict (the third plan builds on the same rows).
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

from longppl.commandline.running import command_line

from ..common.config import Population
from ..common.run_folder import finite

# a number of the answer's shape: five digits (NUMBER_RANGE of ``lines``), not part of a longer run
_ANSWER_SHAPE = re.compile(r"(?<!\d)\d{5}(?!\d)")


def no_answer_shape_share(record: dict) -> float:
    """The share of a member's lines outputs (every length of ``record["lines"]``) that hold no
    number of the answer's shape."""
    outputs = [o for found in record["lines"].values() for o in found["outputs"]]
    return sum(not _ANSWER_SHAPE.search(o) for o in outputs) / len(outputs)


def member_row(member, record: dict, analysis) -> dict:
    """A member's row of the results table."""
    primary = record["longppl"]["primary"]
    per_length = {n: v["accuracy"] for n, v in record["lines"].items()}
    outputs = sum(v["total"] for v in record["lines"].values())
    row = {
        "member": member.name,
        "method": member.extension.method,
        "extension": member.extension.name,
        "configuration": member.configuration,
        "control": member.extension.control,
        "factor": member.extension.factor,
        "rope_theta": member.extension.rope_theta,
        "steps": member.steps,
        "seed": member.seed,
        "acc512": record["acc512"]["accuracy"],
        "accuracy": per_length,
        # exact fractions, rounded once: members with equal counts tie exactly (a float sum's last bit
        # depends on the order of the lengths, and Spearman's average ranks see the difference)
        "primary_accuracy": float(
            sum(Fraction(v["correct"], v["total"]) for v in record["lines"].values()) / len(record["lines"])
        ),
        "no_number_share": sum(v["no_number"] for v in record["lines"].values()) / outputs,
        "no_answer_shape_share": no_answer_shape_share(record),
        "needle": record["needle"]["accuracy"],
        "two_hop": record["two_hop"]["accuracy"] if "two_hop" in record else None,
        "log_likelihood": {n: float(sum(v) / len(v)) for n, v in record["log_likelihood"].items()},
        "mean_log_likelihood": float(
            sum(sum(v) for v in record["log_likelihood"].values())
            / sum(len(v) for v in record["log_likelihood"].values())
        ),
        "ppl": primary["ppl"],
        "longppl": primary["longppl"],
        "longppl_secondary": record["longppl"]["secondary"]["longppl"],
        "soft_longppl": record["longppl"]["soft"]["longppl"],
        "key_tokens": primary["key_tokens"],
        "sensitivity": {k: v["longppl"] for k, v in record["longppl"].items() if k.startswith("alpha=")},
        **{
            f"longppl:{k[len('primary:') :]}": v["longppl"]
            for k, v in record["longppl"].items()
            if k.startswith("primary:")
        },
        "intervals": {
            "ppl": document_interval(primary["documents"]["nll"], primary["documents"]["tokens"], analysis),
            "longppl": document_interval(primary["documents"]["key_nll"], primary["documents"]["key_tokens"], analysis),
        },
        "seconds": record["seconds"],
    }
    return row


def document_interval(nll, counts, analysis) -> dict:
    """A percentile bootstrap interval over documents of the corpus perplexity
    ``exp(sum nll / sum counts)`` (documents resampled with replacement; ``nll[i]`` and ``counts[i]``
    are document ``i``'s summed negative log-likelihood and token count, or key-token weight)."""
    import numpy as np

    nll, counts = np.asarray(nll, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    rng = np.random.default_rng(analysis.seed)
    picks = rng.integers(0, nll.shape[0], size=(analysis.resamples, nll.shape[0]))
    totals = counts[picks].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = np.exp(nll[picks].sum(axis=1) / totals)[totals > 0]
    value = math.exp(nll.sum() / counts.sum()) if counts.sum() > 0 else float("nan")
    tail = (1 - analysis.level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail]) if samples.size else (float("nan"), float("nan"))
    return {"value": value, "low": float(low), "high": float(high), "level": analysis.level}


def exclusion(row: dict, base_acc512: float, analysis) -> str | None:
    """Why ``row`` is left out of the analysis (the plan's rules), or ``None``."""
    if row["acc512"] < analysis.min_acc512_ratio * base_acc512:
        return (
            f"accuracy at 512 tokens {row['acc512']:.3f} is below {analysis.min_acc512_ratio:g} of the base's "
            f"{base_acc512:.3f}"
        )
    if row["no_number_share"] > analysis.max_no_number_share:
        return f"{row['no_number_share']:.0%} of its lines outputs hold no number"
    return None


def statistics_of(
    rows: list[dict], analysis, measure: str = "longppl", benchmark: str = "primary_accuracy", share: bool = True
) -> dict:
    """The plan's statistics over ``rows``: correlations of ``measure`` (LongPPL) and PPL with
    ``benchmark`` (bootstrap intervals, over members and clustered by extension method), their
    paired difference, Williams' t, the partial correlation given acc512, and the inconclusive flag
    with its reasons: fewer than ``analysis.min_members`` members, or (for a benchmark that is a
    ``share`` in [0, 1], i.e. an accuracy) more than ``analysis.inconclusive_share`` of them at its
    floor or ceiling. A log-likelihood has neither, so ``share=False`` leaves that count out
    (``at_floor_or_ceiling`` is ``None``)."""
    from ..common import statistics

    usable = [r for r in rows if finite(r[measure]) and finite(r["ppl"]) and finite(r[benchmark])]
    if len(usable) < 3:
        return {
            "members": [r["member"] for r in usable],
            "skipped": f"{len(usable)} members with a finite {measure}, PPL and {benchmark}; 3 are needed",
            "inconclusive": True,
        }
    longppl = [r[measure] for r in usable]
    ppl = [r["ppl"] for r in usable]
    accuracy = [r[benchmark] for r in usable]
    clusters = [r["method"] for r in usable]
    common = analysis.bootstrap
    found = {"members": [r["member"] for r in usable], "n": len(usable)}
    for method in ("pearson", "spearman"):
        found[method] = {
            "longppl": statistics.bootstrap_correlation(longppl, accuracy, method, **common),
            "ppl": statistics.bootstrap_correlation(ppl, accuracy, method, **common),
            "difference": statistics.paired_bootstrap_difference(longppl, ppl, accuracy, method, **common),
            "longppl_by_method": statistics.bootstrap_correlation(
                longppl, accuracy, method, clusters=clusters, **common
            ),
            "ppl_by_method": statistics.bootstrap_correlation(ppl, accuracy, method, clusters=clusters, **common),
            "difference_by_method": statistics.paired_bootstrap_difference(
                longppl, ppl, accuracy, method, clusters=clusters, **common
            ),
        }
    r_ay, r_by = found["pearson"]["longppl"]["value"], found["pearson"]["ppl"]["value"]
    r_ab = statistics.correlation(longppl, ppl)
    if not all(finite(r) for r in (r_ay, r_by, r_ab)):  # a side without variance (e.g. every accuracy 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "a correlation is undefined"}
    elif abs(r_ab) >= 1 - 1e-12:  # the two measures rank alike: nothing to compare (the test divides by 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "|r(LongPPL, PPL)| = 1"}
    else:
        found["williams_t"] = statistics.williams_t(r_ay, r_by, r_ab, len(usable))
    found["partial_given_acc512"] = statistics.bootstrap_partial_correlation(
        longppl, accuracy, [r["acc512"] for r in usable], **common
    )
    reasons = []
    if len(usable) < analysis.min_members:
        reasons.append(f"{len(usable)} members analysed, fewer than the {analysis.min_members} the plan needs")
    extreme = int(sum(a <= analysis.floor or a >= analysis.ceiling for a in accuracy)) if share else None
    if share and extreme > analysis.inconclusive_share * len(usable):
        reasons.append(
            f"{extreme} of {len(usable)} members at <= {analysis.floor} or >= {analysis.ceiling}, "
            f"more than {analysis.inconclusive_share:.0%}"
        )
    found.update(inconclusive=bool(reasons), inconclusive_reasons=reasons, at_floor_or_ceiling=extreme)
    return found


def sensitivity_statistics(rows: list[dict], analysis, benchmark: str = "primary_accuracy") -> dict:
    """Pearson and Spearman correlations (bootstrap intervals over members) of every other
    measure in the rows with ``benchmark``: LongPPL at each (alpha, beta) of the sensitivity grid,
    with the secondary window, the soft (LongCE-weighted) LongPPL, and PPL for reference.

    Returns ``{measure: {"pearson": ..., "spearman": ...}}`` (``statistics.bootstrap_correlation``
    records); a measure some row lacks or holds as non-finite is left out."""
    from ..common import statistics

    measures = {
        f"LongPPL {k}": [r["sensitivity"].get(k) for r in rows] for k in (rows[0]["sensitivity"] if rows else ())
    }
    measures.update(
        {
            "LongPPL, secondary window": [r["longppl_secondary"] for r in rows],
            "soft LongPPL": [r["soft_longppl"] for r in rows],
            "PPL": [r["ppl"] for r in rows],
        }
    )
    accuracy = [r[benchmark] for r in rows]
    common = analysis.bootstrap
    return {
        name: {
            method: statistics.bootstrap_correlation(values, accuracy, method, **common)
            for method in ("pearson", "spearman")
        }
        for name, values in measures.items()
        if len(rows) >= 3 and all(finite(v) for v in values)
    }


def verdict(found: dict, analysis) -> dict:
    """The plan's outcome for the primary statistics ``found`` (:func:`statistics_of`):
    ``"inconclusive"`` by its rules; ``"reproduced"`` when LongPPL's Pearson r with the accuracy is at
    most ``analysis.success_max_r``, the upper end of its interval below ``analysis.success_max_high``
    and the whole interval of r(LongPPL) - r(PPL) below 0; else ``"not reproduced"``. Each condition
    is returned with whether it holds, so the report shows why."""
    if "skipped" in found:
        return {"outcome": "inconclusive", "conditions": [], "reasons": [found["skipped"]]}
    r, difference = found["pearson"]["longppl"], found["pearson"]["difference"]
    conditions = [
        (
            f"Pearson r(LongPPL, accuracy) {r['value']:.3f} <= {analysis.success_max_r}",
            r["value"] <= analysis.success_max_r,
        ),
        (
            f"its {analysis.level:.0%} upper bound {r['high']:.3f} < {analysis.success_max_high}",
            r["high"] < analysis.success_max_high,
        ),
        (f"r(LongPPL) - r(PPL): interval's upper bound {difference['high']:.3f} < 0", difference["high"] < 0),
    ]
    if found["inconclusive"]:
        outcome = "inconclusive"
    else:
        outcome = "reproduced" if all(held for _, held in conditions) else "not reproduced"
    return {
        "outcome": outcome,
        "conditions": [{"condition": text, "holds": bool(held)} for text, held in conditions],
        "reasons": found["inconclusive_reasons"],
    }


def results_header(config: Population) -> dict:
    """What every ``results.json`` starts with: the command line, the config and every seed."""
    return {
        "command": command_line("longppl-reproduce"),
        "config": dataclasses.asdict(config),
        "seeds": {
            "run": config.seed,
            config.base.name: config.base.seed,
            **{e.name: e.seed for e in config.evaluators if e.enabled},
            **{m.name: m.seed for m in config.members()},
        },
    }


def with_wilson_intervals(record: dict, level: float) -> dict:
    """The answer-token record with Wilson intervals of each rule's recall (over the answer tokens)
    and specificity (over the others), from the counts behind them."""
    from ..common.statistics import wilson_interval

    for found in record["by_alpha"].values():
        for rule in ("lsd", "lsd+lcl"):
            for rate, total in (("recall", found["n_answer"]), ("specificity", found["n_other"])):
                value = found[rule][rate]
                if total and finite(value):
                    found[rule][f"{rate}_interval"] = wilson_interval(round(value * total), total, level)
    return record


def without_outputs(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "outputs"}
