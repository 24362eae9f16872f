"""Context-extension recipes of the paper's fine-tuning settings, through transformers' own RoPE code.

- ``pi``: Position Interpolation (Chen et al., 2023), ``rope_type="linear"``, positions divided by
  ``factor`` (8 for 4k -> 32k, paper App. A.2).
- ``ntk``: NTK-aware scaling (bloc97, 2023), an ABF whose base is set by ``factor``:
  ``rope_theta * factor ** (d / (d - 2))``, ``d`` the head dimension, so that the lowest frequency is
  divided by ``factor`` and the highest kept.
- ``abf``: Adjusted Base Frequency, ``rope_theta = 500000``.
- ``yarn``: YaRN (Peng et al., 2024), ``rope_type="yarn"`` with ``factor`` and
  ``original_max_position_embeddings``.
- ``eabf``: ABF plus entropy-aware attention scaling (Zhang et al., 2024): each query at position
  ``p`` is multiplied by ``max(1, log(p + 1) / log(base_length))`` (``base_length = 4096``, the
  pre-training context), through a registered attention function (SDPA underneath) and its mask
  function.

The recipes only edit ``config.rope_parameters`` (transformers v5) and name the attention
implementation to load the model with; the rotary code itself is transformers'. This module is the one
list of the methods (:data:`PARAMETERS`): the ``longce-train`` command and the reproduction
(``longppl_reproduce``) both read it. Importing it loads neither torch nor transformers (a command's
``--help`` stays quick); applying a recipe does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

#: ``{method: the arguments of apply_context_extension it reads}``, every context-extension method.
PARAMETERS = {
    "none": (),
    "pi": ("factor",),
    "ntk": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "abf": ("rope_theta",),
    "eabf": ("rope_theta", "eabf_base_length"),
}
METHODS = tuple(PARAMETERS)
ABF_ROPE_THETA = 500000.0
EABF_ATTENTION = "longce_eabf"


def ntk_rope_theta(rope_theta: float, factor: float, head_dim: int) -> float:
    """NTK-aware scaling's RoPE base: ``rope_theta * factor ** (head_dim / (head_dim - 2))``.

    Frequency ``i`` of ``head_dim / 2`` is ``base ** (-2i / head_dim)``: with this base the last
    (lowest, ``i = head_dim / 2 - 1``) is the old one divided by ``factor``, the first (``i = 0``) is 1."""
    if head_dim <= 2:
        raise ValueError(f"NTK-aware scaling needs a head dimension above 2, got {head_dim}.")
    return float(rope_theta) * float(factor) ** (head_dim / (head_dim - 2))


def eabf_query_scale(positions: torch.Tensor, base_length: int = 4096) -> torch.Tensor:
    """``max(1, log(p + 1) / log(base_length))`` for each position ``p`` (any shape, float32)."""
    import torch

    return torch.clamp(torch.log(positions.float() + 1.0) / math.log(base_length), min=1.0)


def _eabf_attention(base_length: int):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
        factor: PI / NTK / YaRN scaling factor (PI default 8), new context length / old.
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
    elif method == "ntk":  # only the base changes, as in ABF: max_position_embeddings is left as it is
        if factor is None:
            raise ValueError("NTK-aware scaling needs a scaling factor (e.g. factor=4 to go from 4k to 16k tokens).")
        _check_factor(float(factor))
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        rope = {"rope_type": "default", "rope_theta": ntk_rope_theta(theta, factor, head_dim)}
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
