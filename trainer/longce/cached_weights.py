"""LongCE weights from an evaluator's key-token cache (``LongCEConfig(longce_weights="cache")``).

The paper's LongCE weighs each token by the trained model's own ``min(exp(LSD), gamma)``, which
costs a short-context pass per step. With a frozen evaluator that scored the corpus once into the
key-token cache (``scripts/compute_key_tokens.py``, ``longppl.cache.key_token_cache``), the weights are
fixed per token and can live in the dataset:

- :func:`add_key_token_weights` tokenizes each text for the trained model and adds a
  ``longce_weights`` column, one float per token of ``input_ids``: the evaluator's
  ``min(exp(LSD), gamma)`` (``min(1, gamma)`` where the evaluator has no short score), carried to the trained
  model's tokens by the character-level average of the soft LongPPL variant
  (``longppl.core.scoring.model_key_weights``, ``longppl.rules.alignment.transfer_token_weights``), or taken
  token for token where the trained model's tokens are the evaluator's;
- :class:`LongCEWeightsCollator` wraps any collator that pads rows or packs them
  (``DataCollatorWithFlattening``, which drops unknown keys) and returns the weights as a
  ``[B, T]`` float32 tensor aligned with the batch's ``input_ids`` (1 at padding);
- ``LongCETrainer`` then takes ``w`` from the batch instead of a short-context pass: position
  ``t`` predicts token ``t + 1`` and gets its weight ``longce_weights[:, t + 1]``, exactly as it
  gets ``lp_short[:, t + 1]`` with self-scored weights.

Index convention: ``longce_weights[k]`` is the weight of predicting token ``k`` of the row (as
``lp[k] = log P(x_k | x_<k)``); ``longce_weights[0]`` is never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from longppl.cache.key_token_cache import KeyTokenCache, cached_evaluator_scores
from longppl.core.scoring import model_key_weights, score_with_evaluator
from longppl.models.fingerprints import ModelIdentity, tokenizer_fingerprint
from longppl.rules.alignment import encode_many_with_offsets, encode_with_offsets
from longppl.rules.key_tokens import unscored_weight
from longppl.settings import KeyTokenRule, KeyTokenSettings, require_int, settings_object

# The dataset column (and batch key) holding the per-token weights, defined in config beside the
# weights setting (``weight_sources.CachedWeights`` reads it; this module imports nothing of weight_sources).
from .config import WEIGHTS_COLUMN

#: The rule that carries the evaluator's weights to the trained model's tokens (part of the map's fingerprint).
_TRANSFER = (
    "same tokens keep their weights, else the mean over characters of the covering tokens' mean; "
    "a token without a short score or without characters weighs min(1, gamma)"
)
_HOW_TO_BUILD = "Build it with longce.add_key_token_weights(dataset, key_tokens=..., tokenizer=...)"


def _preview(text: str, width: int = 40) -> str:
    return repr(text[:width] + ("…" if len(text) > width else ""))


def _cache_rows(
    cache: KeyTokenCache,
    texts: list[str],
    evaluator: str | None,
    evaluator_model,
    evaluator_tokenizer,
    trunc_len: int | None,
    sliding_window: int | None,
) -> tuple[list[int], str]:
    """The cache row of every text and the evaluator's fingerprint; with ``evaluator_model``, texts
    the cache lacks are scored, added and saved first (as the metric's cache path does)."""
    if evaluator_model is None:
        settings, fingerprint, _ = cache.select(evaluator, trunc_len=trunc_len, sliding_window=sliding_window)
    else:
        if evaluator_tokenizer is None:
            raise ValueError("evaluator_model is given, so pass its tokenizer too (evaluator_tokenizer).")
        identity = ModelIdentity.of_model(evaluator_model, evaluator_tokenizer)
        # Each of K and d left unset takes its own default.
        settings = settings_object(KeyTokenSettings, None, trunc_len=trunc_len, sliding_window=sliding_window)
        fingerprint = identity.fingerprint

        def score_missing(missing: list[str]):
            return identity, score_with_evaluator(
                evaluator_model, evaluator_tokenizer, missing, settings=settings, per_document=True, progress=False
            )

    rows = cache.find(texts, settings, fingerprint)
    missing = [index for index, row in enumerate(rows) if row is None]
    if missing and evaluator_model is not None:
        cached_evaluator_scores(cache, [texts[i] for i in missing], settings, identity, score_missing)
        rows = cache.find(texts, settings, fingerprint)
    elif missing:
        shown = ", ".join(f"{i} ({_preview(texts[i])})" for i in missing[:5]) + (", …" if len(missing) > 5 else "")
        raise ValueError(
            f"The key-token cache has no rows for {len(missing)} of {len(texts)} texts of the dataset (rows "
            f"{shown}) from evaluator {fingerprint[:22]}… with {settings.describe()}. Score them into the cache "
            "first (scripts/compute_key_tokens.py), pass evaluator_model and evaluator_tokenizer to score and "
            "add them here, or drop those rows. If the cache was built with --max-length, train on its own "
            "texts (its 'text' column): a text cut otherwise is another text."
        )
    return rows, f"{fingerprint}|{settings.describe()}"


def _check_evaluator_tokens(score, text: str, index: int, tokenizer, add_special_tokens: bool) -> None:
    """Refuse a cached row whose tokens are not ``tokenizer``'s: a cache of another evaluator's tokenizer."""
    ids, _ = encode_with_offsets(tokenizer, text, add_special_tokens)
    if not np.array_equal(ids, score.input_ids):
        raise ValueError(
            f"The key-token cache's row for dataset row {index} ({_preview(text)}) holds {score.input_ids.shape[0]} "
            f"evaluator tokens that are not those of evaluator_tokenizer ({type(tokenizer).__name__}, "
            f"{ids.shape[0]} tokens): the cache was scored by an evaluator with another tokenizer. Pass that "
            "evaluator's own tokenizer, or rebuild the cache with this evaluator."
        )


def add_key_token_weights(
    dataset,
    key_tokens,
    tokenizer,
    gamma: float | None = None,
    text_column: str = "text",
    max_length: int | None = None,
    *,
    add_special_tokens: bool = True,
    append_eos: bool = False,
    evaluator: str | None = None,
    evaluator_model=None,
    evaluator_tokenizer=None,
    trunc_len: int | None = None,
    sliding_window: int | None = None,
    batch_size: int = 1000,
    rule: KeyTokenRule | None = None,
):
    """``dataset`` with ``input_ids`` (the trained model's tokens of each text) and ``longce_weights``.

    ``longce_weights[k]`` (float32, one per token of ``input_ids``) is the evaluator's soft weight
    ``min(exp(LSD), gamma)`` carried to token ``k`` by the character-level average (``min(1, gamma)``,
    ``longppl.rules.key_tokens.unscored_weight``, where the evaluator has no short score, and for tokens
    without characters: special tokens, the EOS); where
    ``tokenizer`` gives the evaluator's tokens (a BOS only one side adds aside), token ``k`` keeps its
    evaluator weight exactly.

    Args:
        dataset: a ``datasets.Dataset`` with a string column ``text_column``; other columns are kept
            (an existing ``input_ids`` is replaced).
        key_tokens: the key-token cache: a directory, a ``datasets.Dataset`` or a ``KeyTokenCache``.
        tokenizer: the trained model's tokenizer.
        gamma: cap of the weights, > 0 (default: the paper's 5); or give ``rule`` instead.
        max_length: keep each row's first ``max_length`` tokens (and their weights).
        add_special_tokens: tokenize with the tokenizer's special tokens (a BOS), as training does.
        append_eos: append the EOS token (weight ``min(1, gamma)``: no evaluator scored it) to every row, as
            ``scripts/train_longce.py`` does.
        evaluator: with several evaluators or settings in the cache, the one to use (its name, its
            folder name or the start of its fingerprint, as ``KeyTokenCache.select``; ``trunc_len`` / ``sliding_window`` narrow the settings).
        evaluator_model, evaluator_tokenizer: the evaluator itself: rows must then be its own (its
            fingerprint covers its weights and tokenizer), and texts the cache lacks are scored with
            ``trunc_len`` and ``sliding_window`` (default K=4096, d=1024), added and saved, as the
            metric does (each of ``trunc_len`` and ``sliding_window`` left out takes its own default).
            ``evaluator_tokenizer`` alone checks that the cached rows are its tokens.
        rule: the soft ``KeyTokenRule`` whose ``min(exp(LSD), gamma)`` the weights are, whole (e.g.
            ``LongCEConfig.longce_rule``), instead of ``gamma``; a hard rule is refused.
    Raises:
        ValueError: texts missing from the cache (named, without an evaluator model), an evaluator
            tokenizer that did not produce the cache's rows, a bad ``gamma`` or ``max_length``, both
            ``gamma`` and ``rule`` or a rule that is not soft, a
            missing or non-string text column.
    """
    # the rule whole, or built from gamma (the shared check of gamma, once): the rows take the rule
    rule = settings_object(KeyTokenRule, rule, gamma=gamma, soft=True if rule is None else None)
    if not rule.soft:
        raise ValueError(
            f"rule={rule!r} is the hard rule; LongCE weights are the soft rule's min(exp(LSD), gamma): pass "
            "KeyTokenRule(soft=True, gamma=...) (LongCEConfig.longce_rule)."
        )
    gamma = rule.gamma
    if max_length is not None:
        require_int("max_length", max_length, minimum=2)  # one token predicts nothing
    if text_column not in dataset.column_names:
        raise ValueError(
            f"The dataset has no text column {text_column!r} (its columns: {dataset.column_names}); pass text_column."
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    if append_eos and eos is None:
        raise ValueError(f"append_eos=True, but {type(tokenizer).__name__} has no EOS token.")
    texts = dataset[text_column]
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"Row {index} has {text!r} in text column {text_column!r}; every text must be a string.")
    cache = KeyTokenCache.load(key_tokens, create=evaluator_model is not None)
    rows, evaluator_key = _cache_rows(
        cache, texts, evaluator, evaluator_model, evaluator_tokenizer, trunc_len, sliding_window
    )
    check_tokens = evaluator_tokenizer is not None and evaluator_model is None  # a model's fingerprint covers them
    add_evaluator_bos = cache.row(rows[0])["add_special_tokens"] if rows else True

    def weigh(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], WEIGHTS_COLUMN: []}
        texts = batch[text_column]
        # the batch's texts in one tokenizer call; the columns as numpy arrays, which datasets turns
        # into Arrow lists without a Python object per token (int64 ids, float64 weights: the types
        # that Python ints and floats gave).
        for index, text, (ids, offsets) in zip(
            indices, texts, encode_many_with_offsets(tokenizer, texts, add_special_tokens)
        ):
            score = cache.scores(rows[index])  # one row at a time: a corpus's scores never all sit in memory
            if check_tokens:
                _check_evaluator_tokens(score, text, index, evaluator_tokenizer, add_evaluator_bos)
            weights = model_key_weights(score, offsets, len(text), rule, model_ids=ids).astype(np.float32)
            if append_eos:
                ids, weights = np.append(ids, eos), np.append(weights, np.float32(unscored_weight(gamma)))
            out["input_ids"].append(np.ascontiguousarray(ids[:max_length], dtype=np.int64))
            out[WEIGHTS_COLUMN].append(weights[:max_length].astype(np.float64))
        return out

    # datasets would hash the closure (the cache, the tokenizer) to fingerprint this step: name its inputs instead.
    # _TRANSFER names how weights move between tokenizers: datasets' cache files of an older rule are not reused.
    inputs = [
        getattr(dataset, "_fingerprint", ""),
        evaluator_key,
        tokenizer_fingerprint(tokenizer),
        text_column,
        _TRANSFER,
    ]
    inputs += [repr(value) for value in (gamma, max_length, add_special_tokens, append_eos, check_tokens)]
    fingerprint = hashlib.sha256("\0".join(map(str, inputs)).encode()).hexdigest()
    return dataset.map(
        weigh,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        new_fingerprint=fingerprint,
        desc="LongCE weights",
    )


