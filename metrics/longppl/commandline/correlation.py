"""Pearson and Spearman correlation, for LongPPL and PPL against benchmark scores (paper Fig. 1(b)).

Plain numpy: Spearman's rho is Pearson's r of the ranks, ties sharing their average rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pearson(x, y) -> float:
    """Pearson's r of two ``[n]`` sequences; NaN when one of them is constant or ``n < 2``."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"pearson needs two sequences of the same length, got shapes {x.shape} and {y.shape}.")
    if x.shape[0] < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    denominator = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denominator) if denominator > 0 else float("nan")


def average_ranks(values) -> np.ndarray:
    """``[n]`` ranks 1..n of ``values``; tied values all get the mean of the ranks they span."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    # A run of equal values spans ranks [first+1, last+1]; each member gets their mean.
    new_run = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]])
    run_id = np.cumsum(new_run) - 1
    first = np.flatnonzero(new_run)
    last = np.concatenate([first[1:], [values.shape[0]]]) - 1
    ranks = np.empty(values.shape[0], dtype=np.float64)
    ranks[order] = (first[run_id] + last[run_id]) / 2.0 + 1.0
    return ranks


def spearman(x, y) -> float:
    """Spearman's rho (Pearson's r of average ranks)."""
    return pearson(average_ranks(x), average_ranks(y))


def least_squares_line(x, y) -> tuple[float, float]:
    """``(slope, intercept)`` of the ordinary least-squares line ``y ~ slope * x + intercept`` of two
    ``[n]`` sequences; ``(nan, nan)`` when ``x`` is constant or ``n < 2`` (no line is defined)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"least_squares_line needs two sequences of the same length, got shapes {x.shape} and {y.shape}."
        )
    if x.shape[0] < 2:
        return float("nan"), float("nan")
    dx = x - x.mean()
    spread = (dx * dx).sum()
    if spread == 0:
        return float("nan"), float("nan")
    slope = float((dx * (y - y.mean())).sum() / spread)
    return slope, float(y.mean() - slope * x.mean())


def undefined_because(sides: dict[str, Sequence[float]], what: str = "models") -> str | None:
    """Why correlations between these sides (name -> one value per item) print as NaN: a side whose
    values are all equal has no spread to divide by. ``None`` when every side varies."""
    equal = [name for name, values in sides.items() if len(set(values)) == 1]
    if not equal:
        return None
    count = len(next(iter(sides.values())))
    return f"{' and '.join(equal)} take one value across all {count} {what}, so no correlation with them is defined"
