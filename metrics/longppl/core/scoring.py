"""Scoring documents: the evaluator's long/short log-probs, the evaluated model's log-probs, and
LongPPL / PPL per document and per corpus.

Per-token arrays follow the index convention of ``logprobs`` (``lp[i] = log P(x_i | x_<i)``, NaN
where there is no value). Evaluator arrays are indexed by evaluator tokens, model arrays by the
evaluated model's tokens; the two meet through character spans (``alignment``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..rules.alignment import encode_many_with_offsets, tokens_within_spans, transfer_token_weights
from ..rules.key_tokens import key_char_spans, key_token_mask, soft_weights, unscored_weight

# The DEFAULT_* names live in settings and stay importable from here.
from ..settings import (  # noqa: F401
    DEFAULT_AGGREGATION,
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    KeyTokenRule,
    KeyTokenSettings,
    WindowSettings,
    check_token_ids,
    require_aggregation,
    settings_object,
)
from .batching import long_context_log_probs
from .compilation import compiled_blocks
from .logprobs import unwrap_model
from .progress import Progress, ProgressCallback
from .windows import short_context_log_probs


@dataclass
class EvaluatorScores:
    """The evaluator's view of one document, per evaluator token.

    ``input_ids`` ``[n]``, ``offsets`` ``[n, 2]`` character spans, ``lp_long`` ``[n]`` (NaN at 0),
    ``lp_short`` ``[n]`` (NaN for ``i < trunc_len``).
    """

    input_ids: np.ndarray
    offsets: np.ndarray
    lp_long: np.ndarray
    lp_short: np.ndarray

    def key_mask(self, rule: KeyTokenRule = KeyTokenRule()) -> np.ndarray:
        """``[n]`` bool hard key-token mask over evaluator tokens."""
        return key_token_mask(self.lp_long, self.lp_short, rule)

    def key_spans(self, rule: KeyTokenRule = KeyTokenRule()) -> np.ndarray:
        """``[m, 2]`` merged character spans of the key tokens."""
        return key_char_spans(self.offsets, self.key_mask(rule))


@dataclass
class ModelScores:
    """The evaluated model's tokens and log-probs of one document (``[n]``, ``[n, 2]``, ``[n]``)."""

    input_ids: np.ndarray
    offsets: np.ndarray
    lp: np.ndarray


@dataclass
class DocumentResult:
    """LongPPL and PPL of one document, with the sums that corpus aggregation needs.

    ``n_key_tokens`` counts key tokens (with soft weights: their total weight); ``n_tokens`` counts
    the model's tokens (as the official code does: position 0, which has no prediction, included).
    """

    longppl: float
    ppl: float
    n_key_tokens: float
    n_tokens: int
    key_nll: float  # sum of weight * (-lp) over key tokens
    nll: float  # sum of -lp over predicted tokens
    n_predicted: int


@contextlib.contextmanager
def _scoring(model, torch_compile: bool):
    """Eval mode (restored afterwards), no autograd, and optionally compiled blocks."""
    was_training = unwrap_model(model).training
    model.eval()
    try:
        with torch.inference_mode(), compiled_blocks(model, torch_compile):
            yield
    finally:
        model.train(was_training)


def vocabulary_size(model) -> int | None:
    """Rows of ``model``'s input embedding table (the ids it accepts are ``0 .. rows-1``), or
    ``None`` when the model does not expose one (then token ids are not checked)."""
    inner = unwrap_model(model)
    try:
        embeddings = inner.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        rows = getattr(getattr(inner, "config", None), "vocab_size", None)
    return int(rows) if isinstance(rows, int) else None


def position_limits(model) -> tuple[int | None, str]:
    """``(positions, kind)``: how many tokens ``model`` was built for in one sequence, and whether
    it can run past them.

    ``kind`` is ``"learned"`` when a table of learned absolute position embeddings (GPT-2's ``wpe``,
    OPT's ``embed_positions``, ...) holds one row per position: a longer sequence indexes past the
    table and crashes (``IndexError``, or a device-side assert on a GPU). ``"relative"`` otherwise
    (RoPE, ALiBi, ...): ``max_position_embeddings`` is then the length the model was trained to, and
    running past it computes (often badly: that is what long-context evaluation measures) but
    never crashes. ``positions`` is ``None`` when the config names no limit.
    """
    inner = unwrap_model(model)
    limit = getattr(getattr(inner, "config", None), "max_position_embeddings", None)  # GPT-2: n_positions
    try:
        token_table = inner.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        token_table = None
    for name, module in inner.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and module is not token_table and ("pos" in last or last == "wpe"):
            return (limit if isinstance(limit, int) else module.num_embeddings), "learned"
    return (limit if isinstance(limit, int) else None), "relative"