def check_weights_dataset(dataset, where: str) -> None:
    """Raise ``ValueError`` when a ``datasets.Dataset`` lacks the ``longce_weights`` column or holds a
    weight that is NaN, infinite or negative (naming the row; a map-style ``datasets.Dataset`` only).
    Other datasets, e.g. iterable (streamed) ones, which cannot be read ahead, are checked batch by
    batch in training (the collator, then the trainer at the next log)."""
    import datasets

    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list):
        return
    if WEIGHTS_COLUMN not in names:
        raise ValueError(
            f"longce_weights='cache' takes the token weights from the dataset's {WEIGHTS_COLUMN!r} column, but the "
            f"{where} has none (columns: {names}). {_HOW_TO_BUILD}, or use longce_weights='self'."
        )
    bad = _first_bad_weight(dataset) if isinstance(dataset, datasets.Dataset) else None
    if bad is not None:
        row, token, value = bad
        raise ValueError(
            f"Row {row} of the {where} has {value} in its {WEIGHTS_COLUMN!r} column (token {token}); every weight must "
            "be a finite number >= 0, or training would apply it to the model. Rebuild the column "
            "(longce.add_key_token_weights gives weights in [0, gamma]), or fix or drop that row."
        )


def _first_bad_weight(dataset, rows_per_read: int = 1000) -> tuple[int, int, float] | None:
    """``(row, token, value)`` of the first NaN, infinite or negative weight of a ``datasets.Dataset``'s
    ``longce_weights`` column, or ``None``.

    Read as Arrow ``rows_per_read`` rows at a time (the dataset's own row order, selections and
    shuffles included) and tested as one flat numpy array per read: once, when the trainer is
    built, instead of a check (and a host sync) per step. A column that is not a list of numbers
    is left to the collator, which names the example.
    """
    import pyarrow as pa

    column = dataset.select_columns([WEIGHTS_COLUMN]).with_format("arrow")
    first = 0
    for table in column.iter(batch_size=rows_per_read):
        lists = table.column(0).combine_chunks()
        if not (pa.types.is_list(lists.type) or pa.types.is_large_list(lists.type)):
            return None
        if not (pa.types.is_floating(lists.type.value_type) or pa.types.is_integer(lists.type.value_type)):
            return None
        values = lists.flatten().to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become NaN
        bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))
        if bad.size:
            starts = lists.offsets.to_numpy() - lists.offsets[0].as_py()  # where each row's values begin
            row = int(np.searchsorted(starts, bad[0], side="right")) - 1
            return first + row, int(bad[0] - starts[row]), float(values[bad[0]])
        first += len(table)
    return None


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


