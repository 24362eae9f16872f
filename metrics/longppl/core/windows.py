"""Short-context log-probabilities with the K/d sliding-window scheme (paper App. A.1, official code).

Trunc length ``K`` (``trunc_len``) and stride ``d`` (``sliding_window``). For ``s = 0, d, 2d, …``
while ``s + K < n``, the model reads ``x[s : min(s+K+d, n)]`` alone, and for ``i`` in
``[s+K, min(s+K+d, n))``::

    lp_short[i] = log P(x_i | x_s … x_{i-1})

so every token has between ``K`` and ``K+d-1`` tokens of context. Tokens ``i < K`` get no short
score (NaN). Windows of one or many documents share forward passes (see ``batching``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..settings import DEFAULT_MAX_TOKENS_PER_BATCH, WindowSettings, settings_object
from .batching import Segment, segment_log_probs
from .progress import Progress


def window_bounds(n: int, window: WindowSettings) -> list[tuple[int, int]]:
    """``(start, end)`` of every short window of an ``n``-token document; scored: ``[start+K, end)``."""
    trunc_len, stride = window.trunc_len, window.sliding_window
    return [(s, min(s + trunc_len + stride, n)) for s in range(0, max(n - trunc_len, 0), stride)]


def window_segments(
    sequences: Sequence[torch.Tensor],
    window: WindowSettings,
    skip_first_window: bool = False,
    prefix_token_id: int | None = None,
) -> tuple[list[Segment], list[tuple[int, int, int]]]:
    """The short windows of every document as ``Segment``s, with ``(document, first, end)`` owners.

    Window ``[s, end)`` of document ``k`` scores its tokens ``[first, end) = [s+K, end)``. With
    ``skip_first_window`` the window ``s = 0`` is left out (it is the full context of its tokens).
    ``prefix_token_id``: see ``short_context_log_probs``.
    """
    segments: list[Segment] = []
    owners: list[tuple[int, int, int]] = []
    for doc, seq in enumerate(sequences):
        seq = seq.long().cpu()
        for start, end in window_bounds(int(seq.shape[0]), window):
            if start == 0 and skip_first_window:
                continue
            tokens = seq[start:end]
            first = window.trunc_len
            if prefix_token_id is not None and start > 0:
                tokens = torch.cat([torch.tensor([prefix_token_id]), tokens])
                first += 1
            segments.append(Segment(tokens, first_scored=first))
            owners.append((doc, start + window.trunc_len, end))
    return segments, owners


def short_context_log_probs(
    model: nn.Module,
    sequences: Sequence[torch.Tensor],
    window: WindowSettings | None = None,
    *,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    long_log_probs: Sequence[torch.Tensor] | None = None,
    prefix_token_id: int | None = None,
    on_sequence_done: Callable[[int], None] | None = None,
    skip_first_window: bool = False,
    via_forward: bool = False,
    progress: Progress | None = None,
    equal_lengths: bool = False,
) -> list[torch.Tensor]:
    """Short-context log-probs of every token with at least ``trunc_len`` tokens before it.

    Args:
        sequences: ``[n_k]`` int64 token ids per document.
        window: K and d (``WindowSettings``, checked when built; default ``WindowSettings()``: 4096,
            1024). The only way to give them: ``WindowSettings(K, d)`` replaces the former numbers.
        max_tokens_per_batch: token budget of one forward pass (results do not depend on it).
        long_log_probs: the documents' full-context log-probs, if already computed. The first window
            (``s = 0``) reads ``x[0 : K+d]``, which *is* the full context of its scored tokens, so its
            values are taken from here instead of running it again.
        prefix_token_id: if given (opt-in, not the official behaviour), windows with ``s > 0`` are
            fed as ``[prefix_token_id] + x[s:end]``, e.g. a BOS token that the model expects at the
            head of every sequence. The first window already starts with the document's own tokens.
        on_sequence_done: called with a document's index once all its windows are scored.
        skip_first_window: leave the first window's tokens NaN (LongCE: their short context is their
            long context, so their LSD is exactly 0). Ignored when ``long_log_probs`` is given.
        via_forward: call ``model`` itself rather than its backbone and head (see ``token_log_probs``).
        progress: reports the windows as their batches finish (a bar ``"<desc>: windows"`` when
            they add up to more than ``progress.threshold`` tokens) and the layers and LM-head
            chunks of large batches (see ``progress``).
        equal_lengths: only windows of the same length share a pass, unpadded, so each window's
            scores are those it gets alone (see ``segment_log_probs``).
    Returns:
        ``[n_k]`` float32 per document: ``lp_short[i]`` for ``i >= K``, NaN for ``i < K``.
    """
    window = settings_object(WindowSettings, window)
    results = [torch.full((int(seq.shape[0]),), float("nan")) for seq in sequences]
    skip = skip_first_window or long_log_probs is not None
    segments, owners = window_segments(sequences, window, skip, prefix_token_id)
    if long_log_probs is not None:
        first = window.trunc_len
        for doc, seq in enumerate(sequences):
            end = min(first + window.sliding_window, int(seq.shape[0]))
            results[doc][first:end] = long_log_probs[doc][first:end]
    pending = [0] * len(sequences)
    for doc, _, _ in owners:
        pending[doc] += 1
    if on_sequence_done is not None:
        for doc, count in enumerate(pending):
            if count == 0:
                on_sequence_done(doc)

    def doc_done(index: int) -> None:
        doc = owners[index][0]
        pending[doc] -= 1
        if pending[doc] == 0 and on_sequence_done is not None:
            on_sequence_done(doc)

    progress = progress or Progress(enabled=False)
    many_tokens = sum(int(segment.tokens.shape[0]) for segment in segments) > progress.threshold
    window_steps = progress.labelled(f"{progress.desc}: windows", "window").steps(len(segments), many_tokens, False)
    with window_steps as window_done:

        def done(index: int) -> None:
            window_done()
            doc_done(index)

        scored = segment_log_probs(
            model,
            segments,
            max_tokens_per_batch,
            done,
            via_forward=via_forward,
            progress=progress,
            equal_lengths=equal_lengths,
        )
    for (doc, first, end), lp in zip(owners, scored):
        results[doc][first:end] = lp
    return results
