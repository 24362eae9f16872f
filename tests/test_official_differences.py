"""Deliberate differences from the official code (docs/design.md), each pinned by a test, and the
LongCE weight of a token without a short score, which follows the official loss:

- the first short window (``s = 0``) is the full context of its tokens, so their short score *is*
  the long one (LSD exactly 0); the official code re-runs that window and gets float noise, which
  with ``alpha=0`` makes extra key tokens;
- a key span that covers character 0 does not make the last token key: the official ``cal_overlap``
  appends ``i - 1`` for the first token (``-1``), which indexes the last position's loss;
- a trailing zero-width token (WordPiece's ``[SEP]``) is key when a key span starts at character 0,
  and weighs ``min(1, gamma)`` in the soft variant;
- every path (self-scored LongCE, cached weights, the soft metric) weighs a token without a short
  score ``min(1, gamma)``, as the official LongCE loss does, at ``gamma`` below and above 1.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model
from reference import evaluator_scores, full_log_probs

from longppl import compute_longppl
from longppl.core.scoring import score_with_evaluator
from longppl.settings import KeyTokenRule, KeyTokenSettings

K, D = 40, 16


@pytest.fixture(scope="module")
def evaluator():
    tok = byte_level_bpe()
    return tiny_model("llama", len(tok), seed=11), tok


def test_the_first_window_reuses_the_long_pass(evaluator):
    model, tok = evaluator
    text = govreport_texts()[2][:900]
    [scores] = score_with_evaluator(model, tok, [text], KeyTokenSettings(K, D), per_document=True, progress=False)
    n = scores.input_ids.shape[0]
    assert n > K + D
    first = slice(K, K + D)  # the tokens scored by the window s = 0
    assert np.array_equal(scores.lp_short[first], scores.lp_long[first])  # bit for bit: LSD == 0
    lsd = scores.lp_long - scores.lp_short
    assert not scores.key_mask(KeyTokenRule(alpha=0.0, beta=-1e9))[first].any()  # LSD > 0 is never true there
    # later windows are real short contexts: their LSDs are not all zero
    assert np.any(lsd[K + D :] != 0)
    # The official way (one forward per window, the first one too) agrees up to float noise only.
    _, _, lp_long, lp_short = evaluator_scores(model, tok, text, K, D)
    assert np.allclose(np.array(lp_short[K : K + D]), np.array(lp_long[K : K + D]), atol=1e-4)


def official_cal_overlap(offsets, slices):
    """The official ``cal_overlap``, as published: positions ``i - 1`` of the shifted losses."""
    key, i, j = [], 0, 0
    while i < len(offsets) and j < len(slices):
        (a0, a1), (b0, b1) = offsets[i], slices[j]
        if a0 >= b0 and a1 <= b1:
            key.append(i - 1)
            i += 1
        elif a0 < b0:
            i += 1
        else:
            j += 1
    return key


def test_a_key_span_at_character_0_does_not_wrap_to_the_last_token(tmp_path):
    tok = metaspace_bpe()
    model = tiny_model("mistral", len(tok), seed=12)
    text = govreport_texts()[4][:700]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
    span_end = offsets[4][1]  # the first five tokens, from character 0
    spans = tmp_path / "slice_0.txt"
    spans.write_text(f"[0, {span_end}]", encoding="utf-8")

    out = compute_longppl(text, model, None, tok, None, save_path=str(spans))

    nll = -full_log_probs(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # nll[i]: token i+1
    official = official_cal_overlap(offsets, [[0, span_end]])
    assert official[0] == -1  # token 0 lies in the span: the official code appends -1 ...
    official_nll = [float(nll[i]) for i in official]  # ... and nll[-1] is the last token's loss
    ours = [i for i in official if i >= 0]
    assert out["n_key_token"] == len(ours) == len(official) - 1 == 4
    assert out["longppl"] == pytest.approx(math.exp(sum(float(nll[i]) for i in ours) / len(ours)), rel=1e-5)
    assert out["longppl"] != pytest.approx(math.exp(sum(official_nll) / len(official_nll)), rel=1e-5)


# --------------------------------------------------------------------------- tokens without a short score


def official_loss_weight(model, ids, trunc_len, internal, thre):
    """The official LongCE ``loss_weight``, written out: the long/short ratio starts at 1 for every
    token, each window (the first one too) is run on its own and sets ``exp(short_nll - long_nll)``
    for its tokens, then the cap applies to all. Returns ``(weights, nll)``, ``[n - 1]`` each: the
    weight and NLL of predicting token ``i + 1`` from position ``i``."""
    ids = torch.tensor([ids])
    n = ids.shape[1]
    with torch.no_grad():
        nll = F.cross_entropy(model(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
        ratio = torch.ones(n)
        for start in range(0, n - trunc_len, internal):
            if start + trunc_len + internal > n:
                internal = n - start - trunc_len
            short = ids[:, start : start + trunc_len + internal]
            logits = model(input_ids=short).logits[0, trunc_len - 1 : trunc_len + internal - 1].float()
            short_nll = F.cross_entropy(logits, short[0, trunc_len:], reduction="none")
            long_nll = nll[start + trunc_len - 1 : start + trunc_len + internal - 1]
            ratio[start + trunc_len : start + trunc_len + internal] = torch.exp(short_nll - long_nll)
    return ratio[1:].clamp(max=thre), nll


def longce_args(gamma, **overrides):
    from helpers import one_step_args

    from longce import LongCEConfig

    return one_step_args(LongCEConfig, longce_trunc_len=K, longce_sliding_window=D, longce_gamma=gamma, **overrides)


@pytest.mark.parametrize("gamma", [0.5, 0.97, 1.02, 5.0])
def test_every_path_weighs_tokens_without_a_short_score_as_the_official_loss(evaluator, gamma, tmp_path):
    """Tokens before K and in the first window weigh min(1, gamma) in self-scored LongCE, in the cached
    weights and in the soft metric: all equal the official loss_weight, at gamma below and above 1."""
    from datasets import Dataset

    from longce import LongCETrainer, add_key_token_weights
    from longce.cached_weights import LongCEWeightsCollator
    from longppl.core.scoring import model_key_weights

    model, tok = evaluator
    text = govreport_texts()[3][:600]
    ids = tok(text)["input_ids"]
    assert len(ids) > K + 2 * D
    weights, nll = official_loss_weight(model, ids, K, D, gamma)
    official = (weights * nll).mean()
    assert (weights[: K - 1] == min(1.0, gamma)).all()  # tokens 1 .. K-1: the ratio's start, capped
    if gamma > 0.95:  # this model's ratios lie in [0.95, 1.04]: the later windows' are real ratios
        assert (weights[K + D - 1 :] < min(1.0, gamma)).any()

    # soft metric (the evaluated model's tokens are the evaluator's)
    [scores] = score_with_evaluator(model, tok, [text], KeyTokenSettings(K, D), per_document=True, progress=False)
    rule = KeyTokenRule(soft=True, gamma=gamma)
    soft = model_key_weights(scores, scores.offsets, len(text), rule, model_ids=scores.input_ids)
    torch.testing.assert_close(torch.tensor(soft[1:], dtype=torch.float32), weights, atol=1e-4, rtol=1e-4)

    # cached weights, scored by the same model
    dataset = add_key_token_weights(
        Dataset.from_dict({"text": [text]}),
        str(tmp_path / "cache"),
        tok,
        gamma=gamma,
        evaluator_model=model,
        evaluator_tokenizer=tok,
        trunc_len=K,
        sliding_window=D,
    )
    [row] = dataset
    assert row["input_ids"] == ids
    column = torch.tensor(row["longce_weights"][1:], dtype=torch.float32)
    torch.testing.assert_close(column, weights, atol=1e-4, rtol=1e-4)

    # the trainer's loss, self-scored and from the cached weights
    batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
    model.train()
    try:
        with torch.no_grad():
            self_scored = LongCETrainer(model=model, args=longce_args(gamma)).compute_loss(model, batch)
            cached_trainer = LongCETrainer(model=model, args=longce_args(gamma, longce_weights="cache"))
            cached = cached_trainer.compute_loss(
                model, LongCEWeightsCollator()([{key: row[key] for key in ("input_ids", "longce_weights")}])
            )
    finally:
        model.eval()
    torch.testing.assert_close(self_scored, official, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cached, official, atol=1e-5, rtol=1e-4)
