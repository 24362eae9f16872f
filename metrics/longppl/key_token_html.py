"""An HTML page showing a document with its key tokens highlighted (like the paper's Appendix F),
each evaluator token carrying its LSD and LCL in a tooltip.

Pieces of text are laid out by the evaluator tokens' character spans. Tokens that share characters
(byte-level pieces of one multi-byte character) are shown as one piece whose tooltip lists each
token; characters no token covers are shown plainly; special tokens (zero-width spans) are not
shown. All text is HTML-escaped.
"""

from __future__ import annotations

import html
import math

import numpy as np

from .key_tokens import key_token_mask, long_short_difference
from .scoring import EvaluatorScores

_STYLE = """
body { font-family: Georgia, serif; max-width: 60em; margin: 2em auto; line-height: 1.6; color: #222; }
.doc { white-space: pre-wrap; }
.t:hover { outline: 1px solid #999; }
.key { background: #ff7f1f; color: #000; border-radius: 2px; }
.meta { font-family: sans-serif; font-size: 0.9em; color: #555; }
"""


def _describe(index: int, lsd: float, lcl: float, trunc_len: int) -> str:
    if index == 0:
        return f"token {index}: first token, no prediction"
    if math.isnan(lsd):
        return f"token {index}: LCL {lcl:.2f}; no short-context score (i < K={trunc_len})"
    return f"token {index}: LSD {lsd:.2f}, LCL {lcl:.2f}"


def key_token_html(
    text: str,
    scores: EvaluatorScores,
    alpha: float,
    beta: float,
    use_lcl: bool = True,
    trunc_len: int = 0,
    title: str = "Key tokens",
    details: str = "",
) -> str:
    """A standalone HTML page of ``text`` with key tokens highlighted.

    Args:
        scores: the evaluator's scores of ``text`` (``offsets`` ``[n, 2]``, ``lp_long`` and
            ``lp_short`` ``[n]``), e.g. ``KeyTokenCache.scores(row)``.
        trunc_len: K, only to explain in tooltips why early tokens have no LSD.
        details: a line of context shown under the title (evaluator, settings).
    """
    offsets = np.asarray(scores.offsets, dtype=np.int64).reshape(-1, 2)
    lsd = long_short_difference(scores.lp_long, scores.lp_short)
    key = key_token_mask(scores.lp_long, scores.lp_short, alpha, beta, use_lcl)
    # Pieces: [start, end, key, tooltip lines]; a token overlapping the previous piece joins it.
    pieces: list[list] = []
    for index, (start, end) in enumerate(offsets.tolist()):
        if end <= start:
            continue
        line = _describe(index, float(lsd[index]), float(scores.lp_long[index]), trunc_len)
        if pieces and start < pieces[-1][1]:
            pieces[-1][1] = max(pieces[-1][1], end)
            pieces[-1][2] |= bool(key[index])
            pieces[-1][3].append(line)
        else:
            pieces.append([start, end, bool(key[index]), [line]])
    body, cursor = [], 0
    for start, end, is_key, lines in pieces:
        body.append(html.escape(text[cursor:start]))
        css = "t key" if is_key else "t"
        body.append(f'<span class="{css}" title="{html.escape(" | ".join(lines))}">{html.escape(text[start:end])}</span>')
        cursor = end
    body.append(html.escape(text[cursor:]))
    n_scored = int((~np.isnan(lsd)).sum())
    summary = (
        f"{int(key.sum())} key tokens of {offsets.shape[0]} evaluator tokens "
        f"({int(key.sum()) / max(n_scored, 1):.1%} of the {n_scored} with a short-context score); "
        f"key iff LSD &gt; {alpha:g}" + (f" and LCL &gt; {beta:g}" if use_lcl else "") + ". Hover a token for its LSD and LCL."
    )
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n"
        + (f'<p class="meta">{html.escape(details)}</p>\n' if details else "")
        + f'<p class="meta">{summary}</p>\n'
        f'<div class="doc">{"".join(body)}</div>\n</body></html>\n'
    )
