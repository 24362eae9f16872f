"""Drop-in replacement for the official ``longppl`` package (0.3.0): same functions, arguments and
return keys, computed with this library's batched, chunked core.

Key spans are saved in the official package's format (``[a, b];[c, d]``), so that files written
here are read by the official package too; they are read back without ``eval`` (parsed as integers
and checked to be character spans). JSON key-span files of earlier versions of this library are read
as well.

The arguments are checked as the metric checks them (``settings``): e.g. ``trunc_len=0`` or
``alpha=nan`` is an error here too, not numbers or a silent "no key tokens".
"""

from __future__ import annotations

import json
import os
import re
import warnings

import numpy as np
import torch

from ..atomic_files import write_file_atomically
from ..core.scoring import document_result, score_with_evaluator, score_with_model
from ..models.fingerprints import text_fingerprint
from ..models.loading import check_model_source, load_causal_lm
from ..rules.alignment import tokens_within_spans
from ..settings import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    KeyTokenRule,
    KeyTokenSettings,
)

KEY_SPANS_FORMAT = "longppl-key-spans"
KEY_SPANS_VERSION = 1
_OFFICIAL_SPAN = re.compile(r"^\[\s*(\d+)\s*,\s*(\d+)\s*\]$")
# Character offsets are stored as int64 downstream; anything larger cannot be an offset in a text.
_MAX_OFFSET = np.iinfo(np.int64).max


def save_key_spans(path: str, spans: np.ndarray) -> None:
    """Write key spans ``[m, 2]`` (character ``[start, end)``, text order) in the official package's
    format, ``[a, b];[c, d]`` on one line (empty without spans), atomically (a temporary file in
    the same folder, then rename). The official ``load_key_token`` reads it back."""
    line = ";".join(f"[{start}, {end}]" for start, end in np.asarray(spans, dtype=np.int64).reshape(-1, 2).tolist())
    write_file_atomically(path, lambda handle: handle.write(line))


def load_key_token(save_path: str, text: str | None = None) -> list[list[int]]:
    """Key character spans saved by :func:`compute_longppl` / :func:`find_key_token`.

    Reads this library's JSON files and the official package's ``[a, b];[c, d]`` files.

    Args:
        text: if given, a JSON file computed for a different text is refused.
    Returns:
        ``[[start, end], ...]`` spans in text order.
    """
    if not os.path.isfile(save_path):
        raise FileNotFoundError(
            f"No key-span file at {save_path!r}. Compute it first with an evaluator "
            "(compute_longppl(..., evaluator_model=..., save_path=...))."
        )
    with open(save_path, encoding="utf-8") as handle:
        content = handle.read()
    stripped = content.strip()
    if stripped.startswith("{"):
        try:
            payload = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise ValueError(f"{save_path!r} is not a valid key-span JSON file: {err}") from err
        if payload.get("format") != KEY_SPANS_FORMAT or payload.get("version") != KEY_SPANS_VERSION:
            raise ValueError(
                f"{save_path!r} is not a key-span file of this library (format {payload.get('format')!r}, "
                f"version {payload.get('version')!r}); recompute it with an evaluator."
            )
        if text is not None and payload.get("text_sha256") != text_fingerprint(text):
            raise ValueError(
                f"The key spans in {save_path!r} were computed for a different text; recompute them "
                "with an evaluator or pass the matching save_path."
            )
        spans = payload.get("spans")
        if not isinstance(spans, list) or not all(isinstance(span, list) and len(span) == 2 for span in spans):
            raise ValueError(f"{save_path!r}: 'spans' must be a list of [start, end] pairs; recompute it.")
        return _checked_spans(spans, save_path, text)
    spans = []
    for number, part in enumerate(filter(None, stripped.split(";"))):
        match = _OFFICIAL_SPAN.match(part.strip())
        if match is None:
            raise ValueError(
                f"{save_path!r} is neither a JSON key-span file nor the official '[a, b];[c, d]' format "
                f"(entry {number}: {part[:40]!r})."
            )
        spans.append([int(match.group(1)), int(match.group(2))])
    return _checked_spans(spans, save_path, text)


