#!/usr/bin/env python
"""Context parallelism with cached LongCE weights on 2 GPUs, checked against one GPU without it.

    python scripts/check_context_parallel.py --json cp.json

trains a tiny random Llama (float32, SDPA) a few steps with ``LongCETrainer`` and
``longce_weights="cache"`` twice, from one saved initial model on the same batches (sequential
order): on one GPU without any parallelism (the baseline), then under ``accelerate launch
--num_processes 2`` with accelerate's context parallelism (``ParallelismConfig(cp_size=2)``, FSDP2:
each rank holds half of every sequence, torch's ring attention). Every step logs the loss, the
gradient norm and the LongCE statistics; the script prints the largest relative difference of each
between the two runs and of the trained weights, writes them to ``--json``, and exits with status
1 when one exceeds ``--tolerance`` (float32; ring attention merges partial softmaxes, so the sums run
in another order). Gradient accumulation (2 steps) is on in both runs, so the token count that
normalises the loss spans micro-batches and ranks as in real training.

Rows are single documents of ``--length`` tokens (no padding, no packing: under context parallelism
accelerate replaces every attention mask by plain causal attention, so packed documents would see
each other there and not in the baseline). ``--length`` must be a multiple of 4 (torch's
load-balanced split into 2 x cp_size chunks). Nothing is downloaded: the model comes from a config,
the tokens and weights are random.

``--role single`` / ``--role cp`` with ``--work DIR`` run one side alone (what the driver starts).
Like every script, it imports ``longppl`` and ``longce`` as installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

KEYS = ("loss", "grad_norm", "ce_loss", "longce_mean_weight", "longce_weight_gt1_share", "longce_max_weight")
VOCAB, ROWS = 256, 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this JSON file (default: only print them)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per row, a multiple of 4 (default 1024)")
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest relative difference allowed (default 1e-4)"
    )
    parser.add_argument("--role", choices=["driver", "single", "cp"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    return parser


def prepare(work: str, length: int) -> None:
    """The initial model and the dataset (ids, labels, weights), saved once for both runs."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        # as many key/value heads as query heads: with grouped-query attention SDPA takes enable_gqa,
        # which float32 can only run in the math kernel, and torch's ring attention has no rule for it
        # (first GPU run: "aten.add.Tensor got mixed torch.Tensor and DTensor")
        num_key_value_heads=4,
        max_position_embeddings=length,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    LlamaForCausalLM(config).save_pretrained(os.path.join(work, "init"))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (ROWS, length), generator=generator)
    # weights in [0.25, 5] (gamma = 5), most above 1: far from plain CE, so a misplaced weight shows
    weights = (torch.rand(ROWS, length, generator=generator) * 4.75 + 0.25).clamp(max=5.0)
    Dataset.from_dict(
        {"input_ids": ids.tolist(), "labels": ids.tolist(), "longce_weights": weights.tolist()}
    ).save_to_disk(os.path.join(work, "data"))


