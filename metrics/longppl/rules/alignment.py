"""Character offsets of tokens, and moving key tokens / weights between tokenizers (paper App. A.1).

Key tokens found under the evaluator's tokenizer become character spans of the text (adjacent
spans merged); a token of the evaluated model is key iff its character span lies inside one merged
key span. Soft weights move by the character-level average: each character takes the mean weight
of the evaluator tokens that cover it (several where byte-level tokens split it), and a model token
takes the mean over its characters; a model tokenization equal to the evaluator's keeps the
evaluator's weights token for token.

Offsets are ``[n, 2]`` int64 ``(start, end)`` character spans into the text (``end`` exclusive);
special tokens that are not in the text get a zero-width span.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

_REPLACEMENT = "\ufffd"  # what a byte-level decoder emits for an incomplete UTF-8 sequence


def encode_with_offsets(tokenizer, text: str, add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and character offsets of ``text``.

    Uses the fast tokenizer's ``offset_mapping``; tokenizers without one (slow / Python tokenizers)
    fall back to :func:`decode_offsets`.

    Returns:
        ``ids`` ``[n]`` int64 and ``offsets`` ``[n, 2]`` int64.
    """
    return next(encode_many_with_offsets(tokenizer, [text], add_special_tokens))


def encode_many_with_offsets(
    tokenizer, texts: Sequence[str], add_special_tokens: bool, chunk: int = 256
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`encode_with_offsets` of every text, in order, as a generator.

    A fast tokenizer encodes ``chunk`` texts per call (one call into its Rust ``encode_batch``
    instead of one per text: the per-call overhead of ``transformers`` dominates for short texts),
    giving the same ids and offsets as one call per text; other tokenizers go text by text.
    """
    kwargs = dict(add_special_tokens=add_special_tokens, return_attention_mask=False, verbose=False)
    fast = getattr(tokenizer, "is_fast", False)
    for start in range(0, len(texts), chunk):
        part = list(texts[start : start + chunk])
        if fast:
            try:
                encoded = tokenizer(part, return_offsets_mapping=True, **kwargs)
            except NotImplementedError:  # no offset mapping after all: decode the offsets
                fast = False
            else:
                for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"]):
                    yield np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
                continue
        for text in part:
            ids = np.asarray(tokenizer(text, **kwargs)["input_ids"], dtype=np.int64)
            yield ids, decode_offsets(tokenizer, text, ids)


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decode_offsets(tokenizer, text: str, ids: np.ndarray) -> np.ndarray:
    """Character offsets recovered by incremental decoding, for tokenizers without ``offset_mapping``.

    Each token's text is what decoding it adds after its predecessor (one token of context, so
    SentencePiece's leading-space handling is right). A token that ends inside a multi-byte
    character decodes to U+FFFD; it is held until the character completes, and all held tokens
    share the span of the completed text. (The official ``compute_offsets`` measures decoded
    lengths token by token and drifts on such characters.) Special tokens get zero-width spans.
    The concatenated pieces are then aligned to ``text``.

    Raises:
        ValueError: the tokenizer cannot decode.
    """
    ids = [int(i) for i in ids]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        _decode(tokenizer, ids[:1])
    except Exception as err:  # noqa: BLE001 - any failure means "cannot decode"
        raise ValueError(
            f"{type(tokenizer).__name__} gives no offset mapping and cannot decode token ids ({err!r}), so "
            "its tokens cannot be mapped to characters. Use a fast tokenizer "
            "(AutoTokenizer.from_pretrained(..., use_fast=True)) or one that implements decode()."
        ) from err

    starts = np.zeros(len(ids), dtype=np.int64)
    ends = np.zeros(len(ids), dtype=np.int64)
    pieces: list[str] = []
    produced = 0  # characters of decoded text so far
    stream: list[int] = []  # positions (in ids) of the non-special tokens, in order
    prefix = read = 0  # stream[prefix:read] is the context already emitted; stream[read:] is held
    for pos, token in enumerate(ids):
        if token in special:
            starts[pos] = ends[pos] = produced
            continue
        stream.append(pos)
        context = _decode(tokenizer, [ids[p] for p in stream[prefix:read]])
        current = _decode(tokenizer, [ids[p] for p in stream[prefix:]])
        if len(current) > len(context) and not current.endswith(_REPLACEMENT):
            piece = current[len(context) :]
            for held in stream[read:]:
                starts[held], ends[held] = produced, produced + len(piece)
            pieces.append(piece)
            produced += len(piece)
            prefix, read = read, len(stream)
        else:
            for held in stream[read:]:  # provisional, in case the text ends mid-character
                starts[held] = ends[held] = produced
    if read < len(stream):  # flush tokens still held at the end
        piece = _decode(tokenizer, [ids[p] for p in stream[prefix:]])[
            len(_decode(tokenizer, [ids[p] for p in stream[prefix:read]])) :
        ]
        for held in stream[read:]:
            starts[held], ends[held] = produced, produced + len(piece)
        pieces.append(piece)
        produced += len(piece)
    decoded = "".join(pieces)
    offsets = np.stack([starts, ends], axis=1)
    if decoded == text:
        return offsets
    return _map_positions(decoded, text, type(tokenizer).__name__)[offsets]


def _map_positions(decoded: str, text: str, tokenizer_name: str) -> np.ndarray:
    """``[len(decoded) + 1]`` map from positions in the decoded text to positions in ``text``."""
    if len(decoded) == len(text):
        # Same length (e.g. case or character normalisation): the official code assumes this too.
        return np.arange(len(text) + 1, dtype=np.int64)
    warnings.warn(
        f"{tokenizer_name} does not decode back to the input text ({len(decoded)} vs {len(text)} "
        "characters); token offsets are aligned by sequence matching and may be approximate.",
        stacklevel=3,
    )
    mapping = np.full(len(decoded) + 1, -1, dtype=np.int64)
    matcher = difflib.SequenceMatcher(None, decoded, text, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        mapping[a : a + size + 1] = np.arange(b, b + size + 1)
    # Unmatched positions take the last matched position before them (monotone, never past the end).
    mapping[0] = max(mapping[0], 0)
    return np.maximum.accumulate(mapping)


def tokens_within_spans(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """``[n]`` bool: token ``k`` lies inside one span (``start_j <= a_k`` and ``b_k <= end_j``).

    Args:
        offsets: ``[n, 2]`` token spans in text order.
        spans: ``[m, 2]`` merged key spans, normally in text order (starts and ends non-decreasing),
            so the candidate span is the last one starting at or before the token. Spans out of
            text order (a file edited or written by other code) are matched as the official code
            matches them (:func:`official_span_overlap`).
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if spans.shape[0] == 0 or offsets.shape[0] == 0:
        return np.zeros(offsets.shape[0], dtype=bool)
    if np.any(spans[1:, 0] < spans[:-1, 0]):
        return official_span_overlap(offsets, spans)
    candidate = np.searchsorted(spans[:, 0], offsets[:, 0], side="right") - 1
    safe = np.clip(candidate, 0, None)
    return (candidate >= 0) & (offsets[:, 1] <= spans[safe, 1])


def official_span_overlap(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """``[n]`` bool: the tokens the official ``cal_overlap`` marks, for spans in any order.

    The official code walks tokens (``i``) and spans (``j``) together: token ``i`` inside span ``j``
    is marked and ``i`` advances; a token starting before span ``j`` is skipped; otherwise span
    ``j`` is passed. For spans in text order this is :func:`tokens_within_spans`; for spans out
    of order it marks only what this walk reaches (e.g. reversed spans: the first span's tokens).

    Args:
        offsets: ``[n, 2]`` token spans in text order. spans: ``[m, 2]`` character spans.
    """
    token_spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2).tolist()
    key_spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2).tolist()
    marked = np.zeros(len(token_spans), dtype=bool)
    i = j = 0
    while i < len(token_spans) and j < len(key_spans):
        (a0, a1), (b0, b1) = token_spans[i], key_spans[j]
        if a0 >= b0 and a1 <= b1:
            marked[i] = True
            i += 1
        elif a0 < b0:
            i += 1
        else:
            j += 1
    return marked