def _checked_spans(spans: list, save_path: str, text: str | None) -> list[list[int]]:
    """``spans`` if every entry is a character span ``[start, end]`` (integers, ``0 <= start <= end``,
    ``end <= len(text)`` when the text is known); ``ValueError`` naming the entry otherwise.

    Spans out of text order are kept as they are, with a warning: the official code reads such a
    file too, and counts the tokens its two-pointer walk reaches (``alignment.official_span_overlap``).
    """
    limit = _MAX_OFFSET if text is None else len(text)
    for number, span in enumerate(spans):
        start, end = span
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
            raise ValueError(f"{save_path!r}: span {number} {span!r} is not a pair of integers; recompute the file.")
        if not 0 <= start <= end:
            raise ValueError(
                f"{save_path!r}: span {number} [{start}, {end}] is not a character span (0 <= start <= end); "
                "recompute the file with an evaluator."
            )
        if end > limit:
            what = f"the text has {len(text)} characters" if text is not None else "no text is that long"
            raise ValueError(
                f"{save_path!r}: span {number} [{start}, {end}] ends past the text ({what}): the file belongs "
                "to another text or is corrupt; recompute it with an evaluator."
            )
    starts = [start for start, _ in spans]
    if any(b < a for a, b in zip(starts, starts[1:])):
        warnings.warn(
            f"The key spans in {save_path!r} are not in text order. They are counted as the official code "
            "counts them (walking tokens and spans together, so a span before an earlier one is skipped); "
            "sort the spans by start to count every one.",
            stacklevel=3,
        )
    return [[int(start), int(end)] for start, end in spans]