class PastPositionsWarning(UserWarning):
    """Texts longer than the positions a RoPE-style model was trained on (:func:`check_positions`): they
    are scored, but the log-probs past those positions measure extrapolation. A caller that scores a
    corpus in many calls (``longppl score``: one document at a time) ignores it and says it once."""


def model_name(model) -> str:
    """What messages call ``model``: the Hub id or folder it was loaded from, else its class."""
    inner = unwrap_model(model)
    return getattr(getattr(inner, "config", None), "_name_or_path", "") or type(inner).__name__


def check_positions(encoded, model, role: str, text_names: Sequence[str] | None = None) -> None:
    """Refuse texts longer than a model with learned position embeddings can take; warn (once) for
    texts past a RoPE-style model's trained length (see :func:`position_limits`).

    Args:
        encoded: ``[(ids [n], offsets [n, 2]), ...]`` as :func:`encode_texts` makes them.
        text_names: what messages call each text (default ``predictions[i]``).
    Raises:
        ValueError: naming the model, its positions, the first text too long (its index and length)
            and ``max_length`` as the fix.
    """
    limit, kind = position_limits(model)
    if limit is None:
        return
    longer = [(index, ids.shape[0]) for index, (ids, _) in enumerate(encoded) if ids.shape[0] > limit]
    if not longer:
        return
    index, length = longer[0]
    text = text_names[index] if text_names is not None else f"predictions[{index}]"
    name = model_name(model)
    if kind == "learned":
        raise ValueError(
            f"The {role} {name!r} has learned position embeddings for {limit} positions, but {text} "
            f"is {length} of its tokens long ({len(longer)} text(s) are longer than {limit}): it cannot score "
            f"past position {limit}. Cut the texts with max_length (the metric's argument; longppl-score "
            "--max-length; it counts evaluator tokens), or use a model with more positions."
        )
    warnings.warn(
        f"The {role} {name!r} was trained on {limit} positions (max_position_embeddings), but "
        f"{len(longer)} text(s) are longer, e.g. {text} with {length} tokens: its log-probs past "
        f"position {limit} measure extrapolation. Cut the texts with max_length if that is not intended.",
        PastPositionsWarning,
        stacklevel=3,
    )


def encode_texts(
    tokenizer,
    texts: Sequence[str],
    add_special_tokens: bool,
    model=None,
    role: str = "model",
    start_token=None,
    text_names: Sequence[str] | None = None,
):
    """``[(ids [n], offsets [n, 2]), ...]`` of every text, checked before any forward pass: no text
    may tokenize to nothing, and with ``model`` every id must index its embedding table
    (:func:`settings.check_token_ids`) and no text may be longer than its position table
    (:func:`check_positions`).

    Args:
        start_token: an id put before each text, with the empty span ``(0, 0)`` (as a tokenizer's
            own BOS gets), e.g. ``evaluate``'s ``add_start_token``.
        text_names: what messages call each text (default ``predictions[i]``, the metric's argument).
    """
    encoded = list(encode_many_with_offsets(tokenizer, texts, add_special_tokens))
    if start_token is not None:
        encoded = [
            (np.concatenate([[start_token], ids]), np.concatenate([[[0, 0]], offsets])) for ids, offsets in encoded
        ]
    names = text_names if text_names is not None else [f"predictions[{index}]" for index in range(len(texts))]
    vocab_size = None if model is None else vocabulary_size(model)
    for name, (ids, _) in zip(names, encoded):
        if ids.shape[0] == 0:
            raise ValueError(f"{name} tokenizes to no tokens; pass texts with content.")
        check_token_ids(ids, vocab_size, role, name)
    if model is not None:
        check_positions(encoded, model, role, names)
    return encoded


def truncate_texts(texts: Sequence[str], tokenizer, max_length: int | None) -> list[str]:
    """Cut each text after its first ``max_length`` tokens of ``tokenizer`` (no special tokens counted).

    The metric and ``scripts/compute_key_tokens.py`` both pass the *evaluator's* tokenizer: the
    cut text is then the same for every evaluated model (a fair comparison across tokenizers, and
    one key-token cache serves them all), and ``max_length`` is counted in the unit of ``K``.
    """
    if max_length is None:
        return list(texts)
    out = []
    for text, (ids, offsets) in zip(texts, encode_many_with_offsets(tokenizer, texts, add_special_tokens=False)):
        out.append(text if ids.shape[0] <= max_length else text[: int(offsets[max_length - 1, 1])])
    return out


