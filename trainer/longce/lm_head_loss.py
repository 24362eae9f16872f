"""The LM-head loss of ``LongCETrainer``: one interface, three implementations, one selection rule.

``LongCETrainer`` hands the loss the final hidden states of the trained positions and gets back
``sum_r w[r] * nll[r]`` with the per-token NLL and weights (formula: ``weighted_loss``; ``w`` is
``min(exp(lp_long - lp_short), gamma)``, or the weights the caller gives, e.g. an evaluator's from a
key-token cache, ``cached_weights``). Which code
computes it depends on the head and on where the hidden states are:

- ``LigerLMHeadLoss``: Liger-Kernel's fused linear cross-entropy; a plain ``nn.Linear`` head, CUDA
  hidden states in the head's dtype, no logit multiplier (Liger knows soft-capping only).
- ``FusedLMHeadLoss``: our fused autograd function; any plain ``nn.Linear`` head, any device.
- ``ChunkedLMHeadLoss``: autograd through the head's own forward, a checkpointed chunk at a time;
  any head (LoRA or another adapter on ``lm_head``).

``select_lm_head_loss(kernel, device)`` turns the ``longce_loss_kernel`` setting into one
``LMHeadLoss``: implementations tried in order, the first that ``applies`` to the head and hidden
states computes the loss. The chunked one applies to every head, so it always closes the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from longppl.core.logprobs import CausalLMHead

from .weighted_loss import (
    DEFAULT_LOSS_CHUNK_BYTES,
    chunked_weighted_cross_entropy,
    fused_weighted_linear_cross_entropy,
    liger_available,
    liger_weighted_linear_cross_entropy,
)

#: Values of ``longce_loss_kernel``: "ours" = fused, or chunked for adapter heads; "liger" = Liger
#: where it applies, else ours; "auto" = "liger" when installed and training on CUDA, else "ours".
LOSS_KERNELS = ("auto", "ours", "liger")

LossParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _is_plain_linear(module: nn.Module) -> bool:
    """True for ``nn.Linear`` (and wrappers' subclasses that keep its forward), not LoRA / quantized heads."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class LMHeadLoss(ABC):
    """``sum_r w[r] * nll[r]`` of the trained positions, from their final hidden states and the LM head."""

    def applies(self, head: CausalLMHead, hidden: torch.Tensor) -> bool:
        """Whether this implementation can compute the loss of ``head`` on ``hidden`` (default: always)."""
        return True

    @abstractmethod
    def __call__(
        self,
        head: CausalLMHead,
        hidden: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor],
        targets: torch.Tensor,
        lp_short: torch.Tensor,
        gamma: float,
        weights: torch.Tensor | None = None,
    ) -> LossParts:
        """The weighted loss (see ``weighted_loss``).

        Args:
            head: the model's LM head with its logit post-processing (``head.transform``).
            hidden: ``[N, H]`` final hidden states of the trained positions; row ``r`` predicts ``targets[r]``.
            project: the head module's own forward, ``[n, H] -> [n, V]`` raw logits (the head is
                intercepted while the loss runs, see ``longppl.core.logprobs.intercept_head``).
            targets: ``[N]`` int64 target ids. lp_short: ``[N]`` float32 short-context log-probs of
                the targets, NaN where there is none (weight ``min(1, gamma)``).
            gamma: cap of the weights ``min(exp(lp_long - lp_short), gamma)``, > 0.
            weights: ``[N]`` float32 weights given by the caller (detached, ``longce_weights="cache"``), used
                instead of ``min(exp(lp_long - lp_short), gamma)``; ``lp_short`` and ``gamma`` are then
                unused. None: the weights come from ``lp_short``.
        Returns:
            ``(loss, nll, weights)``: scalar float32 ``sum(weights * nll)``, differentiable in
            ``hidden`` and the head's parameters; detached ``[N]`` float32 NLL and weights (for logging).
        """


@dataclass(frozen=True)
class FusedLMHeadLoss(LMHeadLoss):
    """``fused_weighted_linear_cross_entropy`` on a plain ``nn.Linear`` head (its weight and bias)."""

    chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES

    def applies(self, head: CausalLMHead, hidden: torch.Tensor) -> bool:
        return _is_plain_linear(head.head)

    def __call__(self, head, hidden, project, targets, lp_short, gamma, weights=None) -> LossParts:
        module = head.head
        return fused_weighted_linear_cross_entropy(
            hidden, module.weight, module.bias, targets, lp_short, gamma, head.transform, self.chunk_bytes, weights
        )


