"""Packing token segments into forward passes under a token budget.

A *segment* is a run of tokens fed to the model as one sequence, of which only a suffix is scored.
Whole documents (the long-context pass) and short-context windows are both segments, so both are
batched by the same mechanism. Results never depend on the packing: rows are right-padded and
masked, and each row is scored as if it ran alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .logprobs import DEFAULT_LOGITS_CHUNK_BYTES, resolve_lm_head, token_log_probs, verify_head
from .progress import Progress


@dataclass(frozen=True)
class Segment:
    """``tokens`` (``[L]`` int64, CPU) fed as one sequence; positions ``[first_scored, L)`` are scored."""

    tokens: torch.Tensor
    first_scored: int = 1


def pack_by_token_budget(
    lengths: Sequence[int], max_tokens_per_batch: int, equal_lengths: bool = False
) -> list[list[int]]:
    """Group segment indices into batches whose padded size ``rows * longest`` fits the budget.

    Longest first, so each batch pads to its first segment and equal-length segments (the full
    windows of long documents) share batches without padding. A segment longer than the budget
    gets a batch of its own. With ``equal_lengths`` a batch only holds segments of one length, so
    no row is padded (see ``segment_log_probs``).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        full = current and lengths[current[0]] * (len(current) + 1) > max_tokens_per_batch
        if full or (current and equal_lengths and lengths[index] != lengths[current[0]]):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def segment_log_probs(
    model: nn.Module,
    segments: Sequence[Segment],
    max_tokens_per_batch: int,
    on_segment_done: Callable[[int], None] | None = None,
    logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
    via_forward: bool = False,
    progress: Progress | None = None,
    equal_lengths: bool = False,
) -> list[torch.Tensor]:
    """Score many segments, packed into as few forward passes as the budget allows.

    One forward pass per batch of ``pack_by_token_budget(lengths, max_tokens_per_batch, equal_lengths)``;
    ``via_forward`` is passed to ``token_log_probs`` (call the wrapped model itself).
    ``equal_lengths``: only segments of the same length share a pass. No row is then padded, so
    each runs through the same kernels (SDPA's causal path, no mask) with the same positions as
    it would alone. Its scores equal those it gets alone up to float rounding where the matmul
    kernels pick their summation order by the number of rows: float32 on a GPU (up to 7.6e-6 in
    log-probability measured, ``scripts/bench/bench_document_packing.py``) and multi-threaded CPU. They
    were bit-identical in bfloat16 on an H100 and on one CPU thread. Padded packing (the default)
    also agrees up to float rounding.
    ``progress`` (labelled with what the segments are) reports the decoder layers and LM-head
    chunks of large passes (see ``progress``); it never changes the results.

    Returns:
        one float32 CPU tensor per segment, of length ``L - first_scored``: entry ``j`` is
        ``log P(tokens[first_scored + j] | tokens[:first_scored + j])``.
    """
    results: list[torch.Tensor | None] = [None] * len(segments)
    lengths = [int(s.tokens.shape[0]) for s in segments]
    batches = pack_by_token_budget(lengths, max_tokens_per_batch, equal_lengths)
    progress = progress or Progress(enabled=False)
    if segments and not via_forward:  # probe the head now, so that layer hooks count only real passes
        verify_head(resolve_lm_head(model), segments[batches[0][0]].tokens[None])
    for batch in batches:
        longest = lengths[batch[0]]
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        score = torch.zeros(len(batch), longest, dtype=torch.bool)
        for row, index in enumerate(batch):
            seg = segments[index]
            ids[row, : lengths[index]] = seg.tokens
            mask[row, : lengths[index]] = 1
            score[row, max(seg.first_scored, 1) : lengths[index]] = True
        with progress.forward_pass(model, len(batch) * longest) as on_head_chunk:
            lp = token_log_probs(model, ids, mask, score, logits_chunk_bytes, via_forward, on_head_chunk)
        lp = lp.cpu()  # one sync per batch
        for row, index in enumerate(batch):
            results[index] = lp[row, segments[index].first_scored : lengths[index]]
            if on_segment_done is not None:
                on_segment_done(index)
    return results  # type: ignore[return-value]


def long_context_log_probs(
    model: nn.Module,
    sequences: Sequence[torch.Tensor],
    max_tokens_per_batch: int,
    on_sequence_done: Callable[[int], None] | None = None,
    progress: Progress | None = None,
    equal_lengths: bool = False,
) -> list[torch.Tensor]:
    """Full-context log-probs of whole documents (short ones share forward passes).

    Args:
        sequences: ``[n_k]`` int64 token ids per document.
        progress: reports the layers and LM-head chunks of a long document's pass (see ``progress``).
        equal_lengths: only documents of the same length share a pass (see ``segment_log_probs``).
    Returns:
        ``[n_k]`` float32 per document, ``lp[i] = log P(x_i | x_0..x_{i-1})``, NaN at ``i = 0``.
    """
    segments = [Segment(seq.long().cpu(), first_scored=1) for seq in sequences]
    scored = segment_log_probs(
        model, segments, max_tokens_per_batch, on_sequence_done, progress=progress, equal_lengths=equal_lengths
    )
    return [torch.cat([torch.full((1,), float("nan")), lp]) for lp in scored]
