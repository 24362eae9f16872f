"""Tensor parallelism for evaluators larger than one GPU (the paper's 72B / 123B class).

Which modules are split, and how, is the model family's own plan in transformers:
``config.base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``), the same in
transformers 5.17 and 5.24. Applying it goes through PyTorch's DTensor
``torch.distributed.tensor.parallel.parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``)
rather than ``from_pretrained``'s own tensor parallelism, whose entry point moved between the
versions we support (``tp_plan=`` in 5.17, ``distributed_config=DistributedConfig(...)`` in 5.24,
with the old argument deprecated) and which cannot build a sharded model from a config without a
checkpoint (what the benchmarks of 72B shapes need: 145 GB fit neither host memory nor disk).

What each rank holds (``N`` ranks of one tensor-parallel group):

- the attention projections and the MLP, split as the plan says: column-wise layers keep
  ``1/N`` of the output features (so ``1/N`` of the query / key-value heads), row-wise layers
  ``1/N`` of the input features, summed over the group by an all-reduce. The decoder layers'
  hidden states are then whole (replicated) between blocks;
- the embedding, the norms and the LM head whole: every rank computes the same log-probs from the
  same hidden states, so the scoring core runs unchanged (chunked LM head, packed windows) and
  every rank ends with the same rows. The head's work is repeated on each rank (about 7% of an
  8B model's FLOPs at full-sequence projection, less for short windows, which project ``d`` of
  ``K + d`` positions); its weights cost ``vocab x hidden`` per rank.

Every rank must be given the same inputs in the same order (``longppl-score`` does; only the
group's first rank writes the result). Several groups split a corpus as several processes do.
"""

from __future__ import annotations

import json
import os

import torch

from .settings import require_int

# The plan styles this module applies; a family whose plan uses others (packed, expert, sequence
# parallel...) is refused rather than half-split.
STYLES = ("colwise", "rowwise")
#: Families whose split evaluators the tests score against the unsplit one (docs/design.md).
TESTED_FAMILIES = ("llama", "mistral", "qwen2")


def dtensor_type():
    """PyTorch's ``DTensor`` class (the type of a split parameter)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return DTensor


def tensor_parallel_plan(config, size: int, argument: str = "tensor_parallel") -> dict[str, str]:
    """The family's plan ``{module pattern under the base model: "colwise" | "rowwise"}``, after
    checking that ``size`` ranks can split ``config``'s model with it.

    Args:
        config: the evaluator's ``PretrainedConfig`` (read before any weight is loaded).
        size: ranks in one tensor-parallel group (``>= 1``).
        argument: what messages call ``size`` (``--tensor-parallel`` for the command).
    Raises:
        ValueError: the family has no plan (or one with styles other than :data:`STYLES`), or
            ``size`` does not divide the attention heads, the key-value heads or the MLP width.
    """
    size = require_int(argument, size)
    family = getattr(config, "model_type", type(config).__name__)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    others = sorted({style for style in plan.values() if style not in STYLES})
    if not plan or others:
        why = "has no tensor-parallel plan in transformers" if not plan else f"has a plan with styles {others}"
        raise ValueError(
            f"{argument}={size}: the evaluator's family {family!r} {why}; tensor parallelism works for families "
            f"whose plan splits layers column- and row-wise ({', '.join(TESTED_FAMILIES)} are tested). "
            "Shard it with device='auto' (longppl-score --device auto) instead."
        )
    heads = getattr(config, "num_attention_heads", None)
    widths = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    for field, value in widths.items():
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"{argument}={size} does not divide the evaluator's {field}={value}: every rank must hold whole "
                f"heads and equal MLP slices; pick a size that divides {field}."
            )
    return plan


def check_launch(size: int, world_size: int, local_world_size: int, gpus: int | None, argument: str) -> None:
    """Refuse a launch that cannot host groups of ``size`` ranks, before anything is loaded.

    Args:
        world_size, local_world_size: processes in all / on this machine (``WORLD_SIZE`` and
            ``LOCAL_WORLD_SIZE`` as torchrun and ``accelerate launch`` set them; 1 without a launcher).
        gpus: GPUs this machine shows, or ``None`` where the ranks run on the CPU (gloo).
    Raises:
        ValueError: more ranks asked than GPUs, several processes on one GPU, or a number of
            processes that groups of ``size`` do not fill.
    """
    if gpus is not None and gpus < size:
        raise ValueError(
            f"{argument}={size} asks for {size} GPUs, but this machine has {gpus}: "
            f"pass {argument} {gpus} or less, or --device auto to spread the evaluator over what there is."
        )
    if gpus is not None and local_world_size > gpus:
        raise ValueError(
            f"{argument}={size} with {local_world_size} processes on this machine's {gpus} GPUs: tensor "
            f"parallelism needs one process per GPU; launch {gpus} or fewer (torchrun --nproc-per-node {size})."
        )
    if world_size < size or world_size % size or local_world_size % size:
        raise ValueError(
            f"{argument}={size} needs {size} processes per group on one machine (one per GPU), but "
            f"{world_size} were started ({local_world_size} on this machine): launch a multiple of {size}, "
            f"e.g. torchrun --nproc-per-node {size} -m longppl.tools.compute_key_tokens ..."
        )


def group_mesh(size: int, device_type: str):
    """The 1-D device mesh of this rank's tensor-parallel group: ranks ``[g*size, (g+1)*size)``.

    The process group must be up (``accelerate.PartialState`` or ``torch.distributed.init_process_group``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("data", "tensor"))
    return mesh["tensor"]


