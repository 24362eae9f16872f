"""A document with its key tokens highlighted, as HTML (like the paper's Appendix F), each evaluator
token carrying its LSD and LCL in a tooltip: a standalone page (``key_token_html``, the
``longppl-visualize`` command) or the pieces the Space puts in its own page (``key_token_legend``,
``key_token_document``, styled by ``STYLE``). It sits at the top of the package, not in ``tools/``,
because the Space (which gets this folder without ``tools/``) shows the same view.

Pieces of text are laid out by the evaluator tokens' character spans. Tokens that share characters
(byte-level pieces of one multi-byte character) are shown as one piece whose tooltip lists each
token; characters no token covers are shown plainly; special tokens (zero-width spans) are not
shown. All text is HTML-escaped.

Colours (explained in a legend on the page): every token with a short-context score gets an orange
background whose opacity is proportional to its LSD clipped to ``[0, lsd_cap]`` (a piece of several
tokens takes the largest); key tokens are also underlined and bold (so a key token of low LSD is an
underlined, bold, nearly unshaded piece: the legend shows key tokens across the whole shading); the
first K tokens, which have no short-context score, are grey, and a marker stands where they end. No
piece has a border, margin, padding or rounded corner of its own, so the pieces of a word split into
several tokens join up into the word (backgrounds and underlines meet).

LSD and LCL are in each piece's ``title`` (a tooltip on hover) and, for touch screens and keyboards,
shown under a piece that has the focus (CSS only, from the same ``title``: nothing is repeated per
token): a click or tap focuses any piece (``tabindex="-1"``) and Tab steps through the key tokens
(``tabindex="0"``; not through every token, which would be thousands of tab stops in a long text).
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import TYPE_CHECKING

import numpy as np

from ..rules.alignment import tokens_within_spans
from ..rules.key_tokens import key_char_spans, key_token_mask, long_short_difference
from ..settings import KeyTokenRule, settings_object

if TYPE_CHECKING:  # only for the annotations: scoring imports torch
    from ..core.scoring import EvaluatorScores

#: Background opacity of a token whose LSD reaches the cap (text stays readable on it).
MAX_OPACITY = 0.85
_RGB = "255, 127, 31"  # the paper's highlight colour for key tokens

#: The classes of the document and legend; every rule sits under ``.longppl-keys`` (the class of
#: what ``key_token_legend`` and ``key_token_document`` return), so that a page holding them
#: (the Space's) keeps its own styles.
STYLE = """
.longppl-keys .doc { white-space: pre-wrap; overflow-wrap: break-word; line-height: 1.6; }
.longppl-keys .t { position: relative; }
.longppl-keys .key {
  text-decoration-line: underline; text-decoration-color: #a64300; text-decoration-thickness: 2px;
  text-underline-offset: 0.2em; text-decoration-skip-ink: none; font-weight: bold; color: #000;
}
.longppl-keys .noscore { color: #888; }
.longppl-keys .t:focus { outline: 2px solid #1a5fb4; outline-offset: 1px; }
.longppl-keys .t:focus::after {
  content: attr(title); position: absolute; left: 0; top: 100%; z-index: 10; margin-top: 0.3em;
  width: max-content; max-width: 30em; padding: 0.15em 0.4em; white-space: normal;
  font: normal 0.8rem/1.4 sans-serif; color: #000; background: #fff; border: 1px solid #888;
  border-radius: 3px; pointer-events: none;
}
.longppl-keys .k-end { border-left: 2px solid #c00; }
.longppl-keys .k-end::after {
  content: attr(data-label); font: bold 0.7em sans-serif; color: #c00; vertical-align: super;
}
.longppl-keys .meta, .longppl-keys .legend { font-family: sans-serif; font-size: 0.9em; color: #555; }
.longppl-keys .legend span.swatch {
  display: inline-block; padding: 0 0.4em; margin: 0 0.15em; border-radius: 2px;
}
"""
_PAGE_STYLE = (
    "body { font-family: Georgia, serif; max-width: 60em; margin: 2em auto; line-height: 1.6; color: #222; }" + STYLE
)


def lsd_opacity(lsd: float, lsd_cap: float) -> float:
    """Background opacity for a token of LSD ``lsd``: ``MAX_OPACITY * clip(lsd / lsd_cap, 0, 1)``;
    0 for NaN (no short-context score). Monotone non-decreasing in ``lsd``."""
    if math.isnan(lsd):
        return 0.0
    return MAX_OPACITY * min(max(lsd / lsd_cap, 0.0), 1.0)


def _background(opacity: float) -> str:
    return f"background: rgba({_RGB}, {opacity:.3f})"


def check_lsd_cap(lsd_cap: float | None, alpha: float) -> float:
    """``lsd_cap``, the LSD of full shading; ``None``: ``2 * alpha``, at least 1.

    Raises:
        ValueError: ``lsd_cap`` is not positive.
    """
    if lsd_cap is None:
        return max(2.0 * alpha, 1.0)
    if not lsd_cap > 0:
        raise ValueError(f"lsd_cap={lsd_cap!r} must be a positive LSD (the value shown at full shade).")
    return lsd_cap


def _k(trunc_len: int) -> str:
    return f"K={trunc_len}" if trunc_len else "K"


def key_shades(alpha: float, lsd_cap: float) -> tuple[float, ...]:
    """The LSDs at which the legend shows a key token: from ``alpha`` (a key token's LSD is just above
    it, so this is its faintest shade; 0 for a negative ``alpha``) to ``lsd_cap`` (full shade), or
    only ``lsd_cap`` when ``alpha >= lsd_cap`` (every key token is then fully shaded)."""
    low = max(alpha, 0.0)
    if low >= lsd_cap:
        return (lsd_cap,)
    return (low, (low + lsd_cap) / 2, lsd_cap)


def _rule_of(alpha, beta, use_lcl, rule: KeyTokenRule | None) -> KeyTokenRule:
    """The rule a view function was given: ``rule`` whole, or (as the functions always took it) its
    ``alpha``, ``beta`` and ``use_lcl``; both at once is a ``ValueError`` (``settings_object``)."""
    return settings_object(KeyTokenRule, rule, alpha=alpha, beta=beta, use_lcl=use_lcl)


def key_token_legend(
    alpha: float | None = None,
    beta: float | None = None,
    use_lcl: bool | None = None,
    trunc_len: int = 0,
    lsd_cap: float | None = None,
    *,
    rule: KeyTokenRule | None = None,
) -> str:
    """The legend of the colours and marks, as a ``<div class="legend">`` (style: ``STYLE``, inside an
    element of class ``longppl-keys``). Key tokens are shown at every shade they can have
    (``key_shades``), since a key token of LSD near ``alpha`` is drawn nearly unshaded. The rule:
    ``rule``, or its ``alpha``, ``beta``, ``use_lcl``; ``lsd_cap`` as :func:`check_lsd_cap`."""
    key_rule = _rule_of(alpha, beta, use_lcl, rule)
    alpha, lsd_cap = key_rule.alpha, check_lsd_cap(lsd_cap, key_rule.alpha)

    def swatches(values, css):
        return "".join(
            f'<span class="{css}" style="{_background(lsd_opacity(v, lsd_cap))}">{v:g}</span>' for v in values
        )

    steps = swatches((0.0, lsd_cap / 4, lsd_cap / 2, 3 * lsd_cap / 4, lsd_cap), "swatch")
    k = _k(trunc_len)
    return (
        '<div class="legend"><p><strong>Legend.</strong> Background: LSD = log P(token | long context) &minus; '
        f"log P(token | last {k} tokens), shaded in proportion to LSD clipped to [0, {lsd_cap:g}]: {steps} "
        f"(no shade: LSD &le; 0).</p>"
        f"<p>Key tokens ({key_rule.key_condition('&gt;')}) are underlined and bold, on the shade of their LSD like every token: "
        f"{swatches(key_shades(alpha, lsd_cap), 'swatch key')}. "
        f'<span class="swatch noscore">grey</span>: the first {k} evaluator tokens, which have no '
        'short-context score; <span class="k-end" data-label="K"></span> marks where they end.</p></div>\n'
    )


def _describe(index: int, lsd: float, lcl: float, trunc_len: int) -> str:
    if index == 0:
        return f"token {index}: first token, no prediction"
    if math.isnan(lsd):
        return f"token {index}: LCL {lcl:.2f}; no short-context score (i < K={trunc_len})"
    return f"token {index}: LSD {lsd:.2f}, LCL {lcl:.2f}"


@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """One text's evaluator tokens as the key-token view shows them: only the tokens that cover
    characters of the text count (a special token such as a BOS covers none and is not shown).

    ``key`` counts the tokens the way the metric counts an evaluated model's key tokens: the key
    tokens' characters are merged into spans, and every token whose characters lie within one of
    them is a key token (the official code's transfer by character span). So a token that shares a
    character with a key token is counted too, though its own LSD may be low: the byte pieces of one
    character under a byte-fallback tokenizer (SentencePiece's ``<0xE2>``...), or of a byte-level
    one, are all key when one of them is. Under one tokenizer (the evaluated model tokenizes the text
    as the evaluator does, without its special tokens: the metric's default), ``tokens`` and ``key``
    are the metric's ``n_tokens`` and ``n_key_tokens`` of the text, as long as the tokenizer gives
    zero-width spans to special tokens only.

    ``tokens``: tokens of the text; ``scored``: those with a short-context score (all but the first
    K); ``key``: the key tokens, counted as above.
    """

    tokens: int
    scored: int
    key: int

    @classmethod
    def of(cls, scores: EvaluatorScores, rule: KeyTokenRule) -> "TokenCounts":
        """The counts of ``scores`` (``offsets`` ``[n, 2]``, ``lp_long`` and ``lp_short`` ``[n]``) under
        the hard rule ``rule``."""
        lsd = long_short_difference(scores.lp_long, scores.lp_short)
        return cls.of_marks(scores.offsets, lsd, key_token_mask(scores.lp_long, scores.lp_short, rule))

    @classmethod
    def of_marks(cls, offsets, lsd: np.ndarray, key: np.ndarray) -> "TokenCounts":
        """The counts from what a caller holding them computed already: ``offsets`` ``[n, 2]``, the
        tokens' LSD ``[n]`` (NaN: no short-context score) and the evaluator's own key-token mask ``[n]``
        (its rule applied to each token: ``key_token_mask``)."""
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        covering = offsets[:, 1] > offsets[:, 0]
        # the metric's transfer: tokens within the merged character spans of the key tokens
        within = tokens_within_spans(offsets, key_char_spans(offsets, key))
        return cls(int(covering.sum()), int((covering & ~np.isnan(lsd)).sum()), int((covering & within).sum()))


def _count(name: str, value: int) -> str:
    """A count, marked so that a page (or a test) can find it by what it counts."""
    return f'<span class="count" data-count="{name}">{value}</span>'


def _tokens(value: int) -> str:
    """The word after a count of tokens: "token" after 1, "tokens" after any other count."""
    return "token" if value == 1 else "tokens"


def key_token_document(
    text: str,
    scores: EvaluatorScores,
    alpha: float | None = None,
    beta: float | None = None,
    use_lcl: bool | None = None,
    trunc_len: int = 0,
    lsd_cap: float | None = None,
    *,
    rule: KeyTokenRule | None = None,
) -> tuple[str, str]:
    """``(summary, document)``: a ``<p class="meta">`` counting the evaluator's key tokens of ``text``
    as the metric counts them (``TokenCounts``: each count in a ``<span data-count="key|tokens|scored">``), and the text as a
    ``<div class="doc">`` with its tokens shaded and marked (see the module docstring; style:
    ``STYLE``, inside an element of class ``longppl-keys``). Arguments as ``key_token_html``.
    """
    rule = _rule_of(alpha, beta, use_lcl, rule)
    lsd_cap = check_lsd_cap(lsd_cap, rule.alpha)
    offsets = np.asarray(scores.offsets, dtype=np.int64).reshape(-1, 2)
    lsd = long_short_difference(scores.lp_long, scores.lp_short)
    key = key_token_mask(scores.lp_long, scores.lp_short, rule)
    counts = TokenCounts.of_marks(offsets, lsd, key)
    # Pieces: [start, end, key, tooltip lines, largest LSD of its tokens (NaN: none has one)].
    pieces: list[list] = []
    for index, (start, end) in enumerate(offsets.tolist()):
        if end <= start:
            continue
        value = float(lsd[index])
        line = _describe(index, value, float(scores.lp_long[index]), trunc_len)
        if pieces and start < pieces[-1][1]:
            piece = pieces[-1]
            piece[1] = max(piece[1], end)
            piece[2] |= bool(key[index])
            piece[3].append(line)
            piece[4] = float(np.fmax(piece[4], value))  # fmax: NaN only if both are
        else:
            pieces.append([start, end, bool(key[index]), [line], value])
    marker_label = _k(trunc_len)
    marker = (
        f'<span class="k-end" data-label="{marker_label}" title="the first {html.escape(marker_label)} '
        'evaluator tokens end here: before this point, no short-context score"></span>'
    )
    # The marker goes before the first piece with an LSD: where the first K tokens end.
    body, cursor, marked = [], 0, counts.scored == 0
    for start, end, is_key, lines, largest in pieces:
        body.append(html.escape(text[cursor:start]))
        if not marked and not math.isnan(largest):
            body.append(marker)
            marked = True
        css = "t key" if is_key else ("t" if not math.isnan(largest) else "t noscore")
        style = f' style="{_background(lsd_opacity(largest, lsd_cap))}"' if not math.isnan(largest) else ""
        # Tab stops at the key tokens only; a click or tap focuses any piece (its LSD and LCL then show).
        focus = ' tabindex="0"' if is_key else ' tabindex="-1"'
        body.append(
            f'<span class="{css}" title="{html.escape(" | ".join(lines))}"{style}{focus}>'
            f"{html.escape(text[start:end])}</span>"
        )
        cursor = end
    body.append(html.escape(text[cursor:]))
    summary = (
        f"{_count('key', counts.key)} key {_tokens(counts.key)} of the evaluator's {_count('tokens', counts.tokens)} "
        f"{_tokens(counts.tokens)} of this text ({counts.key / max(counts.scored, 1):.1%} of the "
        f"{_count('scored', counts.scored)} with a "
        f"short-context score); key iff {rule.key_condition('&gt;')}"
        + ", and a token within the characters of key tokens counts as one, as the metric counts them"
        + ". Hover a token for its LSD and LCL, or click or tap it; Tab steps through the key tokens."
        + (
            ""
            if counts.scored
            else f" No token has a short-context score: the text is at most {_k(trunc_len)} evaluator tokens long."
        )
    )
    return f'<p class="meta">{summary}</p>', f'<div class="doc">{"".join(body)}</div>'


def key_token_html(
    text: str,
    scores: EvaluatorScores,
    alpha: float | None = None,
    beta: float | None = None,
    use_lcl: bool | None = None,
    trunc_len: int = 0,
    title: str = "Key tokens",
    details: str = "",
    lsd_cap: float | None = None,
    *,
    rule: KeyTokenRule | None = None,
) -> str:
    """A standalone HTML page of ``text`` with key tokens highlighted.

    Args:
        alpha, beta, use_lcl: the hard rule's values (``None``: its default), or pass ``rule``, a
            ``KeyTokenRule``, whole instead (both at once is a ``ValueError``).
        scores: the evaluator's scores of ``text`` (``offsets`` ``[n, 2]``, ``lp_long`` and
            ``lp_short`` ``[n]``), e.g. ``KeyTokenCache.scores(row)``.
        trunc_len: K, to explain in tooltips and the legend why early tokens have no LSD (the
            marker is placed by the scores: before the first token that has an LSD).
        details: a line of context shown under the title (evaluator, settings).
        lsd_cap: LSD of full shading (default ``2 * alpha``, at least 1): shading is proportional to
            LSD clipped to ``[0, lsd_cap]``.

    Raises:
        ValueError: ``lsd_cap`` is not positive.
    """
    rule = _rule_of(alpha, beta, use_lcl, rule)
    lsd_cap = check_lsd_cap(lsd_cap, rule.alpha)
    summary, document = key_token_document(text, scores, trunc_len=trunc_len, lsd_cap=lsd_cap, rule=rule)
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_PAGE_STYLE}</style></head>"
        f'<body class="longppl-keys">\n<h1>{html.escape(title)}</h1>\n'
        + (f'<p class="meta">{html.escape(details)}</p>\n' if details else "")
        + f"{summary}\n"
        + key_token_legend(trunc_len=trunc_len, lsd_cap=lsd_cap, rule=rule)
        + f"{document}\n</body></html>\n"
    )