def _window_prefix(tokenizer, window_bos: bool) -> int | None:
    if not window_bos:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError(
            f"window_bos=True needs a BOS token, but {type(tokenizer).__name__} has none; leave window_bos=False."
        )
    return int(bos)


def score_with_evaluator(
    evaluator,
    tokenizer,
    texts: Sequence[str],
    settings: KeyTokenSettings | None = None,
    *,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    progress: bool = True,
    torch_compile: bool = False,
    per_document: bool = False,
    progress_callback: ProgressCallback | None = None,
    pack_documents: bool = False,
    text_names: Sequence[str] | None = None,
) -> list[EvaluatorScores]:
    """Long- and short-context log-probs of every evaluator token of every text.

    Args:
        settings: K, d and the evaluator's tokenization (``KeyTokenSettings``, checked when built;
            default ``KeyTokenSettings()``: K=4096, d=1024, the evaluator's special tokens as the
            official code, no BOS at the head of the short windows). The only way to give them:
            ``KeyTokenSettings(trunc_len=K, sliding_window=d)`` replaces the former numbers.
        max_tokens_per_batch: token budget of one forward pass (results do not depend on it).
        torch_compile: compile the evaluator's transformer blocks while scoring (see ``compilation``).
        per_document: a document's scores are bit-for-bit the same whatever other texts are scored
            with it (what a shareable cache needs): each document gets forward passes of its own.
            Without it, segments of all lengths are packed with padding, which changes results by
            float rounding.
        pack_documents: with ``per_document``, documents (and windows) share passes with segments
            of exactly their length, unpadded (``batching.segment_log_probs(equal_lengths=True)``):
            a corpus of many equal-length documents costs a few passes per budget's worth of tokens
            instead of two per document (4-7x faster on a GPU, docs/benchmarks.md). A row then
            depends on its company only at float-rounding level, where the kernels pick their
            summation order by the number of rows (multi-threaded CPU, float32 on a GPU; bfloat16
            on an H100 gave identical rows): opt-in, because a cache of N processes is then not
            bit-identical to one process's.
        progress_callback: ``callback(desc, done, total)`` after every step: documents, window
            batches, decoder layers and LM-head chunks (see ``progress``); raise in it to stop.
        text_names: what error messages call each text (default ``predictions[i]``).
    """
    settings = settings_object(KeyTokenSettings, settings)
    return score_context_ladder(
        evaluator,
        tokenizer,
        texts,
        [settings],
        max_tokens_per_batch=max_tokens_per_batch,
        progress=progress,
        torch_compile=torch_compile,
        per_document=per_document,
        progress_callback=progress_callback,
        pack_documents=pack_documents,
        text_names=text_names,
    )[0]


