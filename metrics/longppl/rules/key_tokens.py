"""Key tokens from long- and short-context log-probabilities (paper Sec. 2.2, 3.1, Table 2).

All arrays are per evaluator token, index ``i`` as in ``logprobs``; NaN marks "no value" (``i = 0``
for ``lp_long``, ``i < K`` for ``lp_short``), and a NaN never makes a token key.

- LSD (long-short difference): ``lsd[i] = lp_long[i] - lp_short[i]``
- LCL (long-context likelihood): ``lcl[i] = lp_long[i]``
- hard rule: key iff ``lsd > alpha and lcl > beta`` (strict; the LCL test can be dropped for the
  paper's ablation)
- soft weight: ``min(exp(lsd), gamma)``, and ``unscored_weight(gamma) = min(1, gamma)`` where there
  is no short score
"""

from __future__ import annotations

import numpy as np

from ..settings import KeyTokenRule


def long_short_difference(lp_long: np.ndarray, lp_short: np.ndarray) -> np.ndarray:
    """``[n]`` LSD, NaN where either log-prob is missing."""
    return np.asarray(lp_long, dtype=np.float32) - np.asarray(lp_short, dtype=np.float32)


def key_token_mask(lp_long: np.ndarray, lp_short: np.ndarray, rule: KeyTokenRule = KeyTokenRule()) -> np.ndarray:
    """``[n]`` bool: ``LSD > rule.alpha`` and (if ``rule.use_lcl``) ``LCL > rule.beta``."""
    return key_rule_mask(long_short_difference(lp_long, lp_short), lp_long, rule)


def key_rule_mask(lsd: np.ndarray, lcl: np.ndarray, rule: KeyTokenRule = KeyTokenRule()) -> np.ndarray:
    """The hard rule on given LSD and LCL arrays (any shape, the same): ``lsd > rule.alpha`` and (if
    ``rule.use_lcl``) ``lcl > rule.beta``, strict; NaN is never key.

    ``rule`` was checked when it was built (a NaN threshold, which would silently make no token key,
    never gets this far).
    """
    with np.errstate(invalid="ignore"):
        mask = np.asarray(lsd, dtype=np.float32) > rule.alpha
        if rule.use_lcl:
            mask &= np.asarray(lcl, dtype=np.float32) > rule.beta
    return mask


def unscored_weight(gamma: float) -> float:
    """The soft weight of a token without a short-context score: ``min(1, gamma)``.

    Its LSD counts as 0 (the long context is all the context it has, or nothing scored it), so the
    formula ``min(exp(LSD), gamma)`` gives ``min(1, gamma)``, as the official LongCE loss does (its
    long/short ratio starts at 1 for every token and the cap is applied to all). The one definition
    of that weight: the metric's soft variant, LongCE's self-scored and cached weights, and the
    tokens that the character-level transfer leaves without an evaluator weight all take it.
    """
    return min(1.0, float(gamma))


def soft_weights(lp_long: np.ndarray, lp_short: np.ndarray, rule: KeyTokenRule = KeyTokenRule(soft=True)) -> np.ndarray:
    """``[n]`` float32 ``min(exp(LSD), rule.gamma)``; :func:`unscored_weight` (``min(1, gamma)``) for
    tokens without a short score (and ``i = 0``)."""
    gamma = rule.gamma
    lsd = long_short_difference(lp_long, lp_short)
    with np.errstate(over="ignore", invalid="ignore"):
        weights = np.minimum(np.exp(lsd), np.float32(gamma))
    return np.where(np.isnan(lsd), np.float32(unscored_weight(gamma)), weights).astype(np.float32)


def merge_adjacent_spans(spans: np.ndarray) -> np.ndarray:
    """Merge character spans that touch (``start[j+1] == end[j]``), keeping their order.

    Args:
        spans: ``[m, 2]`` int ``(start, end)`` spans in text order.
    Returns:
        ``[m', 2]`` merged spans. Like the official code, only exactly touching spans merge.
    """
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if spans.shape[0] == 0:
        return spans
    touches = spans[1:, 0] == spans[:-1, 1]
    keep_start = np.concatenate([[True], ~touches])
    keep_end = np.concatenate([~touches, [True]])
    return np.stack([spans[keep_start, 0], spans[keep_end, 1]], axis=1)


def key_char_spans(offsets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Merged character spans of the key tokens.

    Args:
        offsets: ``[n, 2]`` character span of each evaluator token in the text.
        mask: ``[n]`` bool key-token mask.
    Returns:
        ``[m, 2]`` int64 spans.
    """
    return merge_adjacent_spans(np.asarray(offsets, dtype=np.int64)[np.asarray(mask, dtype=bool)])
