"""The key-token cache: an evaluator's scores of a corpus, kept as a ``datasets.Dataset``.

Score a corpus once with the evaluator; evaluate any number of models against it at the cost of
one perplexity pass each. The raw log-probs are stored, so alpha, beta, the LCL condition, the
soft variant and gamma can all change without a forward pass.

:class:`KeyTokenCache` is the cache as the metric and the commands use it: its rows looked up by
key (text, evaluator, settings), selected by evaluator and settings, added to and saved;
:func:`open_cache` opens one from a folder or the Hub, and :func:`cached_evaluator_scores` is the
metric's use of it (the rows it has, the missing ones scored and added). The rest of the cache's
room, whose public names are importable from here as well:

- ``schema``: what a row is (``CACHE_FEATURES``, ``FORMAT_VERSION``, :func:`key_token_rows`,
  :func:`check_cache_dataset`), with the reference table of the columns;
- ``storage``: the directory on disk and its guarantees (atomic swaps, concurrent writers, the
  lock): :func:`cache_directory`, :func:`append_rows`, :func:`compact_cache`, :func:`repair_cache`;
- ``integrity``: checksums and :class:`CacheDamagedError` (``CHECKSUM_FILE``, :func:`verify_checksums`);
- ``shards``: the immutable shards and their record in ``state.json``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow.compute as pc

from ..atomic_files import directory_lock, recover_directory, swap_interrupted
from ..models.fingerprints import ModelIdentity, text_fingerprint
from ..settings import KeyTokenSettings
from .integrity import CHECKSUM_FILE, CacheDamagedError, verify_checksums
from .schema import (
    _ARRAY_COLUMNS,
    _EVALUATOR_COLUMNS,
    _HOW_TO_BUILD,
    _KEY_COLUMNS,
    _SETTING_COLUMNS,
    CACHE_FEATURES,
    FORMAT_VERSION,
    _check_row,
    check_cache_dataset,
    empty_rows,
    key_token_rows,
    rows_by_key,
)
from .storage import (
    _datasets_progress,
    _prepare_swap,
    _read_directory,
    _swap_in,
    append_rows,
    cache_directory,
    compact_cache,
    repair_cache,
    write_failed,
)

if TYPE_CHECKING:  # scoring imports torch; scripts' --help reads this module's options without it
    from ..core.scoring import EvaluatorScores

#: The public names of the cache's room, importable from here as they were before it had several modules.
__all__ = [
    "CACHE_FEATURES",
    "CHECKSUM_FILE",
    "FORMAT_VERSION",
    "CacheDamagedError",
    "KeyTokenCache",
    "KeyTokenSettings",
    "append_rows",
    "cache_directory",
    "cached_evaluator_scores",
    "check_cache_dataset",
    "compact_cache",
    "key_token_rows",
    "open_cache",
    "repair_cache",
    "verify_checksums",
    "write_failed",
]


def _same_name(name: str, names: Sequence[str]) -> bool:
    """``name`` is one of ``names``, or the same path spelled otherwise (relative or absolute)."""
    return name in names or os.path.abspath(name) in {os.path.abspath(n) for n in names if n}


def _last_component(name: str) -> str:
    return os.path.basename(os.path.normpath(name)) if name else ""


def _evaluator_candidates(query: str, configurations: Sequence[dict]) -> list[dict]:
    """The configurations whose evaluator ``query`` names, by the first of these forms that matches any:
    a stored name (or the same path spelled otherwise), a stored name's last path component (the
    evaluator's folder name, ``Llama-3.1-8B`` of ``meta-llama/Llama-3.1-8B``), or the start of the
    fingerprint, with or without its ``checkpoint:`` / ``weights:`` kind (as :meth:`KeyTokenCache.describe`
    shows it). The forms are tried in this order so that a full name is never ambiguous with a
    folder of the same name elsewhere."""
    query = query.strip()
    short = _last_component(query)
    forms = (
        lambda c: _same_name(query, c["evaluator_names"]),
        lambda c: bool(short) and short in {_last_component(n) for n in c["evaluator_names"]},
        lambda c: (
            c["evaluator_fingerprint"].startswith(query)
            or c["evaluator_fingerprint"].partition(":")[2].startswith(query)
        ),
    )
    for matches in forms:
        found = [c for c in configurations if matches(c)]
        if found:
            return found
    return []


def _evaluator_label(configuration: dict) -> str:
    """How a message names an evaluator so that ``--evaluator`` takes it back: its stored name and the
    start of its fingerprint, then its dtype (one checkpoint's bf16 and fp8 rows share the name)."""
    names = " = ".join(n or "(unnamed)" for n in configuration["evaluator_names"])
    fingerprint = configuration["evaluator_fingerprint"].partition(":")[2][:12]
    return f"{names} [{fingerprint}] in {configuration['evaluator_dtype']}"


class KeyTokenCache:
    """A key-token cache: a ``datasets.Dataset`` of rows (schema above), optionally tied to a directory.

    Args:
        dataset: the rows; ``None`` for an empty cache.
        path: the directory :meth:`save` writes to by default.
    """

    def __init__(self, dataset: datasets.Dataset | None = None, path: str | None = None):
        if dataset is None:
            dataset = empty_rows()
        self._dataset = check_cache_dataset(dataset, repr(path) if path else "the dataset given")
        self.path = path
        self._index: dict[tuple, int] | None = None
        self._arrays = None
        self._pending: list[datasets.Dataset] = []  # rows added since loaded from / saved to ``path``

    @classmethod
    def load(cls, source, create: bool = False) -> "KeyTokenCache":
        """Open a cache from a directory (``save_to_disk``), a ``Dataset``, or a ``KeyTokenCache``.

        Args:
            create: a directory that does not exist yet gives an empty cache that saves there;
                otherwise it is an error.
        """
        if isinstance(source, KeyTokenCache):
            return source
        if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
            return cls(source)
        path = cache_directory(source, create=create)  # a link resolved to its target, once
        if swap_interrupted(path):  # a writer is swapping (wait for it) or died swapping (undo it)
            with directory_lock(path, optional=True):
                recover_directory(path)
        with directory_lock(path, shared=True, optional=True):
            if not os.path.exists(path) or (create and not os.listdir(path)):
                if create:
                    return cls(None, path)
                raise FileNotFoundError(
                    f"No key-token cache at {os.fspath(source)!r} (for one on the Hub, pass "
                    f"datasets.load_dataset({os.fspath(source)!r}, split='train')). {_HOW_TO_BUILD}"
                )
            return cls(_read_directory(path), path)

    def __repr__(self) -> str:
        where = f"{self.path!r}" if self.path is not None else "in memory"
        return f"KeyTokenCache({where}, {len(self)} rows: {self.describe()})"

    @property
    def dataset(self) -> datasets.Dataset:
        """The rows as a ``datasets.Dataset`` (e.g. for ``push_to_hub``)."""
        return self._dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def _key_table(self) -> dict[str, list]:
        return self._dataset.select_columns(list(dict.fromkeys(_KEY_COLUMNS + _EVALUATOR_COLUMNS))).to_dict()

    def configurations(self) -> list[dict]:
        """Distinct (evaluator, settings) combinations with their row counts, most rows first.

        An evaluator is its fingerprint (its content), not its name: rows of one evaluator given
        under several names (``models/ev1`` and its absolute path) form one combination, whose
        ``evaluator_name`` is its most frequent name and ``evaluator_names`` all of them (most
        rows first). ``evaluator_revision`` and ``evaluator_dtype`` are part of the fingerprint.
        """
        keys = self._key_table()
        identity = ("evaluator_fingerprint",) + _SETTING_COLUMNS
        groups: dict[tuple, dict] = {}
        for row in zip(*(keys[name] for name in _EVALUATOR_COLUMNS + _SETTING_COLUMNS)):
            values = dict(zip(_EVALUATOR_COLUMNS + _SETTING_COLUMNS, row))
            group = groups.setdefault(tuple(values[name] for name in identity), dict(values, rows=0, names={}))
            group["rows"] += 1
            group["names"][values["evaluator_name"]] = group["names"].get(values["evaluator_name"], 0) + 1
        configurations = []
        for group in sorted(groups.values(), key=lambda g: -g["rows"]):
            names = [name for name, _ in sorted(group.pop("names").items(), key=lambda kv: -kv[1])]
            configurations.append(dict(group, evaluator_name=names[0], evaluator_names=names))
        return configurations

    def describe(self) -> str:
        """One line per configuration, for error messages."""
        if len(self) == 0:
            return "it is empty"
        lines = [
            f"{c['rows']} rows from evaluator {' = '.join(n or '(unnamed)' for n in c['evaluator_names'])} "
            f"[{c['evaluator_fingerprint'][:22]}…, {c['evaluator_dtype']}] with "
            + KeyTokenSettings(*(c[name] for name in _SETTING_COLUMNS)).describe()
            for c in self.configurations()
        ]
        return "it holds " + "; ".join(lines)

    def select(self, evaluator: str | None = None, **settings) -> tuple[KeyTokenSettings, str, list[int]]:
        """The one (evaluator, settings) configuration that matches the filters, and its rows.

        Args:
            evaluator: an evaluator's stored name, its last path component (folder name) or the start
                of its fingerprint, with or without ``checkpoint:``; ``None`` matches any.
            settings: ``trunc_len``, ``sliding_window``, ``add_special_tokens``, ``window_bos``
                (``None`` or absent matches any).
        Returns:
            ``(settings, evaluator_fingerprint, rows)`` with the rows in cache order.
        Raises:
            ValueError: no configuration or several match (the message lists them).
        """
        unknown = set(settings) - set(_SETTING_COLUMNS)
        if unknown:
            raise TypeError(f"select() got unknown settings {sorted(unknown)}; use {list(_SETTING_COLUMNS)}.")
        matching = [
            c
            for c in self.configurations()
            if all(value is None or c[name] == value for name, value in settings.items())
        ]
        if evaluator is not None:
            matching = _evaluator_candidates(evaluator, matching)
        if len(matching) != 1:
            asked = ", ".join(f"{k}={v}" for k, v in dict(evaluator=evaluator, **settings).items() if v is not None)
            listed = matching or self.configurations()
            candidates = "; ".join(
                f"{_evaluator_label(c)} with " + KeyTokenSettings(*(c[name] for name in _SETTING_COLUMNS)).describe()
                for c in listed
            )
            raise ValueError(
                f"{len(matching)} evaluator/settings combinations of the key-token cache match "
                f"({asked or 'no filter'}); {'candidates' if matching else 'it holds'}: {candidates or 'nothing'}. "
                "Choose one with the evaluator (its name, folder name or fingerprint start, as in [...]) and the "
                "settings options (K, d)."
            )
        chosen = matching[0]
        fingerprint = chosen["evaluator_fingerprint"]
        chosen_settings = KeyTokenSettings(*(chosen[name] for name in _SETTING_COLUMNS))
        wanted = tuple(asdict(chosen_settings).values())
        rows = sorted(
            row for (_, fp, *rest), row in self._rows_by_key().items() if fp == fingerprint and tuple(rest) == wanted
        )
        return chosen_settings, fingerprint, rows

    def texts(self, rows: Sequence[int]) -> list[str]:
        """The stored texts of ``rows``."""
        return self._dataset.select_columns(["text"])[list(rows)]["text"]

    def _rows_by_key(self) -> dict[tuple, int]:
        if self._index is None:
            self._index = rows_by_key(self._dataset)
        return self._index

    def find(
        self, texts: Sequence[str], settings: KeyTokenSettings, evaluator_fingerprint: str | None = None
    ) -> list[int | None]:
        """Row of each text under ``settings`` and the given evaluator, or ``None`` where there is none.

        Args:
            evaluator_fingerprint: ``None`` accepts any evaluator, provided the rows found all come
                from one evaluator (several would be ambiguous: a ValueError names them).
        """
        index = self._rows_by_key()
        wanted = tuple(asdict(settings).values())
        fingerprints = [text_fingerprint(t) for t in texts]
        if evaluator_fingerprint is not None:
            return [index.get((fp, evaluator_fingerprint) + wanted) for fp in fingerprints]
        by_text: dict[str, dict[str, int]] = {}
        for (fp, evaluator, *setting), row in index.items():
            if tuple(setting) == wanted:
                by_text.setdefault(fp, {})[evaluator] = row
        found = [by_text.get(fp, {}) for fp in fingerprints]
        evaluators = sorted({evaluator for rows in found for evaluator in rows})
        if len(evaluators) > 1:
            raise ValueError(
                f"The key-token cache holds rows of {len(evaluators)} evaluators for these texts with "
                f"{settings.describe()} ({self.describe()}); pass the evaluator to use (evaluator_model_id or "
                "evaluator_model) or a cache filtered to one evaluator (dataset.filter(...))."
            )
        return [rows.get(evaluators[0]) if rows else None for rows in found]

    def scores(self, row: int) -> EvaluatorScores:
        """The stored evaluator scores of one row (arrays as in ``EvaluatorScores``)."""
        if self._arrays is None:
            self._arrays = self._dataset.select_columns(["text", *_ARRAY_COLUMNS]).with_format("arrow")
        table = self._arrays[row]

        def values(name: str) -> np.ndarray:
            return table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)

        offsets = table.column("offsets").combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
        from ..core.scoring import EvaluatorScores

        scores = EvaluatorScores(
            values("input_ids").astype(np.int64),
            offsets.astype(np.int64).reshape(-1, 2),
            values("lp_long"),
            values("lp_short"),
        )
        # the text's length in characters from Arrow (no Python copy of a long text on this path)
        _check_row(row, pc.utf8_length(table.column("text")).to_pylist()[0], scores)
        return scores

    def row(self, row: int) -> dict:
        """The scalar columns of one row (text, fingerprints, evaluator, settings), without the arrays."""
        scalar = [name for name in CACHE_FEATURES if name not in _ARRAY_COLUMNS]
        return self._dataset.select_columns(scalar)[row]

    def _drop_duplicates(self) -> None:
        """Keep the first row of each key: shards committed by two runs that scored the same
        document at once hold it twice (the same values: rows are scored document by document)."""
        first = self._rows_by_key()
        if len(first) < len(self._dataset):
            self._dataset = self._dataset.select(sorted(first.values()))
            self._index = self._arrays = None

    def add(self, rows: datasets.Dataset) -> None:
        """Add rows (from :func:`key_token_rows`); a row whose key is already cached replaces the old one."""
        check_cache_dataset(rows, "the rows to add")
        new_keys = rows_by_key(rows)
        if len(new_keys) < len(rows):  # the same document twice: keep its first row
            rows = rows.select(sorted(new_keys.values()))
        replaced = {row for key, row in self._rows_by_key().items() if key in new_keys}
        kept = self._dataset
        if replaced:
            kept = kept.select([row for row in range(len(kept)) if row not in replaced])
        self._dataset = datasets.concatenate_datasets([kept, rows]) if len(kept) else rows
        self._index = self._arrays = None
        self._pending.append(rows)

    def save(self, path: str | None = None, progress: bool = False) -> str:
        """Write the cache to ``path`` (default: where it was loaded from) atomically; return the path.

        Saving to the directory the cache was loaded from (or last saved to) merges: under the
        cache's lock, the rows on disk now (other writers' included) are re-read and the rows
        :meth:`add`-ed here since are added to them, so that concurrent writers lose nothing.
        Saving to another directory replaces its content with this cache's rows. Afterwards the
        cache holds what is on disk (memory-mapped from there).
        """
        path = path if path is not None else self.path
        if path is None:
            raise ValueError("This cache was not loaded from a directory; pass the path to save it to.")
        path = cache_directory(path, argument="path", create=True)
        merge = self.path is not None and os.path.realpath(self.path) == path
        with _datasets_progress(progress), directory_lock(path):
            exists = _prepare_swap(path)
            dataset = self._dataset
            if merge and exists:
                current = KeyTokenCache(_read_directory(path), path)
                current._drop_duplicates()
                for rows in self._pending:
                    current.add(rows)
                dataset = current._dataset
            self._dataset = _swap_in(path, dataset, exists)
        self.path = path
        self._index = self._arrays = None
        self._pending = []
        return path


