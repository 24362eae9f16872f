"""Calibrating the key-token threshold ``alpha`` against a null: documents whose distant context is
unrelated text (``corpus_chunks.null_documents``) should give few key tokens, since no token there can
gain from context beyond the short window.

The caller scores real and null documents with the same evaluator and chooses the positions to
compare (e.g. the kept tail of every row); the functions here take those as flat arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from longppl.rules.key_tokens import key_rule_mask
from longppl.settings import KeyTokenRule, require_finite


def key_token_count(lsd, lcl, alpha: float, beta: float, mask=None) -> int:
    """How many tokens are key by the library's rule (``LSD > alpha and LCL > beta``, strict; NaN is
    never key), among those where ``mask`` (bool, same shape) is True, or among all."""
    key = key_rule_mask(lsd, lcl, KeyTokenRule(alpha, beta))
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != bool or mask.shape != key.shape:
            raise ValueError(
                f"mask must be a bool array of the scores' shape {key.shape}, got dtype {mask.dtype}, shape {mask.shape}."
            )
        key &= mask
    return int(key.sum())


def calibrate_alpha(
    real_lsd,
    real_lcl,
    null_lsd,
    null_lcl,
    *,
    grid: Sequence[float],
    beta: float,
    max_null_ratio: float = 0.10,
    refuse: bool = True,
) -> dict:
    """The smallest ``alpha`` of ``grid`` at which the null documents' key tokens are at most
    ``max_null_ratio`` times the real documents' (and the real ones have some).

    Args:
        real_lsd, real_lcl: ``[m]`` LSD and LCL of the real documents' compared positions.
        null_lsd, null_lcl: ``[m']`` the same for the null documents.
    Returns:
        ``{"alpha": the chosen alpha, "beta", "max_null_ratio", "table": [{"alpha", "real", "null",
        "ratio"} per grid value, in ascending alpha]}`` (``ratio`` is ``null / real``, NaN where
        ``real == 0``). When no grid value qualifies and ``refuse`` is False: ``"alpha": None`` and
        ``"failed"``, the sentence the ValueError would say (an outcome a study records).
    Raises:
        ValueError: no grid value qualifies and ``refuse`` is True (naming the grid and the ratio), or
            an empty grid.
    """
    beta = require_finite("beta", beta)
    max_null_ratio = require_finite("max_null_ratio", max_null_ratio)
    alphas = sorted(require_finite("grid value", value) for value in grid)
    if not alphas:
        raise ValueError("grid is empty; give the alpha values to try, e.g. [0.5, 1, 1.5, 2].")
    table = []
    for alpha in alphas:
        real = key_token_count(real_lsd, real_lcl, alpha, beta)
        null = key_token_count(null_lsd, null_lcl, alpha, beta)
        table.append({"alpha": alpha, "real": real, "null": null, "ratio": null / real if real else float("nan")})
    chosen = next(
        (row["alpha"] for row in table if row["real"] > 0 and row["null"] <= max_null_ratio * row["real"]), None
    )
    found = {"alpha": chosen, "beta": beta, "max_null_ratio": max_null_ratio, "table": table}
    if chosen is None:
        found["failed"] = (
            f"No alpha of grid {alphas} keeps null key tokens within max_null_ratio={max_null_ratio} of the real "
            "ones (with some real key tokens); extend the grid or allow a larger ratio. Null / real key tokens by "
            "alpha: " + ", ".join(f"{row['alpha']:g}: {row['null']}/{row['real']}" for row in table) + "."
        )
        if refuse:
            raise ValueError(found["failed"])
    return found
