"""LongCETrainer against stock Trainer and against a plain reference loss (full logits, windows one by one)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import one_step_args, run_guarded, tiny_model
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments, default_data_collator

from longce import LongCEConfig, LongCETrainer, batch_documents, lm_head_loss
from longce.lm_head_loss import (
    ChunkedLMHeadLoss,
    FirstApplicable,
    FusedLMHeadLoss,
    LigerLMHeadLoss,
    LMHeadLoss,
    select_lm_head_loss,
)
from longce.trainer import _STAT_KEYS
from longppl.core.logprobs import resolve_lm_head

VOCAB = 97
K, D, GAMMA = 8, 5, 5.0  # neither divides the lengths below


def make_args(cls=LongCEConfig, **overrides):
    longce = dict(longce_trunc_len=K, longce_sliding_window=D, longce_gamma=GAMMA) if cls is LongCEConfig else {}
    return one_step_args(cls, **(longce | overrides))


def documents(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def padded_batch(docs, side="right", pad_id=2):
    """``input_ids``, ``attention_mask``, ``labels`` of documents padded on ``side``.

    Labels are -100 on padding and on each document's first token: with left padding a pad position
    would otherwise "predict" it (stock causal-LM losses do train on that pair; LongCETrainer follows
    the labels it is given, exactly like them).
    """
    length = max(len(d) for d in docs)
    ids = torch.full((len(docs), length), pad_id)
    mask = torch.zeros(len(docs), length, dtype=torch.long)
    for row, doc in enumerate(docs):
        cols = slice(0, len(doc)) if side == "right" else slice(length - len(doc), length)
        ids[row, cols], mask[row, cols] = doc, 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(len(docs)), mask.argmax(-1)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate(side):
    return lambda rows: padded_batch([torch.tensor(r["input_ids"]) for r in rows], side)


# --------------------------------------------------------------------------- plain reference


def reference_lp(model, tokens):
    """Full-logits log-probs of ``tokens`` read alone: ``[n]`` with ``lp[i] = log P(x_i | x_<i)``, ``lp[0]`` = 0."""
    logits = model(input_ids=tokens[None]).logits[0].float()
    lp = torch.zeros(len(tokens))
    lp[1:] = -F.cross_entropy(logits[:-1], tokens[1:], reduction="none")
    return lp


def reference_loss(model, docs, trunc_len=K, window=D, gamma=GAMMA, per_token=None):
    """The paper's LongCE loss written plainly: each window run on its own, full logits, weights detached.

    ``per_token``: a list that receives ``(weights, nll)`` of every scored token, concatenated.
    """
    total, count = 0.0, 0
    all_weights, all_nll = [], []
    for doc in docs:
        n = len(doc)
        lp_long = reference_lp(model, doc)
        lp_short = torch.full((n,), float("nan"))
        with torch.no_grad():
            for start in range(0, max(n - trunc_len, 0), window):
                end = min(start + trunc_len + window, n)
                lp_short[start + trunc_len : end] = reference_lp(model, doc[start:end])[trunc_len:]
        ratio = torch.exp(lp_long.detach() - lp_short).clamp(max=gamma)
        weights = torch.where(torch.isnan(lp_short), torch.ones(n), ratio)
        total = total + (weights[1:] * -lp_long[1:]).sum()
        count += n - 1
        all_weights.append(weights[1:])
        all_nll.append(-lp_long[1:].detach())
    if per_token is not None:
        per_token.extend([torch.cat(all_weights), torch.cat(all_nll)])
    return total / count


def gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(ours, reference, atol=1e-5):
    assert ours.keys() == reference.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], atol=atol, rtol=1e-4, msg=name)


def assert_equals_reference(model, docs, loss, grads):
    """Our ``loss`` and parameter ``grads`` equal ``reference_loss``'s on the same documents."""
    model.zero_grad()
    reference = reference_loss(model, docs)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach(), atol=1e-5, rtol=1e-5)
    assert_same_gradients(grads, gradients(model))


def our_loss_and_grads(model, batch, **overrides):
    trainer = LongCETrainer(model=model, args=make_args(**overrides))
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), gradients(model), trainer


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_loss_and_gradients_equal_plain_reference(arch, side):
    model = tiny_model(arch, VOCAB).train()
    docs = documents([37, 23, 8])  # K, d divide none; 8 tokens: no short score at all
    ours, our_grads, _ = our_loss_and_grads(model, padded_batch(docs, side))
    assert_equals_reference(model, docs, ours, our_grads)


def test_weights_really_differ_from_one():
    """Guard for the test above: the weights it checks are not all 1 (K, d small enough to matter)."""
    model = tiny_model("llama", VOCAB).train()
    trainer = LongCETrainer(model=model, args=make_args())
    trainer.compute_loss(model, padded_batch(documents([37, 23])))
    stats = trainer._longce_stats["train"]
    assert stats[3] > 5  # tokens with weight > 1
    assert float(stats[4]) > 1.0


