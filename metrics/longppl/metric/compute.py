"""What the ``evaluate`` metric's ``compute`` runs: check the arguments, resolve the two models'
sources, get the evaluator's scores (live or from the key-token cache) and the evaluated model's,
weigh its tokens, and sum up (:func:`compute_metric`); and the metric's description, citation and
argument list, which the metric file ``longppl.py`` declares. That file is a thin shell over this
module, so that ``evaluate`` copies one file and every other module comes from the installed package.
"""

from __future__ import annotations

import collections.abc
import gc
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import datasets
import numpy as np
import torch

from ..cache.key_token_cache import KeyTokenCache, KeyTokenSettings, cache_directory, cached_evaluator_scores
from ..core.logprobs import resolve_lm_head
from ..core.progress import ProgressCallback
from ..core.scoring import (
    EvaluatorScores,
    ModelScores,
    document_results,
    encode_texts,
    score_with_evaluator,
    score_with_model,
    summarize_results,
    text_key_weights,
    truncate_texts,
)
from ..models.fingerprints import ModelIdentity
from ..models.loading import (
    check_device,
    default_device,
    load_causal_lm,
    load_model,
    load_tokenizer,
    merge_dtype_arguments,
    resolve_dtype,
)
from ..models.precision import check_precision, precision_dtype, to_precision
from ..models.sources import check_model_source
from ..rules.key_tokens import key_char_spans
from ..settings import (
    DEFAULT_MAX_TOKENS_PER_BATCH,
    EvaluatorPrecision,
    KeyTokenRule,
    WindowSettings,
    evaluator_compiles,
    require_aggregation,
    require_bool,
    require_int,
    require_precision,
    settings_object,
)
from .options import LongPPLOptions, options_description

CITATION = """\
@inproceedings{fang2025wrong,
  title={What is Wrong with Perplexity for Long-context Language Modeling?},
  author={Lizhe Fang and Yifei Wang and Zhaoyang Liu and Chenheng Zhang and Stefanie Jegelka and Jinyang Gao and Bolin Ding and Yisen Wang},
  booktitle={The Thirteenth International Conference on Learning Representations},
  year={2025},
  url={https://arxiv.org/abs/2410.23771}
}
"""

DESCRIPTION = """\
LongPPL is perplexity computed only over the *key tokens* of a text: the tokens whose prediction
needs long context. An evaluator model scores every token twice, with its full context and with a
truncated context of K tokens (sliding windows of stride d). A token is key when its long-short
difference LSD = log P(x|long) - log P(x|short) exceeds alpha and its long-context likelihood
LCL = log P(x|long) exceeds beta. The evaluated model's LongPPL is then exp(mean negative
log-likelihood over those tokens); plain perplexity is reported alongside. Key tokens are carried
to the evaluated model's tokenizer through character spans, so any two tokenizers can be mixed.

Unlike perplexity, LongPPL correlates strongly with long-context benchmarks (Pearson -0.96 with
LongBench in the paper). Use a strong long-context model (e.g. Llama-3.1-8B) as evaluator: a model
evaluating itself gives uninformative values (paper, Appendix B.2).
"""

