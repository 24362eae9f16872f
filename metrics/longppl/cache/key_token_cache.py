"""The key-token cache: an evaluator's scores of a corpus, kept as a ``datasets.Dataset``.

Score a corpus once with the evaluator; evaluate any number of models against it at the cost of
one perplexity pass each. The raw log-probs are stored, so alpha, beta, the LCL condition, the
soft variant and gamma can all change without a forward pass. The cache is a plain Arrow table
(no pickled objects): ``save_to_disk`` / ``load_from_disk``, ``push_to_hub`` / ``load_dataset``.

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

A cache directory holds a ``save_to_disk`` base (``data-*.arrow``), immutable shards (``shards``:
rows committed by ``longppl score`` and :func:`append_rows` as they are scored), or both; an old
single-folder cache is a base alone. Its ``state.json`` names every committed file and records
each shard (``shards``), so the directory is a ``datasets`` folder after every commit:
``datasets.load_from_disk(path)`` and :meth:`KeyTokenCache.load` give one ``Dataset`` over the same
files, memory-mapped: the base's rows, then each shard's in commit order. :func:`compact_cache`
(``longppl cache compact``) rewrites base and shards as one base; :func:`repair_cache` (``longppl
cache repair``) drops damaged shards.

Guarantees of a cache directory (written by :meth:`KeyTokenCache.save` and :func:`append_rows`):

- **Appends rewrite nothing**: :func:`append_rows` writes a new shard beside the cache, then moves
  it in and names it in ``state.json`` under the cache's lock; no other file changes, and a
  process killed at any point loses the rows of that shard only. A save to the cache's own directory (the
  metric's) merges base and shards into one new base, as compaction does.

- **Atomic swap**: a save writes a new copy beside the cache and swaps it in (``atomic_files``);
  a save killed at any point leaves the previous cache in place or recoverable on the next open.
- **Concurrent writers lose nothing**: a save holds an exclusive lock (``.<name>.lock`` beside the
  cache, ``atomic_files.directory_lock``) while it re-reads the cache on disk, merges its own new
  rows into it (a row with the same key replaces the old one) and swaps the result in. Any number
  of processes (metric calls, ``compute_key_tokens.py`` runs, or their ``accelerate`` main
  processes) may score into one cache at once: every writer's rows end up in it. The lock is held
  only for the merge and swap, never while scoring. Readers take the lock shared, so a load never
  sees a swap half done. Saving to another directory than the one a cache was loaded from
  replaces that directory's content with this cache's rows (a copy), under the same lock.
- **Checksums**: each shard's size and SHA-256 are in ``state.json``, checked at every load like the
  base's (a missing, truncated or changed shard, an unreadable ``state.json``: :class:`CacheDamagedError`;
  for a shard, ``longppl cache repair`` drops it). A save stores the size and SHA-256 of every
  file it wrote but ``state.json`` (which commits replace; it is checked against the files) in
  ``longppl_checksums.json`` inside the directory; every load verifies them before reading (a
  streaming SHA-256 per file, files in parallel: about 1 ms per MB of cache on one core). A
  truncated or emptied data file, a damaged ``state.json`` / ``dataset_info.json`` or changed
  bytes anywhere raise :class:`CacheDamagedError` (a ValueError) naming the cache and the file,
  with what to do (delete and rebuild, or restore a copy). A directory without the checksum file
  (written by plain ``Dataset.save_to_disk``) is read unverified; errors reading it are reported
  the same way. A ``Dataset`` given in memory (e.g. from the Hub) is not checked: the Hub checks
  its own files.
- **Locking scope**: ``fcntl.flock``, so POSIX only (on Windows saves are not serialised) and on a
  network file system as reliable as its ``flock``; all writers must use this version or later.
- **Leftovers**: temporary directories (``.<name>.new-…`` of a save, ``.<name>.shard-…`` of a shard
  being written) carry their owner's host and process id; the next save or shard removes those
  whose owner ran on this host and is gone, and leaves a live writer's alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.arrow_writer import ArrowWriter

from ..atomic_files import (
    cannot_create,
    directory_lock,
    recover_directory,
    replace_directory_atomically,
    swap_interrupted,
    write_file_atomically,
)
from ..models.fingerprints import ModelIdentity, file_sha256, text_fingerprint
from ..models.sources import require_path
from ..settings import KeyTokenSettings
from .shards import (
    INFO_FILE,
    MANIFEST_FILE,
    RECORD_KEY,
    SHARD_FOLDER,
    STATE_FILE,
    commit_shard,
    has_manifest,
    has_record,
    interrupted_first_commit,
    read_record,
    shard_problem,
    write_record,
    write_shard,
)

if TYPE_CHECKING:  # scoring imports torch; scripts' --help reads this module's options without it
    from ..core.scoring import EvaluatorScores

FORMAT_VERSION = 2
CHECKSUM_FILE = "longppl_checksums.json"

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


class CacheDamagedError(ValueError):
    """A key-token cache directory whose files are damaged (truncated, emptied, changed on disk)."""


def _damaged(path: str, detail: str, shard: bool = False) -> CacheDamagedError:
    """The error for a damaged cache; ``shard``: the damage is in shards only, which
    :func:`repair_cache` can drop (their documents are then scored again by the next run)."""
    repair = (
        f"Drop the damaged shards with `longppl cache repair {path}` (the other rows stay), then run the same "
        "`longppl score` command again to score their documents; or delete"
        if shard
        else "Its rows cannot be trusted: delete"
    )
    return CacheDamagedError(
        f"The key-token cache at {path!r} is damaged: {detail}. {repair} the directory and rebuild it "
        f"({_HOW_TO_BUILD[:-1]}), or restore it from a copy."
    )


def _write_checksums(folder: str) -> None:
    """Record the size and SHA-256 of every file in ``folder`` (a cache just written there) but
    ``state.json``, which each commit of a shard replaces (it is checked against the files instead)."""
    files = {
        name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": file_sha256(os.path.join(folder, name))}
        for name in sorted(os.listdir(folder))
        if name not in (CHECKSUM_FILE, STATE_FILE) and os.path.isfile(os.path.join(folder, name))
    }
    write_file_atomically(
        os.path.join(folder, CHECKSUM_FILE),
        lambda handle: json.dump({"algorithm": "sha256", "files": files}, handle, indent=1, sort_keys=True),
    )


def _checksum_names(path: str) -> list[str]:
    """The files ``longppl_checksums.json`` of ``path`` lists (read by :func:`verify_checksums` first)."""
    with open(os.path.join(path, CHECKSUM_FILE), encoding="utf-8") as handle:
        return sorted(json.load(handle)["files"])


def _stop_checksumming_state(path: str) -> None:
    """Drop ``state.json`` from the checksum file of ``path`` (written by an earlier version, which
    listed it): a commit is about to replace it. Done before the commit, so that a kill in between
    leaves a checksum file that still holds for every file it lists."""
    record = os.path.join(path, CHECKSUM_FILE)
    if not os.path.isfile(record):
        return
    with open(record, encoding="utf-8") as handle:
        checksums = json.load(handle)
    if STATE_FILE in checksums.get("files", {}):
        del checksums["files"][STATE_FILE]
        write_file_atomically(record, lambda handle: json.dump(checksums, handle, indent=1, sort_keys=True))


def verify_checksums(path: str) -> bool:
    """Check the files of the cache directory ``path`` against its ``longppl_checksums.json``.

    Returns:
        ``False`` when the directory has no checksum file (nothing to verify), ``True`` when every
        file listed there has its recorded size and SHA-256.
    Raises:
        CacheDamagedError: the checksum file is unreadable or lists no files, or a listed file is
            missing, of another size or of other content (message names the file).
    """
    record = os.path.join(path, CHECKSUM_FILE)
    if not os.path.isfile(record):
        return False
    try:
        with open(record, encoding="utf-8") as handle:
            files = json.load(handle)["files"]
        expected = {str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise _damaged(path, f"its checksum file {CHECKSUM_FILE} is unreadable ({type(err).__name__}: {err})") from err
    if not expected:  # every save lists the files it wrote; an empty list would vouch for anything
        raise _damaged(path, f"its checksum file {CHECKSUM_FILE} lists no files")
    for name, (size, _) in sorted(expected.items()):
        file = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(file):
            raise _damaged(path, f"its file {name} is missing")
        actual = os.path.getsize(file)
        if actual != size:
            raise _damaged(
                path, f"its file {name} is {actual} bytes, but {size} were written (truncated or overwritten)"
            )
    names = sorted(expected)
    # hashlib releases the GIL on large buffers: the shards of a large cache are hashed in parallel.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda name: file_sha256(os.path.join(path, name)), names))
    for name, digest in zip(names, digests):
        if digest != expected[name][1]:
            raise _damaged(
                path, f"the content of its file {name} does not match its SHA-256 checksum (changed on disk)"
            )
    return True


def _read_directory(path: str) -> datasets.Dataset:
    """The cache's dataset at ``path`` after verifying its checksums; errors name ``path``.

    The rows are the base's (the ``save_to_disk`` files, if any) and then each committed shard's
    (``shards``), every file memory-mapped: one ``Dataset`` over the files ``state.json`` names, in
    its order, the rows ``datasets.load_from_disk(path)`` gives. An empty cache (a first commit
    killed before it was committed) gives no rows.
    """
    if not _is_cache_directory(path):
        shown = sorted(os.listdir(path))
        raise ValueError(
            f"{path!r} is not a key-token cache: it is not a directory written by datasets' save_to_disk or "
            f"longppl score (it holds {', '.join(shown[:5]) + (', …' if len(shown) > 5 else '') or 'nothing'}). "
            f"{_HOW_TO_BUILD}"
        )
    checked = verify_checksums(path)  # the base's files (and an earlier version's state.json)
    try:
        record = read_record(path)
    except ValueError as err:
        raise _damaged(path, str(err)) from err
    if checked:
        listed = {name for name in _checksum_names(path) if name.endswith(".arrow")}
        if listed != set(record.base):
            raise _damaged(
                path, f"its {STATE_FILE} names the files {record.base}, but its checksum file {sorted(listed)}"
            )
    if record.state is not None and RECORD_KEY in record.state and _dataset_features(path) != CACHE_FEATURES:
        raise _damaged(path, f"its {INFO_FILE} does not declare the cache's columns")
    shards = []
    for _, shard, problem in _open_shards(path, record.shards):
        if problem is not None:
            raise _damaged(path, problem, shard=True)
        shards.append(shard)
    parts = []
    for name in record.base:
        try:  # with the file's own columns: a plain save_to_disk copy of other columns is named as such
            parts.append(datasets.Dataset.from_file(os.path.join(path, name)))
        except (OSError, ValueError, pa.ArrowException) as err:
            # a truncated or empty Arrow file of a base without checksums (a plain save_to_disk copy)
            raise _damaged(path, f"datasets could not read it ({type(err).__name__}: {err})") from err
    if len(parts) > 1:
        parts = [datasets.concatenate_datasets(parts)]
    if parts and shards:  # the base's columns are checked before it is joined to the shards'
        check_cache_dataset(parts[0], repr(path))
    parts += shards
    if not parts:
        return KeyTokenCache().dataset
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _open_shards(path: str, entries: list[dict]) -> list[tuple[dict, datasets.Dataset | None, str | None]]:
    """Each committed shard of the cache ``path``, memory-mapped after its checks, or what is wrong
    with it: ``[(entry, shard or None, problem or None)]`` in commit order. A shard is damaged when it
    is missing, of another size or SHA-256 than committed, unreadable, or of another row count."""
    problems = [shard_problem(path, entry) for entry in entries]  # sizes first (cheap), then the content
    names = [entry["file"] for entry, problem in zip(entries, problems) if problem is None]
    # hashlib releases the GIL on large buffers: shards are hashed in parallel, as the base's files.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        digests = dict(zip(names, pool.map(lambda name: file_sha256(os.path.join(path, name)), names)))
    info = datasets.DatasetInfo(description=_DESCRIPTION, features=CACHE_FEATURES)
    opened = []
    for entry, problem in zip(entries, problems):
        shard = None
        if problem is None and digests[entry["file"]] != entry["sha256"]:
            problem = f"the content of its shard {entry['file']} does not match its SHA-256 checksum (changed on disk)"
        if problem is None:
            try:
                shard = datasets.Dataset.from_file(os.path.join(path, entry["file"]), info=info)
            except (OSError, ValueError, pa.ArrowException) as err:
                problem = f"datasets could not read its shard {entry['file']} ({type(err).__name__}: {err})"
        if shard is not None and len(shard) != entry["rows"]:
            problem = f"its shard {entry['file']} holds {len(shard)} rows, but {entry['rows']} were committed"
            shard = None
        opened.append((entry, shard, problem))
    return opened


def _dataset_info() -> dict:
    """``dataset_info.json`` of a cache, as ``save_to_disk`` writes it (first-level keys sorted)."""
    info = asdict(datasets.DatasetInfo(description=_DESCRIPTION, features=CACHE_FEATURES))
    return {key: info[key] for key in sorted(info)}


def _write_directory(dataset: datasets.Dataset, folder: str) -> None:
    """Write ``dataset`` as a base in the empty ``folder``: ``save_to_disk``, its ``state.json``
    marked as a cache's with no shards yet, the checksums."""
    dataset.save_to_disk(folder)
    write_record(folder, read_record(folder), [], _dataset_info())
    _write_checksums(folder)