def score_context_ladder(
    evaluator,
    tokenizer,
    texts: Sequence[str],
    ladder: Sequence[KeyTokenSettings],
    *,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    progress: bool = True,
    torch_compile: bool = False,
    per_document: bool = False,
    progress_callback: ProgressCallback | None = None,
    pack_documents: bool = False,
    text_names: Sequence[str] | None = None,
) -> list[list[EvaluatorScores]]:
    """:func:`score_with_evaluator` under several settings (a ladder of ``K``) sharing one long pass.

    The long-context pass is run once per document and its log-probs reused for the short windows of
    every ``K``; each settings' scores equal those of a separate :func:`score_with_evaluator` call
    with it, bit for bit (the same long pass, the same windows).

    Args:
        ladder: the settings, e.g. ``[KeyTokenSettings(1024, d), KeyTokenSettings(4096, d)]``; they
            must agree on ``add_special_tokens`` (one tokenization, hence one long pass).
        others: as in :func:`score_with_evaluator`.
    Returns:
        ``scores[j][doc]``: the ``EvaluatorScores`` of ``texts[doc]`` under ``ladder[j]``.
    """
    ladder = [settings_object(KeyTokenSettings, settings) for settings in ladder]
    if not ladder:
        raise ValueError("score_context_ladder needs at least one KeyTokenSettings.")
    if len({settings.add_special_tokens for settings in ladder}) > 1:
        raise ValueError(
            "The settings of a context ladder must agree on add_special_tokens (one tokenization, one long pass); "
            "score the others in a run of their own."
        )
    encoded = encode_texts(
        tokenizer, texts, ladder[0].add_special_tokens, evaluator, "evaluator", text_names=text_names
    )
    sequences = [torch.from_numpy(ids) for ids, _ in encoded]
    if pack_documents and not per_document:
        raise ValueError("pack_documents=True needs per_document=True (it packs documents of one length only).")
    alone = per_document and not pack_documents
    groups = [[doc] for doc in range(len(texts))] if alone else [list(range(len(texts)))]
    lp_long: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    lp_short: list[list[torch.Tensor]] = [[torch.empty(0)] * len(texts) for _ in ladder]
    reporter = Progress(progress, progress_callback)
    long_desc = "LongPPL evaluator: long context"
    short_descs = [f"LongPPL evaluator: short windows (K={settings.trunc_len})" for settings in ladder]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_scoring(evaluator, torch_compile))
        long_done = stack.enter_context(reporter.labelled(long_desc, "doc").steps(len(texts)))
        short_dones = [stack.enter_context(reporter.labelled(d, "doc").steps(len(texts))) for d in short_descs]
        for group in groups:
            seqs = [sequences[doc] for doc in group]
            long = long_context_log_probs(
                evaluator,
                seqs,
                max_tokens_per_batch,
                lambda _: long_done(),
                reporter.labelled(long_desc, "doc"),
                equal_lengths=pack_documents,
            )
            for rung, (settings, short_desc, short_done) in enumerate(zip(ladder, short_descs, short_dones)):
                short = short_context_log_probs(
                    evaluator,
                    seqs,
                    max_tokens_per_batch=max_tokens_per_batch,
                    window=settings.window,
                    long_log_probs=long,
                    prefix_token_id=_window_prefix(tokenizer, settings.window_bos),
                    on_sequence_done=lambda _, done=short_done: done(),
                    progress=reporter.labelled(short_desc, "window"),
                    equal_lengths=pack_documents,
                )
                for doc, values_short in zip(group, short):
                    lp_short[rung][doc] = values_short
            for doc, values_long in zip(group, long):
                lp_long[doc] = values_long
    return [
        [
            EvaluatorScores(ids, offsets, long.numpy(), short.numpy())
            for (ids, offsets), long, short in zip(encoded, lp_long, rung)
        ]
        for rung in lp_short
    ]


def score_with_model(
    model,
    tokenizer,
    texts: Sequence[str],
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    add_special_tokens: bool = False,
    progress: bool = True,
    torch_compile: bool = False,
    progress_callback: ProgressCallback | None = None,
    encoded: list | None = None,
    start_token: int | None = None,
) -> list[ModelScores]:
    """Full-context log-probs of the evaluated model's tokens (no special tokens by default, as official).

    ``progress_callback``: as in :func:`score_with_evaluator`. ``encoded``: the texts as
    :func:`encode_texts` gave them for this tokenizer and model (a caller that checked them before
    the evaluator ran passes them on, so long texts are not tokenized twice). ``start_token``: see
    :func:`encode_texts`.
    """
    if encoded is None:
        encoded = encode_texts(tokenizer, texts, add_special_tokens, model, "model", start_token)
    reporter = Progress(progress, progress_callback).labelled("LongPPL: evaluated model", "doc")
    with _scoring(model, torch_compile), reporter.steps(len(texts)) as done:
        lp = long_context_log_probs(
            model, [torch.from_numpy(ids) for ids, _ in encoded], max_tokens_per_batch, lambda _: done(), reporter
        )
    return [ModelScores(ids, offsets, values.numpy()) for (ids, offsets), values in zip(encoded, lp)]


