"""LongCETrainer under FSDP2 (torch ``fully_shard``, 2 CPU processes over gloo) = 1 process without
FSDP on the same global batch, with cached weights (``longce_weights="cache"``) and self-scored ones
("self": short-context passes inside the sharded model, unequal counts per rank).

accelerate keeps an FSDP plugin only on accelerator devices; the worker (``fsdp2_longce_worker.py``,
see its docstring) lets it through on CPU, and the test checks that the parameters really were
sharded (DTensors, half of each weight on a rank). The losses, gradient norms, LongCE statistics and
the trained (gathered) weights must match the single-process run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from datasets import Dataset
from helpers import accelerate_launch_on_cpu, one_torch_thread, run_guarded
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp2_longce_worker.py")
TESTS = os.path.dirname(HERE)
GLOBAL_BATCH = 4
KEYS = ("loss", "grad_norm", "ce_loss", "longce_mean_weight", "longce_weight_gt1_share", "longce_max_weight")


def save_rows(path: str) -> None:
    """8 documents of unequal length (unequal token counts and window passes per process), with weights."""
    generator = torch.Generator().manual_seed(5)
    lengths = [40, 31, 12, 18, 35, 22, 9, 27]
    rows = {
        "input_ids": [torch.randint(3, 90, (n,), generator=generator).tolist() for n in lengths],
        "longce_weights": [(torch.rand(n, generator=generator) * 4 + 0.5).tolist() for n in lengths],
    }
    Dataset.from_dict(rows).save_to_disk(path)


def read_result(directory) -> dict:
    with open(os.path.join(directory, "result.json"), encoding="utf-8") as handle:
        return json.load(handle)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cache", "self"])
def test_fsdp2_two_processes_match_one_process(tmp_path, mode):
    data = str(tmp_path / "data")
    save_rows(data)
    done = run_guarded(
        [*accelerate_launch_on_cpu(2), WORKER, mode, data, str(tmp_path / "fsdp2"), str(GLOBAL_BATCH // 2), "fsdp2"],
        cwd=HERE,
        # the worker runs as a script (its folder first on sys.path) and imports tests/helpers.py
        env=dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
        ),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])

    from distributed import fsdp2_longce_worker

    with one_torch_thread():
        fsdp2_longce_worker.run(mode, data, str(tmp_path / "single"), GLOBAL_BATCH, fsdp2=False)
    fsdp, single = read_result(tmp_path / "fsdp2"), read_result(tmp_path / "single")

    # FSDP2 really ran: every parameter is a DTensor of which each rank holds half the rows
    # (the shapes are rank 0's).
    assert fsdp["world_size"] == 2 and fsdp["distributed_type"] == "DistributedType.FSDP"
    assert single["world_size"] == 1 and single["sharded"] == {}
    weights = load_file(str(tmp_path / "single" / "weights.safetensors"))
    assert fsdp["sharded"].keys() == weights.keys()
    for name, shape in fsdp["sharded"].items():
        rows = weights[name].shape[0]
        assert shape == [(rows + 1) // 2, *weights[name].shape[1:]], (name, shape)  # rank 0's shard: ceil

    # Same loss, gradient norm and LongCE statistics at every step ...
    steps = [[e for e in result["log_history"] if "loss" in e] for result in (fsdp, single)]
    assert len(steps[0]) == len(steps[1]) == fsdp2_longce_worker.STEPS
    for step, (a, b) in enumerate(zip(*steps), 1):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (mode, step, key, a[key], b[key])
    assert max(e["longce_weight_gt1_share"] for e in steps[1]) > 0  # weights != 1 took part

    # ... and the same weights after the updates.
    trained = load_file(str(tmp_path / "fsdp2" / "weights.safetensors"))
    assert trained.keys() == weights.keys()
    for name in weights:
        torch.testing.assert_close(trained[name], weights[name], rtol=1e-5, atol=1e-5, msg=name)
