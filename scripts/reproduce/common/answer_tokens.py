"""Do LSD and LCL find the answer tokens? The paper's check on LongEval (Sec. 3, Fig. 3 and 5(b)).

Each LongEval lines case is followed by its reference answer (``lines.case_text``): "... I need the
number. The <REGISTER_CONTENT> in line swift-harbor is <42130>." An evaluator scores the whole text
with the library's scoring core (``scoring.score_with_evaluator``: the long context is the whole
text, the short context the K/d windows of the metric), and every token of the answer side is then
an *answer token* (its characters overlap the number's digits, ``42130``) or not. Classifying them
by ``LSD > alpha`` alone, and by ``LSD > alpha and LCL > beta`` (the key-token rule), gives the
paper's 85.6% and 98.2% with Mixtral-8x7B. The paper's baseline is a 50-50 random guess on the two
classes, so the headline is the balanced accuracy (the mean of the two classes' recalls); plain
accuracy, precision and the counts come beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from longppl.core.scoring import score_with_evaluator
from longppl.rules.key_tokens import long_short_difference
from longppl.settings import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    KeyTokenRule,
    KeyTokenSettings,
    WindowSettings,
)

from .lines import LINE_TEMPLATE, LinesCase, answer_number_span, case_text


def _record_number_start(case: LinesCase) -> int:
    """The character where the asked number starts in the prompt's record (the line
    ``line <id>: REGISTER_CONTENT is <number>``), or -1 where the prompt has no such line (a file
    in another wording). With the line id unknown, the first line that holds the number counts."""
    number = case.expected_number
    pattern = LINE_TEMPLATE.format(line=case.target_line, number=number) if case.target_line else None
    at = case.prompt.find(pattern) if pattern else -1
    if at >= 0:
        return at + pattern.index(f"<{number}>") + 1
    marker = f"REGISTER_CONTENT is <{number}>"
    at = case.prompt.find(marker)
    return at + len(marker) - len(number) - 1 if at >= 0 else -1


def answer_token_scores(
    model,
    tokenizer,
    cases: Sequence[LinesCase],
    *,
    window: WindowSettings,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    add_special_tokens: bool = True,
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """LSD and LCL of every answer-side token of every case, from ``model`` as the evaluator.

    The text of a case is ``lines.case_text(case)`` (prompt, separator, reference answer); its
    answer side is the tokens that start at or after the end of the prompt (a token that carries
    the separator space with the answer's first word counts) and cover characters (special tokens
    such as an EOS do not). Scores are the metric's: ``LSD = lp_long - lp_short``, ``LCL =
    lp_long`` (``key_tokens``), with the evaluator's special tokens when ``add_special_tokens``.

    Args:
        window: K and d of the short context (``settings.WindowSettings``); every answer token must
            lie past the first K tokens of its text (so K below the prompt's length), or it has no
            short-context score.
        max_tokens_per_batch: token budget of one forward pass (results do not depend on it).
    Returns:
        ``[m]`` arrays over the answer-side tokens of all cases, in case then text order:
        ``"lsd"``, ``"lcl"`` (float32), ``"is_answer"`` (bool: the token's characters overlap the
        expected number's), ``"case"`` (int64 index into ``cases``), ``"position"`` (int64 token
        index in the case's text, special tokens included), ``"source"`` (int64 token index of the
        first token of the asked number in the record, -1 where the prompt has no record line
        ``line <id>: REGISTER_CONTENT is <number>``) and ``"beyond_short"`` (bool: ``source`` lies
        before the token's short context, which starts at ``(position - K) // d * d`` (``windows``),
        so only the long context holds the number; False where ``source`` is -1).

    Why ``beyond_short``: with K of a few hundred tokens and records of about a thousand, the asked
    line often lies inside the short context, and its answer tokens then gain nothing from the long
    context (LSD near 0) by definition. The paper's LongEval records (thousands of tokens, K = 4096
    of a 32k context) put nearly every asked line beyond K; ``beyond_short`` selects those tokens.
    Raises:
        ValueError: a case without a reference answer, or an answer token within the first K tokens.
    """
    if not isinstance(window, WindowSettings):
        raise ValueError(
            f"window must be a longppl.settings.WindowSettings(trunc_len, sliding_window), got {window!r}."
        )
    cases = list(cases)
    if not cases:
        raise ValueError("No cases to score; pass at least one LinesCase with its answer.")
    for index, case in enumerate(cases):
        if case.answer is None:
            raise ValueError(
                f"cases[{index}] has no reference answer (answer=None); the answer-token analysis scores the "
                "answer. Generate cases with lines.generate_lines_cases, or give LongChat prompts that end "
                "with its question."
            )
    texts = [case_text(case) for case in cases]
    scores = score_with_evaluator(
        model,
        tokenizer,
        texts,
        max_tokens_per_batch=max_tokens_per_batch,
        settings=KeyTokenSettings(window.trunc_len, window.sliding_window, add_special_tokens),
        progress=progress,
        per_document=True,  # a case's scores do not depend on the cases scored with it
    )
    names = ("lsd", "lcl", "is_answer", "case", "position", "source", "beyond_short")
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for index, (case, score) in enumerate(zip(cases, scores)):
        starts, ends = score.offsets[:, 0], score.offsets[:, 1]
        answer_side = (starts >= len(case.prompt)) & (ends > starts)
        number_start, number_end = answer_number_span(case, index)
        lsd = long_short_difference(score.lp_long, score.lp_short)[answer_side]
        if np.isnan(lsd).any():
            first = int(np.flatnonzero(answer_side)[0])
            raise ValueError(
                f"cases[{index}]: its answer begins at token {first}, within the first trunc_len={window.trunc_len} "
                "tokens, which have no short-context score; use a trunc_len below the prompt's length (or "
                "longer cases, lines.lines_for_token_length)."
            )
        columns["lsd"].append(lsd)
        columns["lcl"].append(score.lp_long[answer_side].astype(np.float32))
        columns["is_answer"].append(((starts < number_end) & (ends > number_start))[answer_side])
        columns["case"].append(np.full(int(answer_side.sum()), index, dtype=np.int64))
        positions = np.flatnonzero(answer_side).astype(np.int64)
        columns["position"].append(positions)
        record_char = _record_number_start(case)
        holding = np.flatnonzero((starts <= record_char) & (ends > record_char)) if record_char >= 0 else []
        source = int(holding[0]) if len(holding) else -1
        short_start = (positions - window.trunc_len) // window.sliding_window * window.sliding_window
        columns["source"].append(np.full(positions.size, source, dtype=np.int64))
        columns["beyond_short"].append((source >= 0) & (source < short_start))
    return {name: np.concatenate(parts) for name, parts in columns.items()}


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else math.nan


def classify_answer_tokens(
    lsd: np.ndarray,
    lcl: np.ndarray,
    is_answer: np.ndarray,
    *,
    alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
) -> dict:
    """How well each rule tells answer tokens from the other answer-side tokens (Figure 5(b)).

    Rule ``"lsd"`` predicts "answer" iff ``LSD > alpha``; rule ``"lsd+lcl"`` iff ``LSD > alpha and
    LCL > beta`` (the key-token rule; strict, and a NaN never predicts "answer").

    Args:
        lsd, lcl, is_answer: ``[m]`` arrays, as :func:`answer_token_scores` returns them.
    Returns:
        ``{"alpha", "beta", "n_answer", "n_other", "lsd": {...}, "lsd+lcl": {...}}``; per rule
        ``balanced_accuracy`` (the mean of the two recalls: 0.5 for a random guess, whatever the
        classes' sizes), ``accuracy``, ``precision`` (of "answer"; NaN if nothing is predicted so),
        ``recall`` (of answer tokens), ``specificity`` (recall of the other tokens) and the counts
        ``true_positive``, ``false_positive``, ``true_negative``, ``false_negative``. A recall of an
        empty class is NaN, and so is the balanced accuracy then.
    """
    rule = KeyTokenRule(alpha, beta)  # finite thresholds: a NaN one would silently predict nothing
    lsd = np.asarray(lsd, dtype=np.float64)
    lcl = np.asarray(lcl, dtype=np.float64)
    is_answer = np.asarray(is_answer)
    if is_answer.dtype != bool:
        raise ValueError(f"is_answer must be a bool array, got dtype {is_answer.dtype}.")
    if not (lsd.ndim == lcl.ndim == is_answer.ndim == 1 and lsd.shape == lcl.shape == is_answer.shape):
        raise ValueError(
            f"lsd, lcl and is_answer must be 1-D arrays of one length, got shapes {lsd.shape}, {lcl.shape}, "
            f"{is_answer.shape}."
        )
    with np.errstate(invalid="ignore"):
        by_lsd = lsd > rule.alpha
        predictions = {"lsd": by_lsd, "lsd+lcl": by_lsd & (lcl > rule.beta)}
    result: dict = {
        "alpha": rule.alpha,
        "beta": rule.beta,
        "n_answer": int(is_answer.sum()),
        "n_other": int((~is_answer).sum()),
    }
    for name, predicted in predictions.items():
        tp = int((predicted & is_answer).sum())
        fp = int((predicted & ~is_answer).sum())
        tn = int((~predicted & ~is_answer).sum())
        fn = int((~predicted & is_answer).sum())
        recall, specificity = _ratio(tp, tp + fn), _ratio(tn, tn + fp)
        result[name] = {
            "balanced_accuracy": (recall + specificity) / 2,
            "accuracy": _ratio(tp + tn, tp + fp + tn + fn),
            "precision": _ratio(tp, tp + fp),
            "recall": recall,
            "specificity": specificity,
            "true_positive": tp,
            "false_positive": fp,
            "true_negative": tn,
            "false_negative": fn,
        }
    return result
