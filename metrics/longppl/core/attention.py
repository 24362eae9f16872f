"""Sliding-window attention that computes only what the window lets through.

A model whose layers attend within a sliding window of ``W`` tokens (Gemma 3: five layers of six see
the last 512 tokens; Mistral, Qwen2 and others when configured so) runs, under transformers' SDPA
attention, every such layer as full attention with a ``(L, L)`` mask: at 32k tokens that is 32 times
the work the window needs, a 1 GiB boolean mask, and more than half of a small evaluator's time.
:data:`WINDOWED_SDPA` (``attn_implementation="longppl_sdpa_windowed"``) computes a window layer in
blocks instead:

- the ``L`` queries are cut into ``ceil(L / W)`` blocks of ``W``; block ``b`` (queries
  ``bW .. bW+W-1``) attends to the ``2W`` keys ``(b-1)W .. bW+W-1``, which hold every key its
  queries may see (query ``i`` sees keys ``j`` with ``i - W < j <= i``, transformers'
  ``sliding_window_overlay``);
- one SDPA call over all blocks at once (blocks as a batch dimension) with one ``(W, 2W)`` mask,
  that of block 0 also hiding the keys before the text: ``O(L * 2W)`` work and memory instead of
  ``O(L^2)``.

A float32 full-attention layer, which SDPA runs on its math kernel when the head is large (all
``(L, L)`` scores at once), runs in blocks of queries instead (:func:`chunked_causal_attention`).

The result is the same attention up to the order of floating-point sums (every query's softmax runs
over exactly the keys SDPA's masked call lets through). Everything else runs transformers' own SDPA
attention unchanged: full-attention layers (causal, on the flash kernel), a window layer over at
most ``W`` tokens, inputs with padding, packed sequences, a KV cache or attention dropout. The mask
function registered with it returns no mask when the input is one unpadded causal sequence
(the layer's window comes with the call) and transformers' SDPA mask otherwise.

:func:`use_windowed_attention` switches a loaded model to it when the model has window layers; the
library's loader (:func:`loading.load_model`) does so for every model it loads. This module imports
transformers and torch only when called.
"""

from __future__ import annotations

import contextlib

#: The name registered with transformers' attention and mask interfaces.
WINDOWED_SDPA = "longppl_sdpa_windowed"


def _plain_causal(q_length, kv_length, q_offset, kv_offset, attention_mask, allow_is_causal_skip) -> bool:
    """Whether the mask is only causal (and the layer's window): one unpadded sequence, no cache."""
    import torch

    if not allow_is_causal_skip or q_length != kv_length:
        return False  # packing, custom mask functions or a cache: transformers' mask says what is seen
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or q_offset or kv_offset:
        return False
    if attention_mask is None:
        return True
    return attention_mask.shape[-1] == kv_length and bool(attention_mask.all())


