"""Short-context windows: exact against one-window-per-forward references, independent of batching."""

import contextlib
import math

import pytest
import torch
from helpers import byte_level_bpe, govreport_texts, tiny_model

from longppl.core.batching import long_context_log_probs, pack_by_token_budget
from longppl.core.windows import short_context_log_probs, window_bounds
from longppl.settings import WindowSettings


@contextlib.contextmanager
def pass_shapes(model, probe_doc: torch.Tensor):
    """The ``input_ids`` shape of every forward pass of ``model`` inside the block. A pass on
    ``probe_doc`` runs first, so the one-off LM-head verification probe is not counted."""
    long_context_log_probs(model, [probe_doc], 10_000)
    shapes: list[tuple[int, ...]] = []
    handle = model.model.register_forward_pre_hook(
        lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    try:
        yield shapes
    finally:
        handle.remove()


def reference_short(model, ids, K, d, prefix=None):
    """Plain reference: every window alone, full logits, float32 (official algorithm)."""
    n = len(ids)
    out = torch.full((n,), float("nan"))
    for start in range(0, n - K, d):
        end = min(start + K + d, n)
        window = ids[start:end]
        shift = 0
        if prefix is not None and start > 0:
            window = [prefix] + window
            shift = 1
        with torch.no_grad():
            logp = model(torch.tensor([window])).logits[0].float().log_softmax(-1)
        for i in range(start + K, end):
            j = i - start + shift  # position of x_i inside the window
            out[i] = logp[j - 1, ids[i]]
    return out


def reference_long(model, ids):
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return torch.tensor([float("nan")] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))])


@pytest.fixture(scope="module")
def tokenizers():
    return {"bos": byte_level_bpe(add_bos=True), "nobos": byte_level_bpe(add_bos=False)}


def documents(tokenizer, lengths):
    texts = govreport_texts()
    return [tokenizer(texts[i][:3000])["input_ids"][:n] for i, n in enumerate(lengths)]


def test_window_bounds_follow_the_official_scheme():
    # n=23, K=5, d=4: starts 0,4,8,12,16 (16+5 < 23), last window clipped to n.
    assert window_bounds(23, WindowSettings(5, 4)) == [(0, 9), (4, 13), (8, 17), (12, 21), (16, 23)]
    assert window_bounds(5, WindowSettings(5, 4)) == []  # no token has K tokens before it
    assert window_bounds(6, WindowSettings(5, 4)) == [(0, 6)]
    for n, K, d in [(100, 7, 3), (57, 10, 10), (41, 1, 1)]:
        covered = [i for s, e in window_bounds(n, WindowSettings(K, d)) for i in range(s + K, e)]
        assert covered == list(range(K, n))  # every token i >= K scored exactly once


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("bos", ["bos", "nobos"])
def test_short_windows_match_reference(arch, bos, tokenizers):
    tok = tokenizers[bos]
    model = tiny_model(arch, len(tok))
    K, d = 37, 11  # neither divides the lengths
    docs = documents(tok, [203, 150, 38])
    with torch.no_grad():
        ours = short_context_log_probs(
            model, [torch.tensor(x) for x in docs], WindowSettings(K, d), max_tokens_per_batch=400
        )
    for ids, got in zip(docs, ours):
        torch.testing.assert_close(got, reference_short(model, ids, K, d), equal_nan=True, atol=1e-5, rtol=1e-5)
        assert torch.isnan(got[:K]).all() and not torch.isnan(got[K:]).any()


def test_window_bos_prefix_matches_reference(tokenizers):
    tok = tokenizers["bos"]
    model = tiny_model("llama", len(tok))
    K, d = 30, 13
    docs = documents(tok, [160])
    with torch.no_grad():
        ours = short_context_log_probs(
            model,
            [torch.tensor(docs[0])],
            WindowSettings(K, d),
            max_tokens_per_batch=1000,
            prefix_token_id=tok.bos_token_id,
        )
    expected = reference_short(model, docs[0], K, d, prefix=tok.bos_token_id)
    torch.testing.assert_close(ours[0], expected, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[0][K + d :], reference_short(model, docs[0], K, d)[K + d :])


def test_first_window_reuses_the_long_pass(tokenizers):
    """Window s=0 reads x[0:K+d], the very context of the long pass: it is not run again."""
    tok = tokenizers["bos"]
    model = tiny_model("llama", len(tok))
    docs = [torch.tensor(x) for x in documents(tok, [90, 120])]
    K, d = 40, 25
    calls = []
    handle = model.model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    with torch.no_grad():
        long = long_context_log_probs(model, docs, 10_000)
        calls.clear()
        with_reuse = short_context_log_probs(
            model, docs, WindowSettings(K, d), max_tokens_per_batch=K + d, long_log_probs=long
        )
        reused_calls = len(calls)
        calls.clear()
        without = short_context_log_probs(model, docs, WindowSettings(K, d), max_tokens_per_batch=K + d)
        plain_calls = len(calls)
    handle.remove()
    windows = [window_bounds(len(doc), WindowSettings(K, d)) for doc in docs]
    assert plain_calls == sum(len(w) for w in windows)  # budget K+d: one window per forward
    assert reused_calls == plain_calls - len(docs)
    for a, b in zip(with_reuse, without):
        torch.testing.assert_close(a, b, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [1, 90, 500, 100_000])