def _checked_arguments(text, trunc_len, sliding_window, alpha, beta) -> tuple[KeyTokenSettings, KeyTokenRule]:
    """The evaluator's settings (the official ones: its special tokens, no ``window_bos``) and the rule,
    checked as the metric checks them (``settings``), for a non-empty ``text``; ``ValueError``
    otherwise, before any model is loaded."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string (one document), got {type(text).__name__} {text!r:.40}.")
    return KeyTokenSettings(trunc_len, sliding_window), KeyTokenRule(alpha, beta)


def _key_spans(
    text: str, evaluator_model, evaluator_tokenizer, settings: KeyTokenSettings, rule: KeyTokenRule, save_path
):
    """``[m, 2]`` int64 merged key character spans of ``text``, saved to ``save_path`` unless it is
    ``None`` (``find_key_token`` without its checks)."""
    scores = score_with_evaluator(evaluator_model, evaluator_tokenizer, [text], progress=False, settings=settings)
    spans = scores[0].key_spans(rule)
    if save_path is not None:
        save_key_spans(save_path, spans)
    return spans


_ORDER = (
    "compute_longppl takes (text, model, evaluator_model, tokenizer, evaluator_tokenizer, save_path, ...): "
    "text a str, the models causal LM objects or Hub ids / paths, the tokenizers their tokenizers"
)


def _check_argument_order(model, evaluator_model, tokenizer, evaluator_tokenizer) -> None:
    """A ``ValueError`` naming the expected order when a model is not a model (a tokenizer, a text...) or a
    tokenizer is a model: arguments passed in another order, which would otherwise fail deep inside
    transformers (an ``AttributeError`` of a tokenizer used as a model)."""
    for role, value, optional in (("model", model, False), ("evaluator_model", evaluator_model, True)):
        if not (isinstance(value, (str, os.PathLike, torch.nn.Module)) or (optional and value is None)):
            raise ValueError(f"{role} is a {type(value).__name__}, not a model or its Hub id / path; {_ORDER}.")
    for role, value in (("tokenizer", tokenizer), ("evaluator_tokenizer", evaluator_tokenizer)):
        if isinstance(value, torch.nn.Module) or (value is not None and not callable(value)):
            raise ValueError(f"{role} is a {type(value).__name__}, not a tokenizer; {_ORDER}.")


def _as_model(model, tokenizer, role: str):
    if isinstance(model, (str, os.PathLike)):
        model = os.fspath(model)
        if tokenizer is not None:
            warnings.warn(f"{role} is a path; its own tokenizer is loaded and the one given is ignored.", stacklevel=3)
        return load_causal_lm(check_model_source(model, role))
    if tokenizer is None:
        raise ValueError(f"{role} is a model object, so its tokenizer must be given too.")
    return model, tokenizer


def find_key_token(
    text,
    evaluator_model,
    evaluator_tokenizer,
    trunc_len=DEFAULT_TRUNC_LEN,
    sliding_window=DEFAULT_SLIDING_WINDOW,
    save_path=None,
    alpha=DEFAULT_ALPHA,
    beta=DEFAULT_BETA,
):
    """Key character spans of ``text`` under ``evaluator_model`` (official signature).

    Returns:
        ``[m, 2]`` int64 tensor of merged ``(start, end)`` character spans.
    """
    settings, rule = _checked_arguments(text, trunc_len, sliding_window, alpha, beta)
    return torch.from_numpy(_key_spans(text, evaluator_model, evaluator_tokenizer, settings, rule, save_path))


def compute_longppl(
    text,
    model,
    evaluator_model,
    tokenizer=None,
    evaluator_tokenizer=None,
    save_path=None,
    trunc_len=DEFAULT_TRUNC_LEN,
    sliding_window=DEFAULT_SLIDING_WINDOW,
    alpha=DEFAULT_ALPHA,
    beta=DEFAULT_BETA,
):
    r"""LongPPL of one text, with the official ``longppl.compute_longppl`` signature and return keys.

    Parameters:
        text (`str`): the text to score.
        model (`PreTrainedModel` or `str`): the evaluated causal LM, or its path / Hub id.
        evaluator_model (`PreTrainedModel`, `str` or `None`): the model that selects key tokens; ``None``
            reads key spans saved earlier at ``save_path``.
        tokenizer, evaluator_tokenizer: tokenizers of the two models (required for model objects).
        save_path (`str`, optional): where the key spans are saved (the official `[a, b];[c, d]` format,
            which the official package reads too) or, without an evaluator, read. A symbolic link is
            written through (its target replaced atomically; the link stays).
        trunc_len (`int`, default 4096): K, the length of the truncated short context.
        sliding_window (`int`, default 1024): d, the number of tokens sharing one short context.
        alpha, beta (`float`, default 2, -2): key token iff LSD > alpha and LCL > beta.

    Returns:
        `dict` with ``longppl`` (``None`` when no token is key, as in the official package),
        ``n_key_token``, ``ppl`` and ``n_token`` (the evaluated model's tokens, without special tokens).

    Over a corpus, the official evaluation script as it stands (since July 2025) combines the texts'
    values in the log domain: LongPPL ``exp(sum n_key_token * log longppl / sum n_key_token)`` over the
    texts whose ``longppl`` is not ``None``, PPL ``exp(sum n_token * log ppl / sum n_token)`` over all.
    The metric computes exactly this by default (``aggregation="official"``); the script before July
    2025 took the same weighted means of the values themselves (``aggregation="official-pre-2025-07"``).

    As officially, the evaluator tokenizes with its special tokens and the evaluated model without.
    Bad arguments (``trunc_len < 1``, a NaN threshold, ...) raise ``ValueError`` before any model
    is loaded, as in the metric.
    """
    settings, rule = _checked_arguments(text, trunc_len, sliding_window, alpha, beta)
    _check_argument_order(model, evaluator_model, tokenizer, evaluator_tokenizer)
    model, tokenizer = _as_model(model, tokenizer, "model")
    if evaluator_model is not None:
        evaluator_model, evaluator_tokenizer = _as_model(evaluator_model, evaluator_tokenizer, "evaluator_model")
        spans = _key_spans(text, evaluator_model, evaluator_tokenizer, settings, rule, save_path)
    elif save_path is None:
        raise ValueError("evaluator_model is None, so key spans are read from save_path, which is None too.")
    else:
        spans = np.asarray(load_key_token(save_path, text), dtype=np.int64).reshape(-1, 2)

    scores = score_with_model(model, tokenizer, [text], progress=False)[0]
    weights = tokens_within_spans(scores.offsets, spans).astype(np.float64)
    result = document_result(scores.lp, weights)
    if result.n_key_tokens == 0:
        warnings.warn("No key tokens in this text; 'longppl' is None.", stacklevel=2)
        return {"longppl": None, "n_key_token": None, "ppl": result.ppl, "n_token": result.n_tokens}
    return {
        "longppl": result.longppl,
        "n_key_token": int(result.n_key_tokens),
        "ppl": result.ppl,
        "n_token": result.n_tokens,
    }