KWARGS_DESCRIPTION = (
    """
Computes LongPPL and PPL of a causal LM on long texts.

Args:
"""
    + options_description()
    + """

Returns:
    longppl (`float`): corpus LongPPL (NaN if no text has key tokens).
    ppl (`float`): corpus perplexity (per-text perplexities weighted by their token counts).
    mean_perplexity (`float`): the plain mean of `perplexities` over texts, as `evaluate`'s
        `perplexity` metric reports it.
    longppls (`list` of `float`): LongPPL per text (NaN when it has no key tokens).
    perplexities (`list` of `float`): perplexity per text.
    n_key_tokens (`list`): key tokens per text, under the evaluated model's tokenizer.
    n_tokens (`list` of `int`): tokens per text, under the evaluated model's tokenizer.
    settings (`dict`): what the values were computed with: `trunc_len`, `sliding_window`, `alpha`,
        `beta`, `use_lcl`, `soft`, `gamma`, and `window_from` ("arguments", "defaults", or
        "key_tokens" when K and d were taken from the cache).
    key_spans (`list` of `list` of `[start, end]`, with `return_key_spans=True`): per text, the
        character spans `text[start:end]` of the evaluated model's key tokens (the tokens LongPPL
        averages over), adjacent tokens merged.
    evaluator_scores (`list` of `EvaluatorScores`, with `return_evaluator_scores=True`): per text
        (as scored: cut to `max_length`), the evaluator's tokens `input_ids` `[n]`, their character
        spans `offsets` `[n, 2]`, `lp_long` `[n]` (NaN at 0) and `lp_short` `[n]` (NaN for
        `i < trunc_len`), as numpy arrays.

Examples:
    >>> import evaluate
    >>> longppl = evaluate.load("metrics/longppl")  # doctest: +SKIP
    >>> results = longppl.compute(
    ...     predictions=long_texts,
    ...     model_id="Qwen/Qwen2-7B",
    ...     evaluator_model_id="meta-llama/Llama-3.1-8B",
    ... )  # doctest: +SKIP
    >>> sorted(results)  # doctest: +SKIP
    ['longppl', 'longppls', 'mean_perplexity', 'n_key_tokens', 'n_tokens', 'perplexities', 'ppl', 'settings']
"""
)


def refuse_references(references, name: str = "predictions") -> None:
    """LongPPL has no references: texts passed as such (evaluate's usual pair) would be stored nowhere,
    and evaluate would then say that no data was added; say where they go instead."""
    if references is not None:
        raise ValueError(
            f"LongPPL scores the texts given as {name}= (long documents, list of str) and takes no references: "
            f"pass them as {name}=..."
        )


def check_predictions(predictions, allow_empty: bool = False) -> None:
    """Raise a ValueError unless ``predictions`` is a list (any sequence) of non-empty strings.

    A bare string is refused: evaluate would take it as a list of one-character texts.
    """
    if isinstance(predictions, (str, bytes)):
        raise ValueError(
            "predictions is a single string; pass a list of texts, e.g. predictions=[text] "
            "(a bare string would be scored character by character)."
        )
    if predictions is None or not isinstance(predictions, (collections.abc.Sequence, np.ndarray)):
        raise ValueError(
            f"predictions must be a list of strings, got a {type(predictions).__name__}; "
            "pass e.g. predictions=list(texts)."
        )
    if len(predictions) == 0 and not allow_empty:
        raise ValueError("predictions is empty: pass a list with at least one text to score.")
    for index, text in enumerate(predictions):
        if not isinstance(text, str):
            raise ValueError(f"predictions[{index}] is a {type(text).__name__}, not a string; pass texts.")
        if not text.strip():
            raise ValueError(f"predictions[{index}] is an empty string; every text must have content.")


def _resolve_perplexity_names(
    max_tokens_per_batch, batch_size, window: WindowSettings, add_special_tokens, add_start_token
) -> tuple[int, bool, bool]:
    """``(max_tokens_per_batch, add_special_tokens, start_token)`` from our names or from the names of
    ``evaluate``'s ``perplexity`` metric (``batch_size``, ``add_start_token``).

    ``add_start_token=True`` means what it means there: the texts are tokenized without special
    tokens and the tokenizer's ``bos_token_id`` is put before each (``start_token``), whether or
    not the tokenizer would add it itself (GPT-2 and Qwen tokenizers have a BOS but do not)."""
    if batch_size is not None:
        if max_tokens_per_batch is not None:
            raise ValueError(
                "batch_size and max_tokens_per_batch both set the size of a forward pass "
                "(batch_size=B means B * (trunc_len + sliding_window) tokens); pass only one of them."
            )
        max_tokens_per_batch = require_int("batch_size", batch_size) * (window.trunc_len + window.sliding_window)
    elif max_tokens_per_batch is None:
        max_tokens_per_batch = DEFAULT_MAX_TOKENS_PER_BATCH
    max_tokens_per_batch = require_int("max_tokens_per_batch", max_tokens_per_batch)
    add_start_token = False if add_start_token is None else require_bool("add_start_token", add_start_token)
    if add_special_tokens is not None:
        add_special_tokens = require_bool("add_special_tokens", add_special_tokens)
    if add_start_token and add_special_tokens:
        raise ValueError(
            "add_start_token=True puts the tokenizer's BOS token before each text itself (as evaluate's perplexity "
            "does), and add_special_tokens=True lets the tokenizer add its own special tokens too: pass only one."
        )
    return max_tokens_per_batch, bool(add_special_tokens), add_start_token


