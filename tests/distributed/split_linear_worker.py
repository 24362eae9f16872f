"""One rank of a two-process gloo group, started by ``accelerate launch`` from
tests/distributed/test_tensor_parallel.py: split a column-wise and a row-wise ``nn.Linear``, both
with a bias, with ``longppl.parallel.tensor_parallel.split_linear`` over the group, run ``relu(x W1^T + b1)
W2^T + b2`` through them both ways the row-wise layer can sum over the group, and write this
rank's outputs to ``<out>/split-linear-<rank>.npz``:

- ``all_reduce``: all-reduced;
- ``reduce_scatter``: reduce-scattered over the tokens (sequence parallelism), then gathered back
  with ``SplitGroup.gather``; ``local_shape``: the shape this rank held before the gather;
- ``round_trip``: ``x`` scattered over the tokens and gathered back (``SplitGroup.scatter`` / ``gather``);
- ``subclass_all_reduce``, ``subclass_reduce_scatter``: both again with the row-wise weight held as a
  tensor subclass that computes through ``F.linear`` only (:class:`LinearOnlyWeight`), as an fp8
  evaluator's float8 weights do (``longppl.models.precision``: converted after the split).

    python split_linear_worker.py <weights.npz> <out>
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from accelerate import PartialState
from torch.nn import functional as F

from longppl.parallel.tensor_parallel import SplitGroup, group_mesh, split_linear


class LinearOnlyWeight(torch.Tensor):
    """A weight that computes through ``F.linear`` only, as torchao's float8 weights (whose ``mm``
    with ``out=`` left garbage in the output): a transpose or a matrix product on it is an error
    here, so a layer that takes that path fails instead of passing by luck."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, LinearOnlyWeight) else a for a in args]
            return F.linear(*plain, **kwargs)
        if func in (torch.Tensor.t, torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul):
            raise RuntimeError(f"LinearOnlyWeight computes through F.linear only, not {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs)


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
        split = SplitGroup(mesh.get_group(), mesh.get_local_rank(), 2)
        up, down = linear(arrays["w1"], arrays["b1"]), linear(arrays["w2"], arrays["b2"])
        split_linear(up, "colwise", split)
        split_linear(down, "rowwise", split)
        x = torch.from_numpy(arrays["x"])
        batch, tokens = x.shape[:2]
        outputs = {}
        with torch.inference_mode():
            outputs["all_reduce"] = down(torch.relu(up(x)))
            split.sequence_parallel = True
            local = down(torch.relu(up(x)))
            outputs["local_shape"] = torch.tensor(local.shape)
            outputs["reduce_scatter"] = split.gather(local, batch, tokens)
            outputs["round_trip"] = split.gather(split.scatter(x), batch, tokens)
            weight = down.weight.detach().clone().as_subclass(LinearOnlyWeight)
            down.weight = torch.nn.Parameter(weight, requires_grad=False)
            outputs["subclass_reduce_scatter"] = split.gather(down(torch.relu(up(x))), batch, tokens)
            split.sequence_parallel = False
            outputs["subclass_all_reduce"] = down(torch.relu(up(x)))
        arrays = {name: value.as_subclass(torch.Tensor).numpy() for name, value in outputs.items()}
        np.savez(os.path.join(out, f"split-linear-{state.process_index}.npz"), **arrays)
    finally:
        state.destroy_process_group()


if __name__ == "__main__":
    main()