def test_packed_batch_equals_the_same_documents_unpacked():
    model = tiny_model("llama", VOCAB).train()
    docs = documents([30, 17, 26], seed=1)
    packed = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    assert set(packed) >= {"input_ids", "position_ids", "labels"} and packed["input_ids"].shape[0] == 1
    assert [(s.start, s.end) for s in batch_documents(packed["input_ids"], None, packed["position_ids"])] == [
        (0, 30),
        (30, 47),
        (47, 73),
    ]
    loss_packed, grads_packed, _ = our_loss_and_grads(model, packed)
    loss_padded, grads_padded, _ = our_loss_and_grads(model, padded_batch(docs))
    torch.testing.assert_close(loss_packed, loss_padded, atol=1e-5, rtol=1e-5)
    assert_same_gradients(grads_packed, grads_padded)
    model.zero_grad()
    reference_loss(model, docs).backward()
    assert_same_gradients(grads_packed, gradients(model))


def test_max_tokens_per_batch_does_not_change_the_result():
    model = tiny_model("llama", VOCAB).train()
    batch = padded_batch(documents([41, 29]))
    loss_one, grads_one, _ = our_loss_and_grads(model, batch, longce_max_tokens_per_batch=1)
    loss_all, grads_all, _ = our_loss_and_grads(model, batch, longce_max_tokens_per_batch=10_000)
    torch.testing.assert_close(loss_one, loss_all, atol=1e-6, rtol=1e-6)
    assert_same_gradients(grads_one, grads_all)


def test_chunked_loss_equals_single_chunk():
    model = tiny_model("llama", VOCAB).train()
    batch = padded_batch(documents([41, 29]))
    loss_small, grads_small, _ = our_loss_and_grads(model, batch, longce_loss_chunk_bytes=4 * VOCAB * 3)
    loss_big, grads_big, _ = our_loss_and_grads(model, batch)
    torch.testing.assert_close(loss_small, loss_big, atol=1e-6, rtol=1e-6)
    assert_same_gradients(grads_small, grads_big)


def _train(trainer_cls, args, rows, side, model):
    dataset = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=collate(side))
    trainer.train()
    return trainer.state.log_history[0], model


@pytest.mark.parametrize("side", ["right", "left"])
def test_plain_ce_switch_equals_stock_trainer_with_accumulation(side):
    """Gradient accumulation 2 over padded batches of unequal token counts: same loss, same SGD update."""
    base = tiny_model("llama", VOCAB)
    rows = documents([40, 12, 33, 25, 19, 38, 7, 30])
    common = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    stock_log, stock = _train(Trainer, make_args(TrainingArguments, **common), rows, side, copy.deepcopy(base))
    ours_log, ours = _train(LongCETrainer, make_args(longce_weights="none", **common), rows, side, copy.deepcopy(base))
    assert math.isclose(ours_log["loss"], stock_log["loss"], rel_tol=1e-5)
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    assert ours_log["longce_mean_weight"] == 1.0 and ours_log["longce_weight_gt1_share"] == 0.0
    assert math.isclose(ours_log["ce_loss"], ours_log["loss"], rel_tol=1e-4)


def test_logged_statistics_match_the_weights():
    base = tiny_model("llama", VOCAB).train()
    rows = documents([40, 33])
    per_token = []
    with torch.no_grad():
        expected_loss = reference_loss(base, rows, per_token=per_token).item()
    weights, nll = per_token
    log, _ = _train(LongCETrainer, make_args(max_steps=1), rows, "right", base)
    assert set(_STAT_KEYS) <= set(log)
    assert math.isclose(log["loss"], expected_loss, rel_tol=1e-5)
    assert math.isclose(log["ce_loss"], nll.mean().item(), rel_tol=1e-5)
    assert math.isclose(log["longce_mean_weight"], weights.mean().item(), rel_tol=1e-5)
    # the reference runs the first window too, whose LSD is 0 up to float noise; ours knows it is exactly 0
    above_one = (weights > 1 + 1e-5).float().mean().item()
    assert math.isclose(log["longce_weight_gt1_share"], above_one, rel_tol=1e-5)
    assert math.isclose(log["longce_max_weight"], weights.max().item(), rel_tol=1e-5)
    assert 0 < log["longce_weight_gt1_share"] < 1  # the case is not degenerate


def enable_checkpointing(model, kwargs):
    """The model's activation checkpointing under the installed transformers' name (renamed in 5.24)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_on(model):
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model("llama", VOCAB).train()
    batch = padded_batch(documents([37, 23]))
    loss_plain, grads_plain, _ = our_loss_and_grads(model, batch)
    enable_checkpointing(model, {"use_reentrant": False})
    loss_ckpt, grads_ckpt, _ = our_loss_and_grads(model, batch)
    assert checkpointing_on(model)
    torch.testing.assert_close(loss_ckpt, loss_plain, atol=1e-6, rtol=1e-6)
    assert_same_gradients(grads_ckpt, grads_plain)


@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
def test_either_checkpointing_name_works_on_this_transformers_without_warning(name):
    """transformers 5.24 renamed gradient_checkpointing (a deprecated alias that warns there); 5.17 knows only it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = make_args(**{name: True, f"{name}_kwargs": '{"use_reentrant": false}'})
        model = tiny_model("llama", VOCAB)
        _train(LongCETrainer, args, documents([30, 20]), "right", model)
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert args.gradient_checkpointing is True and args.activation_checkpointing is True
    assert args.gradient_checkpointing_kwargs == args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert checkpointing_on(model)  # the Trainer read it under the name it knows
    unset = make_args()
    assert unset.gradient_checkpointing is False and unset.activation_checkpointing is False


