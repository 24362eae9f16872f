"""Known answer: a tiny model trained here to copy from far back; its copied tokens are the key tokens.

Documents are random words in which 16-token segments reappear 64 tokens later. With K = 32 < 64
the short context never holds the original, so the copied tokens (after the first, which nobody
can predict) need long context; no other token is predictable at all.
"""

import evaluate
import numpy as np
import pytest
import torch

from longppl import METRIC_PATH, score_with_evaluator
from longppl.synthetic import cut_context, sample_documents, train_copy_model, word_tokenizer

K, D = 32, 16


@pytest.fixture(scope="module")
def trained():
    model = train_copy_model(steps=600, seed=0)
    docs = sample_documents(12, num_segments=3, generator=torch.Generator().manual_seed(1234))
    return model, docs, word_tokenizer()


def test_copied_tokens_are_found_as_key_tokens(trained):
    model, docs, tok = trained
    scores = score_with_evaluator(model, tok, docs.texts(), K, D, progress=False)
    found = np.concatenate([s.key_mask(2.0, -2.0) for s in scores])
    rank = docs.copy_rank.reshape(-1).numpy()
    copied = rank >= 1  # every copied token but the first of its segment
    for s, ids in zip(scores, docs.ids):
        assert s.input_ids.tolist() == ids.tolist()  # one word, one token
    precision = (found & copied).sum() / found.sum()
    recall = (found & (rank >= 2)).sum() / (rank >= 2).sum()
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)
    assert (found & (rank < 0)).sum() <= 0.01 * (rank < 0).sum()  # hardly any other token


def test_longppl_separates_full_and_cut_context_while_ppl_barely_moves(trained):
    model, _, tok = trained
    docs = sample_documents(8, num_segments=1, segment_length=8, generator=torch.Generator().manual_seed(99))
    metric = evaluate.load(METRIC_PATH)
    common = dict(predictions=docs.texts(), tokenizer=tok, evaluator_model=model, evaluator_tokenizer=tok,
                  trunc_len=K, sliding_window=D, progress=False)
    full = metric.compute(model=model, **common)
    cut = metric.compute(model=cut_context(model, 48), **common)
    assert full["n_key_tokens"] == cut["n_key_tokens"] and min(full["n_key_tokens"]) >= 5
    assert full["longppl"] < 2.0 < 50.0 < cut["longppl"]
    assert cut["ppl"] / full["ppl"] < 1.25