# What ``Dataset.save_to_disk`` writes (its Arrow shards, state and info) and what datasets adds to a
# directory it memory-maps (``cache-*.arrow`` of ``map``/``filter``): a cache's own files. Anything
# else in a cache directory was put there by someone else and survives every save.
_DATASETS_FILE = re.compile(r"(data-\d+-of-\d+|cache-[0-9a-f]+)\.arrow|state\.json|dataset_info\.json")


def _own_files(path: str) -> set[str]:
    """Names in the cache directory ``path`` that belong to the cache (``_DATASETS_FILE``, the
    checksum file, and every file it lists)."""
    own = {CHECKSUM_FILE, MANIFEST_FILE, SHARD_FOLDER}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        with open(os.path.join(path, CHECKSUM_FILE), encoding="utf-8") as handle:
            own.update(str(name) for name in json.load(handle)["files"])
    return own | {name for name in os.listdir(path) if _DATASETS_FILE.fullmatch(name)}


def _dataset_features(path: str) -> datasets.Features | None:
    """The features ``dataset_info.json`` in ``path`` declares, or ``None`` (no such readable file)."""
    try:
        with open(os.path.join(path, INFO_FILE), encoding="utf-8") as handle:
            return datasets.Features.from_dict(json.load(handle)["features"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _dataset_columns(path: str) -> list[str] | None:
    """The columns ``dataset_info.json`` in ``path`` declares, or ``None`` (no such readable file)."""
    try:
        with open(os.path.join(path, "dataset_info.json"), encoding="utf-8") as handle:
            features = json.load(handle)["features"]
        return sorted(features) if isinstance(features, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_cache_directory(path: str) -> bool:
    """Whether the existing directory ``path`` holds a key-token cache: its markers (the checksum
    file every save writes, the shard record in ``state.json``, an earlier version's shard
    manifest), a ``dataset_info.json`` declaring the cache's columns (a plain ``save_to_disk`` copy,
    or a first commit killed after writing it), or nothing but shard files in ``shards/`` (a first
    commit of an earlier version killed before its manifest). Contents are checked when read."""
    if os.path.isfile(os.path.join(path, CHECKSUM_FILE)) or has_manifest(path) or has_record(path):
        return True
    return set(CACHE_FEATURES) <= set(_dataset_columns(path) or ()) or interrupted_first_commit(path)


def _carry_foreign_files(old: str, new: str) -> None:
    """Copy what is not the cache's own (a README the user put in ``old``) into ``new``, the copy
    about to replace it, so that a save never deletes it. Files are hard-linked where the file
    system allows (no second copy of the bytes), else copied; links stay links."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)

    own = _own_files(old)
    for name in sorted(set(os.listdir(old)) - own):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(src, dst)


def _refuse(argument: str, value, detail: str) -> ValueError:
    return ValueError(f"{argument}={value!r} {detail}")


def cache_directory(path, argument: str = "key_tokens", create: bool = False) -> str:
    """The directory a key-token cache is read from (or, with ``create``, written to), as a real path.

    A symbolic link is resolved once, here: rows are written into, and locked at, its target, so a
    writer naming the link and one naming the target share one cache and one lock. Checked before
    anything is loaded or scored, and refused with a ``ValueError`` naming ``argument`` and the value:

    - an empty or blank name, ``.``, ``..``, the file-system root, the home folder, the current
      folder or one above it (a save swaps the directory as a whole: these are never caches);
    - a file;
    - with ``create``: an existing directory that is neither empty nor a key-token cache
      (:func:`_is_cache_directory`), and a folder where nothing can be written (probed by creating
      and removing a temporary directory beside the cache, so that it fails now, not after the
      scoring).

    Args:
        path: ``str`` or ``os.PathLike``.
        argument: the option's name in messages (``key_tokens``, ``--output``).
        create: the caller may write a cache there (one that does not exist yet is allowed).
    Returns:
        ``os.path.realpath(path)`` (``~`` expanded).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{argument} is a {type(path).__name__}; pass the directory of a key-token cache or a datasets.Dataset."
        )
    name = os.fspath(path)
    require_path(name, argument, "the directory of a key-token cache, e.g. key_tokens/NAME")
    real = os.path.realpath(os.path.expanduser(name))
    here = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    if real in (here, home, os.path.dirname(real)) or here.startswith(real.rstrip(os.sep) + os.sep):
        what = {here: "the current folder", home: "the home folder"}.get(real, "a folder that holds the current one")
        if os.path.dirname(real) == real:
            what = "the root of the file system"
        raise _refuse(
            argument,
            name,
            f"is {what} ({real}), which a cache never is (a save replaces its directory as a whole): pass a "
            "folder of its own, e.g. key_tokens/NAME.",
        )
    if os.path.exists(real) and not os.path.isdir(real):
        raise _refuse(argument, name, f"is a file ({real}), not a directory: pass the directory of a key-token cache.")
    if not create:
        return real
    problem = cannot_create(real, folder=True)
    if problem is not None:  # under a file, a loop of links: found now, not when the scored rows are saved
        raise _refuse(argument, name, f"{problem}; pass a folder that can be created, e.g. key_tokens/NAME.")
    if os.path.isdir(real) and os.listdir(real) and not _is_cache_directory(real):
        shown = sorted(os.listdir(real))
        columns = _dataset_columns(real)
        what = (
            f"is a folder holding other files ({', '.join(shown[:5]) + (', …' if len(shown) > 5 else '')}), not a "
            "key-token cache"
            if columns is None
            else f"is a datasets folder that is not a LongPPL key-token cache (its columns are {columns})"
        )
        raise _refuse(
            argument, name, f"{what}; a save would replace it: pass a new or empty folder, or an existing cache."
        )
    folder = os.path.dirname(real)
    while not os.path.isdir(folder):  # the folders a save would create: probe the first that exists
        folder = os.path.dirname(folder)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".longppl-write-probe-", dir=folder))
    except OSError as err:
        raise _refuse(
            argument,
            name,
            f"cannot be written: creating a folder in {folder} failed ({err.strerror or err}). Pass a folder you "
            "can write to, or fix its permissions.",
        ) from None
    return real