def test_both_checkpointing_names_with_different_values():
    with pytest.raises(
        ValueError,
        match=r"gradient_checkpointing=True and activation_checkpointing=False are two "
        r"names of one setting .* give only one of them",
    ):
        make_args(gradient_checkpointing=True, activation_checkpointing=False)
    assert make_args(gradient_checkpointing=True, activation_checkpointing=True).activation_checkpointing is True


def test_bf16_step_runs_and_is_close_to_float32():
    base = tiny_model("llama", VOCAB)
    rows = documents([40, 33])
    log32, _ = _train(LongCETrainer, make_args(), rows, "right", copy.deepcopy(base))
    log16, _ = _train(LongCETrainer, make_args(bf16=True), rows, "right", copy.deepcopy(base).to(torch.bfloat16))
    assert math.isfinite(log16["loss"]) and abs(log16["loss"] - log32["loss"]) < 0.05


def test_lora_trains_adapters_only_and_lora_on_lm_head_is_exact():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", VOCAB).train()
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )
    docs = documents([37, 23])
    ours, grads, _ = our_loss_and_grads(model, padded_batch(docs))
    assert grads and all("lora_" in name for name in grads)
    assert any("lm_head" in name for name in grads)  # the head's adapter is trained, not dropped
    assert_equals_reference(model, docs, ours, grads)


# --------------------------------------------------------------------------- LM-head loss


def plain_head_loss(head, hidden, targets, lp_short, gamma):
    """``sum w * nll`` from the full ``[N, V]`` logits of ``head``, the weights detached, as in weighted_loss."""
    logits = head.transform(head.head(hidden))
    lp = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    ratio = torch.exp(lp.detach() - lp_short).clamp(max=gamma)
    weights = torch.where(torch.isnan(lp_short), torch.ones_like(ratio), ratio)
    return (weights * -lp).sum(), -lp.detach(), weights


def head_loss_inputs(head, n=23, seed=1):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, head.head.in_features, generator=generator)
    targets = torch.randint(0, VOCAB, (n,), generator=generator)
    # Around a random model's log-probs, log(1/V): weights below 1, between 1 and the cap, and capped.
    lp_short = -math.log(VOCAB) + 3 * (torch.rand(n, generator=generator) - 0.5)
    lp_short[::3] = float("nan")  # no short score: weight 1
    return hidden, targets, lp_short


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: soft-capped logits
@pytest.mark.parametrize("implementation", [FusedLMHeadLoss, ChunkedLMHeadLoss])
def test_lm_head_loss_implementations_equal_plain_reference(arch, implementation):
    head = resolve_lm_head(tiny_model(arch, VOCAB))
    hidden, targets, lp_short = head_loss_inputs(head)
    loss_fn = implementation(chunk_bytes=4 * VOCAB * 5)  # 5 rows a chunk: several chunks, a ragged last one
    assert loss_fn.applies(head, hidden)
    ours_hidden = hidden.clone().requires_grad_()
    loss, nll, weights = loss_fn(head, ours_hidden, head.head.forward, targets, lp_short, 2.0)
    loss.backward()
    ours_grads = (ours_hidden.grad, head.head.weight.grad.clone())
    head.head.weight.grad = None
    reference_hidden = hidden.clone().requires_grad_()
    reference, reference_nll, reference_weights = plain_head_loss(head, reference_hidden, targets, lp_short, 2.0)
    reference.backward()
    assert reference_weights.max() == 2.0 and ((reference_weights > 1) & (reference_weights < 2)).any()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, reference_nll)
    torch.testing.assert_close(weights, reference_weights)
    torch.testing.assert_close(ours_grads[0], reference_hidden.grad)
    torch.testing.assert_close(ours_grads[1], head.head.weight.grad)