def _start_token(tokenizer) -> int:
    """The BOS id that ``add_start_token=True`` puts before each text (a ``ValueError`` if there is none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError(
            f"add_start_token=True puts the tokenizer's BOS token before each text, but {type(tokenizer).__name__} "
            "has no BOS token (bos_token_id is None); pass add_start_token=False (the official LongPPL setting)."
        )
    return int(bos)


@dataclass(frozen=True, eq=False)
class _ModelSource:
    """One model as the caller gave it: an object with its tokenizer, or a Hub id / local path.

    Any field may be ``None``: a model given by id has no object until it is loaded, and the
    evaluator is empty when a key-token cache stands in for it.
    """

    model: object = None
    tokenizer: object = None
    model_id: str | None = None

    @classmethod
    def checked(cls, model, tokenizer, model_id, role: str) -> _ModelSource:
        """The source after checking that an object and an id are not both given (``role`` names
        the argument in messages: ``"model"`` or ``"evaluator_model"``)."""
        if model is not None and model_id is not None:
            raise ValueError(f"Pass either {role}_id or {role} (an object), not both.")
        if isinstance(model, (str, os.PathLike)):  # {role}= takes an object; a name goes to {role}_id=
            raise ValueError(
                f"{role}={os.fspath(model)!r} is a Hub id or path: pass it as {role}_id={os.fspath(model)!r} "
                f"({role}= takes a model object, with its tokenizer)."
            )
        if model is not None:
            if tokenizer is None:
                raise ValueError(f"{role} is a model object, so pass its tokenizer too.")
            resolve_lm_head(model)  # clear error now for a model without a causal LM head
        return cls(model, tokenizer, model_id)

    @property
    def given(self) -> bool:
        return self.model is not None or self.model_id is not None


def _model_sources(o: LongPPLOptions) -> tuple[_ModelSource, _ModelSource]:
    """The evaluated model's and the evaluator's sources, checked: which of them are given, and how
    (an object with its tokenizer, or an id that must exist); ``ValueError`` saying what to pass."""
    model = _ModelSource.checked(o.model, o.tokenizer, o.model_id, "model")
    if not model.given:
        raise ValueError("No model to evaluate: pass model_id (Hub id or path) or model and tokenizer.")
    evaluator_given = o.evaluator_model is not None or o.evaluator_model_id is not None
    if o.self_evaluation and evaluator_given:
        raise ValueError("self_evaluation=True uses the evaluated model as evaluator; do not pass an evaluator too.")
    if not o.self_evaluation and not evaluator_given and o.key_tokens is None:
        raise ValueError(
            "No evaluator given. LongPPL needs a strong long-context evaluator model to pick key tokens: "
            "pass evaluator_model_id (e.g. 'meta-llama/Llama-3.1-8B') or evaluator_model and "
            "evaluator_tokenizer. A model that evaluates itself gives uninformative LongPPL "
            "(paper, Appendix B.2: all models score about the same); to run that ablation anyway, "
            "pass self_evaluation=True."
        )
    evaluator = _ModelSource.checked(o.evaluator_model, o.evaluator_tokenizer, o.evaluator_model_id, "evaluator_model")
    if model.model_id is not None:
        check_model_source(model.model_id, "model_id")
    if evaluator.model_id is not None:
        check_model_source(evaluator.model_id, "evaluator_model_id")
    return model, evaluator


def _checked_precision(
    precision: EvaluatorPrecision, o: LongPPLOptions, evaluator: _ModelSource, device, torch_dtype
) -> EvaluatorPrecision:
    """``precision`` (``evaluator_precision``, already a member), checked before anything is loaded:
    fp8 converts an evaluator this metric loads itself (given by id), on a GPU that has float8 tensor
    cores (``precision.check_precision``)."""
    if precision is EvaluatorPrecision.BF16:
        return precision
    if o.self_evaluation or evaluator.model is not None or evaluator.model_id is None:
        given = (
            "self_evaluation=True (the evaluated model is the evaluator)"
            if o.self_evaluation
            else "an evaluator object (converting it would change your model in place)"
            if evaluator.model is not None
            else "no evaluator (only key_tokens)"
        )
        raise ValueError(
            f"evaluator_precision='{precision}' converts the evaluator this metric loads from evaluator_model_id, "
            f"but it got {given}: pass evaluator_model_id, or evaluator_precision='bf16'."
        )
    where = device or default_device()
    return check_precision(precision, where, resolve_dtype(torch_dtype, where))


@dataclass(frozen=True, eq=False)
class _Request:
    """The metric's keyword arguments, checked and normalised by :meth:`from_options`.

    Every argument is checked before any model is loaded or run, so a bad value fails at once with
    the message of ``settings`` (shared with the drop-in and the scripts), not after a long pass.
    """

    predictions: Sequence[str]
    model: _ModelSource  # model_id or model + tokenizer (exactly one of them)
    evaluator: _ModelSource  # empty under self_evaluation, or when only key_tokens is given
    self_evaluation: bool
    key_tokens: str | datasets.Dataset | None
    evaluator_settings: KeyTokenSettings  # K, d and the evaluator's tokenization: what its scores depend on
    window_given: tuple[str, ...]  # which of trunc_len, sliding_window the caller passed
    rule: KeyTokenRule
    max_length: int | None  # in evaluator tokens
    max_tokens_per_batch: int
    add_special_tokens: bool  # for the evaluated model
    start_token: bool  # add_start_token=True: the evaluated model's BOS id before each text
    device: str | None
    torch_dtype: object  # a str, a torch.dtype or None (merged from torch_dtype and dtype)
    evaluator_precision: EvaluatorPrecision  # checked once, here, against the device, dtype and torchao
    aggregation: str
    return_key_spans: bool
    return_evaluator_scores: bool
    progress: bool
    torch_compile: bool | None  # None: only an fp8 evaluator (settings.evaluator_compiles)
    progress_callback: ProgressCallback | None

    @property
    def evaluator_dtype(self):
        """The evaluator's dtype: ``torch_dtype``, or float32 for a tf32 evaluator left unset."""
        return precision_dtype(self.evaluator_precision, self.torch_dtype)

    @classmethod
    def from_options(cls, predictions, options: LongPPLOptions) -> _Request:
        """The request of ``predictions`` and the metric's other arguments (``options``), checked.

        Raises:
            ValueError: an argument is invalid, or the arguments do not go together (the message
                says which and what to pass instead).
        """
        o = options
        # The settings first, then the models: the order in which errors are reported.
        check_predictions(predictions)
        # K and d left unset: the defaults, unless a key-token cache holds one setting of its own
        # (``_Request.with_window_of``).
        window_given = tuple(name for name in ("trunc_len", "sliding_window") if getattr(o, name) is not None)
        # Under the metric's name first: KeyTokenSettings calls it add_special_tokens.
        require_bool("evaluator_add_special_tokens", o.evaluator_add_special_tokens)
        evaluator_settings = settings_object(
            KeyTokenSettings,
            None,
            trunc_len=o.trunc_len,
            sliding_window=o.sliding_window,
            add_special_tokens=o.evaluator_add_special_tokens,
            window_bos=o.window_bos,
        )
        rule = KeyTokenRule.of(o)  # every field of the rule, by name
        max_tokens_per_batch, add_special_tokens, start_token = _resolve_perplexity_names(
            o.max_tokens_per_batch, o.batch_size, evaluator_settings, o.add_special_tokens, o.add_start_token
        )
        torch_dtype = merge_dtype_arguments(o.torch_dtype, o.dtype)
        device = check_device(o.device)
        precision = require_precision("evaluator_precision", o.evaluator_precision)  # the typed value from here on
        if o.torch_compile is not None:
            require_bool("torch_compile", o.torch_compile)
        max_length = None if o.max_length is None else require_int("max_length", o.max_length, minimum=2)
        if o.progress_callback is not None and not callable(o.progress_callback):
            raise ValueError(
                f"progress_callback must be a function callback(desc, done, total), got {o.progress_callback!r}."
            )
        require_aggregation("aggregation", o.aggregation)
        if o.return_key_spans and rule.soft:
            raise ValueError(
                "return_key_spans=True lists the key tokens of the hard rule, but soft=True weights every "
                "token instead; pass soft=False to get key spans."
            )

        model, evaluator = _model_sources(o)
        if (
            max_length is not None
            and not o.self_evaluation
            and evaluator.tokenizer is None
            and evaluator.model_id is None
        ):
            raise ValueError(
                "max_length counts the evaluator's tokens, but no evaluator is given (only key_tokens): pass "
                "evaluator_model_id too (only its tokenizer is loaded when the cache holds every text), or "
                "cut the texts yourself and leave max_length unset."
            )
        precision = _checked_precision(precision, o, evaluator, device, precision_dtype(precision, torch_dtype))
        if isinstance(o.key_tokens, (str, os.PathLike)):  # before any model is loaded or text scored
            cache_directory(o.key_tokens, "key_tokens", create=evaluator.given)
        return cls(
            predictions=predictions,
            model=model,
            evaluator=evaluator,
            self_evaluation=bool(o.self_evaluation),
            key_tokens=o.key_tokens,
            evaluator_settings=evaluator_settings,
            window_given=window_given,
            rule=rule,
            max_length=max_length,
            max_tokens_per_batch=max_tokens_per_batch,
            add_special_tokens=add_special_tokens,
            start_token=start_token,
            device=device,
            torch_dtype=torch_dtype,
            evaluator_precision=precision,
            aggregation=o.aggregation,
            return_key_spans=bool(o.return_key_spans),
            return_evaluator_scores=bool(o.return_evaluator_scores),
            progress=o.progress,
            torch_compile=o.torch_compile,
            progress_callback=o.progress_callback,
        )

    def with_window_of(self, cache: KeyTokenCache) -> "_Request":
        """This request with the cache's K and d where the caller left them unset and the cache's
        rows (for this tokenization of the evaluator, and the values that were passed) hold exactly
        one setting; ``ValueError`` listing them when they hold several."""
        if len(self.window_given) == 2:
            return self
        settings = self.evaluator_settings
        wanted = dict(add_special_tokens=settings.add_special_tokens, window_bos=settings.window_bos)
        wanted.update({name: getattr(settings, name) for name in self.window_given})
        windows = sorted(
            {
                (c["trunc_len"], c["sliding_window"])
                for c in cache.configurations()
                if all(c[name] == value for name, value in wanted.items())
            }
        )
        if len(windows) > 1:
            listed = "; ".join(f"trunc_len={k}, sliding_window={d}" for k, d in windows)
            raise ValueError(
                f"The key-token cache holds rows with {len(windows)} settings of K and d ({listed}), and trunc_len / "
                "sliding_window were not both passed: pass them to choose one."
            )
        if not windows:  # none to take: the defaults (missing rows are scored, or listed in an error)
            return self
        adopted = replace(settings, trunc_len=windows[0][0], sliding_window=windows[0][1])
        return replace(self, evaluator_settings=adopted, window_given=("trunc_len", "sliding_window"))