def write_failed(path: str, err: OSError, dataset: datasets.Dataset, what: str = "the new copy") -> ValueError:
    """A write of ``dataset`` for the cache ``path`` that the file system refused (full, over a
    size limit, read-only), as one clear line: what failed, about how much space it needs."""
    needed = dataset.data.nbytes
    size = f"{needed / 2**20:,.1f} MiB" if needed >= 2**20 else f"{max(needed / 2**10, 0.1):,.1f} KiB"
    unchanged = "The previous cache (if any) is unchanged and nothing was left behind"
    if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # space is not the problem: say so
        return ValueError(
            f"Could not write the key-token cache {path!r}: {err.strerror or err} (errno {err.errno}). {unchanged}: "
            "choose another folder, then run again."
        )
    return ValueError(
        f"Could not write the key-token cache {path!r}: {err.strerror or err} (errno {err.errno}); it needs "
        f"about {size} beside the cache while {what} is written. {unchanged}: free space or choose "
        "another folder, then run again."
    )


@contextlib.contextmanager
def _datasets_progress(enabled: bool):
    """Silence ``datasets``' own progress bars (saving, concatenating) unless ``enabled``."""
    was_enabled = not datasets.utils.are_progress_bars_disabled()
    if not enabled and was_enabled:
        datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            datasets.utils.enable_progress_bars()


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
            dataset = key_token_rows([], [], KeyTokenSettings(), ModelIdentity("", "", "", ""))
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
            keys = self._key_table()
            self._index = {}
            for row, key in enumerate(zip(*(keys[name] for name in _KEY_COLUMNS))):
                self._index.setdefault(key, row)
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
        keys = rows.select_columns(list(_KEY_COLUMNS)).to_dict()
        new_keys: dict[tuple, int] = {}
        for position, key in enumerate(zip(*(keys[name] for name in _KEY_COLUMNS))):
            new_keys.setdefault(key, position)
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