def shard_model(model, mesh) -> None:
    """Split ``model``'s base model in place over ``mesh`` with its family's plan (checked by
    :func:`tensor_parallel_plan`); embedding, norms and LM head stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = tensor_parallel_plan(model.config, mesh.size())
    parallelize_module(model.base_model, mesh, {pattern: styles[style]() for pattern, style in plan.items()})


def build_sharded_model(config, mesh, dtype: torch.dtype, device: str):
    """``config``'s causal LM, split over ``mesh``, with uninitialised weights on ``device``.

    Built on the meta device first, so no rank ever holds the whole model: a 72B model is never
    materialised in host memory. Buffers (RoPE's ``inv_freq``) are computed on the CPU at build
    time and put back after the weights get their device memory.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, mesh)
    buffers = {name: buffer for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty gave the head a tensor of its own
    model.eval()
    return model


def local_slice(parameter, mesh_rank: int) -> tuple[slice, ...] | None:
    """The index of this rank's part of a split parameter in the whole tensor (``None``: not split).

    Split dimensions are divided evenly (:func:`tensor_parallel_plan` checks the widths), so rank
    ``r`` holds rows ``[r * local, (r + 1) * local)`` of the split dimension.
    """
    if not isinstance(parameter, dtensor_type()):
        return None
    placement = parameter.placements[0]
    if not placement.is_shard():
        return None
    local = parameter.to_local()
    index = [slice(None)] * local.dim()
    index[placement.dim] = slice(mesh_rank * local.shape[placement.dim], (mesh_rank + 1) * local.shape[placement.dim])
    return tuple(index)


def _weight_files(folder: str) -> dict[str, str]:
    """``{parameter name: safetensors file}`` of a saved checkpoint (one file, or an index of shards)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(
            f"{folder!r} holds no model.safetensors (or its index): tensor parallelism reads safetensors "
            "checkpoints only; save the model with save_pretrained(safe_serialization=True)."
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def load_sharded_model(name_or_path: str, size: int, device: str, dtype: torch.dtype):
    """A saved causal LM split over this rank's tensor-parallel group of ``size`` ranks.

    Each rank reads only its own slices of the split weights from the safetensors files (and the
    whole of the unsplit ones), so host memory never holds the whole model.

    Args:
        name_or_path: a local folder saved with ``save_pretrained``, or a Hub id (downloaded).
        device: this rank's device (``"cuda:<local rank>"``, or ``"cpu"`` for gloo ranks).
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = name_or_path
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    config = AutoConfig.from_pretrained(folder)
    tensor_parallel_plan(config, size)
    mesh = group_mesh(size, torch.device(device).type)
    model = build_sharded_model(config, mesh, dtype, device)
    files = _weight_files(folder)
    rank = mesh.get_local_rank()
    dtensor = dtensor_type()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    handles: dict[str, object] = {}
    try:
        with torch.no_grad():
            for name, parameter in model.named_parameters(remove_duplicate=False):
                if name not in files:
                    if name in tied:
                        continue
                    raise ValueError(f"{folder!r} holds no weight {name!r}: it is not a checkpoint of this model.")
                if files[name] not in handles:
                    handles[files[name]] = safe_open(files[name], framework="pt")
                stored = handles[files[name]].get_slice(name)
                index = local_slice(parameter, rank)
                local = parameter.to_local() if isinstance(parameter, dtensor) else parameter.data
                value = stored[index] if index is not None else stored[:]
                local.copy_(value.to(local.dtype))
    finally:
        handles.clear()
    if tied:
        model.tie_weights()
    return model
