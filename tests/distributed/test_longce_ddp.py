"""LongCETrainer under DDP (2 CPU processes, gloo) = 1 process on the same global batch.

Each global batch holds 4 documents: two long ones (many short-context windows) that go to rank 0
and two short ones (one window) that go to rank 1, so the ranks need different numbers of
short-context forward passes and rank 1 must run idle passes to keep in step. Loss, logged LongCE
statistics and the updated weights must match the single-process run.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from helpers import accelerate_launch_on_cpu, one_torch_thread, run_guarded
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "ddp_longce_worker.py")
STEPS, GLOBAL_BATCH = 3, 4
K, D, BUDGET = 16, 8, 64


def documents(seed: int = 0) -> list[str]:
    """Per global batch: long, long (rank 0's half), short, short (rank 1's half)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(STEPS):
        for n in (rng.randint(150, 220), rng.randint(150, 220), rng.randint(26, 36), rng.randint(26, 36)):
            texts.append("".join(rng.choice("abcdefgh ") for _ in range(n)))
    return texts


def recipe_argv(tmp_path, data: str, name: str, per_device_batch: int) -> list[str]:
    return [
        "--config",
        os.path.join(REPO, "configs", "tiny_cpu.yaml"),
        "--data_files",
        data,
        "--output_dir",
        str(tmp_path / name),
        "--cache_dir",
        str(tmp_path / "cache"),
        # Every document is one piece (<= max_seq_length) and keeps its own position ids and windows.
        "--packing",
        "true",
        "--max_seq_length",
        "256",
        # Same examples in the same order: process r takes the r-th per-device batch of each global batch.
        "--train_sampling_strategy",
        "sequential",
        "--dataloader_drop_last",
        "true",
        "--per_device_train_batch_size",
        str(per_device_batch),
        "--gradient_accumulation_steps",
        "1",
        # Normalise by the tokens of the whole global batch, as one process does.
        "--average_tokens_across_devices",
        "true",
        # What Trainer picks without checkpointing and for PEFT models: DDP then walks back from the
        # forward's outputs for used parameters, which LongCE's intercepted LM head must keep reachable.
        "--ddp_find_unused_parameters",
        "true",
        "--max_steps",
        str(STEPS),
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "0",
        "--learning_rate",
        "1e-3",
        "--longce_trunc_len",
        str(K),
        "--longce_sliding_window",
        str(D),
        "--longce_max_tokens_per_batch",
        str(BUDGET),
    ]


def read_report(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents()))

    # accelerate 1.15's --cpu starts one process (multi-CPU goes through MPI); its torchrun launcher
    # (--multi_gpu) starts two, and use_cpu=True in the recipe makes them use gloo on the CPU.
    launch = [
        *accelerate_launch_on_cpu(2),
        WORKER,
        str(tmp_path / "ddp.json"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = run_guarded(
        launch + recipe_argv(tmp_path, str(data), "ddp", GLOBAL_BATCH // 2),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    ranks = [read_report(str(tmp_path / f"ddp.json.rank{r}")) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["steps"] for r in ranks] == [STEPS, STEPS]

    # The single-process reference, in this process (the worker's patches are undone afterwards).
    from distributed import ddp_longce_worker

    with one_torch_thread():
        ddp_longce_worker.run(str(tmp_path / "single.json"), recipe_argv(tmp_path, str(data), "single", GLOBAL_BATCH))
    single = read_report(str(tmp_path / "single.json.rank0"))
    assert single["world_size"] == 1 and single["steps"] == STEPS

    # The equalisation really ran: rank 0's long documents need more window passes than rank 1's
    # short ones, yet both ranks made the same number of forward calls (1 gradient pass per step +
    # the most window passes of any rank).
    own = [r["own_window_passes"] for r in ranks]
    assert own[0] > own[1] > 0, own
    assert ranks[0]["forwards"] == ranks[1]["forwards"] == STEPS + own[0], ranks
    assert single["forwards"] == STEPS + single["own_window_passes"]

    # Same loss, gradient norm and LongCE statistics at every step ...
    keys = ("loss", "grad_norm", "ce_loss", "longce_mean_weight", "longce_weight_gt1_share", "longce_max_weight")
    ddp_log = [e for e in ranks[0]["log_history"] if "loss" in e]
    single_log = [e for e in single["log_history"] if "loss" in e]
    assert len(ddp_log) == len(single_log) == STEPS
    for step, (a, b) in enumerate(zip(ddp_log, single_log), 1):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key, a[key], b[key])
    assert max(e["longce_weight_gt1_share"] for e in single_log) > 0  # the windows gave weights != 1

    # ... and the same weights after the updates.
    ddp_weights = load_file(str(tmp_path / "ddp" / "model.safetensors"))
    single_weights = load_file(str(tmp_path / "single" / "model.safetensors"))
    assert ddp_weights.keys() == single_weights.keys()
    for name in ddp_weights:
        torch.testing.assert_close(ddp_weights[name], single_weights[name], rtol=1e-5, atol=1e-5, msg=name)
