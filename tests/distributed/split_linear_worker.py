"""One rank of a two-process gloo group, started by ``accelerate launch`` from
tests/distributed/test_tensor_parallel.py: split a column-wise and a row-wise ``nn.Linear``, both
with a bias, with ``longppl.tensor_parallel.split_linear`` over the group, run ``relu(x W1^T + b1)
W2^T + b2`` through them, and write this rank's output to ``<out>/split-linear-<rank>.npz``.

    python split_linear_worker.py <weights.npz> <out>
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from accelerate import PartialState

from longppl.tensor_parallel import group_mesh, split_linear


def linear(weight: np.ndarray, bias: np.ndarray) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def main() -> None:
    weights_file, out = sys.argv[1:]
    arrays = np.load(weights_file, allow_pickle=False)
    state = PartialState(cpu=True)
    try:
        mesh = group_mesh(2, "cpu")
        rank, group = mesh.get_local_rank(), mesh.get_group()
        up, down = linear(arrays["w1"], arrays["b1"]), linear(arrays["w2"], arrays["b2"])
        split_linear(up, "colwise", rank, 2, group)
        split_linear(down, "rowwise", rank, 2, group)
        with torch.inference_mode():
            output = down(torch.relu(up(torch.from_numpy(arrays["x"]))))
        np.savez(os.path.join(out, f"split-linear-{state.process_index}.npz"), output=output.numpy())
    finally:
        state.destroy_process_group()


if __name__ == "__main__":
    main()