def _prepare_swap(path: str) -> bool:
    """Under the exclusive lock of ``path``, before its content is replaced: finish an interrupted
    swap and check again that only a cache or an empty folder is replaced (another process may have
    put files there since the first check). Returns whether a non-empty cache is there."""
    recover_directory(path)
    exists = os.path.isdir(path) and bool(os.listdir(path))
    if exists and not _is_cache_directory(path):
        cache_directory(path, argument="path", create=True)  # raises, naming what is there
    return exists


def _swap_in(path: str, dataset: datasets.Dataset, exists: bool) -> datasets.Dataset:
    """Replace the cache directory ``path`` by ``dataset`` written as one base (the caller holds the
    exclusive lock); the user's files in it are carried over. Returns the rows memory-mapped from
    their new home."""

    def write(folder: str) -> None:
        _write_directory(dataset, folder)
        if exists:
            _carry_foreign_files(path, folder)

    try:
        replace_directory_atomically(path, write)
    except OSError as err:  # full disk, file-size limit, read-only: the old copy is intact
        raise write_failed(path, err, dataset) from err
    if not len(dataset):  # datasets cannot read back a folder of no rows (state.json names no file)
        return dataset
    # memory-mapped from its new home (its checksums were just taken from these files)
    return check_cache_dataset(datasets.load_from_disk(path), repr(path))


