"""LongCE: long-context cross-entropy fine-tuning (Fang et al., ICLR 2025, Sec. 3.2).

Replace ``transformers.Trainer`` with ``LongCETrainer`` and ``TrainingArguments`` with
``LongCEConfig``; nothing else in a training script changes. Each token's loss is weighted by
``min(exp(lp_long - lp_short), gamma)``, scored by the model being trained (detached), with the
short-context windows of the ``longppl`` scoring core. ``context_extension`` holds the RoPE
recipes of the paper's settings (PI, ABF, YaRN, EABF).
"""

from longppl.logprobs import LogitTransform

from .config import LongCEConfig
from .context_extension import apply_context_extension, register_eabf_attention
from .documents import DocumentSpan, batch_documents, batch_short_log_probs
from .trainer import LongCETrainer
from .weighted_loss import (
    chunked_weighted_cross_entropy,
    fused_weighted_linear_cross_entropy,
    longce_weights,
)

__all__ = [
    "DocumentSpan",
    "LogitTransform",
    "LongCEConfig",
    "LongCETrainer",
    "apply_context_extension",
    "batch_documents",
    "batch_short_log_probs",
    "chunked_weighted_cross_entropy",
    "fused_weighted_linear_cross_entropy",
    "longce_weights",
    "register_eabf_attention",
]
