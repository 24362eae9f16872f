"""Context-extension recipes of the paper's fine-tuning settings, through transformers' own RoPE code.

- ``pi``: Position Interpolation (Chen et al., 2023), ``rope_type="linear"``, positions divided by
  ``factor`` (8 for 4k -> 32k, paper App. A.2).
- ``abf``: Adjusted Base Frequency, ``rope_theta = 500000``.
- ``yarn``: YaRN (Peng et al., 2024), ``rope_type="yarn"`` with ``factor`` and
  ``original_max_position_embeddings``.
- ``eabf``: ABF plus entropy-aware attention scaling (Zhang et al., 2024): each query at position
  ``p`` is multiplied by ``max(1, log(p + 1) / log(base_length))`` (``base_length = 4096``, the
  pre-training context), through a registered attention function (SDPA underneath) and its mask
  function.

The recipes only edit ``config.rope_parameters`` (transformers v5) and name the attention
implementation to load the model with; the rotary code itself is transformers'.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

METHODS = ("none", "pi", "abf", "yarn", "eabf")
ABF_ROPE_THETA = 500000.0
EABF_ATTENTION = "longce_eabf"


def eabf_query_scale(positions: torch.Tensor, base_length: int = 4096) -> torch.Tensor:
    """``max(1, log(p + 1) / log(base_length))`` for each position ``p`` (any shape, float32)."""
    return torch.clamp(torch.log(positions.float() + 1.0) / math.log(base_length), min=1.0)


def _eabf_attention(base_length: int):
    def eabf_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """SDPA with each query ``[B, heads, q, dim]`` scaled by ``eabf_query_scale`` of its position."""
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # queries are the last q of the k keys
            q_len, k_len = query.shape[-2], key.shape[-2]
            position_ids = torch.arange(k_len - q_len, k_len, device=query.device)[None]
        scale = eabf_query_scale(position_ids.to(query.device), base_length)[:, None, :, None]
        return sdpa_attention_forward(module, query * scale.to(query.dtype), key, value, attention_mask, **kwargs)

    return eabf_attention


def register_eabf_attention(base_length: int = 4096, name: str = EABF_ATTENTION) -> str:
    """Register the EABF attention function (and SDPA's mask function) under ``name``; returns ``name``.

    Load or switch a model with ``attn_implementation=name`` (``from_pretrained`` or
    ``model.set_attn_implementation(name)``).
    """
    if base_length < 2:
        raise ValueError(f"EABF base_length must be >= 2 (log(base_length) divides), got {base_length}.")
    AttentionInterface.register(name, _eabf_attention(base_length))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def apply_context_extension(
    config: PretrainedConfig,
    method: str,
    factor: float | None = None,
    rope_theta: float | None = None,
    original_max_position_embeddings: int | None = None,
    eabf_base_length: int = 4096,
) -> str | None:
    """Edit ``config`` (in place) for ``method``; returns the attention implementation to use, if any.

    Args:
        method: one of ``METHODS``.
        factor: PI / YaRN scaling factor (PI default 8).
        rope_theta: ABF / EABF base (default 500000).
        original_max_position_embeddings: YaRN's pre-training context (default: the config's
            ``max_position_embeddings`` before the change, which becomes ``original * factor``).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown context-extension method {method!r}; choose one of {METHODS}.")
    text_config = config.get_text_config()
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    if method == "none":
        return None
    if method == "pi":
        factor = 8.0 if factor is None else float(factor)
        _check_factor(factor)
        rope = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
        text_config.max_position_embeddings = int(text_config.max_position_embeddings * factor)
    elif method in ("abf", "eabf"):
        rope = {"rope_type": "default", "rope_theta": float(rope_theta or ABF_ROPE_THETA)}
    elif method == "yarn":
        if factor is None:
            raise ValueError("YaRN needs a scaling factor (e.g. factor=8 to go from 4k to 32k tokens).")
        _check_factor(float(factor))
        original = original_max_position_embeddings or text_config.max_position_embeddings
        rope = {
            "rope_type": "yarn",
            "factor": float(factor),
            "rope_theta": theta,
            "original_max_position_embeddings": int(original),
        }
        text_config.max_position_embeddings = int(original * factor)
    text_config.rope_parameters = rope
    return register_eabf_attention(eabf_base_length) if method == "eabf" else None


def _check_factor(factor: float) -> None:
    if not factor >= 1.0:
        raise ValueError(f"A context-extension factor must be >= 1 (new length / old length), got {factor}.")