def append_rows(path, rows: datasets.Dataset) -> str:
    """Commit ``rows`` (from :func:`key_token_rows`) to the cache directory ``path`` as a new shard.

    The shard is written and hashed beside the cache first, then moved in and named in ``state.json``
    under the cache's lock (``shards``): no Arrow file of the cache is rewritten, a reader sees all of the
    shard or none of it, and a process killed at any point loses these rows only. Rows whose key is
    already cached are appended too (the first row of a key is the one used; compaction drops the
    others). Any number of processes may append to one cache at once.

    Returns:
        the cache's real path.
    Raises:
        ValueError: ``path`` is not a cache's folder (``cache_directory``), or the file system
            refused the write (full disk...): one line; the cache is unchanged.
    """
    check_cache_dataset(rows, "the rows to add")
    path = cache_directory(path, argument="path", create=True)

    def write(file: str) -> None:
        writer = ArrowWriter(features=CACHE_FEATURES, path=file)
        try:
            writer.write_table(rows.with_format(None).data.table)
            writer.finalize()
        finally:
            writer.close()

    with _datasets_progress(False):
        try:
            tmp, entry = write_shard(path, len(rows), write)
        except OSError as err:  # a full disk or a file-size limit: nothing of this shard is kept
            raise write_failed(path, err, rows, "the new shard") from err
    with directory_lock(path):
        recover_directory(path)
        # checked again under the lock: another process may have put other files there meanwhile
        if os.path.isdir(path) and os.listdir(path) and not _is_cache_directory(path):
            shutil.rmtree(tmp, ignore_errors=True)
            cache_directory(path, argument="path", create=True)  # raises, naming what is there
        try:
            commit_shard(path, tmp, entry, _dataset_info(), _stop_checksumming_state)
        except OSError as err:
            raise write_failed(path, err, rows, "the new shard") from err
        except ValueError as err:  # state.json or the manifest unreadable: nothing was changed
            raise _damaged(path, str(err)) from err
    return path


