"""An evaluator's precision: ``"bf16"``, the evaluator as loaded (the exact reference, the default),
or ``"fp8"``, the Linear layers of its transformer blocks in float8 through torchao.

**What fp8 is.** torchao's dynamic float8 recipe with per-row scales,
``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``: each weight
``[out, in]`` is cast once to float8 e4m3 with one scale per output row; each activation is cast at
every call with one scale per token (row); the product runs on the GPU's float8 tensor cores
(``torch._scaled_mm``) and comes back in bfloat16. Only the ``nn.Linear`` layers inside the
transformer blocks (``compilation.repeated_blocks``: attention q/k/v/o, MLP gate/up/down) are
converted. The embedding, the norms, the attention itself and the LM head stay bfloat16, so the
log-probs' last projection and the softmax over the vocabulary keep their precision. The scores are
then approximate: a token near a threshold (LSD near ``alpha``, LCL near ``beta``) may flip. On the
14M-parameter models trained here it looked harmless (Jaccard 0.90 with bf16); on real evaluators its
key tokens agreed with float32's at a Jaccard index of 0.81 (SmolLM2-135M, 8k tokens; bf16 0.96) and
0.59 (Gemma 3 270M, 32k; bf16 0.87) (``scripts/bench/bench_real_models.py``, docs/benchmarks.md). So fp8 is off by default,
approximate, and says so with those figures at every use (:data:`FP8_APPROXIMATE`, warned by
:func:`check_precision`); its rows never mix with bf16 rows in a cache
(``fingerprints.ModelIdentity.with_precision``).

**Why torchao.** It is PyTorch's own quantization library, released in step with torch (0.17, the
first release built for torch 2.11, is the oldest taken), and what transformers (``TorchAoConfig``),
vLLM and torchtitan use for float8. Its float8 weights are a tensor subclass held by the Linear's
``weight`` parameter: the module keeps its class, so the tensor-parallel split's row-wise layers
(``parallel.tensor_parallel.RowwiseLinear``) stay what they are, and ``torch.compile`` traces
through it and fuses the per-token casts into the blocks. Not transformers' ``TorchAoConfig``
(``from_pretrained(quantization_config=...)``): that converts while loading, before the
tensor-parallel split, which this library applies itself to a loaded or meta model; and not float8
kernels of our own, which would be a second implementation of what torchao maintains.

**When.** After loading, and after the tensor-parallel split: a rank converts the Linear layers it
holds, its local shards (a column-wise shard's rows keep their whole-row scales; a row-wise shard's
scales cover its slice of the input features). torchao's float8 needs each converted Linear's two
dimensions to be multiples of 16 (the shard's, under tensor parallelism); a model with another is
refused rather than converted in part. Each rank first holds its bf16 share, then converts it:
a GPU must fit the bf16 share.

**Compiled by default.** Eager, the casts are extra kernels around every product, and a probe took
1.2x the bf16 time; with the blocks compiled (``core.compilation``) they fuse and it took 0.72x. So
an fp8 evaluator's blocks run compiled unless ``torch_compile=False`` (``--no-torch-compile``):
``settings.evaluator_compiles``.

**Refused, each in one line** (:func:`check_precision`, before anything is loaded): a device that
is not a CUDA GPU (the CPU, ``mps``, and ``"auto"``, whose layer split may offload weights to the
CPU), a GPU of compute capability below 8.9 (float8 tensor cores: Ada, Hopper and later), a dtype
other than bfloat16 (torchao's per-row scaling takes bfloat16 weights), and torchao missing or older
than :data:`MIN_TORCHAO`. What of that needs no torch (a device or dtype the user named, torchao's
version) a command checks before torch is imported (:func:`check_precision_request`); whether the
machine has a GPU, and which, only torch can say.

This module imports torch only in the functions that use it, so that a command can import it first.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from importlib import metadata

from ..settings import EvaluatorPrecision

#: The oldest torchao taken: 0.17.0 is the first release built against torch 2.11 (0.18.0, the newest
#: when this was written, too); the recipe's API is the same in both.
MIN_TORCHAO = "0.17.0"
#: How to install it: the ``fp8`` extra of setup.cfg.
FP8_INSTALL = 'pip install "longppl-hf[fp8]"'
#: Float8 tensor cores: compute capability 8.9 (Ada) and later (Hopper 9.0, Blackwell 10.0).
MIN_CAPABILITY = (8, 9)
#: torchao's float8 matmul takes Linear layers whose input and output features are multiples of this.
FP8_MULTIPLE = 16
#: The warning of every fp8 evaluator: what the precision does to key tokens, as measured on a real model.
FP8_APPROXIMATE = (
    "evaluator_precision='fp8' is approximate: against float32 on real evaluators (H200, docs/benchmarks.md) its "
    "key tokens agreed at a Jaccard index of 0.81 [0.67, 0.95] on SmolLM2-135M at 8k tokens (bf16: 0.96 "
    "[0.88, 1.00]) and 0.59 [0.55, 0.63] on Gemma 3 270M at 32k (bf16: 0.87 [0.85, 0.88]); use it where speed "
    "matters more than which tokens are key, and compare only with other fp8 results."
)


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"0.17.0+cu128"`` -> ``(0, 17, 0)``: the leading numbers of a version string."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def torchao_version() -> str | None:
    """The installed torchao's version (its distribution's metadata; nothing is imported), ``None`` if
    it is not installed."""
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def check_torchao(argument: str = "evaluator_precision") -> None:
    """``ValueError`` (one line, with the command that fixes it) unless torchao >= :data:`MIN_TORCHAO`
    is installed."""
    installed = torchao_version()
    if installed is None:
        raise ValueError(
            f"{argument}='fp8' converts the evaluator with torchao, which is not installed: {FP8_INSTALL} "
            f"(torchao >= {MIN_TORCHAO}), or use {argument}='bf16'."
        )
    if _version_tuple(installed) < _version_tuple(MIN_TORCHAO):
        raise ValueError(
            f"{argument}='fp8' needs torchao >= {MIN_TORCHAO} (its float8 recipe as built for torch 2.11), "
            f"but torchao {installed} is installed: {FP8_INSTALL.replace('install', 'install -U', 1)}."
        )


def _refuse_device(device: str, kind: str, argument: str) -> None:
    """Refuse ``device`` (of type ``kind``: ``cuda``, ``cpu``, ...) for fp8 unless it is a CUDA GPU."""
    fallback = f"use {argument}='bf16'"
    if device == "auto":
        raise ValueError(
            f"{argument}='fp8' with device 'auto' (accelerate's layer split, which may leave weights on the CPU) "
            "is not supported: run the evaluator on one GPU, or split it with tensor parallelism "
            f"(longppl score --tensor-parallel N), or {fallback}."
        )
    if kind != "cuda":
        raise ValueError(
            f"{argument}='fp8' runs the evaluator's products on a CUDA GPU's float8 tensor cores, but its device "
            f"is {device!r}: {fallback} there, or run on a GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer."
        )


def _refuse_dtype(name: str, argument: str) -> None:
    """Refuse a dtype (by its name, ``float32``) other than bfloat16 for fp8."""
    if name != "bfloat16":
        raise ValueError(
            f"{argument}='fp8' converts a bfloat16 evaluator (torchao's per-row float8 scales take bfloat16 "
            f"weights), but it would be loaded in {name}: leave the dtype unset "
            "(bfloat16 on a GPU) or pass bfloat16."
        )


def _check_tf32(device: str | None, dtype_name: str | None, argument: str) -> None:
    """TF32's checks: a CUDA device (or ``"auto"``, or none named yet) and a float32 evaluator."""
    if device is not None and device != "auto" and device.split(":", 1)[0] != "cuda":
        raise ValueError(
            f"{argument}='tf32' runs the evaluator's products on a CUDA GPU's TF32 tensor cores, but its device is "
            f"{device!r}: there, load the evaluator in float32 (torch_dtype='float32') with {argument}='bf16' "
            "(the evaluator as loaded), which is the float32 reference itself."
        )
    if dtype_name not in (None, "auto", "float32"):
        raise ValueError(
            f"{argument}='tf32' runs a float32 evaluator (TF32 products, float32 accumulation), but it would be "
            f"loaded in {dtype_name}: leave the dtype unset or pass float32."
        )