@dataclass(frozen=True, eq=False)
class _Sources:
    """What scoring reads: the texts as scored and the two models' sources.

    ``model.tokenizer`` is always set; ``model.model`` is ``None`` while the evaluated model is
    given by id (it is loaded only once the evaluator has run and been freed). Under
    ``self_evaluation``, ``evaluator`` is the evaluated model itself.
    """

    texts: list[str]  # predictions, cut to max_length evaluator tokens when it is set
    model: _ModelSource
    evaluator: _ModelSource
    model_encoded: list | None  # the texts encoded for a model given as an object (checked early)
    start_token: int | None  # the BOS id put before each text for the evaluated model (add_start_token)


def _resolve_sources(request: _Request) -> _Sources:
    """Load what is needed before scoring (tokenizers; the model itself under self_evaluation), cut
    the texts to ``max_length`` and, for a model object, check its tokens (a tokenizer of another
    model fails here, before the evaluator's long run)."""
    model, tokenizer, model_id = request.model.model, request.model.tokenizer, request.model.model_id
    if request.self_evaluation and model is None:
        model, tokenizer = load_causal_lm(model_id, request.device, request.torch_dtype)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_id)  # the model itself is loaded after the evaluator is freed
    start_token = _start_token(tokenizer) if request.start_token else None
    evaluator = request.evaluator
    if request.max_length is not None:
        cutter = tokenizer if request.self_evaluation else evaluator.tokenizer or load_tokenizer(evaluator.model_id)
        texts = truncate_texts(request.predictions, cutter, request.max_length)
    else:
        texts = list(request.predictions)
    model_encoded = None
    if model is not None:
        model_encoded = encode_texts(tokenizer, texts, request.add_special_tokens, model, "model", start_token)
    if request.self_evaluation:
        evaluator = _ModelSource(model, tokenizer)
    return _Sources(texts, _ModelSource(model, tokenizer, model_id), evaluator, model_encoded, start_token)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_evaluator(model, tokenizer, texts, request: _Request, *, per_document: bool = False):
    """``score_with_evaluator`` with the request's settings (``per_document`` for cache rows)."""
    return score_with_evaluator(
        model,
        tokenizer,
        texts,
        settings=request.evaluator_settings,
        per_document=per_document,
        max_tokens_per_batch=request.max_tokens_per_batch,
        progress=request.progress,
        torch_compile=evaluator_compiles(request.torch_compile, request.evaluator_precision),
        progress_callback=request.progress_callback,
    )