class LongCEWeightsCollator:
    """A collator that keeps ``longce_weights`` aligned with the tokens of the batch it wraps.

    The wrapped collator (``DataCollatorWithFlattening``, ``DataCollatorForLanguageModeling``,
    ``default_data_collator``, ...) gets the features without the weights; the weights are then
    placed where each row's ``input_ids`` ended up: concatenated for a packed ``[1, sum n]`` batch,
    in the row's tokens (left or right of its padding) for a padded ``[B, T]`` one; 1 elsewhere
    (padding, never a target). A collator that cuts or reorders tokens is refused with an error.

    ``collator=None`` wraps ``DataCollatorWithFlattening()``. Returns the wrapped collator's batch
    plus ``longce_weights``: ``[B, T]`` float32.
    """

    def __init__(self, collator: Callable[[list], Mapping[str, Any]] | None = None):
        if collator is None:
            from transformers import DataCollatorWithFlattening

            collator = DataCollatorWithFlattening()
        self.collator = collator

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        rows, weights, stripped = [], [], []
        for index, feature in enumerate(features):
            if WEIGHTS_COLUMN not in feature:
                raise ValueError(
                    f"Example {index} of the batch has no {WEIGHTS_COLUMN!r} (keys: {sorted(feature)}). {_HOW_TO_BUILD}, "
                    "and keep the column (LongCETrainer keeps it from remove_unused_columns)."
                )
            ids = _as_list(feature["input_ids"])
            values = torch.as_tensor(_as_list(feature[WEIGHTS_COLUMN]), dtype=torch.float32)
            if values.ndim != 1 or values.shape[0] != len(ids):
                raise ValueError(
                    f"Example {index} has {tuple(values.shape)} {WEIGHTS_COLUMN} for {len(ids)} input_ids: the column "
                    "needs one weight per token. Cut or split input_ids and longce_weights together (the same slices)."
                )
            if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
                raise ValueError(
                    f"Example {index} has {WEIGHTS_COLUMN} that are negative, NaN or infinite; every weight must be a "
                    f"finite number >= 0. {_HOW_TO_BUILD} (its weights lie in [0, gamma]), or fix that example."
                )
            rows.append(torch.as_tensor(ids, dtype=torch.long))
            weights.append(values)
            # A copy without the weights: the wrapped collator may not know the key, the caller's dict stays whole.
            stripped.append({key: value for key, value in feature.items() if key != WEIGHTS_COLUMN})
        batch = dict(self.collator(stripped))
        batch[WEIGHTS_COLUMN] = place_weights(torch.as_tensor(batch["input_ids"]), rows, weights)
        return batch


