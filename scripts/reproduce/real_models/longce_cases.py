"""The exploratory case-resampled interval of "LongCE from a real start" (docs/reproduction.md, the
study's deviations: "One exploratory interval more"). It decides nothing.

The plan's t intervals vary the seed, which is the data order only: every run of a start answers
the same task cases (each task set is built once, its seed its length). Here the cases are drawn
again instead: each resample draws each length's cases with replacement, the same draw for every
run of the start, so that the paired differences stay paired, and recomputes the plan's statistic,
the mean over seeds of ``arm - baseline`` on the primary outcome at the last checkpoint (each run's
outcome the mean over lengths of its mean over that length's cases).

Pure: records in, numbers out.
"""

from __future__ import annotations

import numpy as np

from ..common.run_folder import finite
from ..common.statistics import percentile_summary

#: Resamples and the generator's seed (the LongPPL study's too).
RESAMPLES = 10000
SEED = 0


def per_case(record: dict, prefix: str) -> dict[int, np.ndarray]:
    """``{length: per-case scores}`` of a ``longce_evaluate`` record's task sets named
    ``<prefix>-<length>`` (booleans as 0/1, passage recall's fractions as they are). Raises
    ``ValueError`` when a set has no ``per_case`` list or none is named so."""
    found = {}
    for name, task in record.get("tasks", {}).items():
        head, _, length = name.rpartition("-")
        if head != prefix or not length.isdigit():
            continue
        cases = task.get("per_case")
        if not isinstance(cases, list) or not cases:
            raise ValueError(f"{record.get('key')}: task set {name} has no per-case answers")
        found[int(length)] = np.asarray(cases, dtype=np.float64)
    if not found:
        raise ValueError(f"{record.get('key')}: no task set named {prefix}-<length>")
    return found


def _draws(sizes: dict[int, int], resamples: int, seed: int) -> dict[int, np.ndarray]:
    """Per length, ascending, ``rng.integers(n, size=(resamples, n))`` from one generator."""
    rng = np.random.default_rng(seed)
    return {length: rng.integers(n, size=(resamples, n)) for length, n in sorted(sizes.items())}


def case_resampled(
    evaluated: dict,
    runs: list[dict],
    prefix: str,
    step: int,
    pairs,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    level: float = 0.95,
) -> dict:
    """Each pair's mean over seeds of the paired differences, with the percentile interval over
    resampled cases.

    Args:
        evaluated: ``{key: longce_evaluate row}`` (keys ``<start>/<arm>-s<seed>/<step>``).
        runs: one start's rows (``start_rows``' ``runs``: ``run``, ``method``, ``seed``, ``void``);
            void runs are left out, as the plan leaves them out of the accuracy comparisons.
        prefix: the primary outcome's task-set prefix (``recall``, ``lines-beyond``).
        step: the checkpoint (the primary one).
        pairs: ``(arm, baseline)`` pairs.

    Returns:
        ``{"a - b": {"value", "low", "high", "resamples", "dropped", "level", "seeds"}}``
        (``statistics.percentile_summary``'s, with the seeds), or
        ``{"a - b": {"skipped": why}}`` for a pair with fewer than one seed in both arms or without
        per-case answers. Draws: per length in ascending order, ``integers(n, size=(resamples, n))``
        of ``numpy.random.default_rng(seed)``, shared by every run and pair.
    """
    cases, problems = {}, {}
    for row in runs:
        if row.get("void"):
            continue
        record = evaluated.get(f"{row['run']}/{step}")
        try:
            if record is None:
                raise ValueError(f"{row['run']} has no evaluation at step {step}")
            cases[row["method"], row["seed"]] = per_case(record, prefix)
        except ValueError as error:
            problems[row["method"], row["seed"]] = str(error)
    sizes: dict[int, int] = {}
    for (arm, s), found in cases.items():
        if sizes and set(found) != set(sizes):
            raise ValueError(
                f"{arm} seed {s}: {prefix} task sets at lengths {sorted(found)} where other runs have "
                f"{sorted(sizes)}; every run of a start must answer the same task sets."
            )
        for length, values in found.items():
            if sizes.setdefault(length, values.size) != values.size:
                raise ValueError(
                    f"{arm} seed {s}: {prefix}-{length} has {values.size} cases where other runs have "
                    f"{sizes[length]}; every run of a start must answer the same task sets."
                )
    draws = _draws(sizes, resamples, seed) if sizes else {}
    # each run's outcome in every resample: the mean over lengths of its drawn cases' mean
    resampled = {
        run: np.mean([found[length][draws[length]].mean(axis=1) for length in sorted(sizes)], axis=0)
        for run, found in cases.items()
    }
    observed = {run: float(np.mean([v.mean() for v in found.values()])) for run, found in cases.items()}
    out = {}
    for a, b in pairs:
        name = f"{a} - {b}"
        seeds = sorted(s for (arm, s) in resampled if arm == a and (b, s) in resampled)
        if not seeds:
            why = [problems[k] for k in problems if k[0] in (a, b)] or ["no seed with both arms' per-case answers"]
            out[name] = {"skipped": why[0]}
            continue
        samples = np.mean([resampled[a, s] - resampled[b, s] for s in seeds], axis=0)
        value = float(np.mean([observed[a, s] - observed[b, s] for s in seeds]))
        out[name] = {**percentile_summary(value, samples, level), "seeds": seeds}
    return out


def holds_under_both(t_interval: dict | None, cases: dict | None) -> bool | None:
    """Whether the t interval (``{"low", "high"}``) and the case-resampled interval both exclude 0
    on the same side; ``None`` when either is missing."""
    if not t_interval or not cases or "skipped" in cases:
        return None
    bounds = (t_interval.get("low"), t_interval.get("high"), cases["low"], cases["high"])
    if not all(finite(x) for x in bounds):
        return None
    t_low, t_high, c_low, c_high = bounds
    return bool((t_low > 0 and c_low > 0) or (t_high < 0 and c_high < 0))
