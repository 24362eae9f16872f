"""The LongCE loss from hidden states and the LM head, without a ``[tokens, vocabulary]`` tensor.

For ``N`` scored positions with final hidden states ``h`` (``[N, H]``), targets ``y`` (``[N]``) and
short-context log-probs ``lp_short`` (``[N]``, NaN where the token has no short score)::

    lp_long[r] = log softmax(logits(h[r]))[y[r]]          (the model's own full-context score)
    w[r]       = min(exp(lp_long[r] - lp_short[r]), gamma)  (detached; min(1, gamma) where lp_short is NaN)
    loss       = sum_r w[r] * (-lp_long[r])

(the caller divides by the number of label tokens). Every function also takes the weights directly
(``weights``, ``[N]``, e.g. an evaluator's from a key-token cache, ``longce.cached_weights``): they
replace ``w`` and ``lp_short`` is then unused. ``logits`` is the head's projection followed by
the architecture's post-processing (Cohere/Granite multiplier, Gemma soft-capping).

Three implementations; ours cut the rows into chunks (``longppl.core.logprobs.rows_per_chunk``) so that
the largest logits tensor alive is ``[chunk, V]``. ``lm_head_loss`` puts them behind one interface
and owns the rule that picks one for a head and a device:

- ``fused_weighted_linear_cross_entropy`` for a plain ``nn.Linear`` head: an autograd function that
  computes the gradients of ``hidden``, ``weight`` and ``bias`` during the forward pass (as
  Liger-Kernel's fused linear cross-entropy does), so backward is a multiplication by the incoming
  scalar. Memory: one logits chunk plus ``[N, H]`` and ``[V, H]`` gradient buffers.
- ``liger_weighted_linear_cross_entropy``: the same loss through Liger-Kernel's fused linear
  cross-entropy (Triton, CUDA only) with ``reduction="none"``: 0.118 s vs our 0.159 s for the
  loss of 32k tokens on an H200, same gradients; ``LongCETrainer`` uses it when it is installed
  and applies (``longce_loss_kernel="auto"``).
- ``chunked_weighted_cross_entropy`` for any other head (e.g. LoRA on ``lm_head``): each chunk goes
  through the head module under activation checkpointing, so its logits are recomputed in backward
  instead of kept, and the adapter's own forward defines the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longppl.core.logprobs import DEFAULT_LOGITS_CHUNK_BYTES, LogitTransform, rows_per_chunk
from longppl.rules.key_tokens import unscored_weight

# float32 bytes of one logits chunk, the scoring core's (chunks are cut by its ``rows_per_chunk``):
# 1 GiB is ~2k rows of a 128k vocabulary. Measured on an H200 (scripts/bench/bench_longce.py
# --loss-kernels, 32k tokens, Llama-3.2-1B head): 0.159 s vs 0.222 s with 256 MiB chunks (fewer,
# larger matmuls), for ~4 GiB more peak memory.
DEFAULT_LOSS_CHUNK_BYTES = DEFAULT_LOGITS_CHUNK_BYTES


def lsd_weights(lp_long: torch.Tensor, lp_short: torch.Tensor, gamma: float) -> torch.Tensor:
    """``min(exp(lp_long - lp_short), gamma)`` (``min(exp(LSD), gamma)``), and ``min(1, gamma)``
    (``longppl.rules.key_tokens.unscored_weight``) where ``lp_short`` is NaN (no short score: LSD counts as 0).

    Shapes: any, broadcastable; float32 result. ``gamma=None`` would be unbounded: always pass one.
    """
    weight = torch.exp(lp_long.float() - lp_short.float()).clamp(max=gamma)
    return torch.where(torch.isnan(lp_short), torch.full_like(weight, unscored_weight(gamma)), weight)


#: The name ``lsd_weights`` had first (kept): ``longce_weights`` is also the setting and the column.
longce_weights = lsd_weights


def _token_weights(
    lp_long: torch.Tensor, lp_short: torch.Tensor, gamma: float, given: torch.Tensor | None
) -> torch.Tensor:
    """The rows' weights: ``given`` (float32) when the caller has them, else :func:`lsd_weights`."""
    return lsd_weights(lp_long, lp_short, gamma) if given is None else given.float()