def _score_live(request: _Request, sources: _Sources) -> list[EvaluatorScores]:
    """The evaluator's scores of the texts, loading it first when given by id (and freeing it after)."""
    evaluator = sources.evaluator
    if evaluator.model is None:
        model, tokenizer = load_causal_lm(evaluator.model_id, request.device, request.evaluator_dtype)
        model = to_precision(model, request.evaluator_precision)  # checked before: bf16, or fp8 by id
        scores = _run_evaluator(model, tokenizer, sources.texts, request)
        del model
        _release_memory()
        return scores
    return _run_evaluator(evaluator.model, evaluator.tokenizer, sources.texts, request)


def _score_from_cache(request: _Request, sources: _Sources, cache: KeyTokenCache) -> list[EvaluatorScores]:
    """The evaluator's scores of the texts from the key-token cache; the evaluator (if any) scores
    only the texts the cache lacks, and is loaded only then (or when its checkpoint has no
    fingerprint that can be taken without loading it)."""
    evaluator, tokenizer, evaluator_id = (
        sources.evaluator.model,
        sources.evaluator.tokenizer,
        sources.evaluator.model_id,
    )
    device, torch_dtype = request.device, request.evaluator_dtype
    identity = None
    if evaluator is None and evaluator_id is not None:
        identity = ModelIdentity.of_checkpoint(evaluator_id, resolve_dtype(torch_dtype, device or default_device()))
        if identity is None:  # a Hub id that cannot be resolved to a commit: fingerprint the weights
            evaluator, tokenizer = load_causal_lm(evaluator_id, device, torch_dtype)
    if evaluator is not None and identity is None:
        identity = ModelIdentity.of_model(evaluator, tokenizer)  # the weights as loaded, before any conversion
    if identity is not None:  # fp8 rows are keyed apart from bf16 rows; bf16 keeps its identity
        identity = identity.with_precision(request.evaluator_precision)

    def score_missing(missing):
        model, model_tokenizer = evaluator, tokenizer
        if model is None:
            model, model_tokenizer = load_causal_lm(evaluator_id, device, torch_dtype)
        model = to_precision(model, request.evaluator_precision)  # bf16: as it is (an object given stays so)
        return identity, _run_evaluator(model, model_tokenizer, missing, request, per_document=True)

    settings = request.evaluator_settings
    scores = cached_evaluator_scores(cache, sources.texts, settings, identity, score_missing if identity else None)
    evaluator = None  # release the model before freeing memory (score_missing has run)
    _release_memory()
    return scores


