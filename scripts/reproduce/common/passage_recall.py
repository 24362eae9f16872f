"""Passage recall: a held-out long-context task in a format no model of the reproduction trained on.

A case is a stretch of a held-out book in which a span of ``span`` (24) tokens lies far back; the
case ends with the span's first ``cue`` (8) tokens repeated (the cue), and the model, teacher
forced, should go on with the span's next ``span - cue`` (16) tokens. Everything is in token ids,
never text, so nothing is retokenised and no boundary drifts::

    input_ids = haystack (length - cue tokens of a book) | cue | continuation (the scored tokens)
                  span_start ^                          ^ cue_start     ^ scored_start  ^ scored_end

``input_ids[cue_start:]`` equals ``input_ids[span_start : span_start + span]``: the cue and the
continuation are the span, copied. The case's context is its first ``length`` tokens (haystack and
cue, ``scored_start == length``); the continuation is appended only to be teacher forced.

Distance: ``distance = cue_start - span_start``, the number of tokens from the span's first token up
to, not including, the cue's first token. Every token of the span stands exactly ``distance`` tokens
before its copy, so a scored token at index ``t`` is recalled from index ``t - distance``; a case has
``distance > beyond``, out of sight of a model that attends only to the last ``beyond`` tokens (the
predicting position, ``t - 1``, among them).

Index convention (the package's, ``longppl.core.logprobs``): the logits at position ``t`` predict
token ``t + 1``; the scored tokens ``input_ids[scored_start:scored_end]`` are predicted by the logits
at positions ``scored_start - 1 ... scored_end - 2``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longppl.settings import require_int

from .run_folder import write_jsonl

# How many times a case is drawn again when its cue occurs elsewhere in it, before giving up.
_ATTEMPTS = 64


@dataclass(frozen=True)
class RecallCase:
    """One passage-recall case (the module docstring draws its layout).

    Attributes:
        input_ids: ``[scored_end]`` token ids: haystack, cue, then the scored continuation.
        span_start: index of the span's first token in ``input_ids``.
        cue_start: index of the cue's first token (the haystack's length).
        scored_start: index of the first scored token (the context's length, ``length``).
        book: index of the book, in the list the case was drawn from.
        offset: index in that book of the haystack's first token.
    """

    input_ids: tuple[int, ...]
    span_start: int
    cue_start: int
    scored_start: int
    book: int
    offset: int

    @property
    def scored_end(self) -> int:
        """One past the last scored token: ``len(input_ids)``."""
        return len(self.input_ids)

    @property
    def distance(self) -> int:
        """``cue_start - span_start``: how far back each cue and scored token's source lies."""
        return self.cue_start - self.span_start


def _occurrences(ids: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Start indices of every occurrence of ``pattern`` in ``ids`` (overlapping ones included)."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(pattern))
    return np.flatnonzero((windows == pattern).all(axis=1))


def passage_recall_cases(
    books_ids: Sequence, length: int, beyond: int, cases: int, seed, span: int = 24, cue: int = 8
) -> list[RecallCase]:
    """``cases`` cases whose context (haystack and cue) is ``length`` tokens, with the span's start
    more than ``beyond`` tokens before the cue's (``distance > beyond``, module docstring), and
    ``span - cue`` scored tokens after the cue (``len(input_ids) == length + span - cue``).

    The haystack is ``length - cue`` consecutive tokens of one of ``books_ids`` (each a ``[n]``
    array of a book's token ids; books shorter than that are skipped), uniform over every such
    stretch of every book. The span's start is uniform over ``[0, length - cue - max(beyond + 1,
    span)]``, so the whole span lies in the haystack. A draw whose cue occurs anywhere in the case
    but at the span and the cue itself (recall would be ambiguous) is drawn again, stretch and span,
    at most 64 times. The same ``seed`` (anything ``numpy.random.default_rng`` takes) gives the same
    cases.

    Raises:
        ValueError: a bad argument; ``length`` too short for a span ``beyond`` tokens back; no book
            long enough; or 64 draws in a row with an ambiguous cue (books too repetitive).
    """
    for name, value in (("length", length), ("cases", cases), ("span", span), ("cue", cue)):
        require_int(name, value)
    require_int("beyond", beyond, minimum=0)
    if cue >= span:
        raise ValueError(f"cue={cue} must be shorter than span={span}: the tokens after the cue are the ones scored.")
    haystack = length - cue
    latest = haystack - max(beyond + 1, span)  # the last span start allowed
    if latest < 0:
        raise ValueError(
            f"length={length} tokens leaves no span of {span} tokens starting more than beyond={beyond} tokens "
            f"before the cue of {cue} tokens; ask for a longer length or a shorter beyond."
        )
    books = []
    for index, ids in enumerate(books_ids):
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"books_ids[{index}] is not a 1-D array of token ids (shape {ids.shape}, {ids.dtype}).")
        books.append(ids)
    stretches = np.array([max(0, len(ids) - haystack + 1) for ids in books], dtype=np.int64)
    total = int(stretches.sum())
    if total == 0:
        longest = max((len(ids) for ids in books), default=0)
        raise ValueError(
            f"No book holds the {haystack} tokens a case of length={length} takes from it (the longest of "
            f"{len(books)} holds {longest}); pass longer books or ask for a shorter length."
        )
    ends = np.cumsum(stretches)
    rng = np.random.default_rng(seed)
    drawn = []
    for _ in range(cases):
        for _ in range(_ATTEMPTS):
            pick = int(rng.integers(total))
            book = int(np.searchsorted(ends, pick, side="right"))
            offset = pick - int(ends[book] - stretches[book])
            stretch = books[book][offset : offset + haystack]
            span_start = int(rng.integers(latest + 1))
            ids = np.concatenate([stretch, stretch[span_start : span_start + span]])
            if set(_occurrences(ids, ids[haystack:length]).tolist()) == {span_start, haystack}:
                break
        else:
            raise ValueError(
                f"{_ATTEMPTS} draws in a row found no span whose first {cue} tokens occur only there and in the cue "
                "(recall would be ambiguous); the books are too repetitive: pass other books or a longer cue."
            )
        drawn.append(RecallCase(tuple(int(i) for i in ids), span_start, haystack, length, book, offset))
    return drawn


_FIELDS = ("input_ids", "span_start", "cue_start", "scored_start", "book", "offset")


def write_passage_recall_cases(path: str, cases: Sequence[RecallCase]) -> None:
    """Write cases as JSONL (atomically), one object per case with the fields of :class:`RecallCase`;
    :func:`read_passage_recall_cases` reads them back."""
    write_jsonl(path, [dataclasses.asdict(c) for c in cases])  # the fields in _FIELDS's order


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def read_passage_recall_cases(path: str) -> list[RecallCase]:
    """Cases from a JSONL file written by :func:`write_passage_recall_cases` (JSON only; blank lines
    skipped), each checked to be a case: the cue and the scored tokens copy the span, which ends at
    or before the cue.

    Raises:
        ValueError: naming the file and line of a record that is not a JSON object, lacks a field or
            holds a bad value there; or an empty file.
    """
    from longppl.commandline.corpus import jsonl_records

    cases = []
    hint = f"passage-recall files need {', '.join(map(repr, _FIELDS))} on every line."
    for where, record in jsonl_records(path, _FIELDS, hint):
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(_whole(i) for i in ids):
            raise ValueError(f"{where}, field 'input_ids' is {ids!r:.60}, not a list of token ids.")
        for field in _FIELDS[1:]:
            if not _whole(record[field]):
                raise ValueError(f"{where}, field {field!r} is {record[field]!r}, not a whole number.")
        case = RecallCase(tuple(ids), *(record[field] for field in _FIELDS[1:]))
        tail = case.scored_end - case.cue_start  # the span's length
        if not (
            case.cue_start < case.scored_start < case.scored_end
            and case.span_start + tail <= case.cue_start
            and ids[case.cue_start :] == ids[case.span_start : case.span_start + tail]
        ):
            raise ValueError(
                f"{where} is not a passage-recall case: its cue and scored tokens (from index {case.cue_start}) do "
                f"not copy a span ending before them (from index {case.span_start}); write it again."
            )
        cases.append(case)
    if not cases:
        raise ValueError(f"{path} holds no test cases (it is empty); write one JSON object per line.")
    return cases


def passage_recall_accuracy(model, cases: Sequence[RecallCase], batch_size: int, device=None) -> dict:
    """Teacher-forced top-1 recall of the scored tokens: ``{"accuracy": mean over cases of the share
    of a case's scored tokens that are the model's top-1 prediction, "exact": share of cases with all
    of them right, "per_case": [share], "cases": n}``.

    ``model`` is a causal LM (a ``*ForCausalLM``); it runs in eval mode (its mode is restored after)
    without gradients, one forward pass per ``batch_size`` cases stacked as they are (all cases
    share one length: no padding), a window layer computed in blocks
    (``longppl.core.attention.windowed_attention``). The logits at position ``t`` predict token ``t + 1``, and only the
    ``scored_end - scored_start`` positions that predict a scored token go through the LM head.
    ``device``: where the inputs go (default: the model's input embeddings' device).

    Raises:
        ValueError: no cases, or cases of different lengths or scored ranges (score each apart).
    """
    import torch

    from longppl.core.attention import windowed_attention
    from longppl.core.logprobs import resolve_lm_head, verify_head

    require_int("batch_size", batch_size)
    cases = list(cases)
    if not cases:
        raise ValueError("No cases to score; pass at least one RecallCase.")
    shapes = {(c.scored_start, c.scored_end) for c in cases}
    if len(shapes) > 1:
        raise ValueError(
            f"The cases have {len(shapes)} different (scored_start, scored_end) pairs, {sorted(shapes)[:3]}...; "
            "score the cases of each length on their own."
        )
    ((start, end),) = shapes
    head = resolve_lm_head(model)
    device = head.input_device if device is None else torch.device(device)
    per_case: list[float] = []
    was_training = model.training
    try:
        model.eval()
        # the cases are unpadded causal sequences: a window layer (Gemma 3's) runs in blocks, not as
        # full attention under an (L, L) mask
        with torch.no_grad(), windowed_attention(model):
            for first in range(0, len(cases), batch_size):
                ids = torch.tensor([c.input_ids for c in cases[first : first + batch_size]], device=device)
                verify_head(head, ids)
                # the last scored token is only a target: the inputs stop before it
                hidden = head.backbone(input_ids=ids[:, : end - 1], use_cache=False).last_hidden_state
                predicted = head.logits(hidden[:, start - 1 : end - 1]).argmax(-1)
                right = (predicted == ids[:, start:end].to(predicted.device)).double().mean(-1)
                per_case.extend(right.tolist())
    finally:
        model.train(was_training)
    return {
        "accuracy": float(np.mean(per_case)),
        "exact": float(np.mean([share == 1.0 for share in per_case])),
        "per_case": per_case,
        "cases": len(per_case),
    }
