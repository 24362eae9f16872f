"""Loading causal LMs and tokenizers from Hub ids or local paths, with device and dtype defaults.

The arguments are checked before anything is loaded (:func:`check_device`,
:func:`sources.check_model_source`, :func:`merge_dtype_arguments`), so a typo fails at once with a
message that says what to pass, instead of a raw error from transformers, a CUDA assertion, or a
minute of Hub retries.
"""

from __future__ import annotations

import torch

# check_model_source lives with the rule for every name (models, corpora, caches) and stays
# importable from here.
from .sources import check_model_source

VALID_DEVICES = (
    "'cuda' (or 'cuda:<index>', or 'gpu' as evaluate's perplexity says) for a GPU, 'cpu', 'mps' (Apple GPU), 'auto' (shard a large model over all "
    "GPUs) or None (a GPU when one is available, else the CPU)"
)


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device) -> str | None:
    """``device`` as a string (``None`` stays ``None``), after checking that it names a device that
    exists here; ``ValueError`` saying what to pass otherwise.

    Accepts ``None``, ``"auto"``, a ``torch.device`` or a string ``torch.device`` parses (``"cpu"``,
    ``"cuda"``, ``"cuda:1"``, ``"mps"``, ``"xpu"``).
    """
    if device is None or device == "auto":
        return device
    if isinstance(device, str) and device.strip().lower() == "gpu":
        device = "cuda"  # evaluate's perplexity metric takes device="gpu" for CUDA
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} is not a device name: pass {VALID_DEVICES}.")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device: pass {VALID_DEVICES}.") from None
    if parsed.type == "cpu":
        return str(parsed)
    backend = torch.backends.mps if parsed.type == "mps" else getattr(torch, parsed.type, None)
    if not callable(getattr(backend, "is_available", None)):
        raise ValueError(f"device={device!r} cannot run a model: pass {VALID_DEVICES}.")
    if not backend.is_available():
        raise ValueError(
            f"device={device!r}, but PyTorch sees no {parsed.type} device here "
            f"(torch.{parsed.type}.is_available() is False): pass device='cpu', or leave device unset "
            "to use a GPU only when one is available."
        )
    count = getattr(backend, "device_count", lambda: 1)()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"device={device!r}, but there are only {count} {parsed.type} device(s) (indices 0..{count - 1})."
        )
    return str(parsed)


def merge_dtype_arguments(torch_dtype=None, dtype=None):
    """The one dtype setting given as ``torch_dtype`` (the older name) or ``dtype`` (transformers 5's).

    Raises ``ValueError`` when both are given and name different dtypes.
    """
    if dtype is None:
        return torch_dtype
    if torch_dtype is None:
        return dtype

    def canonical(value):
        return value if value == "auto" else resolve_dtype(value, "cpu")

    if canonical(torch_dtype) != canonical(dtype):
        raise ValueError(
            f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree: they are one setting (dtype is its "
            "transformers 5 name); pass only one of them."
        )
    return dtype


def resolve_dtype(torch_dtype, device: str) -> torch.dtype:
    """``None``/``"auto"`` -> bfloat16 on a GPU that supports it, float32 otherwise; strings by name."""
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    if torch_dtype in (None, "auto"):
        on_gpu = str(device).startswith("cuda") or device == "auto"
        if on_gpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    dtype = getattr(torch, str(torch_dtype).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"torch_dtype={torch_dtype!r} is not a torch dtype; use 'bfloat16', 'float16', 'float32' or 'auto'."
        )
    return dtype


def load_causal_lm(name_or_path: str, device: str | None = None, torch_dtype=None):
    """Load ``(model, tokenizer)`` for scoring: eval mode, on ``device`` (``"auto"`` shards over GPUs).

    Args:
        name_or_path: a Hub model id or a local directory saved with ``save_pretrained``.
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``, ``"auto"`` (accelerate's ``device_map="auto"``,
            for models larger than one GPU) or ``None`` (GPU if available).
        torch_dtype: see :func:`resolve_dtype`.
    """
    return load_model(name_or_path, device, torch_dtype), load_tokenizer(name_or_path)


def load_model(
    name_or_path: str,
    device: str | None = None,
    torch_dtype=None,
    tensor_parallel: int = 1,
    sequence_parallel: bool | None = None,
):
    """The model alone, as :func:`load_causal_lm` loads it (for callers that hold its tokenizer already).

    ``tensor_parallel=N > 1``: split over this rank's group of ``N`` processes (one per GPU, the
    process group already up, e.g. under torchrun), each holding ``1/N`` of the attention and MLP
    weights on ``device`` (``tensor_parallel.load_sharded_model``; a safetensors checkpoint).
    ``sequence_parallel``: whether to also split the hidden states between the split layers over
    the tokens (``tensor_parallel.shard_model``; ``None``, the default: where the model's layout
    allows, which Llama, Mistral and Qwen2 have).
    """
    from transformers import AutoModelForCausalLM

    if sequence_parallel and tensor_parallel <= 1:
        raise ValueError(
            f"sequence_parallel=True with tensor_parallel={tensor_parallel}: sequence parallelism splits the "
            "tokens over a tensor-parallel group; pass tensor_parallel=N > 1 or sequence_parallel=False."
        )
    name_or_path = check_model_source(name_or_path)
    device = check_device(device) or default_device()
    if tensor_parallel > 1:
        from ..parallel.tensor_parallel import load_sharded_model

        dtype = resolve_dtype(torch_dtype, device)
        return load_sharded_model(name_or_path, tensor_parallel, device, dtype, sequence_parallel)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=resolve_dtype(torch_dtype, device), device_map=device
    )
    model.eval()
    return model


def load_tokenizer(name_or_path: str):
    """The tokenizer saved with a model (fast when available, for its offset mapping)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_source(name_or_path, tokenizer=True))