def precision_dtype(precision, torch_dtype):
    """The dtype to load the evaluator in for ``precision``: ``"float32"`` for TF32 when ``torch_dtype``
    is unset (``None``/``"auto"``), else ``torch_dtype`` as given (checked by :func:`check_precision`)."""
    if EvaluatorPrecision.of(precision) is EvaluatorPrecision.TF32 and torch_dtype in (None, "auto"):
        return "float32"
    return torch_dtype


def check_precision_request(
    precision, device: str | None, torch_dtype: str | None, argument: str = "evaluator_precision"
) -> EvaluatorPrecision:
    """The checks of :func:`check_precision` that need no torch, for a command to run before it imports
    torch: a ``device`` named that is not a CUDA GPU (``cpu``, ``mps``, ``auto``), a ``torch_dtype``
    named other than bfloat16, and, on a CUDA device named, torchao missing or too old. ``None`` (and
    a dtype ``"auto"``): not chosen yet. Whether the process's own device is a GPU of float8 tensor
    cores only torch can say: with no device named, :func:`check_precision` says it once torch is
    loaded, before torchao (on a machine without a GPU, installing torchao would not help).

    Returns:
        ``precision`` (a member of ``EvaluatorPrecision`` or its string), checked, as a member: what
        the command passes on.
    Raises:
        ValueError: in :func:`check_precision`'s words.
    """
    precision = EvaluatorPrecision.of(precision, argument)
    if precision is EvaluatorPrecision.BF16:
        return precision
    if precision is EvaluatorPrecision.TF32:
        _check_tf32(device, None if torch_dtype is None else str(torch_dtype).replace("torch.", ""), argument)
        return precision
    if device is not None:
        _refuse_device(device, device.split(":", 1)[0], argument)
    if torch_dtype not in (None, "auto"):
        _refuse_dtype(str(torch_dtype).replace("torch.", ""), argument)
    if device is not None:
        check_torchao(argument)
    return precision


