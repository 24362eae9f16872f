"""Plain, independent references for the tests: the official LongPPL algorithm written out token by
token with full float32 logits, one window per forward (no code from the package under test)."""

from __future__ import annotations

import math

import torch


def full_log_probs(model, ids):
    """[n, V] float32 log-softmax of one unpadded sequence (row j predicts token j+1)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def evaluator_scores(evaluator, tokenizer, text, K, d, add_special_tokens=True):
    """(ids, offsets, lp_long, lp_short) lists for one text, the official way."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
    n = len(ids)
    full = full_log_probs(evaluator, ids)
    lp_long = [math.nan] + [float(full[i - 1, ids[i]]) for i in range(1, n)]
    lp_short = [math.nan] * n
    for start in range(0, n - K, d):
        width = d if start + K + d <= n else n - start - K
        short = full_log_probs(evaluator, ids[start : start + K + width])
        for j in range(width):
            lp_short[start + K + j] = float(short[K + j - 1, ids[start + K + j]])
    return ids, offsets, lp_long, lp_short


def merge(spans):
    merged = []
    for a, b in spans:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return merged


def official_overlap(offsets, slices):
    """Official cal_overlap (two pointers), returning model token indices (no i-1 shift)."""
    out, i, j = [], 0, 0
    while i < len(offsets) and j < len(slices):
        (a0, a1), (b0, b1) = offsets[i], slices[j]
        if a0 >= b0 and a1 <= b1:
            out.append(i)
            i += 1
        elif a0 < b0:
            i += 1
        else:
            j += 1
    return out


def longppl_document(
    text, model, tokenizer, evaluator, evaluator_tokenizer, K, d, alpha, beta, use_lcl=True, scores=None
):
    """Per-document dict: longppl, n_key, ppl, n_tokens, key_nll (sum), nll (sum), n_pred, and
    key_spans (the merged character spans of the model's key tokens). ``scores``: the evaluator's
    :func:`evaluator_scores` of ``text`` when computed already (several rules on one text)."""
    ids, offsets, lp_long, lp_short = scores or evaluator_scores(evaluator, evaluator_tokenizer, text, K, d)
    key = [
        i
        for i in range(len(ids))
        if not math.isnan(lp_short[i]) and (lp_long[i] - lp_short[i]) > alpha and (not use_lcl or lp_long[i] > beta)
    ]
    slices = merge([list(offsets[i]) for i in key])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    m_ids, m_offsets = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
    full = full_log_probs(model, m_ids)
    nll = [-float(full[i - 1, m_ids[i]]) for i in range(1, len(m_ids))]
    key_model = [i for i in official_overlap(m_offsets, slices) if i >= 1]
    key_nll = [nll[i - 1] for i in key_model]
    return {
        "longppl": math.exp(sum(key_nll) / len(key_nll)) if key_nll else math.nan,
        "n_key": len(key_nll),
        "ppl": math.exp(sum(nll) / len(nll)),
        "n_tokens": len(m_ids),
        "key_nll": sum(key_nll),
        "nll": sum(nll),
        "n_pred": len(nll),
        "key_spans": merge([list(m_offsets[i]) for i in key_model]),
    }
