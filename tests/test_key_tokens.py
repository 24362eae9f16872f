"""LSD / LCL / hard rule / soft weights / span merging against plain per-token references."""

import math

import numpy as np
import pytest

from longppl.core.scoring import text_key_weights
from longppl.rules.key_tokens import (
    key_char_spans,
    key_token_mask,
    long_short_difference,
    merge_adjacent_spans,
    soft_weights,
)
from longppl.settings import KeyTokenRule

NAN = float("nan")


@pytest.fixture
def scores():
    rng = np.random.default_rng(0)
    n = 300
    lp_long = rng.uniform(-6, 0, n).astype(np.float32)
    lp_short = rng.uniform(-9, 0, n).astype(np.float32)
    lp_long[0] = NAN
    lp_short[:40] = NAN  # K = 40
    # exact threshold cases: strict inequalities must exclude them
    lp_long[50], lp_short[50] = -1.0, -3.0  # LSD == 2
    lp_long[51], lp_short[51] = -2.0, -5.0  # LCL == -2
    return lp_long, lp_short


def test_hard_rule_matches_plain_loop(scores):
    lp_long, lp_short = scores
    for alpha, beta, use_lcl in [(2.0, -2.0, True), (1.0, -1.0, True), (0.5, -2.0, False), (-0.5, -10.0, True)]:
        expected = []
        for lo, sh in zip(lp_long.tolist(), lp_short.tolist()):
            if math.isnan(lo) or math.isnan(sh):
                expected.append(False)
                continue
            lsd = np.float32(lo) - np.float32(sh)
            expected.append(bool(lsd > alpha and (not use_lcl or lo > beta)))
        got = key_token_mask(lp_long, lp_short, KeyTokenRule(alpha, beta, use_lcl))
        assert got.tolist() == expected
    strict = key_token_mask(lp_long, lp_short, KeyTokenRule(2.0, -2.0))
    assert not strict[50] and not strict[51] and not strict[:40].any()


def test_lsd_and_soft_weights(scores):
    lp_long, lp_short = scores
    lsd = long_short_difference(lp_long, lp_short)
    weights = soft_weights(lp_long, lp_short, KeyTokenRule(soft=True, gamma=5.0))
    for i in range(len(lp_long)):
        if math.isnan(lp_short[i]) or math.isnan(lp_long[i]):
            assert math.isnan(lsd[i]) and weights[i] == 1.0
        else:
            assert lsd[i] == pytest.approx(lp_long[i] - lp_short[i], abs=1e-6)
            assert weights[i] == pytest.approx(min(math.exp(lp_long[i] - lp_short[i]), 5.0), rel=1e-5)
    assert weights.max() == pytest.approx(5.0) and weights.min() < 1.0


def test_merge_adjacent_spans():
    spans = np.array([[0, 3], [3, 5], [6, 8], [8, 9], [9, 12], [14, 15], [15, 15], [20, 22]])
    assert merge_adjacent_spans(spans).tolist() == [[0, 5], [6, 12], [14, 15], [20, 22]]
    assert merge_adjacent_spans(np.zeros((0, 2))).shape == (0, 2)
    # byte pieces of one character share a span; like the official code they do not merge
    assert merge_adjacent_spans(np.array([[4, 5], [4, 5], [5, 7]])).tolist() == [[4, 5], [4, 7]]


def test_key_char_spans():
    offsets = np.array([[0, 0], [0, 2], [2, 5], [6, 9], [9, 10], [11, 14]])
    mask = np.array([False, False, True, True, True, False])
    assert key_char_spans(offsets, mask).tolist() == [[2, 5], [6, 10]]


def test_bad_rules_are_refused_at_the_edges_not_silently_keyless():
    """The rule is checked once, where it is built: ``KeyTokenRule`` and the public functions that take
    its values one by one (``text_key_weights``); the inner functions take the checked rule."""
    with pytest.raises(ValueError, match="alpha must be a finite number, got nan"):
        KeyTokenRule(alpha=NAN)
    with pytest.raises(ValueError, match="beta must be a finite number, got nan"):
        text_key_weights([], [], [], 2.0, NAN)
    with pytest.raises(ValueError, match="gamma must be > 0"):
        text_key_weights([], [], [], soft=True, gamma=0.0)
    with pytest.raises(ValueError, match=r"gamma must be a finite number > 0 .* got inf"):
        KeyTokenRule(soft=True, gamma=math.inf)


def test_a_rule_and_its_values_together_are_refused():
    with pytest.raises(ValueError, match=r"Got both a KeyTokenRule and alpha: pass the settings object alone"):
        text_key_weights([], [], [], alpha=1.0, rule=KeyTokenRule())
    with pytest.raises(ValueError, match=r"settings must be a KeyTokenRule, got \(2.0, -2.0\)"):
        text_key_weights([], [], [], rule=(2.0, -2.0))