def check_precision(precision, device: str, dtype, argument: str = "evaluator_precision") -> EvaluatorPrecision:
    """``precision`` (an ``EvaluatorPrecision``, or its string ``"bf16"`` / ``"fp8"``), checked against
    where and how the evaluator will run, before it is loaded; returned as a member.

    Args:
        device: the evaluator's device as the caller resolved it: ``"cuda"`` (every visible GPU is
            checked: each process of a launch takes one), ``"cuda:1"``, ``"cpu"``, ``"mps"``, ``"auto"``.
        dtype: the ``torch.dtype`` it is loaded in.
        argument: what messages call the setting (``--evaluator-precision`` for the command).
    Raises:
        ValueError: one line saying what is wrong and what to pass (see the module docstring).
    """
    precision = EvaluatorPrecision.of(precision, argument)
    if precision is EvaluatorPrecision.BF16:
        return precision
    if precision is EvaluatorPrecision.TF32:
        _check_tf32(device, str(dtype).replace("torch.", ""), argument)
        return precision
    import torch

    fallback = f"use {argument}='bf16'"
    _refuse_device(device, "auto" if device == "auto" else torch.device(device).type, argument)
    where = torch.device(device)
    indices = [where.index] if where.index is not None else list(range(torch.cuda.device_count()))
    for index in indices:
        capability = tuple(torch.cuda.get_device_capability(index))
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"{argument}='fp8' needs float8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: L4, L40, H100, H200, B200), but cuda:{index} "
                f"({torch.cuda.get_device_name(index)}) has {capability[0]}.{capability[1]}: {fallback}."
            )
    _refuse_dtype(str(dtype).replace("torch.", ""), argument)
    check_torchao(argument)
    warnings.warn(FP8_APPROXIMATE, UserWarning, stacklevel=2)
    return precision


