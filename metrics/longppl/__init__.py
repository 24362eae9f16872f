"""LongPPL: key-token perplexity for long-context language models (Fang et al., ICLR 2025).

- ``evaluate.load(longppl.METRIC_PATH)`` (or ``evaluate.load("metrics/longppl")`` from a checkout)
  gives the ``evaluate`` metric; after ``python -m longppl.register``, ``evaluate.load("longppl")``
  does too.
- ``from longppl import compute_longppl`` is a drop-in for the official ``longppl`` package.
- The scoring core (token log-probs without full logits, batched short-context windows, key-token
  rules, cross-tokenizer alignment) is importable for other tools, e.g. the LongCE trainer.
- ``KeyTokenCache``: an evaluator's scores of a corpus as a ``datasets.Dataset``, to evaluate many
  models against at the cost of one perplexity pass each.
"""

import os

from .alignment import encode_with_offsets, tokens_within_spans, transfer_token_weights
from .batching import Segment, long_context_log_probs, pack_by_token_budget, segment_log_probs
from .fingerprints import ModelIdentity, text_fingerprint
from .key_token_cache import KeyTokenCache, KeyTokenSettings, cached_evaluator_scores, key_token_rows, open_cache
from .key_tokens import key_char_spans, key_token_mask, long_short_difference, merge_adjacent_spans, soft_weights
from .logprobs import resolve_lm_head, token_log_probs
from .official import compute_longppl, find_key_token, load_key_token
from .progress import Progress
from .scoring import (
    DocumentResult,
    EvaluatorScores,
    ModelScores,
    aggregate,
    document_result,
    document_results,
    model_key_weights,
    score_with_evaluator,
    score_with_model,
    summarize_results,
    text_key_weights,
)
from .windows import short_context_log_probs, window_bounds

__version__ = "0.1.0"

#: Folder of the ``evaluate`` module: ``evaluate.load(longppl.METRIC_PATH)`` works from any directory.
METRIC_PATH = os.path.dirname(os.path.abspath(__file__))

__all__ = [
    "METRIC_PATH",
    "DocumentResult",
    "EvaluatorScores",
    "KeyTokenCache",
    "KeyTokenSettings",
    "ModelIdentity",
    "ModelScores",
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
    "Progress",
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
