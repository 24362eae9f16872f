"""LongPPL: key-token perplexity for long-context language models (Fang et al., ICLR 2025).

- ``evaluate.load(longppl.METRIC_PATH)`` (or ``evaluate.load("metrics/longppl")`` from a checkout)
  gives the ``evaluate`` metric; after ``python -m longppl.register``, ``evaluate.load("longppl")``
  does too. ``import longppl`` registers it by itself when evaluate's module-cache copy is missing
  or stale (see :mod:`longppl.register`; ``LONGPPL_AUTO_REGISTER=0`` turns that off).
- ``from longppl import compute_longppl`` is a drop-in for the official ``longppl`` package.
- The scoring core (token log-probs without full logits, batched short-context windows, key-token
  rules, cross-tokenizer alignment) is importable for other tools, e.g. the LongCE trainer.
- ``KeyTokenCache``: an evaluator's scores of a corpus as a ``datasets.Dataset``, to evaluate many
  models against at the cost of one perplexity pass each.
"""

import importlib
import os

from . import register as _register

# Public names -> the submodule defining them. They load on first use (PEP 562), so that
# `import longppl` and its light submodules (threads, register, key_tokens, ...) do not import
# torch: a script's `--help` answers at once.
_EXPORTS = {
    "alignment": ("encode_with_offsets", "tokens_within_spans", "transfer_token_weights"),
    "batching": ("Segment", "long_context_log_probs", "pack_by_token_budget", "segment_log_probs"),
    "fingerprints": ("ModelIdentity", "text_fingerprint"),
    "key_token_cache": ("KeyTokenCache", "KeyTokenSettings", "cached_evaluator_scores", "key_token_rows", "open_cache"),
    "key_tokens": ("key_char_spans", "key_token_mask", "long_short_difference", "merge_adjacent_spans", "soft_weights"),
    "logprobs": ("resolve_lm_head", "token_log_probs"),
    "official": ("compute_longppl", "find_key_token", "load_key_token"),
    "progress": ("Progress",),
    "scoring": (
        "DocumentResult",
        "EvaluatorScores",
        "ModelScores",
        "aggregate",
        "document_result",
        "document_results",
        "model_key_weights",
        "score_with_evaluator",
        "score_with_model",
        "summarize_results",
        "text_key_weights",
    ),
    "windows": ("short_context_log_probs", "window_bounds"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# Submodules that `import longppl` used to load eagerly: `longppl.scoring` etc. still resolve without
# an import of their own.
_SUBMODULES = set(_EXPORTS) | {"atomic_files", "compilation", "loading"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

#: Folder of the ``evaluate`` module: ``evaluate.load(longppl.METRIC_PATH)`` works from any directory.
METRIC_PATH = os.path.dirname(os.path.abspath(__file__))

# evaluate.load("longppl") by its bare name: keep evaluate's module-cache copy of the metric this
# package's code (a cheap check; a one-off copy when missing or stale), and quiet evaluate's
# "couldn't be found ... remotely" warning about that copy. See longppl.register.
_register.install_log_filter()
_register.ensure_registered()

__all__ = [
    "METRIC_PATH",
    "DocumentResult",
    "EvaluatorScores",
    "KeyTokenCache",
    "KeyTokenSettings",
    "ModelIdentity",
    "ModelScores",
    "Progress",
    "Segment",
    "aggregate",
    "cached_evaluator_scores",
    "compute_longppl",
    "document_result",
    "document_results",
    "encode_with_offsets",
    "find_key_token",
    "key_char_spans",
    "key_token_mask",
    "key_token_rows",
    "load_key_token",
    "long_context_log_probs",
    "long_short_difference",
    "merge_adjacent_spans",
    "open_cache",
    "model_key_weights",
    "pack_by_token_budget",
    "resolve_lm_head",
    "score_with_evaluator",
    "score_with_model",
    "segment_log_probs",
    "short_context_log_probs",
    "soft_weights",
    "text_key_weights",
    "summarize_results",
    "text_fingerprint",
    "token_log_probs",
    "tokens_within_spans",
    "transfer_token_weights",
    "window_bounds",
]