def windowed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """The mask :func:`windowed_sdpa_attention` receives: ``None`` for one unpadded causal sequence
    of ``q_length == kv_length`` tokens, else transformers' SDPA mask (4D boolean, ``(batch, 1,
    q_length, kv_length)``) built from the same arguments."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if _plain_causal(q_length, kv_length, q_offset, kv_offset, attention_mask, allow_is_causal_skip):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


_BLOCK_MASKS: dict = {}


def _block_mask(blocks: int, window: int, device):
    """``(1, blocks, W, 2W)`` booleans: query ``q`` of a block sees its keys ``k`` with
    ``q < k <= q + W`` (key ``k`` of block ``b`` is token ``(b-1)W + k``, query ``q`` token
    ``bW + q``), and block 0 none of the ``W`` keys before the text."""
    import torch

    key = (blocks, window, str(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        q = torch.arange(window, device=device)[:, None]
        k = torch.arange(2 * window, device=device)[None, :]
        mask = ((k > q) & (k <= q + window)).expand(blocks, window, 2 * window).clone()
        mask[0, :, :window] = False
        mask = mask.unsqueeze(0)
        # One length at a time is what scoring uses: keep one mask (a local is returned, so a
        # thread scoring beside this one may replace it without harm).
        _BLOCK_MASKS.clear()
        _BLOCK_MASKS[key] = mask
    return mask


def blockwise_window_attention(query, key, value, window: int, scaling: float | None):
    """Causal attention of each token to the last ``window`` tokens (itself included), in blocks.

    Args:
        query: ``(batch, heads, L, head_dim)``.
        key, value: ``(batch, kv_heads, L, head_dim)``; ``heads`` a multiple of ``kv_heads`` (grouped
            queries: key head ``h // (heads // kv_heads)`` serves query head ``h``).
        window: ``W``; token ``i`` sees tokens ``j`` with ``i - W < j <= i``.
        scaling: the softmax scale (``None``: ``head_dim ** -0.5``).

    Returns ``(batch, L, heads, head_dim)``, as transformers' attention functions do.
    """
    import torch.nn.functional as F

    batch, heads, length, dim = query.shape
    if key.shape[1] != heads:
        groups = heads // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    blocks = -(-length // window)
    padded = blocks * window

    def key_blocks(x):
        # W positions before the text (hidden by block 0's mask) and the end padded to whole blocks;
        # block b's keys are the 2W positions from bW of the padded sequence.
        x = F.pad(x, (0, 0, window, padded - length))
        x = x.unfold(2, 2 * window, window)  # (batch, heads, blocks, dim, 2W)
        return x.transpose(-1, -2).reshape(batch * heads, blocks, 2 * window, dim)

    q = F.pad(query, (0, 0, 0, padded - length)).reshape(batch * heads, blocks, window, dim)
    out = F.scaled_dot_product_attention(
        q, key_blocks(key), key_blocks(value), attn_mask=_block_mask(blocks, window, query.device), scale=scaling
    )
    out = out.reshape(batch, heads, padded, dim)[:, :, :length]
    return out.transpose(1, 2).contiguous()


#: Queries per block of :func:`chunked_causal_attention`: ``heads x 2048 x L`` float32 scores at a
#: time (1 GiB for 4 heads at 32k tokens) instead of ``heads x L x L``.
CAUSAL_QUERY_BLOCK = 2048


def chunked_causal_attention(query, key, value, scaling: float | None, block: int = CAUSAL_QUERY_BLOCK):
    """Causal attention in blocks of ``block`` queries, each over the keys up to its last query.

    For float32, where PyTorch's SDPA has no flash kernel and, at a head size over its
    memory-efficient kernel's (Gemma 3: 256), runs the math kernel, which holds the whole
    ``(heads, L, L)`` score matrix twice (42 GiB at 32k tokens): in blocks it holds one block's
    scores and skips the keys after the block, half of the work. Shapes as
    :func:`blockwise_window_attention`; returns ``(batch, L, heads, head_dim)``.
    """
    import torch
    import torch.nn.functional as F

    heads, length = query.shape[1], query.shape[2]
    if key.shape[1] != heads:
        groups = heads // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    for start in range(0, length, block):
        end = min(start + block, length)
        # query start + q sees keys k <= start + q
        mask = torch.arange(end, device=query.device)[None, :] <= torch.arange(start, end, device=query.device)[:, None]
        out[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, :end], value[:, :, :end], attn_mask=mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous()


def windowed_sdpa_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs
):
    """transformers' attention-function signature (``query``: ``(batch, heads, L, head_dim)``,
    ``key``/``value``: ``(batch, kv_heads, S, head_dim)``; returns ``((batch, L, heads, head_dim),
    None)``): over one unpadded causal sequence, :func:`blockwise_window_attention` for a window layer
    longer than its window and :func:`chunked_causal_attention` for a float32 full-attention layer
    longer than :data:`CAUSAL_QUERY_BLOCK`; transformers' ``sdpa_attention_forward`` for everything else."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[2]
    plain = (
        attention_mask is None
        and length == key.shape[2]
        and not dropout
        and kwargs.get("softcap") is None
        and getattr(module, "is_causal", True)
    )
    if plain and sliding_window is not None and length > sliding_window:
        return blockwise_window_attention(query, key, value, int(sliding_window), scaling), None
    if plain and sliding_window is None and query.dtype == torch.float32 and length > CAUSAL_QUERY_BLOCK:
        return chunked_causal_attention(query, key, value, scaling), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        **kwargs,
    )


def register_windowed_attention() -> str:
    """Register :data:`WINDOWED_SDPA` with transformers (idempotent) and return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(WINDOWED_SDPA, windowed_sdpa_attention)
    AttentionMaskInterface.register(WINDOWED_SDPA, windowed_mask)
    return WINDOWED_SDPA


def has_window_layers(config) -> bool:
    """Whether some layer of the model ``config`` describes attends within a sliding window."""
    config = getattr(config, "get_text_config", lambda: config)()
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return bool(getattr(config, "use_sliding_window", True))


def use_windowed_attention(model) -> bool:
    """Switch ``model`` (a loaded transformers model) to :data:`WINDOWED_SDPA` when it has window
    layers and runs transformers' SDPA attention; returns whether it did. Other models, models on
    another attention implementation (eager, flash, flex) and composite models (a vision tower's
    configuration beside the text model's) are left as they are."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not has_window_layers(config):
        return False
    if getattr(config, "get_text_config", lambda: config)() is not config:
        return False  # set_attn_implementation would switch the other towers too
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return False  # SDPA has no soft-capping; such a model's attention is left to transformers
    model.set_attn_implementation(register_windowed_attention())
    return True


@contextlib.contextmanager
def windowed_attention(model):
    """Run the ``with`` block with ``model`` on :data:`WINDOWED_SDPA` where :func:`use_windowed_attention`
    switches it, and put it back on SDPA afterwards: a caller's model leaves as it came in."""
    switched = use_windowed_attention(model)
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation("sdpa")