def model_key_weights(
    evaluator_scores: EvaluatorScores,
    model_offsets: np.ndarray,
    text_length: int,
    rule: KeyTokenRule,
    model_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Per model token ``[n_model]``: 1.0 / 0.0 for key / not key (hard rule), or the transferred soft
    weight (``rule.soft``).

    ``model_ids`` (``[n_model]``, the tokens of ``model_offsets``) lets the soft weights stay the
    evaluator's own, token for token, where the model's tokens are the evaluator's
    (``alignment.transfer_token_weights``); without them they are always the character-level average.
    A model token that no evaluator weight reaches (no characters: a BOS, EOS or ``[SEP]``) weighs
    ``key_tokens.unscored_weight(rule.gamma)``, ``min(1, gamma)``, as a token without a short score.
    """
    if rule.soft:
        weights = soft_weights(evaluator_scores.lp_long, evaluator_scores.lp_short, rule)
        return transfer_token_weights(
            text_length,
            evaluator_scores.offsets,
            weights,
            model_offsets,
            evaluator_scores.input_ids,
            model_ids,
            fill=unscored_weight(rule.gamma),  # what no evaluator token scored weighs as a token without a score
        )
    spans = evaluator_scores.key_spans(rule)
    return tokens_within_spans(model_offsets, spans).astype(np.float64)


def document_result(lp: np.ndarray, weights: np.ndarray) -> DocumentResult:
    """LongPPL ``exp(sum w*(-lp) / sum w)`` over key tokens and PPL over all predicted tokens.

    Args:
        lp: ``[n]`` model log-probs (NaN at 0). weights: ``[n]`` key weights (0/1 for the hard rule).
    """
    lp = np.asarray(lp, dtype=np.float64)
    predicted = ~np.isnan(lp)
    nll = -lp[predicted]
    w = np.asarray(weights, dtype=np.float64)[predicted]
    key = w > 0
    key_weight = float(w[key].sum())
    key_nll = float((w[key] * nll[key]).sum())
    longppl = math.exp(key_nll / key_weight) if key_weight > 0 else float("nan")
    ppl = math.exp(float(nll.mean())) if nll.size else float("nan")
    return DocumentResult(longppl, ppl, key_weight, int(lp.shape[0]), key_nll, float(nll.sum()), int(nll.size))


def text_key_weights(
    texts: Sequence[str],
    evaluator_scores: Sequence[EvaluatorScores],
    model_scores: Sequence[ModelScores],
    alpha: float | None = None,
    beta: float | None = None,
    use_lcl: bool | None = None,
    soft: bool | None = None,
    gamma: float | None = None,
    rule: KeyTokenRule | None = None,
) -> list[np.ndarray]:
    """Per text, the ``[n_k]`` key weight of every evaluated-model token (see :func:`model_key_weights`).

    ``rule`` (a ``KeyTokenRule``), or, as before, any of ``alpha``, ``beta``, ``use_lcl``, ``soft``,
    ``gamma`` (the settings' defaults for those not given).

    The evaluator's scores may come from a live run or from a key-token cache: only the stored
    ``lp_long``, ``lp_short`` and ``offsets`` are used, so alpha, beta, the soft variant and gamma
    can change without a forward pass.
    """
    rule = settings_object(KeyTokenRule, rule, alpha=alpha, beta=beta, use_lcl=use_lcl, soft=soft, gamma=gamma)
    return [
        model_key_weights(ev, ms.offsets, len(text), rule, ms.input_ids)
        for text, ev, ms in zip(texts, evaluator_scores, model_scores)
    ]


def document_results(model_scores: Sequence[ModelScores], key_weights: Sequence[np.ndarray]) -> list[DocumentResult]:
    """LongPPL and PPL of every text from the evaluated model's log-probs and its tokens' key weights
    (``text_key_weights``)."""
    return [document_result(ms.lp, w) for ms, w in zip(model_scores, key_weights)]


@dataclass(frozen=True)
class _CorpusRule:
    """One corpus value as a weighted mean over documents: ``sum_i c_i * term_i / sum_i c_i * w_i``,
    exponentiated when ``exp`` (the terms are log values or NLLs), the mean itself otherwise.

    ``weight`` names the ``DocumentResult`` field that is ``w_i``; ``term`` gives ``[n]`` terms
    (``w_i`` times the averaged value) from the ``[n]`` columns. Documents of weight 0 are left out.
    """

    weight: str
    term: Callable[[Mapping[str, np.ndarray]], np.ndarray]
    exp: bool


#: The rules of ``settings.AGGREGATIONS`` (their words are there), per metric. ``official`` is the
#: official evaluation script as it stands: the weighted mean of the texts' log LongPPLs (log PPLs),
#: weighted by key tokens (by ``n_tokens``, the first token included), exponentiated. For LongPPL
#: this is ``pooled`` (``n_key * log LongPPL`` is the text's key NLL); for PPL the official weights
#: count each text's first token, which has no prediction, so the two differ slightly.
_RULES = {
    "official": {
        "longppl": _CorpusRule("n_key_tokens", lambda c: c["n_key_tokens"] * np.log(c["longppl"]), exp=True),
        "ppl": _CorpusRule("n_tokens", lambda c: c["n_tokens"] * np.log(c["ppl"]), exp=True),
    },
    "official-pre-2025-07": {
        "longppl": _CorpusRule("n_key_tokens", lambda c: c["n_key_tokens"] * c["longppl"], exp=False),
        "ppl": _CorpusRule("n_tokens", lambda c: c["n_tokens"] * c["ppl"], exp=False),
    },
    "pooled": {
        "longppl": _CorpusRule("n_key_tokens", lambda c: c["key_nll"], exp=True),
        "ppl": _CorpusRule("n_predicted", lambda c: c["nll"], exp=True),
    },
}


def document_columns(results: Sequence[DocumentResult]) -> dict[str, np.ndarray]:
    """The fields of ``results`` as ``[n]`` float64 arrays, one per field, in document order."""
    return {
        name: np.array([getattr(r, name) for r in results], dtype=np.float64)
        for name in DocumentResult.__dataclass_fields__
    }


def corpus_values(
    columns: Mapping[str, np.ndarray], aggregation: str = DEFAULT_AGGREGATION, counts: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Corpus ``longppl`` and ``ppl`` under ``aggregation`` (one of ``settings.AGGREGATIONS``), for one
    corpus or for many resamples of it at once (the harness's bootstrap): the one place the rules are.

    Args:
        columns: per document, ``[n]`` arrays of the ``DocumentResult`` fields (:func:`document_columns`).
        counts: ``[r, n]``, how often each document is in each of ``r`` corpora; default ``[1, n]``
            ones, the documents themselves.
    Returns:
        ``{"longppl": [r], "ppl": [r]}``; NaN where no document counts (LongPPL: none with key tokens).
    """
    require_aggregation("aggregation", aggregation)
    counts = np.ones((1, len(columns["longppl"]))) if counts is None else np.asarray(counts, dtype=np.float64)
    out = {}
    for metric, rule in _RULES[aggregation].items():
        weights = np.asarray(columns[rule.weight], dtype=np.float64)
        counted = weights > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(counted, rule.term(columns), 0.0)  # a left-out document's NaN stays out
            weight, total = counts @ np.where(counted, weights, 0.0), counts @ terms
            mean = np.where(weight > 0, total / np.where(weight > 0, weight, 1.0), np.nan)
        out[metric] = np.exp(mean) if rule.exp else mean
    return out


def aggregate(results: Sequence[DocumentResult], aggregation: str = DEFAULT_AGGREGATION) -> tuple[float, float]:
    """Corpus ``(longppl, ppl)`` of ``results`` under ``aggregation`` (:func:`corpus_values`).

    ``"official"`` (default) is the official evaluation script as it stands (since July 2025):
    ``exp(sum n_key * log LongPPL / sum n_key)`` over the documents with key tokens and
    ``exp(sum n_tokens * log PPL / sum n_tokens)`` over all, ``n_tokens`` counting each document's
    first token. ``"official-pre-2025-07"`` is that script before July 2025: the same weighted means
    of the LongPPLs and PPLs themselves. ``"pooled"`` is the perplexity of all key tokens of all
    documents taken together, ``exp(sum nll / count)`` (and likewise PPL over predicted tokens);
    its LongPPL is the official one.
    """
    values = corpus_values(document_columns(results), aggregation)
    return float(values["longppl"][0]), float(values["ppl"][0])


def summarize_results(
    results: Sequence[DocumentResult], aggregation: str = DEFAULT_AGGREGATION, soft: bool = False
) -> dict:
    """The metric's return value: corpus ``longppl`` and ``ppl`` (see :func:`aggregate`),
    ``mean_perplexity`` (the plain mean of the per-text perplexities, as ``evaluate``'s
    ``perplexity`` metric reports it), and per text ``longppls``, ``perplexities``,
    ``n_key_tokens`` (int, or the total weight when ``soft``) and ``n_tokens``."""
    longppl, ppl = aggregate(results, aggregation)
    return {
        "longppl": longppl,
        "ppl": ppl,
        "mean_perplexity": float(np.mean([r.ppl for r in results])) if results else float("nan"),
        "longppls": [r.longppl for r in results],
        "perplexities": [r.ppl for r in results],
        "n_key_tokens": [r.n_key_tokens if soft else int(r.n_key_tokens) for r in results],
        "n_tokens": [r.n_tokens for r in results],
    }