def _text_tokens(offsets: np.ndarray) -> slice:
    """The tokens of ``offsets`` ``[n, 2]`` without the zero-width ones at either end (a BOS or EOS)."""
    covering = np.flatnonzero(offsets[:, 1] > offsets[:, 0])
    return slice(int(covering[0]), int(covering[-1]) + 1) if covering.size else slice(0, 0)


def transfer_token_weights(
    text_length: int,
    source_offsets: np.ndarray,
    source_weights: np.ndarray,
    target_offsets: np.ndarray,
    source_ids: np.ndarray | None = None,
    target_ids: np.ndarray | None = None,
    fill: float = 1.0,
) -> np.ndarray:
    """Character-level average of per-token weights from one tokenization to another (paper App. A.1).

    Each character's value is the mean weight of the source tokens whose spans cover it (``fill``
    where none does): byte-level tokens that split one multi-byte character all carry that character's
    span, so the character gets their mean. Each target token gets the mean over its characters
    (so a target byte token inside a character gets that character's value), or ``fill`` if it spans
    no character (a BOS, an EOS, WordPiece's trailing ``[SEP]``).

    The same tokens keep their weights: when ``source_ids`` and ``target_ids`` are given and the
    target's tokens are the source's (equal ids and offsets once the zero-width tokens at either end,
    such as a BOS only one side adds, are set aside), target token ``k`` takes its source token's
    weight exactly, and those end tokens of the target get ``fill``. Averaging would there blur the
    byte tokens of one character into one value.

    Args:
        text_length: characters of the text.
        source_offsets: ``[n_source, 2]`` character spans; source_weights: ``[n_source]``.
        target_offsets: ``[n_target, 2]`` character spans.
        source_ids, target_ids: ``[n_source]`` and ``[n_target]`` token ids, or ``None``.
        fill: the weight of what no source token carries a weight to (the soft variant passes
            ``key_tokens.unscored_weight(gamma)``, the weight of a token without a short score).
    Returns:
        ``[n_target]`` float64 weights.
    """
    source_offsets = np.asarray(source_offsets, dtype=np.int64).reshape(-1, 2)
    target_offsets = np.asarray(target_offsets, dtype=np.int64).reshape(-1, 2)
    source_weights = np.asarray(source_weights, dtype=np.float64)
    if source_ids is not None and target_ids is not None:
        source_text, target_text = _text_tokens(source_offsets), _text_tokens(target_offsets)
        if np.array_equal(np.asarray(source_ids)[source_text], np.asarray(target_ids)[target_text]) and np.array_equal(
            source_offsets[source_text], target_offsets[target_text]
        ):
            weights = np.full(target_offsets.shape[0], fill, dtype=np.float64)
            weights[target_text] = source_weights[source_text]
            return weights
    widths = source_offsets[:, 1] - source_offsets[:, 0]
    covering = widths > 0
    starts, widths = source_offsets[covering, 0], widths[covering]
    # The characters of every covering token in token order, without a Python loop over tokens:
    # token j's run begins at position (cumsum - width)[j] of the concatenation and at starts[j] in the text.
    chars = np.arange(int(widths.sum())) + np.repeat(starts - (np.cumsum(widths) - widths), widths)
    total = np.bincount(chars, weights=np.repeat(source_weights[covering], widths), minlength=text_length)
    count = np.bincount(chars, minlength=text_length)
    per_char = np.full(text_length, fill, dtype=np.float64)
    np.divide(total, count, out=per_char, where=count > 0)
    cumulative = np.concatenate([[0.0], np.cumsum(per_char)])
    a, b = target_offsets[:, 0], target_offsets[:, 1]
    width = b - a
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (cumulative[b] - cumulative[a]) / width
    return np.where(width > 0, mean, fill)