def train(work: str, role: str, steps: int) -> None:
    """One side: ``single`` (one process, no parallelism) or ``cp`` (2 processes, cp_size=2, FSDP2)."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, default_data_collator

    from longce import LongCEConfig, LongCETrainer

    extra = {}
    if role == "cp":
        from accelerate.parallelism_config import ParallelismConfig

        extra = dict(
            parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=1, dp_replicate_size=1, tp_size=1),
            fsdp="full_shard",
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
        )
    args = LongCEConfig(
        output_dir=os.path.join(work, role),
        longce_weights="cache",
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        average_tokens_across_devices=True,
        seed=0,
        **extra,
    )
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(work, "init"), dtype=torch.float32, attn_implementation="sdpa"
    )
    trainer = LongCETrainer(
        model=model,
        args=args,
        train_dataset=load_from_disk(os.path.join(work, "data")),
        data_collator=default_data_collator,  # rows of one length: stacked, no mask
    )
    trainer.train()
    from torch.distributed.tensor import DTensor

    weights, sharded = {}, 0
    for name, param in trainer.model_wrapped.named_parameters():
        if isinstance(param, DTensor):
            sharded += 1
            param = param.full_tensor()  # a collective: every rank
        weights[name.replace("_fsdp_wrapped_module.", "")] = param.detach().float().cpu().contiguous()
    if trainer.args.process_index == 0:
        save_file(weights, os.path.join(work, f"{role}.safetensors"))
        pc = getattr(trainer.accelerator, "parallelism_config", None)
        with open(os.path.join(work, f"{role}.json"), "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "world_size": trainer.args.world_size,
                    "cp_size": getattr(pc, "cp_size", 1) if pc is not None else 1,
                    "distributed_type": str(trainer.accelerator.distributed_type),
                    "dtensor_parameters": sharded,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "log_history": trainer.state.log_history,
                },
                handle,
            )


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(work: str) -> dict:
    from safetensors.torch import load_file

    runs = {}
    for role in ("single", "cp"):
        with open(os.path.join(work, f"{role}.json"), encoding="utf-8") as handle:
            runs[role] = json.load(handle)
    steps = {role: [e for e in run["log_history"] if "loss" in e] for role, run in runs.items()}
    if len(steps["single"]) != len(steps["cp"]) or not steps["cp"]:
        raise SystemExit(f"step logs differ in number: {len(steps['single'])} vs {len(steps['cp'])}")
    per_key = {
        key: max(relative(c[key], s[key]) for c, s in zip(steps["cp"], steps["single"]) if key in s) for key in KEYS
    }
    single, cp = (load_file(os.path.join(work, f"{role}.safetensors")) for role in ("single", "cp"))
    if single.keys() != cp.keys():
        raise SystemExit(f"parameter names differ: {sorted(single.keys() ^ cp.keys())[:6]}")
    weights = max(((cp[n] - single[n]).abs().max() / single[n].abs().max().clamp(min=1e-12)).item() for n in single)
    init = load_file(os.path.join(work, "init", "model.safetensors"))
    moved = max((single[n] - init[n]).abs().max().item() for n in single)
    return {
        "runs": {role: {k: v for k, v in run.items() if k != "log_history"} for role, run in runs.items()},
        "steps": {role: [{k: e.get(k) for k in KEYS} for e in entries] for role, entries in steps.items()},
        "max_relative_difference": {**per_key, "trained_weights": weights},
        "largest_weight_update": moved,
    }


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    if options.role != "driver":
        train(options.work, options.role, options.steps)
        from longce.cli import close_process_group

        close_process_group()  # every rank first meets the others (a lone teardown can abort at exit)
        return 0
    if options.length % 4:
        raise SystemExit(f"--length must be a multiple of 4 (got {options.length})")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="longce-cp-") as work:
        prepare(work, options.length)
        me = [os.path.abspath(__file__), "--work", work, "--steps", str(options.steps)]
        single_env = dict(env, CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
        subprocess.run([sys.executable, *me, "--role", "single"], env=single_env, check=True)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
        subprocess.run([*launch, *me, "--role", "cp"], env=env, check=True)
        results = compare(work)
    results["tolerance"] = options.tolerance
    worst = max(results["max_relative_difference"].values())
    results["passed"] = bool(worst <= options.tolerance and results["runs"]["cp"]["cp_size"] == 2)
    for role in ("single", "cp"):
        print(role, results["runs"][role])
        for step, entry in enumerate(results["steps"][role], 1):
            print(f"  step {step}: " + ", ".join(f"{k}={v:.6g}" for k, v in entry.items() if v is not None))
    print("max relative difference (cp vs single):")
    for key, value in results["max_relative_difference"].items():
        print(f"  {key}: {value:.3g}")
    print(f"largest weight update: {results['largest_weight_update']:.3g}")
    print("PASSED" if results["passed"] else f"FAILED (tolerance {options.tolerance})")
    if options.json:
        from longppl.atomic_files import write_file_atomically

        # whole or not at all: a check cut off while writing leaves its previous results
        write_file_atomically(options.json, lambda handle: json.dump(results, handle, indent=2))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
