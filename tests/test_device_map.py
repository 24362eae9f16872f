"""An evaluator split over several devices (``device="auto"``: accelerate's ``device_map``) scores
exactly like the same evaluator on one device, and a tensor on the wrong device fails.

Faithful on a CPU-only machine because the split is real accelerate machinery on virtual devices
(``virtual_devices.VirtualDevices``): ``accelerate.dispatch_model`` attaches the same
``AlignDevicesHook``s it attaches on a multi-GPU machine (``from_pretrained(device_map="auto")``
calls it), with the embedding on ``cuda:0``, the last decoder layer and final norm on ``cuda:1``
and the LM head on ``cuda:2``. Every ``.device`` the scoring core reads reports those devices, every
``.to`` moves there, and an operation that mixes two devices raises CUDA's own ``RuntimeError``, so
a hidden-state chunk, an index or a target on the wrong device fails here as it would on GPUs. The
data stay on the CPU, so the split model's scores must equal the unsplit model's bit for bit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from accelerate import dispatch_model
from helpers import byte_level_bpe, govreport_texts, tiny_model
from virtual_devices import VirtualDevices, index_of

import longppl
from longppl.core.logprobs import CausalLMHead, resolve_lm_head, token_log_probs, verify_head
from longppl.settings import KeyTokenSettings

K, D = 24, 8  # short windows of 24 tokens scored 8 at a time: many packed windows per document
SPLIT = {
    "model.embed_tokens": 0,
    "model.rotary_emb": 0,
    "model.layers.0": 0,
    "model.layers.1": 1,
    "model.norm": 1,
    "lm_head": 2,
}


@pytest.fixture(scope="module")
def evaluators():
    """``(tokenizer, unsplit evaluator, the same weights split as SPLIT)``; use the split one under VirtualDevices."""
    tokenizer = byte_level_bpe()
    whole = tiny_model("llama", len(tokenizer), seed=1)
    with VirtualDevices():
        split = dispatch_model(copy.deepcopy(whole), SPLIT)
        # the once-per-model logits probe, now, so that it adds no LM-head call to any test's count
        verify_head(resolve_lm_head(split), torch.tensor([tokenizer(govreport_texts()[0][:100])["input_ids"]]))
    return tokenizer, whole, split


def test_the_split_evaluator_really_sits_on_three_devices(evaluators):
    _, _, split = evaluators
    with VirtualDevices():
        devices = {name: str(parameter.device) for name, parameter in split.named_parameters()}
    assert devices["model.embed_tokens.weight"] == "cuda:0"
    assert devices["model.layers.0.self_attn.q_proj.weight"] == "cuda:0"
    assert devices["model.layers.1.self_attn.q_proj.weight"] == "cuda:1"
    assert devices["model.norm.weight"] == "cuda:1"
    assert devices["lm_head.weight"] == "cuda:2"


@pytest.mark.parametrize(
    "options",
    [dict(), dict(per_document=True), dict(per_document=True, pack_documents=True)],
    ids=["padded", "per-document", "packed-documents"],
)
def test_split_evaluator_scores_equal_the_unsplit_ones(evaluators, options):
    tokenizer, whole, split = evaluators
    texts = [text[:400] for text in govreport_texts()[:3]] + [govreport_texts()[3][:400]]
    args = (tokenizer, texts, KeyTokenSettings(K, D))
    kwargs = dict(max_tokens_per_batch=256, progress=False, **options)
    expected = longppl.score_with_evaluator(whole, *args, **kwargs)
    with VirtualDevices():
        got = longppl.score_with_evaluator(split, *args, **kwargs)
    for ours, reference in zip(got, expected, strict=True):
        assert np.array_equal(ours.input_ids, reference.input_ids)
        assert not np.isnan(ours.lp_short[K:]).any() and not np.isnan(ours.lp_long[1:]).any()
        assert np.array_equal(ours.lp_long, reference.lp_long, equal_nan=True)
        assert np.array_equal(ours.lp_short, reference.lp_short, equal_nan=True)


@pytest.mark.parametrize("via_forward", [False, True], ids=["backbone-then-head", "head-intercepted"])
def test_every_lm_head_chunk_runs_on_the_heads_device(evaluators, via_forward):
    """Padded batch, a few rows per LM-head chunk: every chunk comes from the final norm's device
    to the head's (cuda:1 -> cuda:2), the result comes back on the embedding's device (cuda:0), and
    equals the unsplit model's."""
    tokenizer, whole, split = evaluators
    rows = [tokenizer(text[:300])["input_ids"] for text in govreport_texts()[:2]]
    longest = max(map(len, rows))
    ids = torch.tensor([row + [2] * (longest - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows])
    chunk_bytes = 4 * len(tokenizer) * 7  # 7 rows of float32 logits per chunk
    head = split.lm_head
    arriving, seen = [], []
    hook, inner = head._hf_hook, head._old_forward  # accelerate's hook, and the module's own forward

    def arrive(module, hidden):  # what reaches the head, before its hook moves it to cuda:2
        if hidden.dim() == 2:  # an LM-head chunk (the logits probe passes [1, T, H])
            arriving.append(index_of(hidden))
        return type(hook).pre_forward(hook, module, hidden)

    def spy(hidden):
        if hidden.dim() == 2:
            seen.append((index_of(hidden), hidden.shape[0]))
        return inner(hidden)

    hook.pre_forward, head._old_forward = arrive, spy
    try:
        with VirtualDevices():
            ours = token_log_probs(split, ids, mask, logits_chunk_bytes=chunk_bytes, via_forward=via_forward)
            assert str(ours.device) == "cuda:0"
            ours = ours.cpu()
    finally:
        del hook.pre_forward
        head._old_forward = inner
    expected = token_log_probs(whole, ids, mask, logits_chunk_bytes=chunk_bytes)
    assert torch.equal(ours.isnan(), expected.isnan()) and int((~ours.isnan()).sum()) > 7
    assert torch.equal(ours.nan_to_num(), expected.nan_to_num())
    assert len(seen) == -(-int((~ours.isnan()).sum()) // 7)
    assert {device for device, _ in seen} == {2}
    # each chunk leaves the final norm's device (cuda:1) straight for the head's: no detour (an
    # extra copy) through the embedding's device
    assert arriving == [1] * len(seen)


def test_a_head_chunk_that_bypasses_the_heads_device_fails(evaluators, monkeypatch):
    """The harness can fail: an LM head applied as ``F.linear(hidden, head.weight)`` skips the hook
    that moves its input to the head's device; on one device it works, split it must raise."""
    tokenizer, whole, split = evaluators
    ids = torch.tensor([tokenizer(govreport_texts()[0][:200])["input_ids"]])

    def misplaced(self, hidden, project=None):
        return self.transform(F.linear(hidden, self.head.weight))

    monkeypatch.setattr(CausalLMHead, "logits", misplaced)
    token_log_probs(whole, ids)  # one device: fine
    with VirtualDevices(), pytest.raises(RuntimeError, match=r"same device.*cuda:1.*cuda:2"):
        token_log_probs(split, ids)


def test_virtual_devices_raise_like_cuda():
    with VirtualDevices():
        a = torch.ones(3, 3).to("cuda:0")
        b = torch.ones(3, 3).to(1)
        with pytest.raises(RuntimeError, match=r"same device.*cuda:0.*cuda:1"):
            a @ b
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            a[torch.tensor([0, 2]).to(b.device)]
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            a.numpy()
        with pytest.raises(RuntimeError, match=r"same device.*cuda:0 and cuda:1.*index_put_"):
            a[torch.tensor([0, 2])] = b[:2]
        a[0:2] = b[:2]  # slice assignment copies across devices, as on real GPUs
        assert str((a[torch.tensor([0, 2])] * torch.tensor(2.0)).device) == "cuda:0"  # CPU indices, 0-d CPU factor
        assert torch.equal(b.to(a.device).cpu() @ torch.ones(3, 3), torch.full((3, 3), 3.0))