def _model_scores(request: _Request, sources: _Sources, evaluator_scores) -> list[ModelScores]:
    """The evaluated model's log-probs of the texts; a model given by id is loaded only now, once
    the evaluator has been freed."""
    same_tokens = (
        request.add_special_tokens == request.evaluator_settings.add_special_tokens and not request.start_token
    )
    if request.self_evaluation and same_tokens:
        # Same model, same tokens: the evaluator's long pass already holds the model's log-probs.
        return [ModelScores(s.input_ids, s.offsets, s.lp_long) for s in evaluator_scores]
    model = sources.model.model
    if model is None:
        model = load_model(sources.model.model_id, request.device, request.torch_dtype)  # tokenizer: above
    return score_with_model(
        model,
        sources.model.tokenizer,
        sources.texts,
        request.max_tokens_per_batch,
        add_special_tokens=request.add_special_tokens,
        progress=request.progress,
        torch_compile=bool(request.torch_compile),  # unset: the evaluated model runs eagerly
        progress_callback=request.progress_callback,
        encoded=sources.model_encoded,
        start_token=sources.start_token,
    )


def _output(request: _Request, results, model_scores, weights, evaluator_scores, window_from_cache: bool) -> dict:
    """The metric's return value (``summarize_results``), the settings it was computed with
    (``settings``: K, d, the rule, and ``window_from`` saying whether K and d were passed, left at
    their defaults or taken from the key-token cache), with ``key_spans`` and ``evaluator_scores``
    when asked for."""
    output = summarize_results(results, request.aggregation, request.rule.soft)
    window_from = "key_tokens" if window_from_cache else "arguments" if request.window_given else "defaults"
    output["settings"] = dict(
        asdict(request.evaluator_settings.window), **asdict(request.rule), window_from=window_from
    )
    if request.return_key_spans:  # the tokens document_result counts: key and predicted
        output["key_spans"] = [
            key_char_spans(ms.offsets, (w > 0) & ~np.isnan(ms.lp)).tolist() for ms, w in zip(model_scores, weights)
        ]
    if request.return_evaluator_scores:
        output["evaluator_scores"] = list(evaluator_scores)
    return output


