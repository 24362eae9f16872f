"""Known answer: a tiny model trained here to copy from far back; its copied tokens are the key tokens.

Documents are random words in which 16-token segments reappear 64 tokens later. With K = 32 < 64
the short context never holds the original, so the copied tokens (after the first, which nobody
can predict) need long context; no other token is predictable at all.
"""

import evaluate
import numpy as np
import pytest
import torch

from longppl import METRIC_PATH, KeyTokenRule, KeyTokenSettings, score_with_evaluator
from longppl.commandline.synthetic import (
    _cache_path,
    cut_context,
    default_cache_dir,
    sample_documents,
    train_copy_model,
    word_tokenizer,
)

K, D = 32, 16


@pytest.fixture(scope="module")
def trained():
    # The quickstart trains this very model (600 steps, seed 0) and keeps it: trained once between them.
    model = train_copy_model(steps=600, seed=0, cache_dir=default_cache_dir())
    docs = sample_documents(12, num_segments=3, generator=torch.Generator().manual_seed(1234))
    return model, docs, word_tokenizer()


@pytest.mark.slow
def test_copied_tokens_are_found_as_key_tokens(trained):
    model, docs, tok = trained
    scores = score_with_evaluator(model, tok, docs.texts(), KeyTokenSettings(K, D), progress=False)
    found = np.concatenate([s.key_mask(KeyTokenRule(2.0, -2.0)) for s in scores])
    rank = docs.copy_rank.reshape(-1).numpy()
    copied = rank >= 1  # every copied token but the first of its segment
    for s, ids in zip(scores, docs.ids):
        assert s.input_ids.tolist() == ids.tolist()  # one word, one token
    precision = (found & copied).sum() / found.sum()
    recall = (found & (rank >= 2)).sum() / (rank >= 2).sum()
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)
    assert (found & (rank < 0)).sum() <= 0.01 * (rank < 0).sum()  # hardly any other token


@pytest.mark.slow
def test_longppl_separates_full_and_cut_context_while_ppl_barely_moves(trained):
    model, _, tok = trained
    docs = sample_documents(8, num_segments=1, segment_length=8, generator=torch.Generator().manual_seed(99))
    metric = evaluate.load(METRIC_PATH)
    common = dict(
        predictions=docs.texts(),
        tokenizer=tok,
        evaluator_model=model,
        evaluator_tokenizer=tok,
        trunc_len=K,
        sliding_window=D,
        progress=False,
    )
    full = metric.compute(model=model, **common)
    cut = metric.compute(model=cut_context(model, 48), **common)
    assert full["n_key_tokens"] == cut["n_key_tokens"] and min(full["n_key_tokens"]) >= 5
    assert full["longppl"] < 2.0 < 50.0 < cut["longppl"]
    assert cut["ppl"] / full["ppl"] < 1.25


def test_a_cached_copy_model_is_the_trained_one(tmp_path):
    """The cache returns the weights training gives, keyed by the settings; a damaged file is retrained."""
    steps = []
    fresh = train_copy_model(steps=3, seed=5, cache_dir=str(tmp_path), log=lambda step, loss: steps.append(step))
    assert steps and len(list(tmp_path.glob("copy-model-*.safetensors"))) == 1
    again = train_copy_model(steps=3, seed=5, cache_dir=str(tmp_path), log=lambda step, loss: steps.append(-1))
    assert -1 not in steps  # loaded, not trained
    for (name, a), (_, b) in zip(fresh.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    plain = train_copy_model(steps=3, seed=5)  # no cache: the same weights
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), again.state_dict().values()))
    other = train_copy_model(steps=3, seed=6, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("copy-model-*.safetensors"))) == 2
    assert not torch.equal(other.lm_head.weight, again.lm_head.weight)
    path = _cache_path(str(tmp_path), dict(steps=3, seed=5, batch_size=32, learning_rate=3e-3))
    with open(path, "wb") as handle:
        handle.write(b"not safetensors")
    with pytest.warns(UserWarning, match="Could not read the cached copy model"):
        redone = train_copy_model(steps=3, seed=5, cache_dir=str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), redone.state_dict().values()))