@pytest.mark.parametrize("implementation", [FusedLMHeadLoss, ChunkedLMHeadLoss, FirstApplicable])
def test_lm_head_loss_with_given_weights_equals_plain_weighted_ce(implementation):
    head = resolve_lm_head(tiny_model("gemma2", VOCAB))
    hidden, targets, lp_short = head_loss_inputs(head)
    given = torch.rand(len(targets), generator=torch.Generator().manual_seed(2)) * 4 + 0.5  # any values, not capped
    if implementation is FirstApplicable:
        loss_fn = select_lm_head_loss("auto", "cpu", chunk_bytes=4 * VOCAB * 5)
    else:
        loss_fn = implementation(chunk_bytes=4 * VOCAB * 5)
    ours_hidden = hidden.clone().requires_grad_()
    loss, nll, weights = loss_fn(head, ours_hidden, head.head.forward, targets, lp_short, 2.0, given)
    loss.backward()
    ours_grads = (ours_hidden.grad, head.head.weight.grad.clone())
    head.head.weight.grad = None
    # Reference: plain cross-entropy of the full logits, each row times its given weight (lp_short, gamma unused).
    reference_hidden = hidden.clone().requires_grad_()
    lp = head.transform(head.head(reference_hidden)).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    reference = (given * -lp).sum()
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, -lp.detach())
    torch.testing.assert_close(weights, given)
    torch.testing.assert_close(ours_grads[0], reference_hidden.grad)
    torch.testing.assert_close(ours_grads[1], head.head.weight.grad)


def test_select_lm_head_loss_by_kernel_device_and_head(monkeypatch):
    from peft import LoraConfig, get_peft_model

    plain = resolve_lm_head(tiny_model("llama", VOCAB))
    lora = resolve_lm_head(get_peft_model(tiny_model("llama", VOCAB), LoraConfig(r=2, target_modules=["lm_head"])))
    hidden = torch.zeros(3, plain.head.in_features)

    def kinds(kernel, device):
        return [type(loss) for loss in select_lm_head_loss(kernel, device).implementations]

    monkeypatch.setattr(lm_head_loss, "liger_available", lambda: True)
    assert kinds("auto", "cuda") == kinds("liger", "cpu") == [LigerLMHeadLoss, FusedLMHeadLoss, ChunkedLMHeadLoss]
    assert kinds("auto", "cpu") == kinds("ours", "cuda") == [FusedLMHeadLoss, ChunkedLMHeadLoss]
    # Liger needs CUDA hidden states: on the CPU "liger" falls back to ours, per head.
    chosen = select_lm_head_loss("liger", "cpu")
    assert type(chosen.choose(plain, hidden)) is FusedLMHeadLoss
    assert type(chosen.choose(lora, hidden)) is ChunkedLMHeadLoss
    assert not LigerLMHeadLoss().applies(plain, hidden)
    monkeypatch.setattr(lm_head_loss, "liger_available", lambda: False)
    assert kinds("auto", "cuda") == [FusedLMHeadLoss, ChunkedLMHeadLoss]
    for build in (lambda: select_lm_head_loss("liger", "cuda"), lambda: make_args(longce_loss_kernel="liger")):
        with pytest.raises(ValueError, match=r"longce_loss_kernel='liger' needs Liger-Kernel \(pip install"):
            build()


def test_trainer_computes_its_loss_through_lm_head_loss():
    model = tiny_model("llama", VOCAB).train()
    docs = documents([40, 29])
    trainer = LongCETrainer(model=model, args=make_args())
    assert trainer.lm_head_loss == select_lm_head_loss("auto", "cpu")
    calls = []

    class Recorded(LMHeadLoss):  # the chunked implementation on the plain head, calls recorded
        def __call__(self, head, hidden, project, targets, lp_short, gamma, weights=None):
            calls.append((hidden.shape, gamma, weights))
            return ChunkedLMHeadLoss()(head, hidden, project, targets, lp_short, gamma, weights)

    trainer.lm_head_loss = Recorded()
    model.zero_grad()
    loss = trainer.compute_loss(model, padded_batch(docs))
    loss.backward()
    assert calls == [((39 + 28, 32), GAMMA, None)]  # every label token once, this trainer's gamma, self-scored
    assert_equals_reference(model, docs, loss.detach(), gradients(model))


# --------------------------------------------------------------------------- bad input


def test_batch_without_labels_or_input_ids():
    model = tiny_model("llama", VOCAB)
    trainer = LongCETrainer(model=model, args=make_args())
    batch = padded_batch(documents([20]))
    with pytest.raises(ValueError, match="needs labels in every batch"):
        trainer.compute_loss(model, {k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="needs input_ids in every batch"):
        trainer.compute_loss(model, {k: v for k, v in batch.items() if k != "input_ids"})


def test_all_labels_ignored():
    model = tiny_model("llama", VOCAB)
    trainer = LongCETrainer(model=model, args=make_args())
    batch = padded_batch(documents([20]))
    batch["labels"][:] = -100
    with pytest.raises(ValueError, match="Every label of this batch is -100"):
        trainer.compute_loss(model, batch)
    with pytest.raises(ValueError, match="Every label of this batch is -100"):  # a step of no tokens at all
        trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(0))


def _train_with_unlabelled_micro_batch(trainer_cls, args, model):
    """One step of 3 accumulated micro-batches of one sequence each; the second sequence's labels are all -100."""
    rows = documents([24, 24, 24], seed=4)
    labels = [r.tolist() for r in rows]
    labels[1] = [-100] * len(labels[1])
    dataset = Dataset.from_dict({"input_ids": [r.tolist() for r in rows], "labels": labels})
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
    trainer.train()
    return trainer.state.log_history[0], model


