"""Opt-in regional compilation: same log-probs, and the user's model is left as it was."""

import torch
from helpers import byte_level_bpe, govreport_texts, tiny_model

from longppl import token_log_probs
from longppl.core.compilation import compiled_blocks, repeated_blocks


def test_compiled_blocks_give_the_same_scores_and_are_restored():
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok))
    ids = torch.tensor([tok(govreport_texts()[0][:800])["input_ids"]])
    blocks = repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    with torch.no_grad():
        eager = token_log_probs(model, ids)
        # "eager" backend: dynamo traces the blocks (the plumbing under test) without inductor's
        # minutes of CPU code generation; inductor itself is exercised by the GPU benchmark.
        with compiled_blocks(model, backend="eager"):
            assert all(b._compiled_call_impl is not None for b in blocks)
            compiled = token_log_probs(model, ids)
            shorter = token_log_probs(model, ids[:, :100])  # another length: dynamic, no error
    assert all(b._compiled_call_impl is None for b in blocks)
    torch.testing.assert_close(compiled, eager, equal_nan=True)
    torch.testing.assert_close(shorter[0], eager[0, :100], equal_nan=True, atol=1e-5, rtol=1e-5)


def test_disabled_is_a_no_op():
    model = tiny_model("gpt2", 300)
    with compiled_blocks(model, enabled=False):
        assert all(getattr(b, "_compiled_call_impl", None) is None for b in repeated_blocks(model))