def compact_cache(path) -> dict:
    """Rewrite the cache directory ``path`` as one ``save_to_disk`` folder: its base and all its
    shards, each key once (the first row), in the same order; atomically, under the cache's lock
    (held from the read to the swap: a commit waits for it, so the counts are of one state).

    Returns:
        ``{"path", "rows_before", "rows", "shards"}`` (``shards``: how many were merged).
    """
    path = cache_directory(path, argument="path")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No key-token cache at {path!r}. {_HOW_TO_BUILD}")
    with _datasets_progress(False), directory_lock(path):
        exists = _prepare_swap(path)
        cache = KeyTokenCache(_read_directory(path), path)
        shards = len(read_record(path).shards)
        before = len(cache)
        cache._drop_duplicates()
        if len(cache):  # (datasets cannot read back a folder of no rows: an empty cache stays as it is)
            _swap_in(path, cache.dataset, exists)
    return dict(path=path, rows_before=before, rows=len(cache), shards=shards)


def repair_cache(path) -> dict:
    """Drop the damaged shards of the cache directory ``path`` from its record, under its lock.

    A shard is damaged when it is missing, of another size or content than committed, or
    unreadable; its rows leave the cache (its file stays in ``shards/``, unnamed, until the next
    compaction), and the next ``longppl score`` run with the same options scores its documents
    again. The base and the record itself cannot be repaired this way (the error says so).

    Returns:
        ``{"path", "dropped": [{"file", "rows", "problem"}], "shards", "rows"}`` (shards and rows kept).
    """
    path = cache_directory(path, argument="path")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No key-token cache at {path!r}. {_HOW_TO_BUILD}")
    dropped = []
    with directory_lock(path):
        recover_directory(path)
        if not _is_cache_directory(path):
            _read_directory(path)  # raises, saying what is there
        try:
            record = read_record(path)
        except ValueError as err:
            raise _damaged(path, str(err)) from err
        kept = []
        for entry, _, problem in _open_shards(path, record.shards):
            if problem is None:
                kept.append(entry)
            else:
                dropped.append(dict(file=entry["file"], rows=entry["rows"], problem=problem))
        if dropped:
            write_record(path, record, kept, _dataset_info(), _stop_checksumming_state)
        cache = KeyTokenCache(_read_directory(path), path)  # the base and the shards kept, verified
    return dict(path=path, dropped=dropped, shards=len(kept), rows=len(cache))


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
