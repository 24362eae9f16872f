"""LongPPL: perplexity over the key tokens of long-context language modeling (evaluate metric)."""

from __future__ import annotations

import collections.abc
import gc
import warnings

import datasets
import evaluate
import numpy as np
import torch

# evaluate copies only the sibling modules this file imports directly (it does not follow imports
# recursively), so every module of the scoring core is imported here, even where unused. (No
# comments on these lines: evaluate reads a comment after a relative import as a download URL.)
from .alignment import encode_with_offsets
from .atomic_files import write_file_atomically
from .batching import long_context_log_probs
from .compilation import compiled_blocks
from .fingerprints import ModelIdentity
from .key_token_cache import KeyTokenCache, KeyTokenSettings, cached_evaluator_scores
from .key_tokens import key_char_spans
from .loading import (
    check_device,
    check_model_source,
    default_device,
    load_causal_lm,
    load_model,
    load_tokenizer,
    merge_dtype_arguments,
    resolve_dtype,
)
from .logprobs import resolve_lm_head
from .official import compute_longppl, find_key_token, load_key_token
from .progress import Progress
from .scoring import (
    ModelScores,
    document_results,
    encode_texts,
    score_with_evaluator,
    score_with_model,
    summarize_results,
    text_key_weights,
    truncate_texts,
)
from .settings import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    KeyTokenRule,
    WindowSettings,
    require_bool,
    require_int,
)
from .windows import window_bounds

# Re-exported: the official package's scripts do `from longppl.longppl import *`.
__all__ = ["LongPPL", "compute_longppl", "find_key_token", "load_key_token"]
_CORE = (encode_with_offsets, long_context_log_probs, compiled_blocks, window_bounds, write_file_atomically, Progress)

_CITATION = """\
@inproceedings{fang2025wrong,
  title={What is Wrong with Perplexity for Long-context Language Modeling?},
  author={Lizhe Fang and Yifei Wang and Zhaoyang Liu and Chenheng Zhang and Stefanie Jegelka and Jinyang Gao and Bolin Ding and Yisen Wang},
  booktitle={The Thirteenth International Conference on Learning Representations},
  year={2025},
  url={https://arxiv.org/abs/2410.23771}
}
"""

_DESCRIPTION = """\
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

_KWARGS_DESCRIPTION = """
Computes LongPPL and PPL of a causal LM on long texts.

