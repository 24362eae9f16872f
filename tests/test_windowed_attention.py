"""Window layers computed in blocks (``core.attention``) against plain references written here."""

import copy
import math

import pytest
import torch
from helpers import windows_in_blocks

from longppl.core.attention import (
    WINDOWED_SDPA,
    blockwise_window_attention,
    use_windowed_attention,
    windowed_attention,
)
from longppl.core.logprobs import token_log_probs


def reference_window_attention(query, key, value, window, scaling):
    """Plain attention, one query at a time: token i sees keys j with i - window < j <= i."""
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    out = torch.zeros(batch, length, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                lo = max(0, i - window + 1)
                k = key[b, h // groups, lo : i + 1].double()
                v = value[b, h // groups, lo : i + 1].double()
                scores = (k @ query[b, h, i].double()) * scaling
                out[b, i, h] = torch.softmax(scores, 0) @ v
    return out


@pytest.mark.parametrize("length,window", [(37, 8), (40, 8), (9, 8), (64, 5)])
def test_blocks_equal_plain_window_attention(length, window):
    torch.manual_seed(length + window)
    query = torch.randn(2, 4, length, 6)
    key, value = torch.randn(2, 2, length, 6), torch.randn(2, 2, length, 6)
    scaling = 1 / math.sqrt(6)
    got = blockwise_window_attention(query, key, value, window, scaling)
    assert got.shape == (2, length, 4, 6)
    torch.testing.assert_close(
        got.double(), reference_window_attention(query, key, value, window, scaling), atol=1e-5, rtol=1e-5
    )


def tiny_gemma(window=16, layers=6):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(config).eval()


def test_a_window_model_scores_as_under_eager_attention_and_comes_back_on_sdpa(monkeypatch):
    model = tiny_gemma()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    calls = windows_in_blocks(monkeypatch)
    ids = torch.randint(0, 300, (2, 150))
    with torch.no_grad():
        got = token_log_probs(model, ids)
        want = token_log_probs(eager, ids)
    torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=2e-5, rtol=2e-5)
    assert calls and set(calls) == {16}  # the window layers ran in blocks (5 of every 6 layers)
    assert len(calls) == 5
    assert model.config._attn_implementation == "sdpa"  # the caller's model is put back


def test_padding_runs_transformers_sdpa_unchanged(monkeypatch):
    model = tiny_gemma()
    import longppl.core.attention as attention

    monkeypatch.setattr(attention, "blockwise_window_attention", lambda *a: pytest.fail("blocks under padding"))
    ids = torch.randint(0, 300, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        with windowed_attention(model):
            assert model.config._attn_implementation == WINDOWED_SDPA
            got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], plain[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1, 7:], plain[1, 7:], atol=0, rtol=0)


def test_models_without_window_layers_or_on_another_attention_are_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    assert not use_windowed_attention(llama)
    eager = tiny_gemma()
    eager.set_attn_implementation("eager")
    assert not use_windowed_attention(eager)
    assert eager.config._attn_implementation == "eager"


def test_float32_full_attention_in_query_blocks_equals_plain_causal_attention():
    from longppl.core.attention import chunked_causal_attention

    torch.manual_seed(3)
    query = torch.randn(1, 4, 45, 6)
    key, value = torch.randn(1, 2, 45, 6), torch.randn(1, 2, 45, 6)
    got = chunked_causal_attention(query, key, value, 0.5, block=8)
    want = reference_window_attention(query, key, value, window=45, scaling=0.5)  # a window of L: causal
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_long_float32_model_runs_its_full_layers_in_query_blocks(monkeypatch):
    import longppl.core.attention as attention

    model = tiny_gemma(window=8, layers=2)  # layer 0 a window layer, layer 1 full attention
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model = type(model)(model.config).eval()
    monkeypatch.setattr(attention, "CAUSAL_QUERY_BLOCK", 16)
    real, calls = attention.chunked_causal_attention, []
    monkeypatch.setattr(attention, "chunked_causal_attention", lambda *a, **k: calls.append(1) or real(*a, block=16))
    ids = torch.randint(0, 300, (1, 70))
    with torch.no_grad():
        plain = model(ids).logits
        with windowed_attention(model):
            got = model(ids).logits
    assert calls == [1]
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=2e-5)
