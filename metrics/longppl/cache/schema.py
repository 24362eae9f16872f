"""What a row of the key-token cache is: its columns, how rows are built and how a dataset is
checked to be a cache's. A new column of the cache is declared here alone (``CACHE_FEATURES``, and
its values in :func:`key_token_rows`); on-disk storage (``storage``, ``integrity``) and lookup
(``key_token_cache``) take the columns from here.

The cache is a plain Arrow table of raw log-probs, so the key-token rule can change without a
forward pass (no pickled objects): ``save_to_disk`` / ``load_from_disk``, ``push_to_hub`` / ``load_dataset``.

Schema (``FORMAT_VERSION = 2``), one row per (document, evaluator, settings):

====================  ==============================  ===========================================
column                Arrow type                      meaning
====================  ==============================  ===========================================
format_version        int32                           ``FORMAT_VERSION`` of the writer
text                  string                          the text scored (after any ``max_length`` cut)
text_fingerprint      string                          SHA-256 of ``text`` (``fingerprints``)
evaluator_name        string                          Hub id or path of the evaluator ("" unknown)
evaluator_revision    string                          Hub commit of the evaluator ("" if none)
evaluator_dtype       string                          dtype it computed in, e.g. ``bfloat16``
evaluator_fingerprint string                          ``checkpoint:…`` or ``weights:…`` digest (with tokenizer)
trunc_len             int32                           K, the short-context length
sliding_window        int32                           d, the short-window stride
add_special_tokens    bool                            evaluator tokenized with its special tokens
window_bos            bool                            BOS fed at the head of each short window
input_ids             list<int32>                     ``[n]`` evaluator token ids
offsets               list<fixed_size_list<int32>[2]> ``[n, 2]`` character span of each token
lp_long               list<float32>                   ``[n]`` ``log P(x_i | x_<i)``; NaN at ``i = 0``
lp_short              list<float32>                   ``[n]`` short-context log-prob; NaN for ``i < K``
====================  ==============================  ===========================================

Index conventions are those of ``logprobs`` and ``windows`` (docs/design.md). A row is found by its
key: text fingerprint, evaluator fingerprint and the four settings ``trunc_len``,
``sliding_window``, ``add_special_tokens``, ``window_bos``; anything else never matches, so a
cache is recomputed, not reused, for another text, evaluator or setting. A cache may hold rows of
several evaluators and settings side by side. Rows are scored document by document
(``score_with_evaluator(per_document=True)``), so a row does not depend on which other documents
were scored with it, and a corpus scored on N processes gives the same cache as on one. The opt-in
``pack_documents`` (``longppl-score --pack-documents``) trades that bit-for-bit guarantee, at
float-rounding level, for fewer passes over many equal-length documents.

What makes a directory a cache of ours: exactly these columns and types, and ``format_version``
equal to ``FORMAT_VERSION`` in every row (it survives ``push_to_hub``, unlike a sidecar file).
Format 2 differs from format 1 only in what the evaluator fingerprint covers: since format 2 it
includes the evaluator's tokenizer (``fingerprints``), so that the same weights with another
tokenizer (other vocabulary, merges, normaliser, BOS setting) never reuse rows. A format-1 row
cannot tell which tokenizer produced it, so format-1 caches are refused with an error that says to
rebuild them, rather than matched (stale rows) or kept beside new rows (ambiguous lookups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa

from ..models.fingerprints import ModelIdentity, text_fingerprint
from ..settings import KeyTokenSettings

if TYPE_CHECKING:  # scoring imports torch; scripts' --help reads this module's options without it
    from ..core.scoring import EvaluatorScores

FORMAT_VERSION = 2
CACHE_FEATURES = datasets.Features(
    {
        "format_version": datasets.Value("int32"),
        "text": datasets.Value("string"),
        "text_fingerprint": datasets.Value("string"),
        "evaluator_name": datasets.Value("string"),
        "evaluator_revision": datasets.Value("string"),
        "evaluator_dtype": datasets.Value("string"),
        "evaluator_fingerprint": datasets.Value("string"),
        "trunc_len": datasets.Value("int32"),
        "sliding_window": datasets.Value("int32"),
        "add_special_tokens": datasets.Value("bool"),
        "window_bos": datasets.Value("bool"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "offsets": datasets.List(datasets.List(datasets.Value("int32"), length=2)),
        "lp_long": datasets.List(datasets.Value("float32")),
        "lp_short": datasets.List(datasets.Value("float32")),
    }
)
_SETTING_COLUMNS = ("trunc_len", "sliding_window", "add_special_tokens", "window_bos")
_KEY_COLUMNS = ("text_fingerprint", "evaluator_fingerprint") + _SETTING_COLUMNS
_EVALUATOR_COLUMNS = ("evaluator_name", "evaluator_revision", "evaluator_dtype", "evaluator_fingerprint")
_ARRAY_COLUMNS = ("input_ids", "offsets", "lp_long", "lp_short")
_DESCRIPTION = f"LongPPL key-token cache, format {FORMAT_VERSION} (see longppl.cache.key_token_cache)."
_HOW_TO_BUILD = (
    "Build one with the longppl-score command, or with the metric: "
    "compute(..., key_tokens=<new directory>, evaluator_model_id=...)."
)


def _dataset_info() -> dict:
    """``dataset_info.json`` of a cache, as ``save_to_disk`` writes it (first-level keys sorted)."""
    info = asdict(datasets.DatasetInfo(description=_DESCRIPTION, features=CACHE_FEATURES))
    return {key: info[key] for key in sorted(info)}


def _list_array(arrays: Sequence[np.ndarray], values_type: pa.DataType, width: int | None = None) -> pa.Array:
    """One Arrow list per array (``[n]`` or ``[n, width]``), built without Python loops over tokens."""
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    values = pa.array(flat.astype(values_type.to_pandas_dtype()), type=values_type)
    if width is not None:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    return pa.ListArray.from_arrays(offsets, values)


# Arrow's list and string arrays index their values with int32 offsets: rows are built in chunks
# of at most this many tokens (and text bytes), well below 2**31.
_MAX_CHUNK_ITEMS = 1 << 30


def _chunks(texts: Sequence[str], scores: Sequence[EvaluatorScores]) -> list[list[int]]:
    chunks: list[list[int]] = [[]]
    tokens = chars = 0
    for index, (text, score) in enumerate(zip(texts, scores)):
        n, c = int(score.input_ids.shape[0]), len(text.encode("utf-8"))
        if chunks[-1] and (tokens + n > _MAX_CHUNK_ITEMS or chars + c > _MAX_CHUNK_ITEMS):
            chunks.append([])
            tokens = chars = 0
        chunks[-1].append(index)
        tokens, chars = tokens + n, chars + c
    return chunks


def key_token_rows(
    texts: Sequence[str],
    scores: Sequence[EvaluatorScores],
    settings: KeyTokenSettings,
    evaluator: ModelIdentity,
) -> datasets.Dataset:
    """Cache rows (a ``Dataset`` with ``CACHE_FEATURES``) for ``scores[k]`` of ``texts[k]``."""
    if len(texts) != len(scores):
        raise ValueError(f"{len(texts)} texts but {len(scores)} evaluator scores; pass one score per text.")

    def table(rows: list[int]) -> pa.Table:
        n = len(rows)
        chunk_texts, chunk_scores = [texts[i] for i in rows], [scores[i] for i in rows]
        columns = {
            "format_version": pa.array([FORMAT_VERSION] * n, type=pa.int32()),
            "text": pa.array(chunk_texts, type=pa.string()),
            "text_fingerprint": pa.array([text_fingerprint(t) for t in chunk_texts], type=pa.string()),
            "evaluator_name": pa.array([evaluator.name] * n, type=pa.string()),
            "evaluator_revision": pa.array([evaluator.revision] * n, type=pa.string()),
            "evaluator_dtype": pa.array([evaluator.dtype] * n, type=pa.string()),
            "evaluator_fingerprint": pa.array([evaluator.fingerprint] * n, type=pa.string()),
            "trunc_len": pa.array([settings.trunc_len] * n, type=pa.int32()),
            "sliding_window": pa.array([settings.sliding_window] * n, type=pa.int32()),
            "add_special_tokens": pa.array([settings.add_special_tokens] * n, type=pa.bool_()),
            "window_bos": pa.array([settings.window_bos] * n, type=pa.bool_()),
            "input_ids": _list_array([s.input_ids for s in chunk_scores], pa.int32()),
            "offsets": _list_array([s.offsets for s in chunk_scores], pa.int32(), width=2),
            "lp_long": _list_array([s.lp_long for s in chunk_scores], pa.float32()),
            "lp_short": _list_array([s.lp_short for s in chunk_scores], pa.float32()),
        }
        return pa.Table.from_arrays(list(columns.values()), schema=CACHE_FEATURES.arrow_schema)

    rows = pa.concat_tables([table(chunk) for chunk in _chunks(texts, scores)])
    return datasets.Dataset(rows, info=datasets.DatasetInfo(description=_DESCRIPTION, features=CACHE_FEATURES))


def check_cache_dataset(dataset, where: str) -> datasets.Dataset:
    """Return ``dataset`` if it is a key-token cache of this format, else raise a ValueError saying why."""
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{where} is a DatasetDict with splits {list(dataset)}; a key-token cache is one Dataset: "
            "pass one split, e.g. load_dataset(name, split='train')."
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"{where} is a {type(dataset).__name__}; pass a path or a datasets.Dataset.")
    columns = set(dataset.column_names)
    if "format_version" not in columns or not {"lp_long", "lp_short", "offsets"} <= columns:
        raise ValueError(
            f"{where} is not a LongPPL key-token cache (its columns are {sorted(columns)}). {_HOW_TO_BUILD}"
        )
    versions = set(dataset.unique("format_version"))
    if versions - {FORMAT_VERSION}:
        raise ValueError(
            f"{where} was written in key-token cache format {sorted(versions)}, but this version of longppl "
            f"reads format {FORMAT_VERSION}. Recompute the cache with this version ({_HOW_TO_BUILD[:-1]}), or "
            "read it with the longppl version that wrote it."
        )
    wrong = [
        f"{name} ({dataset.features.get(name)!r}, expected {feature!r})"
        for name, feature in CACHE_FEATURES.items()
        if dataset.features.get(name) != feature
    ]
    extra = sorted(columns - set(CACHE_FEATURES))
    if wrong or extra:
        raise ValueError(
            f"{where} does not have the key-token cache schema: "
            + "; ".join(
                (["wrong or missing columns: " + ", ".join(wrong)] if wrong else [])
                + ([f"unexpected columns {extra} (remove them with remove_columns)"] if extra else [])
            )
        )
    return dataset


def _check_row(row: int, n_chars: int, scores: EvaluatorScores) -> None:
    """Refuse a row whose arrays disagree with each other or with its text (a crafted or hand-edited
    cache; the checksums cover bytes, not meaning): every array has one entry per token, and each
    token's span ``[start, end)`` lies within the text, ``0 <= start <= end <= n_chars``."""
    n = scores.input_ids.shape[0]
    problems = [
        f"{name} holds {len(values)} values for {n} tokens"
        for name, values in (("offsets", scores.offsets), ("lp_long", scores.lp_long), ("lp_short", scores.lp_short))
        if len(values) != n
    ]
    if not problems:
        start, end = scores.offsets[:, 0], scores.offsets[:, 1]
        bad = np.flatnonzero((start < 0) | (start > end) | (end > n_chars))
        if bad.size:
            problems.append(
                f"token {bad[0]} spans characters [{start[bad[0]]}, {end[bad[0]]}) of a text of {n_chars} "
                f"({bad.size} such tokens)"
            )
    if problems:
        raise ValueError(
            f"row {row} of the key-token cache is inconsistent: {'; '.join(problems)}. The cache was edited or "
            f"written by another tool: rebuild it ({_HOW_TO_BUILD[:-1]})."
        )


def empty_rows() -> datasets.Dataset:
    """A cache's dataset of no rows (its columns and types all there)."""
    return key_token_rows([], [], KeyTokenSettings(), ModelIdentity("", "", "", ""))


def rows_by_key(dataset: datasets.Dataset) -> dict[tuple, int]:
    """``{key: row}``: the first row of ``dataset`` (a cache's rows) for each key, the text and
    evaluator fingerprints and the settings (``_KEY_COLUMNS``); the first is the one a lookup uses."""
    keys = dataset.select_columns(list(_KEY_COLUMNS)).to_dict()
    index: dict[tuple, int] = {}
    for row, key in enumerate(zip(*(keys[name] for name in _KEY_COLUMNS))):
        index.setdefault(key, row)
    return index