Args:
    predictions (`list` of `str`): the texts to score (long documents; each needs more than
        `trunc_len` evaluator tokens to have key tokens). A bare string is refused (it would be
        scored character by character): pass one text as `[text]`.
    model_id (`str`): Hub id or local path of the evaluated causal LM. Or pass `model` and
        `tokenizer` objects (a PEFT-wrapped model works too). Checked before anything is loaded: a
        path must exist, and while offline (`HF_HUB_OFFLINE=1`) a Hub id must be in the local cache.
    evaluator_model_id (`str`): Hub id or local path of the evaluator. Or pass `evaluator_model`
        and `evaluator_tokenizer`. Required unless `self_evaluation=True` or `key_tokens` holds
        every text.
    key_tokens (`str` or `datasets.Dataset`, optional): a key-token cache (directory written by
        `scripts/compute_key_tokens.py` or by this argument, or a `Dataset` of it, e.g. from the
        Hub). Texts found in it, for the same evaluator and `trunc_len`, `sliding_window`,
        `evaluator_add_special_tokens`, `window_bos`, are not scored again: when all are found the
        evaluator is neither loaded nor run, and alpha, beta, soft and gamma may differ from the
        run that built it. Missing texts are scored by the evaluator and added (a directory is
        created or updated atomically; a `Dataset` is only updated in memory); without an
        evaluator they are an error that lists them.
    self_evaluation (`bool`, default False): use the evaluated model as its own evaluator (the
        paper's ablation; uninformative as a benchmark).
    alpha (`float`, default 2.0): LSD threshold; key iff LSD > alpha.
    beta (`float`, default -2.0): LCL threshold; key iff LCL > beta.
    use_lcl (`bool`, default True): False drops the LCL condition (paper ablation).
    soft (`bool`, default False): weight every token by min(exp(LSD), gamma) instead of the hard
        rule (paper Table 2); `n_key_tokens` then holds the total weight.
    gamma (`float`, default 5.0): cap of the soft weights.
    trunc_len (`int`, default 4096): K, the short-context length.
    sliding_window (`int`, default 1024): d, how many tokens share one short context.
    max_length (`int`, optional): keep only the first `max_length` *evaluator* tokens of each text
        (special tokens not counted), as `scripts/compute_key_tokens.py --max-length` does. Counted
        in evaluator tokens because K, d and the key tokens are, and because the cut text is then
        the same whatever model is evaluated: models with different tokenizers are compared on the
        same text, and a key-token cache built with `--max-length N` serves `max_length=N`. It
        needs the evaluator's tokenizer: with `key_tokens` and no evaluator, pass
        `evaluator_model_id` too (the evaluator itself is loaded only for texts the cache lacks).
        The official script cuts by the evaluated model's tokens instead; to reproduce it exactly,
        cut the texts yourself.
    max_tokens_per_batch (`int`, default 32768): token budget of one forward pass; short windows
        and short documents are packed up to it. Results do not depend on it.
    batch_size (`int`, optional): the name `evaluate`'s `perplexity` metric uses (texts per forward
        pass). Forward passes are packed by tokens here, so it sets the token budget to
        `max_tokens_per_batch = batch_size * (trunc_len + sliding_window)`: `batch_size` full short
        windows per pass. Pass it or `max_tokens_per_batch`, not both.
    device (`str`, optional): where models given by id are loaded: "cuda", "cuda:1", "cpu", "mps",
        "auto" (shard over GPUs). Default: a GPU if available. A device that is not one, or that is
        not available here, is refused. Model objects stay where they are.
    torch_dtype (`str` or `torch.dtype`, optional): dtype of models given by id; default bfloat16
        on GPU, float32 on CPU.
    dtype (`str` or `torch.dtype`, optional): transformers 5's name of `torch_dtype`; pass either
        (both, with different values, is an error).
    aggregation (`str`, default "official"): "official" = key-token-weighted mean of per-text
        LongPPLs (token-weighted for PPL), as the official evaluation script; "pooled" =
        exp(total NLL / total count) over all texts.
    add_special_tokens (`bool`, default False): tokenize for the evaluated model with its special
        tokens (the official code does not).
    add_start_token (`bool`, optional): `evaluate`'s `perplexity` name: True puts the tokenizer's
        start (BOS) token before each text, so that the first token of the text is scored too. Here
        that is `add_special_tokens=True` (the evaluated model's tokenizer must add a BOS token with
        its special tokens); False is `add_special_tokens=False`. Note the defaults differ: the
        `perplexity` metric adds it, LongPPL (like the official code) does not. Pass it or
        `add_special_tokens`, not both with different values.
    evaluator_add_special_tokens (`bool`, default True): tokenize for the evaluator with its special
        tokens (official behaviour).
    window_bos (`bool`, default False): opt-in: put the evaluator's BOS at the head of every short
        window (the official code does not).
    torch_compile (`bool`, default False): compile the models' transformer blocks while scoring
        (10-20% faster on GPU after a one-off compilation of 10-20 s; worth it for corpora).
    progress (`bool`, default True): show progress bars (per text; inside a text of more than
        32768 tokens also per batch of short windows, per decoder layer and per LM-head chunk).
    progress_callback (`callable`, optional): called as `progress_callback(desc, done, total)`
        after every step of scoring (texts, batches of windows, decoder layers, LM-head chunks),
        whether bars are shown or not. An exception it raises stops scoring and propagates out
        of `compute` (e.g. to enforce a time limit).
    return_key_spans (`bool`, default False): also return `key_spans`, to see which tokens are key
        (hard rule only).

Returns:
    longppl (`float`): corpus LongPPL (NaN if no text has key tokens).
    ppl (`float`): corpus perplexity (per-text perplexities weighted by their token counts).
    mean_perplexity (`float`): the plain mean of `perplexities` over texts, as `evaluate`'s
        `perplexity` metric reports it.
    longppls (`list` of `float`): LongPPL per text (NaN when it has no key tokens).
    perplexities (`list` of `float`): perplexity per text.
    n_key_tokens (`list`): key tokens per text, under the evaluated model's tokenizer.
    n_tokens (`list` of `int`): tokens per text, under the evaluated model's tokenizer.
    key_spans (`list` of `list` of `[start, end]`, with `return_key_spans=True`): per text, the
        character spans `text[start:end]` of the evaluated model's key tokens (the tokens LongPPL
        averages over), adjacent tokens merged.