def test_results_do_not_depend_on_batching(budget, tokenizers):
    tok = tokenizers["bos"]
    model = tiny_model("mistral", len(tok))
    docs = [torch.tensor(x) for x in documents(tok, [211, 64, 150, 97, 20])]
    K, d = 33, 14
    with torch.no_grad():
        short = short_context_log_probs(model, docs, WindowSettings(K, d), max_tokens_per_batch=budget)
        long = long_context_log_probs(model, docs, max_tokens_per_batch=budget)
    for ids, s, lo in zip(docs, short, long):
        torch.testing.assert_close(s, reference_short(model, ids.tolist(), K, d), equal_nan=True, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lo, reference_long(model, ids.tolist()), equal_nan=True, atol=1e-5, rtol=1e-5)


def test_packing_respects_budget_and_counts_forward_calls(tokenizers):
    lengths = [48, 48, 48, 48, 30, 48, 12]
    batches = pack_by_token_budget(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 100
    assert len(batches) == math.ceil(5 / 2) + 1  # five 48s two by two, then 30 and 12 together
    assert pack_by_token_budget([500], 100) == [[0]]  # too long for the budget: alone

    tok = tokenizers["bos"]
    model = tiny_model("llama", len(tok))
    docs = [torch.tensor(x) for x in documents(tok, [200, 200])]
    with torch.no_grad(), pass_shapes(model, docs[0]) as shapes:
        short_context_log_probs(model, docs, WindowSettings(40, 20), max_tokens_per_batch=60 * 4)
    # 8 windows of 60 tokens per document (starts 0..140), 4 per forward under a 240-token budget.
    assert shapes == [(4, 60)] * 4


def test_bad_window_settings_are_named_not_raw_errors():
    ids = torch.arange(60)
    model = tiny_model("llama", 100)
    with pytest.raises(ValueError, match="trunc_len must be an integer >= 1, got -5"):
        WindowSettings(-5, 8)
    with pytest.raises(ValueError, match="sliding_window must be an integer >= 1, got 0"):
        WindowSettings(16, 0)
    # one signature: K and d travel as a WindowSettings (numbers in its place are refused, by name)
    with pytest.raises(ValueError, match=r"settings must be a WindowSettings, got 16; build one"):
        short_context_log_probs(model, [ids], 16, max_tokens_per_batch=1000)
    with pytest.raises(TypeError, match="trunc_len"):
        short_context_log_probs(model, [ids], trunc_len=16, window=WindowSettings(16, 8))


def test_a_window_object_gives_what_its_numbers_give(tokenizers):
    tok = tokenizers["nobos"]
    model = tiny_model("llama", len(tok))
    docs = [torch.tensor(x) for x in documents(tok, [120, 75])]
    with torch.no_grad():
        by_position = short_context_log_probs(model, docs, WindowSettings(30, 7), max_tokens_per_batch=500)
        by_object = short_context_log_probs(model, docs, max_tokens_per_batch=500, window=WindowSettings(30, 7))
    for a, b, ids in zip(by_position, by_object, docs):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(a, reference_short(model, ids.tolist(), 30, 7), equal_nan=True, atol=1e-5, rtol=1e-5)


def test_equal_length_packing_shares_passes_across_documents_and_matches_each_alone(tokenizers):
    """``equal_lengths``: segments of one length share unpadded passes, across documents, and each
    document's scores are those it gets alone (up to float rounding) and those of the plain reference."""
    tok = tokenizers["bos"]
    model = tiny_model("llama", len(tok))
    K, d = 40, 20
    docs = [torch.tensor(x) for x in documents(tok, [150, 150, 150, 97, 150, 97])]
    assert [len(x) for x in docs] == [150, 150, 150, 97, 150, 97]
    with torch.no_grad(), pass_shapes(model, docs[0]) as shapes:
        long = long_context_log_probs(model, docs, 10_000, equal_lengths=True)
        n_long = len(shapes)
        short = short_context_log_probs(
            model, docs, WindowSettings(K, d), max_tokens_per_batch=10_000, long_log_probs=long, equal_lengths=True
        )
    # one pass per length, unpadded: four documents of 150 tokens, then two of 97
    assert shapes[:n_long] == [(4, 150), (2, 97)]
    # windows after the first (taken from the long pass): 150 tokens -> starts 20..100, lengths 60, 60,
    # 60, 60 (s=80: 140), 50 (s=100); 97 tokens -> starts 20, 40: lengths 60, 57. One pass per length.
    assert sorted(shapes[n_long:]) == sorted([(4 * 4 + 2, 60), (2, 57), (4, 50)])
    for ids, lo, sh in zip(docs, long, short):
        with torch.no_grad():
            alone_long = long_context_log_probs(model, [ids], 10_000, equal_lengths=True)
            alone_short = short_context_log_probs(
                model,
                [ids],
                WindowSettings(K, d),
                max_tokens_per_batch=10_000,
                long_log_probs=alone_long,
                equal_lengths=True,
            )
        # up to float rounding: on several CPU threads the matmuls may sum in another order for
        # another number of rows (bit-identical on one thread)
        torch.testing.assert_close(lo, alone_long[0], equal_nan=True, atol=1e-6, rtol=0)
        torch.testing.assert_close(sh, alone_short[0], equal_nan=True, atol=1e-6, rtol=0)
        # and the plain reference (every window alone, full logits)
        torch.testing.assert_close(sh, reference_short(model, ids.tolist(), K, d), equal_nan=True, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lo, reference_long(model, ids.tolist()), equal_nan=True, atol=1e-5, rtol=1e-5)
    assert pack_by_token_budget([5, 5, 4, 5, 4], 100, equal_lengths=True) == [[0, 1, 3], [2, 4]]
    assert pack_by_token_budget([5, 5, 5], 10, equal_lengths=True) == [[0, 1], [2]]  # the budget still holds