@pytest.mark.parametrize(
    "overrides", [dict(longce_weights="none"), dict(longce_trunc_len=64)], ids=["plain-ce", "self"]
)
def test_an_unlabelled_micro_batch_of_an_accumulated_step_trains_like_stock_trainer(overrides):
    """Its tokens count 0 in num_items_in_batch and it adds 0 to the loss and the gradients: the update and
    the logged loss are stock Trainer's (self-scored LongCE with K beyond the sequences weighs every token 1)."""
    base = tiny_model("llama", VOCAB)
    common = dict(gradient_accumulation_steps=3, per_device_train_batch_size=1, max_steps=1)
    stock_log, stock = _train_with_unlabelled_micro_batch(
        Trainer, make_args(TrainingArguments, **common), copy.deepcopy(base)
    )
    ours_log, ours = _train_with_unlabelled_micro_batch(
        LongCETrainer, make_args(**common, **overrides), copy.deepcopy(base)
    )
    assert math.isfinite(stock_log["loss"])
    assert math.isclose(ours_log["loss"], stock_log["loss"], rel_tol=1e-5)
    moved = False
    for (name, p), q, b in zip(stock.named_parameters(), ours.parameters(), base.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
        moved |= not torch.equal(p, b)
    assert moved
    assert math.isclose(ours_log["ce_loss"], ours_log["loss"], rel_tol=1e-4)  # the mean over the 2 x 23 labels


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("longce_gamma", 0.0, "longce_gamma must be > 0"),
        ("longce_gamma", -1.0, "longce_gamma must be > 0"),
        ("longce_gamma", float("nan"), "longce_gamma must be a finite number > 0"),
        ("longce_gamma", float("inf"), "longce_gamma must be a finite number > 0"),
        ("longce_trunc_len", 0, r"longce_trunc_len \(K\) must be an integer >= 1"),
        ("longce_sliding_window", 0, r"longce_sliding_window \(d\) must be an integer >= 1"),
        ("longce_max_tokens_per_batch", 0, "longce_max_tokens_per_batch must be"),
        ("longce_loss_kernel", "fast", "longce_loss_kernel must be one of"),
        ("longce_loss_chunk_bytes", 0, "longce_loss_chunk_bytes must be an integer >= 1"),
        ("longce_plain_ce", "false", "longce_plain_ce must be True or False"),
        ("longce_compile_windows", 1, "longce_compile_windows must be True or False"),
    ],
)
def test_bad_settings(setting, value, message):
    with pytest.raises(ValueError, match=message):
        make_args(**{setting: value})


def test_longce_settings_is_deprecated_and_still_reads_a_longce_config():
    """One release more: importing or building LongCESettings warns, naming LongCEConfig, and works."""
    import longce

    with pytest.warns(FutureWarning, match=r"LongCESettings is deprecated.*use LongCEConfig"):
        from longce.config import LongCESettings
    with pytest.warns(FutureWarning, match=r"LongCESettings is deprecated.*use LongCEConfig"):
        assert longce.LongCESettings is LongCESettings
    assert "LongCESettings" not in dir(longce)
    with pytest.warns(FutureWarning, match=r"LongCESettings is deprecated.*use LongCEConfig"):
        settings = LongCESettings(gamma=2.5, trunc_len=16)
    assert isinstance(settings.config, LongCEConfig) and settings.config.longce_gamma == 2.5
    assert (settings.gamma, settings.trunc_len, settings.sliding_window, settings.plain_ce) == (2.5, 16, 1024, False)
    assert (settings.window.trunc_len, settings.longce_rule.gamma) == (16, 2.5)
    with pytest.warns(FutureWarning, match="LongCESettings is deprecated"):
        assert (
            LongCESettings.from_args(make_args(longce_gamma=2.5, longce_trunc_len=16, longce_sliding_window=1024))
            == settings
        )
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="longce_gamma must be > 0"):
        LongCESettings(gamma=0.0)  # checked by LongCEConfig, under its field's name
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match=r"no setting\(s\) \['gama'\].*use LongCEConfig"):
        LongCESettings(gama=2.0)


def test_the_trainers_longce_attribute_is_deprecated_and_reads_its_config():
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(longce_gamma=2.5))
    with pytest.warns(FutureWarning, match=r"LongCETrainer.longce .* is deprecated.*trainer.args") as caught:
        settings = trainer.longce
    assert len(caught) == 1 and (settings.gamma, settings.trunc_len, settings.window.sliding_window) == (2.5, K, D)
    with pytest.raises(AttributeError, match="can no longer be set.*longce_\\* fields of trainer.args"):
        trainer.longce = settings


def test_longce_plain_ce_is_deprecated_and_sets_longce_weights_none():
    with pytest.warns(FutureWarning, match=r"longce_plain_ce is deprecated.*use longce_weights='none'"):
        args = make_args(longce_plain_ce=True)
    assert args.longce_weights == "none"
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=args)
    assert type(trainer.weight_source).__name__ == "NoWeights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default (False) and its replacement do not warn
        assert make_args(longce_weights="none").longce_weights == "none" and make_args().longce_weights == "self"
    with pytest.raises(ValueError, match="set only one of them"):
        make_args(longce_plain_ce=True, longce_weights="cache")


