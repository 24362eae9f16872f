"""Worker of test_longce_fsdp2.py: LongCETrainer on a saved dataset, with or without FSDP2.

    accelerate launch --multi_gpu --num_processes 2 ... tests/distributed/fsdp2_longce_worker.py MODE DATA OUTPUT_DIR PER_DEVICE_BATCH fsdp2
    (or, in the test's own process: run(MODE, DATA, OUTPUT_DIR, PER_DEVICE_BATCH, fsdp2=False))

MODE is the ``longce_weights`` setting ("cache" or "self"). Writes ``OUTPUT_DIR/result.json`` (rank 0):
``{"world_size", "distributed_type", "log_history", "sharded"}`` and ``OUTPUT_DIR/weights.safetensors``,
the full (gathered) trained weights.

Why the worker patches accelerate: accelerate 1.15 takes FSDP only on accelerator devices. On CPU,
``PartialState._prepare_backend`` (accelerate/state.py) gives ``MULTI_CPU`` (with ``use_cpu``) or
``NO`` (without), and ``AcceleratorState.__init__`` sets ``distributed_type = FSDP`` and keeps the
``fsdp_plugin`` only in the branch for MULTI_GPU / MLU / SDAA / MUSA / NPU / XPU / HPU / NEURON, so an
FSDP config on CPU silently trains with DDP (or one process). torch's ``fully_shard`` itself runs
on CPU over gloo, so ``allow_fsdp_on_cpu`` does what that branch does for GPUs, and everything after
it is accelerate's and Trainer's own FSDP2 code (``fsdp2_prepare_model``: ``fully_shard`` per decoder
layer and on the root, DTensor parameters, all-gather / reduce-scatter over gloo). The worker checks
that the parameters really are sharded (``sharded`` in the result).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from helpers import one_step_args, tiny_model

from longce import LongCEConfig, LongCETrainer

VOCAB, STEPS = 97, 2


def allow_fsdp_on_cpu() -> None:
    """Make accelerate keep the FSDP plugin on a gloo/CPU process group (see the module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            self.fsdp_plugin = fsdp_plugin
        # Every later AcceleratorState() (e.g. AcceleratedOptimizer's) copies PartialState's MULTI_CPU
        # over the shared state again: keep FSDP for as long as the plugin is there.
        if getattr(self, "fsdp_plugin", None) is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


def full_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Every parameter gathered to full size (a collective: call on every rank), and the local shard
    shape of each parameter that is a DTensor."""
    from torch.distributed.tensor import DTensor

    weights, shards = {}, {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            shards[name] = list(param.to_local().shape)
            param = param.full_tensor()
        weights[name] = param.detach().clone().contiguous()
    return weights, shards


def run(mode: str, data: str, output_dir: str, per_device_batch: int, fsdp2: bool) -> LongCETrainer:
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import DataCollatorWithFlattening

    extra = {}
    if fsdp2:
        allow_fsdp_on_cpu()
        extra = dict(
            fsdp="full_shard",
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
        )
    args = one_step_args(
        LongCEConfig,
        output_dir=output_dir,
        longce_weights=mode,
        longce_trunc_len=8,
        longce_sliding_window=4,
        per_device_train_batch_size=per_device_batch,
        max_steps=STEPS,
        learning_rate=1e-2,
        train_sampling_strategy="sequential",  # process r takes the r-th per-device batch of each global batch
        dataloader_drop_last=True,
        average_tokens_across_devices=True,  # normalise by the tokens of the whole global batch
        **extra,
    )
    dataset = load_from_disk(data)
    if mode == "self":
        dataset = dataset.remove_columns("longce_weights")
    trainer = LongCETrainer(
        model=tiny_model("llama", VOCAB),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    weights, shards = full_weights(trainer.model_wrapped)
    if trainer.args.process_index == 0:
        os.makedirs(output_dir, exist_ok=True)
        save_file(weights, os.path.join(output_dir, "weights.safetensors"))
        with open(os.path.join(output_dir, "result.json"), "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "world_size": trainer.args.world_size,
                    "distributed_type": str(trainer.accelerator.distributed_type),
                    "sharded": shards,
                    "log_history": trainer.state.log_history,
                },
                handle,
            )
    return trainer


if __name__ == "__main__":
    from longce.cli import close_process_group

    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "fsdp2")
    close_process_group()