@dataclass(frozen=True)
class LigerLMHeadLoss(LMHeadLoss):
    """``liger_weighted_linear_cross_entropy`` on a plain ``nn.Linear`` head (Liger-Kernel, CUDA)."""

    def applies(self, head: CausalLMHead, hidden: torch.Tensor) -> bool:
        module = head.head
        return (
            _is_plain_linear(module)
            and hidden.is_cuda
            and head.transform.multiplier == 1.0
            and hidden.dtype == module.weight.dtype
        )

    def __call__(self, head, hidden, project, targets, lp_short, gamma, weights=None) -> LossParts:
        module = head.head
        return liger_weighted_linear_cross_entropy(
            hidden, module.weight, module.bias, targets, lp_short, gamma, head.transform, weights
        )


@dataclass(frozen=True)
class ChunkedLMHeadLoss(LMHeadLoss):
    """``chunked_weighted_cross_entropy`` through ``project``: any head, LoRA-wrapped ones included."""

    chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES

    def __call__(self, head, hidden, project, targets, lp_short, gamma, weights=None) -> LossParts:
        vocab = head.model.config.get_text_config().vocab_size
        return chunked_weighted_cross_entropy(
            hidden, project, vocab, targets, lp_short, gamma, head.transform, self.chunk_bytes, weights
        )


@dataclass(frozen=True)
class FirstApplicable(LMHeadLoss):
    """The first of ``implementations`` that applies to the head and hidden states computes the loss."""

    implementations: tuple[LMHeadLoss, ...]

    def applies(self, head: CausalLMHead, hidden: torch.Tensor) -> bool:
        return any(loss.applies(head, hidden) for loss in self.implementations)

    def choose(self, head: CausalLMHead, hidden: torch.Tensor) -> LMHeadLoss:
        """The implementation that computes the loss of ``head`` on ``hidden``."""
        for loss in self.implementations:
            if loss.applies(head, hidden):
                return loss
        names = ", ".join(type(loss).__name__ for loss in self.implementations)
        raise ValueError(
            f"No LM-head loss of ({names}) applies to the head {type(head.head).__name__}; end the list with "
            "ChunkedLMHeadLoss, which runs any head."
        )

    def __call__(self, head, hidden, project, targets, lp_short, gamma, weights=None) -> LossParts:
        return self.choose(head, hidden)(head, hidden, project, targets, lp_short, gamma, weights)


def check_loss_kernel(kernel: str) -> None:
    """Raise ``ValueError`` for an unknown ``longce_loss_kernel``, or for "liger" without Liger-Kernel."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"longce_loss_kernel must be one of {LOSS_KERNELS}, got {kernel!r}.")
    if kernel == "liger" and not liger_available():
        raise ValueError(
            "longce_loss_kernel='liger' needs Liger-Kernel (pip install 'liger-kernel>=0.8.2') "
            "and a CUDA build of PyTorch with Triton; or use 'auto' / 'ours'."
        )


def select_lm_head_loss(
    kernel: str, device: torch.device | str, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES
) -> LMHeadLoss:
    """The ``LMHeadLoss`` of the ``longce_loss_kernel`` setting ``kernel`` for training on ``device``.

    "auto" takes Liger-Kernel when it is installed and ``device`` is CUDA (where it is faster, see
    ``weighted_loss``). Where Liger does not apply to a batch (a LoRA head, a logit multiplier,
    hidden states in another dtype) ours computes the loss, so "liger" never fails at a step.
    ``chunk_bytes``: float32 bytes of one logits chunk of ours.
    """
    check_loss_kernel(kernel)
    use_liger = kernel == "liger" or (kernel == "auto" and torch.device(device).type == "cuda" and liger_available())
    ours = (FusedLMHeadLoss(chunk_bytes), ChunkedLMHeadLoss(chunk_bytes))
    return FirstApplicable(((LigerLMHeadLoss(),) if use_liger else ()) + ours)
