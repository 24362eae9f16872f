"""LongCE: long-context cross-entropy fine-tuning (Fang et al., ICLR 2025, Sec. 3.2).

Replace ``transformers.Trainer`` with ``LongCETrainer`` and ``TrainingArguments`` with
``LongCEConfig``; nothing else in a training script changes. Each token's loss is weighted by
``min(exp(lp_long - lp_short), gamma)``, scored by the model being trained (detached), with the
short-context windows of the ``longppl`` scoring core. ``context_extension`` holds the RoPE
recipes of the paper's settings (PI, ABF, YaRN, EABF) and NTK-aware scaling.

Modules: ``config`` (``LongCEConfig``), ``trainer`` (``LongCETrainer``),
``documents`` (documents of a batch and their short-context scores), ``lm_head_loss`` (the LM-head
loss: one interface, its implementations and the rule choosing one), ``weighted_loss`` (the loss
functions themselves), ``weight_sources`` (where the token weights come from: one interface, the
self-scored, cached and plain-CE sources, the rule choosing one), ``cached_weights`` (weights from
an evaluator's key-token cache, ``longce_weights="cache"``), ``context_extension``.
"""

import importlib

# Public names -> the submodule defining them. They load on first use (PEP 562), so that
# `import longce` imports neither torch nor transformers, and `from longce import LongCEConfig`
# does not import `datasets` / `pyarrow` (transformers' Trainer does: only `LongCETrainer` needs it).
_EXPORTS = {
    "cached_weights": ("LongCEWeightsCollator", "add_key_token_weights"),
    "config": ("LongCEConfig",),
    "context_extension": ("apply_context_extension", "register_eabf_attention"),
    "documents": ("DocumentSpan", "batch_documents", "batch_short_log_probs"),
    "lm_head_loss": (
        "ChunkedLMHeadLoss",
        "FirstApplicable",
        "FusedLMHeadLoss",
        "LMHeadLoss",
        "LigerLMHeadLoss",
        "select_lm_head_loss",
    ),
    "trainer": ("LongCETrainer",),
    "weight_sources": (
        "CachedWeights",
        "NoWeights",
        "SelfScoredWeights",
        "WEIGHTS_COLUMN",
        "WeightSource",
        "weight_source_for",
    ),
    "weighted_loss": (
        "chunked_weighted_cross_entropy",
        "fused_weighted_linear_cross_entropy",
        "longce_weights",
        "lsd_weights",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# Deprecated names, importable one release more (their module warns, naming the replacement); not in dir().
_DEPRECATED = {"LongCESettings": "config"}


def __getattr__(name: str):
    if name in _EXPORTS:  # a submodule: `longce.trainer` without an import of its own
        return importlib.import_module(f".{name}", __name__)
    if name in _DEPRECATED:
        return getattr(importlib.import_module(f".{_DEPRECATED[name]}", __name__), name)  # warns at each use
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


# What a training script uses; the rest stays importable from here (lazily) and from its module.
__all__ = [
    "LongCEConfig",
    "LongCETrainer",
    "add_key_token_weights",
    "apply_context_extension",
    "longce_weights",
    "register_eabf_attention",
]
