"""Documents inside a training batch, and their short-context log-probs.

A batch ``[B, T]`` holds documents as maximal runs of real tokens (``attention_mask == 1``, left or
right padding) whose position ids count up by one; in a packed batch
(``DataCollatorWithFlattening``) ``position_ids`` restart at 0 at every document. Short windows
(the K/d scheme of ``longppl.core.windows``) are built per document, so they never cross a document
boundary, and the first ``K`` tokens of every document get no short score (LongCE weight
``min(1, gamma)``, ``longppl.rules.key_tokens.unscored_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longppl.core.batching import pack_by_token_budget
from longppl.core.windows import short_context_log_probs, window_segments
from longppl.settings import WindowSettings


@dataclass(frozen=True)
class DocumentSpan:
    """Tokens ``[start, end)`` of batch row ``row`` form one document."""

    row: int
    start: int
    end: int


def batch_documents(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> list[DocumentSpan]:
    """The documents of a ``[B, T]`` batch (see the module docstring), in row-major order.

    Args:
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]`` 1 for real tokens; ``None`` means all real.
        position_ids: ``[B, T]`` or ``[1, T]``; a document starts wherever ``position_ids[t] !=
            position_ids[t-1] + 1``. ``None``: documents are split by padding only.
    """
    batch, length = input_ids.shape
    real = (
        torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.detach().cpu().bool()
    )
    starts = real.clone()
    starts[:, 1:] &= ~real[:, :-1]
    if position_ids is not None:
        positions = position_ids.detach().cpu().expand(batch, length)
        starts[:, 1:] |= real[:, 1:] & (positions[:, 1:] != positions[:, :-1] + 1)
    ends = real.clone()  # ends[t]: token t is the last of its document (next is padding or a start)
    ends[:, :-1] = real[:, :-1] & ~(real[:, 1:] & ~starts[:, 1:])
    start_rows, start_cols = starts.nonzero(as_tuple=True)
    _, end_cols = ends.nonzero(as_tuple=True)  # row-major order matches the starts one to one
    return [DocumentSpan(int(r), int(s), int(e) + 1) for r, s, e in zip(start_rows, start_cols, end_cols)]


def count_window_passes(
    input_ids: torch.Tensor,
    documents: list[DocumentSpan],
    window: WindowSettings,
    max_tokens_per_batch: int,
) -> int:
    """How many forward passes ``batch_short_log_probs`` runs for these documents."""
    sequences = [input_ids[d.row, d.start : d.end] for d in documents]
    segments, _ = window_segments(sequences, window, skip_first_window=True)
    return len(pack_by_token_budget([int(s.tokens.shape[0]) for s in segments], max_tokens_per_batch))


def batch_short_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    documents: list[DocumentSpan],
    window: WindowSettings,
    max_tokens_per_batch: int,
) -> torch.Tensor:
    """Short-context log-probs of every token of a batch, each document scored on its own, with the
    windows of ``window`` (K, d: ``LongCEConfig.longce_window``).

    Windows of all documents share forward passes (``max_tokens_per_batch``); ``model`` is called
    through its own forward (FSDP / DeepSpeed safe). The first window of a document (``s = 0``)
    is its tokens' full context, so it is not run: those tokens stay NaN, i.e. weight ``min(1, gamma)``,
    which is what ``min(exp(lp_long - lp_short), gamma) = min(exp(0), gamma)`` gives.

    Returns:
        ``[B, T]`` float32 on ``input_ids.device``: ``lp_short[b, i] = log P(x_i | x_s … x_{i-1})``
        for the tokens of windows ``s > 0`` (document-local index ``>= K + d``), NaN elsewhere.
    """
    out = torch.full(input_ids.shape, float("nan"), dtype=torch.float32)
    ids = input_ids.cpu()  # one device-to-host copy for the batch, not one per document
    sequences = [ids[d.row, d.start : d.end] for d in documents]
    scores = short_context_log_probs(
        model,
        sequences,
        max_tokens_per_batch=max_tokens_per_batch,
        skip_first_window=True,
        via_forward=True,
        window=window,
    )
    for doc, lp in zip(documents, scores):
        out[doc.row, doc.start : doc.end] = lp
    return out.to(input_ids.device)
