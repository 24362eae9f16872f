"""Context parallelism with cached weights (``longce_weights="cache"``, ``cp_size > 1``), on one process.

torch's ring attention has no CPU kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` has
no context-parallel handler in torch 2.13), so a real CP run needs GPUs
(``scripts/check_context_parallel.py``). Here the Trainer's own ``training_step`` /
``prediction_step`` run once per emulated CP rank: the accelerator's ``maybe_context_parallel``
is replaced by a stand-in that shards the Trainer's buffers in place exactly as torch's
``context_parallel`` does (its head-tail load-balancing order, then the rank's chunk). The model
is position-local (value and output projections zero: a position's output depends on its token
only), so a shard's forward equals the full forward at the shard's positions, and the mean of the
ranks' losses and gradients (what averaging over the CP group gives) must equal a plain weighted
cross-entropy of the whole batch, written here.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import one_step_args, tiny_model
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer
from transformers import DataCollatorWithFlattening

from longce import LongCEConfig, LongCETrainer
from longce.cached_weights import LongCEWeightsCollator
from longce.trainer import SHIFT_WEIGHTS

VOCAB, CP = 97, 2


def rows_with_weights(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, VOCAB, (n,), generator=generator).tolist(),
            "longce_weights": (torch.rand(n, generator=generator) * 4 + 0.25).tolist(),
        }
        for n in lengths
    ]


def position_local_model():
    """A tiny Llama whose attention adds nothing (v_proj = o_proj = 0): outputs depend on each token alone."""
    model = tiny_model("llama", VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.zero_()
            layer.self_attn.o_proj.weight.zero_()
    return model.train()


def reference_loss(model, rows):
    """Plain weighted CE, each row alone: position t predicts token t+1 with weight w[t+1], over all label tokens."""
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor(row["input_ids"])
        nll = F.cross_entropy(model(input_ids=ids[None]).logits[0, :-1].float(), ids[1:], reduction="none")
        total = total + (torch.tensor(row["longce_weights"])[1:] * nll).sum()
        count += len(ids) - 1
    return total / count


class EmulatedCPAccelerator:
    """The trainer's accelerator seen as rank ``rank`` of a CP group of ``CP`` processes (the whole world):
    ``maybe_context_parallel`` shards its buffers in place as torch's ``context_parallel`` does
    (``no_restore_buffers`` stay sharded) and records them; ``gather`` returns ``CP`` copies (every CP
    rank holds the same batch, so the same token count)."""

    def __init__(self, real, rank: int):
        self._real, self.rank, self.num_processes = real, rank, CP
        self.parallelism_config = SimpleNamespace(
            cp_enabled=True, cp_backend="torch", cp_size=CP, sp_size=1, tp_size=1, non_data_parallel_size=CP
        )
        self.given: list[tuple[torch.Tensor, int]] = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def gather(self, tensor):
        return tensor.reshape(-1).repeat(CP)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
        assert set(no_restore_buffers) == set(buffers)  # the Trainer keeps every shard: nothing to restore
        length = buffers[0].shape[1]
        balancer = _create_default_load_balancer(length, CP, "cpu")
        order = balancer._generate_indices() if balancer is not None else torch.arange(length)[None]  # [1, T]
        for buffer, dim in zip(buffers, buffer_seq_dims):
            assert dim == 1 and buffer.shape[1] == length
            self.given.append((buffer.clone(), dim))
            shard = buffer.gather(1, order.expand(buffer.shape[0], -1)).chunk(CP, dim=1)[self.rank].clone()
            buffer.resize_(shard.shape)
            buffer.copy_(shard)
        yield


@pytest.fixture
def cp_trainer(monkeypatch, tmp_path):
    """``make(rank)``: a cache-mode ``LongCETrainer`` on the position-local model, as CP rank ``rank``."""
    # Trainer reads the world size from the arguments (to gather token counts); the world is the CP group.
    monkeypatch.setattr(LongCEConfig, "world_size", property(lambda self: CP))

    def make(rank: int) -> LongCETrainer:
        args = one_step_args(
            LongCEConfig, output_dir=str(tmp_path), longce_weights="cache", average_tokens_across_devices=True
        )
        trainer = LongCETrainer(model=position_local_model(), args=args)
        trainer.accelerator = EmulatedCPAccelerator(trainer.accelerator, rank)
        trainer.model.config._attn_implementation = "sdpa"  # Trainer's CP check (the only backend it shards for)
        return trainer

    return make


def grads_of(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def stack_rows(features):
    """Rows of one length as ``[B, T]`` with labels and an all-ones attention mask (sharded too)."""
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


COLLATORS = {
    # packed documents with position_ids, no attention mask; 13 + 9 + 10 = 32 tokens (torch's balancer wants 2*CP | T)
    "packed": (DataCollatorWithFlattening(), [13, 9, 10]),
    "rows": (stack_rows, [12, 12]),
}


@pytest.mark.parametrize("name", COLLATORS)
def test_cp_ranks_together_equal_the_whole_batch(name, cp_trainer):
    collator, lengths = COLLATORS[name]
    rows = rows_with_weights(lengths, seed=3)

    reference_model = position_local_model()
    reference = reference_loss(reference_model, rows)
    reference.backward()
    expected = grads_of(reference_model)

    losses, grads, seen = [], {}, []
    for rank in range(CP):
        trainer = cp_trainer(rank)
        batch = LongCEWeightsCollator(collator)(rows)
        # Counted by Trainer on the whole batch before sharding: CP copies gathered, divided by cp_size.
        num_items = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
        assert num_items == sum(n - 1 for n in lengths)
        losses.append(trainer.training_step(trainer.model, batch, num_items))
        for key, grad in grads_of(trainer.model).items():
            grads[key] = grads.get(key, 0) + grad / CP  # FSDP averages gradients over the CP group
        seen.append(trainer.accelerator.given)

    torch.testing.assert_close(torch.stack(losses).mean(), reference.detach(), atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], atol=1e-5, rtol=1e-4, msg=key)

    # Every rank got the same buffers, the weights among them, shifted like shift_labels before sharding.
    given = [torch.tensor(r["longce_weights"]) for r in rows]
    expected_shift = torch.cat(given)[None, 1:] if name == "packed" else torch.stack(given)[:, 1:]
    for buffers in seen:
        shifted = [tensor for tensor, _ in buffers if tensor.dtype == torch.float32]
        assert len(buffers) == (6 if name == "rows" else 5) and len(shifted) == 1  # + attention_mask
        torch.testing.assert_close(shifted[0][:, :-1], expected_shift)


def test_the_shards_pair_each_position_with_its_target_and_weight(cp_trainer):
    """What each rank trains on: position p (global index) with target ids[p+1] and weight w[p+1]."""
    rows = rows_with_weights([13, 9, 10], seed=4)
    distinct = (torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(4))[:32] + 3).split([13, 9, 10])
    for row, tokens in zip(rows, distinct):  # distinct tokens: a token tells its global index
        row["input_ids"] = tokens.tolist()
    ids = torch.cat(distinct)
    weights = torch.cat([torch.tensor(r["longce_weights"]) for r in rows])
    starts = {0, 13, 22}  # first token of each document: predicted by no position
    covered = []
    for rank in range(CP):
        trainer = cp_trainer(rank)
        batch = LongCEWeightsCollator()(rows)
        cp_context, inputs = trainer._prepare_context_parallel_inputs(trainer.model, batch)
        assert "longce_weights" not in inputs and SHIFT_WEIGHTS in inputs
        with cp_context():
            positions = inputs["position_ids"][0]  # within each document
            local_ids, targets = inputs["input_ids"][0], inputs["shift_labels"][0]
            local_weights = trainer._position_weights(inputs, inputs["input_ids"])[0]
        assert local_ids.shape[0] == ids.shape[0] // CP
        for token, position, target, weight in zip(local_ids, positions, targets, local_weights):
            p = int((ids == token).nonzero())
            assert position == p - max(s for s in starts if s <= p)  # position_ids went with their tokens
            covered.append(p)
            if p + 1 in starts or p + 1 == ids.shape[0]:
                assert target == -100
            else:
                assert target == ids[p + 1] and weight == pytest.approx(weights[p + 1].item())
    assert sorted(covered) == list(range(ids.shape[0]))  # the ranks' positions: every position once


def test_evaluation_under_cp_equals_the_whole_batch(cp_trainer):
    rows = rows_with_weights([13, 9, 10], seed=5)
    with torch.no_grad():
        reference = reference_loss(position_local_model(), rows)
    losses = []
    for rank in range(CP):
        trainer = cp_trainer(rank)
        loss, _, _ = trainer.prediction_step(trainer.model, LongCEWeightsCollator()(rows), prediction_loss_only=True)
        losses.append(loss)
    torch.testing.assert_close(torch.stack(losses).mean(), reference, atol=1e-5, rtol=1e-5)


def test_cache_mode_accepts_cp_and_self_mode_refuses_it(cp_trainer):
    trainer = cp_trainer(0)
    trainer._refuse_context_parallelism()  # cache weights: no error
    trainer.args.longce_weights = "self"
    with pytest.raises(ValueError, match="only with longce_weights='cache'"):
        trainer._refuse_context_parallelism()


def test_unsharded_weights_are_caught(cp_trainer):
    """Weights that missed the sharding (e.g. a Trainer that builds its buffers otherwise) are an error, not
    weights of other tokens."""
    trainer = cp_trainer(0)
    batch = LongCEWeightsCollator()(rows_with_weights([13, 9, 10]))
    cp_context, inputs = trainer._prepare_context_parallel_inputs(trainer.model, batch)
    inputs[SHIFT_WEIGHTS] = inputs[SHIFT_WEIGHTS].clone()  # no longer the buffer that gets sharded
    with (
        cp_context(),
        pytest.raises(ValueError, match=r"longce_shift_weights has shape \(1, 32\) but input_ids \(1, 16\)"),
    ):
        trainer.compute_loss(trainer.model, inputs)