def block_linears(blocks: Sequence) -> dict[str, object]:
    """``{name: module}`` of the ``nn.Linear`` layers (subclasses too: the split's row-wise layers) inside
    ``blocks`` whose weight is a plain tensor (not converted yet); names are ``<block index>.<name in
    the block>``."""
    import torch
    from torch import nn

    found = {}
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and type(module.weight) in (torch.Tensor, nn.Parameter):
                found[f"{index}.{name}"] = module
    return found


def convert_blocks_to_fp8(blocks: Sequence, where: str = "the evaluator") -> int:
    """Convert, in place, the Linear layers inside ``blocks`` (transformer blocks, or any modules) to
    torchao's dynamic float8 with per-row scales (the module docstring); returns how many.

    All or nothing: every layer's shape and dtype are checked before the first is converted.
    ``where`` names the model in messages.

    Raises:
        ValueError: a layer whose input or output features are not multiples of :data:`FP8_MULTIPLE`
            (under tensor parallelism: its shard), or whose weight is not bfloat16.
    """
    import torch

    linears = block_linears(blocks)
    for name, linear in linears.items():
        rows, columns = linear.weight.shape
        if rows % FP8_MULTIPLE or columns % FP8_MULTIPLE:
            raise ValueError(
                f"evaluator_precision='fp8': torchao's float8 products need Linear layers whose features are "
                f"multiples of {FP8_MULTIPLE}, but {where}'s block layer {name} holds a weight of {rows} x "
                f"{columns} (this process's shard under tensor parallelism): use evaluator_precision='bf16' "
                "(or another tensor-parallel size)."
            )
        if linear.weight.dtype != torch.bfloat16:
            raise ValueError(
                f"evaluator_precision='fp8' converts bfloat16 weights, but {where}'s block layer {name} is "
                f"{str(linear.weight.dtype).replace('torch.', '')}: load the evaluator in bfloat16."
            )
    if not linears:
        return 0
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    chosen = {id(linear) for linear in linears.values()}
    for block in blocks:
        quantize_(block, config, filter_fn=lambda module, fqn: id(module) in chosen)
    return len(linears)


def to_precision(model, precision: EvaluatorPrecision | str):
    """``model`` with its evaluator ``precision`` applied, in place: as it is for ``"bf16"``; for
    ``"tf32"``, marked so that the scoring's forward passes run its products in TF32 (a float32 model;
    ``core.logprobs.tf32_matmuls``); for ``"fp8"``, the Linear layers of its transformer blocks converted (:func:`convert_blocks_to_fp8`),
    embedding, norms and LM head untouched. Call it after the tensor-parallel split, and after taking
    the model's fingerprint (``ModelIdentity.of_model`` reads the bf16 weights); the caller has run
    :func:`check_precision`.

    Raises:
        ValueError: the model lists no transformer blocks (``_no_split_modules``), or a layer cannot be
            converted (:func:`convert_blocks_to_fp8`).
    """
    precision = EvaluatorPrecision.of(precision)  # a member passes unchecked
    if precision is EvaluatorPrecision.BF16:
        return model
    from ..core.compilation import repeated_blocks
    from ..core.logprobs import TF32_ATTRIBUTE, unwrap_model

    if precision is EvaluatorPrecision.TF32:
        base = unwrap_model(model)
        dtypes = {str(p.dtype).replace("torch.", "") for p in base.parameters() if p.is_floating_point()}
        if dtypes - {"float32"}:
            raise ValueError(
                f"evaluator_precision='tf32' runs a float32 evaluator, but {type(base).__name__} holds "
                f"{', '.join(sorted(dtypes))} weights: load it in float32."
            )
        setattr(base, TF32_ATTRIBUTE, True)  # read by every forward pass of the scoring (core.logprobs)
        return model

    blocks = repeated_blocks(model)
    name = type(unwrap_model(model)).__name__
    if not blocks:
        raise ValueError(
            f"evaluator_precision='fp8' converts the Linear layers of the transformer blocks, but {name} lists no "
            "blocks (_no_split_modules): use evaluator_precision='bf16'."
        )
    convert_blocks_to_fp8(blocks, where=name)
    return model