Examples:
    >>> import evaluate
    >>> longppl = evaluate.load("metrics/longppl")  # doctest: +SKIP
    >>> results = longppl.compute(
    ...     predictions=long_texts,
    ...     model_id="Qwen/Qwen2-7B",
    ...     evaluator_model_id="meta-llama/Llama-3.1-8B",
    ... )  # doctest: +SKIP
    >>> sorted(results)  # doctest: +SKIP
    ['longppl', 'longppls', 'mean_perplexity', 'n_key_tokens', 'n_tokens', 'perplexities', 'ppl']
"""


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
) -> tuple[int, bool]:
    """``(max_tokens_per_batch, add_special_tokens)`` from our names or from the names of
    ``evaluate``'s ``perplexity`` metric (``batch_size``, ``add_start_token``)."""
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
    if add_start_token is not None:
        add_start_token = require_bool("add_start_token", add_start_token)
        if add_special_tokens is not None and require_bool("add_special_tokens", add_special_tokens) != add_start_token:
            raise ValueError(
                f"add_start_token={add_start_token} and add_special_tokens={add_special_tokens} disagree: "
                "add_start_token (the name of evaluate's perplexity metric) sets add_special_tokens; pass only one."
            )
        add_special_tokens = add_start_token
    add_special_tokens = False if add_special_tokens is None else require_bool("add_special_tokens", add_special_tokens)
    return max_tokens_per_batch, add_special_tokens


def _check_start_token(tokenizer) -> None:
    """``add_start_token=True`` needs a tokenizer that puts its BOS token first with its special tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    if bos is None or not ids or ids[0] != bos:
        raise ValueError(
            f"add_start_token=True asks for a start (BOS) token before each text, but {type(tokenizer).__name__} "
            "adds none with its special tokens; pass add_start_token=False (the official LongPPL setting)."
        )


def _model_and_tokenizer(model, tokenizer, model_id, role: str):
    """``(model or None, tokenizer or None, id or None)`` after checking that exactly one source is given."""
    if model is not None and model_id is not None:
        raise ValueError(f"Pass either {role}_id or {role} (an object), not both.")
    if model is not None:
        if tokenizer is None:
            raise ValueError(f"{role} is a model object, so pass its tokenizer too.")
        resolve_lm_head(model)  # clear error now for a model without a causal LM head
    return model, tokenizer, model_id


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _evaluator_scores(evaluator, tokenizer, texts, settings, scoring, per_document=False):
    return score_with_evaluator(
        evaluator,
        tokenizer,
        texts,
        settings.trunc_len,
        settings.sliding_window,
        add_special_tokens=settings.add_special_tokens,
        window_bos=settings.window_bos,
        per_document=per_document,
        **scoring,
    )


def _score_live(texts, settings, evaluator, tokenizer, evaluator_id, device, torch_dtype, scoring):
    """The evaluator's scores of ``texts``, loading it first when given by id (and freeing it after)."""
    if evaluator is None:
        evaluator, tokenizer = load_causal_lm(evaluator_id, device, torch_dtype)
        scores = _evaluator_scores(evaluator, tokenizer, texts, settings, scoring)
        del evaluator
        _release_memory()
        return scores
    return _evaluator_scores(evaluator, tokenizer, texts, settings, scoring)


