"""Token log-probs through the chunked LM head equal the model's own full logits."""

import pytest
import torch
from helpers import byte_level_bpe, govreport_texts, tiny_model
from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaModel

from longppl import token_log_probs
from longppl.core.logprobs import head_log_probs, resolve_lm_head

ARCHS = ["llama", "mistral", "qwen2", "gpt2", "gemma2"]


def reference_log_probs(model, ids):
    """Plain reference: full logits of one unpadded sequence, float32 log-softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.tensor([float("nan")]), lp])


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def sequences(tokenizer):
    texts = govreport_texts()
    return [tokenizer(t[:1500])["input_ids"][:n] for t, n in zip(texts[:3], (137, 200, 61))]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_full_logits(arch, tokenizer, sequences):
    model = tiny_model(arch, len(tokenizer))
    ids = sequences[0]
    with torch.no_grad():
        ours = token_log_probs(model, torch.tensor([ids]))[0]
    torch.testing.assert_close(ours, reference_log_probs(model, ids), equal_nan=True, atol=1e-5, rtol=1e-5)
    assert torch.isnan(ours[0])


def test_gemma2_soft_capping_is_applied(tokenizer, sequences):
    model = tiny_model("gemma2", len(tokenizer))
    ids = torch.tensor([sequences[0][:40]])
    head = resolve_lm_head(model)
    assert head.final_logit_softcapping == 2.0
    with torch.no_grad():
        hidden = head.backbone(input_ids=ids).last_hidden_state[0]
        logits = head.logits(hidden)
        raw = model.get_output_embeddings()(hidden)
    assert logits.abs().max() <= 2.0 + 1e-5 < raw.abs().max()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_single_rows(arch, side, tokenizer, sequences):
    model = tiny_model(arch, len(tokenizer))
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        span = slice(0, len(seq)) if side == "right" else slice(longest - len(seq), longest)
        ids[row, span] = torch.tensor(seq)
        mask[row, span] = 1
    with torch.no_grad():
        batched = token_log_probs(model, ids, mask)
    for row, seq in enumerate(sequences):
        real = batched[row][mask[row].bool()]
        torch.testing.assert_close(real, reference_log_probs(model, seq), equal_nan=True, atol=1e-5, rtol=1e-5)
        assert torch.isnan(batched[row][~mask[row].bool()]).all()


def test_score_mask_limits_lm_head_rows(tokenizer, sequences):
    model = tiny_model("llama", len(tokenizer))
    ids = torch.tensor([sequences[1]])
    score = torch.zeros_like(ids, dtype=torch.bool)
    score[0, 150:170] = True
    with torch.no_grad():
        token_log_probs(model, ids[:, :8])  # one-off verification probe, not counted below
    rows_seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(o.shape[0]))
    with torch.no_grad():
        lp = token_log_probs(model, ids, score_mask=score)
    handle.remove()
    assert rows_seen == [20]
    ref = reference_log_probs(model, sequences[1])
    torch.testing.assert_close(lp[0, 150:170], ref[150:170], atol=1e-5, rtol=1e-5)
    assert torch.isnan(lp[0, :150]).all() and torch.isnan(lp[0, 170:]).all()


def test_no_full_logits_tensor_is_built(tokenizer, sequences):
    """With a small logits budget the head only ever sees chunks, never [sequence, vocab]."""
    model = tiny_model("qwen2", len(tokenizer))
    ids = torch.tensor([sequences[1]])
    with torch.no_grad():
        token_log_probs(model, ids[:, :8])  # one-off verification probe, not counted below
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    budget = 16 * len(tokenizer) * 4  # 16 rows of float32 logits
    with torch.no_grad():
        lp = token_log_probs(model, ids, logits_chunk_bytes=budget)
    handle.remove()
    assert max(s[0] for s in shapes) == 16 and len(ids[0]) > 16
    assert sum(s[0] for s in shapes) == len(ids[0]) - 1
    torch.testing.assert_close(lp[0], reference_log_probs(model, sequences[1]), equal_nan=True, atol=1e-5, rtol=1e-5)


def test_head_log_probs_row_gather(tokenizer):
    model = tiny_model("llama", len(tokenizer))
    head = resolve_lm_head(model)
    hidden = torch.randn(10, 32)
    targets = torch.randint(len(tokenizer), (4,))
    rows = torch.tensor([7, 0, 3, 3])
    got = head_log_probs(head, hidden, targets, rows, logits_chunk_bytes=1)
    with torch.no_grad():
        expected = model.lm_head(hidden[rows]).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, expected)


def test_peft_lora_model_including_lm_head(tokenizer, sequences):
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", len(tokenizer))
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )
    peft_model.eval()
    ids = sequences[2]
    with torch.no_grad():
        ours = token_log_probs(peft_model, torch.tensor([ids]))[0]
        logits = peft_model(input_ids=torch.tensor([ids])).logits[0].float()
    expected = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(ours[1:], expected, atol=1e-5, rtol=1e-5)
    # The adapters (lm_head's included) really change the scores: an adapter-free twin differs.
    plain = tiny_model("llama", len(tokenizer))
    assert not torch.allclose(ours[1:], reference_log_probs(plain, ids)[1:], atol=1e-3)


@pytest.mark.parametrize(
    "build",
    [
        lambda v: LlamaModel(
            LlamaConfig(
                vocab_size=v,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ),
        lambda v: LlamaForSequenceClassification(
            LlamaConfig(
                vocab_size=v,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                pad_token_id=0,
            )
        ),
    ],
    ids=["bare-backbone", "classifier"],
)
def test_model_without_causal_lm_head_is_refused(build, tokenizer):
    model = build(len(tokenizer))
    with pytest.raises(ValueError, match="not a causal language model with an LM head.*AutoModelForCausalLM"):
        token_log_probs(model, torch.tensor([[1, 2, 3]]))


def test_unknown_logit_postprocessing_is_detected(tokenizer, sequences):
    model = tiny_model("llama", len(tokenizer))
    original = model.forward

    def forward_with_scaled_logits(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0  # a post-processing resolve_lm_head does not know about
        return out

    model.forward = forward_with_scaled_logits
    with pytest.raises(RuntimeError, match="do not reproduce its own logits"):
        token_log_probs(model, torch.tensor([sequences[0]]))


def test_float32_rounding_at_a_large_scale_is_not_taken_for_postprocessing(tokenizer, sequences):
    """Two float32 passes that sum in another order differ by rounding that grows with the values'
    scale (a real model's log-probabilities reach about 90): a relative change of 2e-5 on logits of
    about 100 is such a difference, and is accepted; a change of 1% is not."""
    ids = torch.tensor([sequences[0]])

    def with_logits_times(factor: float):
        model = tiny_model("llama", len(tokenizer))
        with torch.no_grad():
            model.lm_head.weight.mul_(100.0 / model(ids).logits.abs().max())
        original = model.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            out.logits = out.logits * factor
            return out

        model.forward = forward
        with torch.no_grad():
            moved = (model(ids).logits[0].log_softmax(-1) - original(ids).logits[0].log_softmax(-1)).abs().max()
        return model, moved

    rounded, moved = with_logits_times(1.0 + 2e-5)
    assert moved > 1e-3  # beyond a fixed tolerance of 1e-3
    token_log_probs(rounded, ids)  # accepted
    scaled, _ = with_logits_times(1.01)
    with pytest.raises(RuntimeError, match="do not reproduce its own logits"):
        token_log_probs(scaled, ids)


def test_scores_through_a_deepspeed_style_engine(tokenizer, sequences):
    # DeepSpeed's engine wraps the model in `.module` and is what the Trainer hands compute_loss; deepspeed
    # is not installed in CI, so a wrapper class that lives in a `deepspeed.*` module stands in for it.
    class Engine(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.module(*args, **kwargs)

    Engine.__module__ = "deepspeed.runtime.engine"
    model = tiny_model("llama", len(tokenizer))
    engine = Engine(model)
    ids = sequences[0]
    assert resolve_lm_head(engine).model is model
    with torch.no_grad():
        ours = token_log_probs(engine, torch.tensor([ids]), via_forward=True)[0]
    assert engine.calls == 1  # through the engine's forward (where ZeRO-3 gathers the weights)
    torch.testing.assert_close(ours, reference_log_probs(model, ids), equal_nan=True, atol=1e-5, rtol=1e-5)

    class Unrelated(Engine):  # same shape, not deepspeed's: not unwrapped
        pass

    Unrelated.__module__ = "my_project.wrappers"
    with pytest.raises(ValueError, match="Unrelated is not a causal language model"):
        resolve_lm_head(Unrelated(model))