def compute_metric(predictions, **kwargs) -> dict:
    """The metric's value for ``predictions`` (texts, checked by :func:`check_predictions`): check the
    arguments, resolve the two models' sources, get the evaluator's scores (live or from the key-token
    cache) and the evaluated model's, weigh its tokens, and sum up. The arguments are the fields of
    ``options.LongPPLOptions``; they and the returned dict are described in ``KWARGS_DESCRIPTION``."""
    request = _Request.from_options(predictions, LongPPLOptions.from_kwargs(kwargs))
    sources = _resolve_sources(request)
    window_from_cache = False
    if request.key_tokens is None:
        evaluator_scores = _score_live(request, sources)
    else:  # the evaluator's scores from the cache (those it lacks scored and added)
        cache = KeyTokenCache.load(request.key_tokens, create=sources.evaluator.given)
        adopted = request.with_window_of(cache)
        window_from_cache, request = adopted.window_given != request.window_given, adopted
        evaluator_scores = _score_from_cache(request, sources, cache)
    model_scores = _model_scores(request, sources, evaluator_scores)
    weights = text_key_weights(sources.texts, evaluator_scores, model_scores, rule=request.rule)
    results = document_results(model_scores, weights)
    _warn_without_key_tokens(evaluator_scores, results, request.evaluator_settings.trunc_len)
    return _output(request, results, model_scores, weights, evaluator_scores, window_from_cache)


def _warn_without_key_tokens(evaluator_scores, results, trunc_len: int) -> None:
    # stacklevel 6 = the user's compute() call (through the metric's compute, evaluate's, the
    # metric's _compute and compute_metric).
    too_short = [i for i, s in enumerate(evaluator_scores) if s.input_ids.shape[0] <= trunc_len]
    if too_short:
        warnings.warn(
            f"Texts {too_short} have at most trunc_len={trunc_len} evaluator tokens, so no token has a "
            "short context to compare with: their LongPPL is NaN. Use longer texts or a smaller trunc_len.",
            stacklevel=6,
        )
    no_keys = [i for i, r in enumerate(results) if r.n_key_tokens == 0 and i not in too_short]
    if no_keys:
        warnings.warn(f"Texts {no_keys} have no key tokens: their LongPPL is NaN.", stacklevel=6)
    if all(r.n_key_tokens == 0 for r in results):
        warnings.warn("No text has key tokens: the corpus LongPPL is NaN.", stacklevel=6)