class _FusedWeightedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, lp_short, gamma, transform, chunk_bytes, grads, given):
        n_rows = hidden.shape[0]
        vocab = weight.shape[0]
        step = rows_per_chunk(vocab, chunk_bytes)
        need_hidden, need_weight, need_bias = grads
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Gradient buffers in float32: they sum over all chunks.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        matmul_weight = None  # the weight in the logits' dtype (bf16 under autocast), cast once
        nll = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        weights = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, n_rows, step):
            end = min(start + step, n_rows)
            h = hidden[start:end]
            raw = F.linear(h, weight, bias)
            if matmul_weight is None:
                matmul_weight = weight.to(raw.dtype)
            z = raw.float()
            if transform.multiplier != 1.0:
                z = z * transform.multiplier
            capped = None
            if transform.softcap is not None:
                capped = torch.tanh(z / transform.softcap)
                z = capped * transform.softcap
            lse = torch.logsumexp(z, dim=-1)
            tgt = targets[start:end]
            lp = z.gather(1, tgt[:, None]).squeeze(1) - lse
            w = _token_weights(lp, lp_short[start:end], gamma, None if given is None else given[start:end])
            nll[start:end] = -lp
            weights[start:end] = w
            if not any(grads):
                continue
            # d(w * nll)/dz = w * (softmax(z) - onehot(y)), w held constant (detached)
            grad_z = z.sub_(lse[:, None]).exp_()
            grad_z[torch.arange(end - start, device=z.device), tgt] -= 1.0
            grad_z.mul_(w[:, None])
            if capped is not None:
                grad_z.mul_(1.0 - capped * capped)
            if transform.multiplier != 1.0:
                grad_z.mul_(transform.multiplier)
            grad_raw = grad_z.to(raw.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_raw @ matmul_weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.add_(grad_raw.t() @ h.to(raw.dtype))
            if grad_bias is not None:
                grad_bias.add_(grad_z.sum(0))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll, weights)
        return (weights * nll).sum(), nll, weights

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_weights):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = (grad_bias * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def fused_weighted_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lp_short: torch.Tensor,
    gamma: float,
    transform: LogitTransform = LogitTransform(),
    chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LongCE loss for a linear head ``raw = hidden @ weight.T + bias`` (see the module docstring).

    Args:
        hidden: ``[N, H]`` final hidden states of the predicting positions.
        weight: ``[V, H]``, bias ``[V]`` or None: the LM head's parameters.
        targets: ``[N]`` int64 target ids; ``lp_short``: ``[N]`` float32 (NaN: weight ``min(1, gamma)``).
        weights: ``[N]`` per-row weights given directly (detached), used instead of
            ``min(exp(lp_long - lp_short), gamma)``; ``lp_short`` and ``gamma`` are then unused.
    Returns:
        ``(loss, nll, weights)``: scalar ``sum(w * nll)`` (differentiable in hidden, weight, bias),
        and the detached ``[N]`` float32 per-token NLL and weights (for logging).
    """
    enabled = torch.is_grad_enabled()
    grads = (
        enabled and hidden.requires_grad,
        enabled and weight.requires_grad,
        enabled and bias is not None and bias.requires_grad,
    )
    return _FusedWeightedLinearCE.apply(
        hidden, weight, bias, targets, lp_short, gamma, transform, chunk_bytes, grads, weights
    )


def liger_available() -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy can be imported (needs Triton and a GPU build)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return False
    return True


def liger_weighted_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lp_short: torch.Tensor,
    gamma: float,
    transform: LogitTransform = LogitTransform(),
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_weighted_linear_cross_entropy`` through Liger-Kernel (>= 0.8.2, ``reduction="none"``).

    Liger returns the per-token NLL ``[N]``; the weights come from it (detached; or are ``weights``
    when given), and the backward
    of ``sum(w * nll)`` scales each row's gradient by its ``w``. Needs ``transform.multiplier == 1``
    (Liger knows soft-capping, not a logit multiplier) and CUDA tensors.
    """
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    if transform.multiplier != 1.0:
        raise ValueError("Liger-Kernel's fused linear cross-entropy has no logit multiplier; use the fused function.")
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none", softcap=transform.softcap)
    nll = loss_fn(weight, hidden, targets, bias).float()
    weights = _token_weights(-nll.detach(), lp_short, gamma, weights)
    return (weights * nll).sum(), nll.detach(), weights


def chunked_weighted_cross_entropy(
    hidden: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    targets: torch.Tensor,
    lp_short: torch.Tensor,
    gamma: float,
    transform: LogitTransform = LogitTransform(),
    chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same loss as ``fused_weighted_linear_cross_entropy`` for any head ``project: [n, H] -> [n, V]``.

    Each chunk runs under non-reentrant activation checkpointing: its logits are freed after the
    forward and recomputed in backward, so autograd through ``project`` (LoRA adapters included)
    never holds more than one chunk of logits.
    """
    step = rows_per_chunk(vocab_size, chunk_bytes)
    given = weights
    nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    weights = torch.empty_like(nll)

    def chunk_loss(
        h: torch.Tensor, tgt: torch.Tensor, short: torch.Tensor, w: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lp = -F.cross_entropy(transform(project(h)), tgt, reduction="none")
        w = _token_weights(lp.detach(), short, gamma, w)
        return (w * -lp).sum(), torch.stack([-lp.detach(), w])

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], step):
        end = start + step
        args = (hidden[start:end], targets[start:end], lp_short[start:end], None if given is None else given[start:end])
        if torch.is_grad_enabled() and hidden.requires_grad:
            loss, stats = checkpoint(chunk_loss, *args, use_reentrant=False)
        else:
            loss, stats = chunk_loss(*args)
        total = total + loss
        nll[start:end], weights[start:end] = stats[0], stats[1]
    return total, nll, weights