def place_weights(batch_ids: torch.Tensor, rows: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` float32 weights for the collated ``batch_ids`` ``[B, T]`` of ``rows`` (each ``[n_r]``).

    Packed (``B = 1``, ``T = sum n_r``, rows concatenated in order, empty rows dropped): the weights
    are concatenated. Padded (``B`` = number of rows): row ``r``'s weights go where its tokens are,
    at the start or the end of line ``r``. Anything else raises ``ValueError``.
    """
    kept = [r for r in range(len(rows)) if rows[r].numel() > 0]
    total = sum(rows[r].numel() for r in kept)
    if batch_ids.ndim == 2 and batch_ids.shape[0] == 1 and batch_ids.shape[1] == total:
        if torch.equal(batch_ids[0], torch.cat([rows[r] for r in kept])):
            return torch.cat([weights[r] for r in kept])[None]
    placed = torch.ones(batch_ids.shape, dtype=torch.float32)
    if batch_ids.ndim == 2 and batch_ids.shape[0] == len(rows):
        length = batch_ids.shape[1]
        for r, (ids, values) in enumerate(zip(rows, weights)):
            n = ids.numel()
            if n <= length and torch.equal(batch_ids[r, :n], ids):
                placed[r, :n] = values
            elif n <= length and torch.equal(batch_ids[r, length - n :], ids):
                placed[r, length - n :] = values
            else:
                break
        else:
            return placed
    raise ValueError(
        f"The wrapped collator's input_ids {tuple(batch_ids.shape)} are neither the {len(rows)} rows packed into "
        "one line nor each row padded on its left or right: it cut or reordered tokens, so the weights cannot follow "
        "them. Cut rows before collating (add_key_token_weights(max_length=...)), or use DataCollatorWithFlattening "
        "or a padding collator."
    )
