"""A key-token cache on disk: its directory read, written, swapped, appended to, compacted and
repaired, under its lock. What a row is comes from ``schema``; the checksums from ``integrity``;
the cache object that looks rows up (``KeyTokenCache``) is in ``key_token_cache``.

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
- **Checksums**: every file is verified at every load (``integrity``); a damaged cache is a
  ``CacheDamagedError`` naming the file, never rows read from it.
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

import datasets
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter

from ..atomic_files import (
    cannot_create,
    directory_lock,
    recover_directory,
    replace_directory_atomically,
)
from ..models.sources import require_path
from .integrity import (
    CHECKSUM_FILE,
    _checksum_names,
    _damaged,
    _open_shards,
    _stop_checksumming_state,
    _write_checksums,
    verify_checksums,
)
from .schema import _HOW_TO_BUILD, CACHE_FEATURES, _dataset_info, check_cache_dataset, empty_rows, rows_by_key
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
    write_record,
    write_shard,
)


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
        return empty_rows()
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


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
        dataset = check_cache_dataset(_read_directory(path), repr(path))
        shards = len(read_record(path).shards)
        before = len(dataset)
        first = rows_by_key(dataset)
        if len(first) < before:  # shards of two runs that scored one document at once hold it twice
            dataset = dataset.select(sorted(first.values()))
        if len(dataset):  # (datasets cannot read back a folder of no rows: an empty cache stays as it is)
            _swap_in(path, dataset, exists)
    return dict(path=path, rows_before=before, rows=len(dataset), shards=shards)


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
        rows = len(check_cache_dataset(_read_directory(path), repr(path)))  # the base and the shards kept, verified
    return dict(path=path, dropped=dropped, shards=len(kept), rows=rows)