def _score_from_cache(key_tokens, texts, settings, evaluator, tokenizer, evaluator_id, device, torch_dtype, scoring):
    """The evaluator's scores of ``texts`` from the key-token cache; the evaluator (if any) scores
    only the texts the cache lacks, and is loaded only then (or when its checkpoint has no
    fingerprint that can be taken without loading it)."""
    cache = KeyTokenCache.load(key_tokens, create=evaluator is not None or evaluator_id is not None)
    identity = None
    if evaluator is None and evaluator_id is not None:
        identity = ModelIdentity.of_checkpoint(evaluator_id, resolve_dtype(torch_dtype, device or default_device()))
        if identity is None:  # a Hub id that cannot be resolved to a commit: fingerprint the weights
            evaluator, tokenizer = load_causal_lm(evaluator_id, device, torch_dtype)
    if evaluator is not None and identity is None:
        identity = ModelIdentity.of_model(evaluator, tokenizer)

    def score_missing(missing):
        model, model_tokenizer = evaluator, tokenizer
        if model is None:
            model, model_tokenizer = load_causal_lm(evaluator_id, device, torch_dtype)
        return identity, _evaluator_scores(model, model_tokenizer, missing, settings, scoring, per_document=True)

    scores = cached_evaluator_scores(cache, texts, settings, identity, score_missing if identity else None)
    evaluator = None  # release the model before freeing memory (score_missing has run)
    _release_memory()
    return scores


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class LongPPL(evaluate.Metric):
    """LongPPL (Fang et al., ICLR 2025) as an ``evaluate`` metric."""

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://arxiv.org/abs/2410.23771", "https://github.com/PKU-ML/LongPPL"],
        )

    # Texts are checked before evaluate stores them: its Arrow encoding would turn 123 into "123".
    def compute(self, *, predictions=None, references=None, **kwargs):
        """Compute LongPPL and PPL of a model on ``predictions`` (the arguments are listed below)."""
        if predictions is not None:  # None: texts were given earlier through add() / add_batch()
            check_predictions(predictions)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch of texts to score at the next ``compute(...)``."""
        if predictions is not None:
            check_predictions(predictions, allow_empty=True)
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """Add one text to score at the next ``compute(...)``."""
        if prediction is not None:
            check_predictions([prediction])
        return super().add(prediction=prediction, reference=reference, **kwargs)

    def _compute(
        self,
        predictions,
        model_id=None,
        evaluator_model_id=None,
        model=None,
        tokenizer=None,
        evaluator_model=None,
        evaluator_tokenizer=None,
        self_evaluation=False,
        alpha=DEFAULT_ALPHA,
        beta=DEFAULT_BETA,
        use_lcl=True,
        soft=False,
        gamma=DEFAULT_GAMMA,
        trunc_len=DEFAULT_TRUNC_LEN,
        sliding_window=DEFAULT_SLIDING_WINDOW,
        max_length=None,
        max_tokens_per_batch=None,
        device=None,
        torch_dtype=None,
        aggregation="official",
        add_special_tokens=None,
        evaluator_add_special_tokens=True,
        window_bos=False,
        progress=True,
        torch_compile=False,
        return_key_spans=False,
        key_tokens=None,
        batch_size=None,
        add_start_token=None,
        dtype=None,
        progress_callback=None,
    ):
        # Every argument is checked before any model is loaded or run.
        check_predictions(predictions)
        window = WindowSettings(trunc_len, sliding_window)
        rule = KeyTokenRule(alpha, beta, use_lcl, soft, gamma)
        max_tokens_per_batch, add_special_tokens = _resolve_perplexity_names(
            max_tokens_per_batch, batch_size, window, add_special_tokens, add_start_token
        )
        torch_dtype = merge_dtype_arguments(torch_dtype, dtype)
        device = check_device(device)
        evaluator_add_special_tokens = require_bool("evaluator_add_special_tokens", evaluator_add_special_tokens)
        window_bos = require_bool("window_bos", window_bos)
        if max_length is not None:
            max_length = require_int("max_length", max_length, minimum=2)
        if progress_callback is not None and not callable(progress_callback):
            raise ValueError(
                f"progress_callback must be a function callback(desc, done, total), got {progress_callback!r}."
            )
        if aggregation not in ("official", "pooled"):
            raise ValueError(f"aggregation must be 'official' or 'pooled', got {aggregation!r}.")
        if return_key_spans and rule.soft:
            raise ValueError(
                "return_key_spans=True lists the key tokens of the hard rule, but soft=True weights every "
                "token instead; pass soft=False to get key spans."
            )

        model, tokenizer, model_id = _model_and_tokenizer(model, tokenizer, model_id, "model")
        if model is None and model_id is None:
            raise ValueError("No model to evaluate: pass model_id (Hub id or path) or model and tokenizer.")
        evaluator_given = evaluator_model is not None or evaluator_model_id is not None
        if self_evaluation and evaluator_given:
            raise ValueError(
                "self_evaluation=True uses the evaluated model as evaluator; do not pass an evaluator too."
            )
        if not self_evaluation and not evaluator_given and key_tokens is None:
            raise ValueError(
                "No evaluator given. LongPPL needs a strong long-context evaluator model to pick key tokens: "
                "pass evaluator_model_id (e.g. 'meta-llama/Llama-3.1-8B') or evaluator_model and "
                "evaluator_tokenizer. A model that evaluates itself gives uninformative LongPPL "
                "(paper, Appendix B.2: all models score about the same); to run that ablation anyway, "
                "pass self_evaluation=True."
            )
        evaluator_model, evaluator_tokenizer, evaluator_model_id = _model_and_tokenizer(
            evaluator_model, evaluator_tokenizer, evaluator_model_id, "evaluator_model"
        )
        if model_id is not None:
            check_model_source(model_id, "model_id")
        if evaluator_model_id is not None:
            check_model_source(evaluator_model_id, "evaluator_model_id")
        if (
            max_length is not None
            and not self_evaluation
            and evaluator_tokenizer is None
            and evaluator_model_id is None
        ):
            raise ValueError(
                "max_length counts the evaluator's tokens, but no evaluator is given (only key_tokens): pass "
                "evaluator_model_id too (only its tokenizer is loaded when the cache holds every text), or "
                "cut the texts yourself and leave max_length unset."
            )

        if self_evaluation and model is None:
            model, tokenizer = load_causal_lm(model_id, device, torch_dtype)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_id)  # the model itself is loaded after the evaluator is freed
        if add_start_token:
            _check_start_token(tokenizer)
        if max_length is not None:
            cutter = tokenizer if self_evaluation else evaluator_tokenizer or load_tokenizer(evaluator_model_id)
            texts = truncate_texts(predictions, cutter, max_length)
        else:
            texts = list(predictions)
        model_encoded = None
        if model is not None:  # a tokenizer of another model fails here, before the evaluator's long run
            model_encoded = encode_texts(tokenizer, texts, add_special_tokens, model, "model")
        trunc_len, sliding_window = window.trunc_len, window.sliding_window
        alpha, beta, use_lcl, soft, gamma = rule.alpha, rule.beta, rule.use_lcl, rule.soft, rule.gamma

        if self_evaluation:
            evaluator_model, evaluator_tokenizer, evaluator_model_id = model, tokenizer, None
        scoring = dict(
            max_tokens_per_batch=max_tokens_per_batch,
            progress=progress,
            torch_compile=torch_compile,
            progress_callback=progress_callback,
        )
        settings = KeyTokenSettings(trunc_len, sliding_window, evaluator_add_special_tokens, window_bos)
        if key_tokens is None:
            evaluator_scores = _score_live(
                texts, settings, evaluator_model, evaluator_tokenizer, evaluator_model_id, device, torch_dtype, scoring
            )
        else:
            evaluator_scores = _score_from_cache(
                key_tokens,
                texts,
                settings,
                evaluator_model,
                evaluator_tokenizer,
                evaluator_model_id,
                device,
                torch_dtype,
                scoring,
            )

        if model is None:
            model = load_model(model_id, device, torch_dtype)  # its tokenizer is loaded above
        if self_evaluation and add_special_tokens == evaluator_add_special_tokens:
            # Same model, same tokens: the evaluator's long pass already holds the model's log-probs.
            model_scores = [ModelScores(s.input_ids, s.offsets, s.lp_long) for s in evaluator_scores]
        else:
            model_scores = score_with_model(
                model,
                tokenizer,
                texts,
                max_tokens_per_batch,
                add_special_tokens=add_special_tokens,
                progress=progress,
                torch_compile=torch_compile,
                progress_callback=progress_callback,
                encoded=model_encoded,
            )

        weights = text_key_weights(texts, evaluator_scores, model_scores, alpha, beta, use_lcl, soft, gamma)
        results = document_results(model_scores, weights)
        self._warn_without_key_tokens(evaluator_scores, results, trunc_len)
        output = summarize_results(results, aggregation, soft)
        if return_key_spans:  # the tokens document_result counts: key and predicted
            output["key_spans"] = [
                key_char_spans(ms.offsets, (w > 0) & ~np.isnan(ms.lp)).tolist() for ms, w in zip(model_scores, weights)
            ]
        return output

    @staticmethod
    def _warn_without_key_tokens(evaluator_scores, results, trunc_len: int) -> None:
        # stacklevel 5 = the user's compute() call (through our compute, evaluate's, and _compute).
        too_short = [i for i, s in enumerate(evaluator_scores) if s.input_ids.shape[0] <= trunc_len]
        if too_short:
            warnings.warn(
                f"Texts {too_short} have at most trunc_len={trunc_len} evaluator tokens, so no token has a "
                "short context to compare with: their LongPPL is NaN. Use longer texts or a smaller trunc_len.",
                stacklevel=5,
            )
        no_keys = [i for i, r in enumerate(results) if r.n_key_tokens == 0 and i not in too_short]
        if no_keys:
            warnings.warn(f"Texts {no_keys} have no key tokens: their LongPPL is NaN.", stacklevel=5)
        if all(r.n_key_tokens == 0 for r in results):
            warnings.warn("No text has key tokens: the corpus LongPPL is NaN.", stacklevel=5)