def test_infinite_gamma_is_refused_by_the_trainer_and_the_metric_alike():
    """One rule (longppl.settings.require_gamma): the trainer's settings, its dataset step and the
    metric's key-token rule refuse an infinite cap with the same message, under their own names."""
    from longce import add_key_token_weights
    from longppl.settings import KeyTokenRule

    def message(name):
        return (
            rf"^{name} must be a finite number > 0 \(it caps the soft weights min\(exp\(LSD\), {name}\); infinity "
            r"would leave them unbounded: use a large finite cap instead\), got inf\.$"
        )

    with pytest.raises(ValueError, match=message("longce_gamma")):
        make_args(longce_gamma=math.inf)
    for build in (
        lambda: KeyTokenRule(soft=True, gamma=math.inf),
        lambda: add_key_token_weights(Dataset.from_dict({"text": ["a"]}), None, None, gamma=math.inf),
    ):
        with pytest.raises(ValueError, match=message("gamma")):
            build()


def test_model_without_causal_lm_head():
    from transformers import LlamaModel

    backbone = LlamaModel(tiny_model("llama", VOCAB).config)
    with pytest.raises(ValueError, match="not a causal language model with an LM head"):
        LongCETrainer(model=backbone, args=make_args())


def test_context_parallelism_is_refused_with_self_scored_weights():
    # (with longce_weights="cache" it runs: test_longce_context_parallel.py)
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args())
    trainer.accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2, sp_size=1))
    with pytest.raises(ValueError, match=r"context parallelism \(cp_size=2\) only with longce_weights='cache'"):
        trainer._refuse_context_parallelism()
    trainer.accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=1, sp_size=2))
    with pytest.raises(ValueError, match=r"does not support sequence parallelism \(sp_size=2"):
        trainer._refuse_context_parallelism()


def test_data_parallel_is_refused():
    args = make_args()
    args._n_gpu = 2  # what TrainingArguments finds on a machine with 2 GPUs and no distributed launch
    with pytest.raises(ValueError, match="does not support torch.nn.DataParallel"):
        LongCETrainer(model=tiny_model("llama", VOCAB), args=args)


def test_plain_training_arguments_get_longce_defaults():
    given = make_args(TrainingArguments, learning_rate=3e-3, save_strategy="steps", save_steps=7, hub_token="secret")
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=given)
    # Converted into a LongCEConfig once (TRL's pattern): every TrainingArguments field kept, LongCE's defaults.
    assert type(trainer.args) is LongCEConfig
    for spec in dataclasses.fields(TrainingArguments):
        if spec.init:
            assert getattr(trainer.args, spec.name) == getattr(given, spec.name), spec.name
    defaults = {spec.name: spec.default for spec in dataclasses.fields(LongCEConfig) if spec.name.startswith("longce_")}
    assert {name: getattr(trainer.args, name) for name in defaults} == defaults
    assert (trainer.args.longce_trunc_len, trainer.args.longce_sliding_window, trainer.args.longce_gamma) == (
        4096,
        1024,
        5.0,
    )
    assert type(trainer.weight_source).__name__ == "SelfScoredWeights"
    # Given positionally too (Trainer's order: model, args); a LongCEConfig is used as it is.
    assert type(LongCETrainer(tiny_model("llama", VOCAB), given).args) is LongCEConfig
    config = make_args(longce_gamma=2.5)
    assert LongCETrainer(model=tiny_model("llama", VOCAB), args=config).args is config


def test_evaluation_logs_eval_statistics():
    base = tiny_model("llama", VOCAB)
    rows = documents([40, 33, 21, 35])
    per_token = []
    with torch.no_grad():
        reference_loss(base.train(), rows, per_token=per_token)
    weights, nll = per_token
    dataset = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})
    trainer = LongCETrainer(
        model=base, args=make_args(per_device_eval_batch_size=2), eval_dataset=dataset, data_collator=collate("right")
    )
    metrics = trainer.evaluate()
    assert math.isclose(metrics["eval_ce_loss"], nll.mean().item(), rel_tol=1e-5)
    assert math.isclose(metrics["eval_longce_mean_weight"], weights.mean().item(), rel_tol=1e-5)
    assert "longce_mean_weight" not in metrics and "train" not in trainer._longce_stats


