"""Two deliberate differences from the official code (docs/design.md), each pinned by a test:

- the first short window (``s = 0``) is the full context of its tokens, so their short score *is*
  the long one (LSD exactly 0); the official code re-runs that window and gets float noise, which
  with ``alpha=0`` makes extra key tokens;
- a key span that covers character 0 does not make the last token key: the official ``cal_overlap``
  appends ``i - 1`` for the first token (``-1``), which indexes the last position's loss.
"""

import math

import numpy as np
import pytest
import torch
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