def open_cache(source: str, split: str = "train", argument: str = "key_tokens") -> KeyTokenCache:
    """A cache from a local directory or, if no such path exists, from the Hub
    (``datasets.load_dataset(source, split=split)``, e.g. a cache shared with ``push_to_hub``).

    Which of the two is decided by ``sources.locate_cache``: a missing local path, or a
    Hub id while offline or the Hub unreachable, fails at once with one line naming ``argument``.
    """
    from ..models.sources import locate_cache

    location = locate_cache(source, argument)
    if location.local:
        return KeyTokenCache.load(location.path)
    return KeyTokenCache.load(datasets.load_dataset(source, split=split))


def cached_evaluator_scores(
    cache: KeyTokenCache,
    texts: Sequence[str],
    settings: KeyTokenSettings,
    evaluator: ModelIdentity | None,
    score_missing: Callable[[list[str]], tuple[ModelIdentity, list[EvaluatorScores]]] | None,
    save: bool = True,
) -> list[EvaluatorScores]:
    """Evaluator scores of ``texts`` from ``cache``, scoring (and caching) only the missing ones.

    Args:
        evaluator: identity of the evaluator rows must come from; ``None`` accepts the cache's
            (one) evaluator.
        score_missing: ``texts -> (identity, scores)`` runs the evaluator on the texts not cached
            (each distinct text once); ``None`` makes missing texts an error that lists them.
        save: write the updated cache to its directory (a cache opened from a ``Dataset`` has
            none and is updated in memory only).
    Returns:
        ``EvaluatorScores`` per text, in order.
    """
    rows = cache.find(texts, settings, evaluator.fingerprint if evaluator else None)
    missing = [i for i, row in enumerate(rows) if row is None]
    if missing and score_missing is None:
        shown = ", ".join(map(str, missing[:20])) + (", …" if len(missing) > 20 else "")
        raise ValueError(
            f"The key-token cache has no rows for {len(missing)} of {len(texts)} texts (predictions "
            f"[{shown}]) with {settings.describe()}; {cache.describe()}. Pass an evaluator "
            "(evaluator_model_id or evaluator_model) to score and add them, or the settings the cache was "
            "built with. If the cache was built with max_length, pass its own texts (its 'text' column)."
        )
    if missing:
        distinct = list(dict.fromkeys(texts[i] for i in missing))
        identity, scores = score_missing(distinct)
        cache.add(key_token_rows(distinct, scores, settings, identity))
        if save and cache.path is not None:
            cache.save()
        rows = cache.find(texts, settings, identity.fingerprint)
    return [cache.scores(row) for row in rows]
