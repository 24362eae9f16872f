"""Loading causal LMs and tokenizers from Hub ids or local paths, with device and dtype defaults."""

from __future__ import annotations

import torch


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def load_model(name_or_path: str, device: str | None = None, torch_dtype=None):
    """The model alone, as :func:`load_causal_lm` loads it (for callers that hold its tokenizer already)."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(torch_dtype, device),
                                                 device_map=device)
    model.eval()
    return model


def load_tokenizer(name_or_path: str):
    """The tokenizer saved with a model (fast when available, for its offset mapping)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)