def _blocks(count, length, seed):
    """run_clm's evaluation data: ``count`` blocks of ``length`` tokens, ``labels`` = ``input_ids``."""
    ids = [row.tolist() for row in documents([length] * count, seed=seed)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def plain_mean_nll(model, docs):
    """Cross-entropy of each document's tokens 1.. given their prefix, averaged over all those tokens."""
    model.eval()
    with torch.no_grad():
        nll = [F.cross_entropy(model(input_ids=d[None]).logits[0, :-1].float(), d[1:], reduction="sum") for d in docs]
    return (sum(nll) / sum(len(d) - 1 for d in docs)).item()


def test_eval_perplexity_is_plain_ce_and_matches_a_stock_trainers_exp_eval_loss():
    """run_clm's perplexity is exp(eval_loss); ours is LongCE's loss, so eval_perplexity = exp(eval_ce_loss) is
    the one to compare. Five blocks in eval batches of 2, 2 and 1, after a LongCE step with accumulation 2."""
    model = tiny_model("llama", VOCAB)
    evaluation = _blocks(5, 30, seed=5)
    args = make_args(
        per_device_eval_batch_size=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=0.01,
    )
    trainer = LongCETrainer(
        model=model,
        args=args,
        train_dataset=_blocks(2, 30, seed=6),
        eval_dataset=evaluation,
        data_collator=default_data_collator,
    )
    trainer.train()
    ours = trainer.evaluate()
    stock = Trainer(
        model=model,
        args=make_args(TrainingArguments, per_device_eval_batch_size=2),
        eval_dataset=evaluation,
        data_collator=default_data_collator,
    ).evaluate()
    assert math.isclose(ours["eval_perplexity"], math.exp(stock["eval_loss"]), rel_tol=1e-5)
    assert math.isclose(ours["eval_perplexity"], math.exp(ours["eval_ce_loss"]), rel_tol=1e-6)
    docs = [torch.tensor(row) for row in evaluation["input_ids"]]
    assert math.isclose(ours["eval_perplexity"], math.exp(plain_mean_nll(model, docs)), rel_tol=1e-5)
    # not degenerate: the LongCE weights move eval_loss away from plain CE
    assert abs(ours["eval_loss"] - stock["eval_loss"]) > 1e-3


def test_eval_perplexity_averages_over_tokens_when_sequences_differ_in_length():
    """Padded sequences of unequal lengths: the corpus perplexity over every label token (stock eval_loss
    averages per-batch means there, weighted by sequences, which is another number)."""
    model = tiny_model("llama", VOCAB)
    docs = documents([40, 12, 33, 25, 19], seed=7)
    common = dict(eval_dataset=_eval_dataset(docs), data_collator=collate("right"))
    ours = LongCETrainer(model=model, args=make_args(per_device_eval_batch_size=2), **common).evaluate()
    stock = Trainer(model=model, args=make_args(TrainingArguments, per_device_eval_batch_size=2), **common).evaluate()
    # padded_batch leaves each document's first token unlabelled, as plain_mean_nll scores it
    assert math.isclose(ours["eval_perplexity"], math.exp(plain_mean_nll(model, docs)), rel_tol=1e-5)
    assert not math.isclose(ours["eval_perplexity"], math.exp(stock["eval_loss"]), rel_tol=1e-5)


@pytest.mark.parametrize(
    "metric, given, expected",
    [
        ("eval_perplexity", None, False),
        ("eval_ce_loss", None, False),
        ("eval_accuracy", None, True),
        ("eval_perplexity", True, True),
    ],
)
def test_metric_for_best_model_perplexity_is_minimised(metric, given, expected):
    args = make_args(metric_for_best_model=metric, greater_is_better=given)
    assert args.greater_is_better is expected
    help_text = LongCEConfig.__dataclass_fields__["metric_for_best_model"].metadata["help"]
    assert "eval_loss" in help_text and "eval_ce_loss" in help_text and "eval_perplexity" in help_text


# --------------------------------------------------------------------------- predictions and metrics


def _eval_dataset(rows):
    return Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})


def greedy_documents(model, lengths, prefix=6):
    """Random prefixes continued by the model's own argmax: an accuracy strictly between 0 and 1."""
    docs = []
    with torch.no_grad():
        for doc in documents([prefix] * len(lengths), seed=3):
            while len(doc) < lengths[len(docs)]:
                doc = torch.cat([doc, model(input_ids=doc[None]).logits[0, -1].argmax()[None]])
            docs.append(doc)
    return docs


def test_compute_metrics_gets_real_logits_and_argmax_accuracy_matches_plain_model():
    model = tiny_model("llama", VOCAB)
    rows = greedy_documents(model, [40, 33, 21, 35])
    seen = {}

    def accuracy(eval_pred):
        logits, labels = eval_pred.predictions, eval_pred.label_ids
        seen["shape"] = logits.shape
        predicted, targets = logits.argmax(-1)[:, :-1], labels[:, 1:]
        scored = targets != -100
        return {"accuracy": float((predicted[scored] == targets[scored]).mean())}

    trainer = LongCETrainer(
        model=model,
        args=make_args(per_device_eval_batch_size=2),
        eval_dataset=_eval_dataset(rows),
        data_collator=collate("right"),
        compute_metrics=accuracy,
    )
    metrics = trainer.evaluate()
    assert seen["shape"] == (4, 40, VOCAB)
    with torch.no_grad():  # plain reference: the model's own logits, one document at a time
        hits = [(model(input_ids=doc[None]).logits[0, :-1].argmax(-1) == doc[1:]) for doc in rows]
    expected = torch.cat(hits).float().mean().item()
    assert 0.5 < expected < 1 and math.isclose(metrics["eval_accuracy"], expected, rel_tol=1e-6)
    # The loss and the LongCE statistics are those of a loss-only evaluation.
    loss_only = LongCETrainer(
        model=model,
        args=make_args(per_device_eval_batch_size=2),
        eval_dataset=_eval_dataset(rows),
        data_collator=collate("right"),
    ).evaluate()
    for key in ("eval_loss", *(f"eval_{k}" for k in _STAT_KEYS)):
        assert math.isclose(metrics[key], loss_only[key], rel_tol=1e-6), key


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_predict_returns_the_models_logits_and_test_prefixed_statistics(arch):
    model = tiny_model(arch, VOCAB)
    rows = documents([40, 33, 21, 35])
    per_token = []
    with torch.no_grad():
        reference_loss(model, rows, per_token=per_token)
    weights, nll = per_token
    trainer = LongCETrainer(model=model, args=make_args(per_device_eval_batch_size=4), data_collator=collate("right"))
    output = trainer.predict(_eval_dataset(rows))
    batch = padded_batch(rows)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert output.predictions.shape == (4, 40, VOCAB)
    torch.testing.assert_close(torch.from_numpy(output.predictions), expected, atol=1e-5, rtol=1e-5)
    metrics = output.metrics
    assert {f"test_{key}" for key in _STAT_KEYS} <= set(metrics)
    assert math.isclose(metrics["test_ce_loss"], nll.mean().item(), rel_tol=1e-5)
    assert math.isclose(metrics["test_longce_mean_weight"], weights.mean().item(), rel_tol=1e-5)
    assert not any(key.startswith("eval_") for key in metrics) and not trainer._longce_stats


def test_training_and_loss_only_evaluation_keep_the_stand_in_logits():
    model = tiny_model("llama", VOCAB).train()
    trainer = LongCETrainer(model=model, args=make_args())
    _, outputs = trainer.compute_loss(model, padded_batch(documents([20, 15])), return_outputs=True)
    assert outputs.logits.shape == (2, 20, 0)
    loss, logits, _ = trainer.prediction_step(
        model.eval(), padded_batch(documents([20, 15])), prediction_loss_only=True
    )
    assert logits is None and torch.isfinite(loss)


# --------------------------------------------------------------------------- sequences too short for LongCE


def test_sequences_no_longer_than_k_plus_d_warn_once(caplog):
    model = tiny_model("llama", VOCAB).train()
    trainer = LongCETrainer(model=model, args=make_args())
    short = padded_batch(documents([K + D, 9]))  # K + d = 13: the first window is the whole context
    with caplog.at_level("WARNING", logger="longce.trainer"):
        trainer.compute_loss(model, short)
        trainer.compute_loss(model, short)
    messages = [r.getMessage() for r in caplog.records if r.name == "longce.trainer"]
    assert len(messages) == 1, messages
    assert "K + d = 13 tokens (longest: 13; longce_trunc_len K=8, longce_sliding_window d=5)" in messages[0]
    assert "plain cross-entropy" in messages[0] and "smaller longce_trunc_len" in messages[0]
    # Per trainer: a new trainer warns again; long enough sequences and plain CE (longce_weights 'none') do not warn.
    caplog.clear()
    with caplog.at_level("WARNING", logger="longce.trainer"):
        LongCETrainer(model=model, args=make_args()).compute_loss(model, padded_batch(documents([K + D + 1])))
        LongCETrainer(model=model, args=make_args(longce_weights="none")).compute_loss(model, short)
        assert not caplog.records
        LongCETrainer(model=model, args=make_args()).compute_loss(model, short)
    assert len(caplog.records) == 1


# --------------------------------------------------------------------------- imports

IMPORTS = r"""
import json, sys
heavy = lambda: sorted(m for m in ("torch", "transformers", "datasets", "pyarrow") if m in sys.modules)
import longce
report = {"import longce": heavy()}
from longce import LongCEConfig
report["LongCEConfig"] = heavy()
from longce import LongCETrainer
report["LongCETrainer"] = heavy()
report["lazy"] = [longce.LongCETrainer is longce.trainer.LongCETrainer, longce.longce_weights.__module__]
report["all"] = all(getattr(longce, name) is not None for name in longce.__all__)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_import_longce_is_light_and_longce_config_needs_no_datasets(tmp_path):
    from longppl import register

    register.register_metric(str(tmp_path))  # a current copy: `import longppl` does not load evaluate for it
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(tmp_path))
    done = run_guarded([sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["import longce"] == []
    assert report["LongCEConfig"] == ["torch", "transformers"]  # TrainingArguments needs torch, not datasets
    assert "datasets" in report["LongCETrainer"]  # transformers' Trainer imports it: the check above can fail
    assert report["lazy"] == [True, "longce.weighted_loss"] and report["all"]
    with pytest.raises(AttributeError, match="has no attribute 'LongCETrainr'"):
        import longce

        longce.LongCETrainr  # noqa: B018
