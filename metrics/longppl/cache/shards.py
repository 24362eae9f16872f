"""Immutable shards of a key-token cache: rows committed as they are scored, never rewritten, in a
folder that ``datasets.load_from_disk`` opens as it is after every commit.

A cache directory is a ``datasets`` folder (what ``Dataset.save_to_disk`` writes, and what
``datasets.load_from_disk`` reads): ``state.json`` names its Arrow files, ``dataset_info.json``
declares their columns. Its Arrow files are

- the *base*: ``data-*.arrow`` written by a save or a compaction (with ``longppl_checksums.json``,
  their sizes and SHA-256), if the cache has one;
- the shards: ``shards/<name>.arrow``, Arrow stream files with the cache's schema (``CACHE_FEATURES``,
  as ``datasets``' own cache files), each written once, renamed into place whole, never changed.

``state.json`` is also the record of the shards: besides ``datasets``' own keys (``_data_files``:
the base's files, then each shard's, in commit order) it holds ``"longppl_shards": {"format":
"longppl-shards", "version": 2, "shards": [{"file": "shards/<name>.arrow", "rows": n, "bytes": b,
"sha256": h}, ...]}``. One file, replaced atomically (``atomic_files.write_file_atomically``), is the
commit: ``datasets`` and longppl read the same list of files, so ``datasets.load_from_disk`` gives
every committed row and nothing else, whenever it runs. A file in ``shards/`` that ``state.json``
does not name (its writer was killed between the rename and the commit) is ignored and removed by
the next compaction. (``datasets`` joins each ``filename`` to the folder, so a file in ``shards/``
is read like one beside ``state.json``.)

Caches of earlier versions listed their shards in ``longppl_shards.json`` (version 1) and had no
``state.json`` without a base; they are read as they are, and the next commit moves their record
into ``state.json`` (writing ``dataset_info.json`` first where it is missing) and removes
``longppl_shards.json`` last.

A commit holds the cache's lock (``atomic_files.directory_lock``) only for the rename and the
record's atomic rewrite: the shard's bytes are written, flushed to the disk and hashed before, in a
temporary folder beside the cache owned by the writer (removed once its writer is gone). The
shard is flushed before its rename and ``shards/`` after it, before ``state.json`` names it, so that
not even a power loss leaves the record naming bytes that never reached the disk. A cache's first
commit, where the folder does not exist yet, builds the whole folder beside it and renames it into
place. So a kill at any point loses at most the rows of the shard being written. Compaction
(``longppl cache compact``, or any :meth:`KeyTokenCache.save` to the cache's own directory) writes
base and shards as one new base and swaps it in (the shards go with the old copy).

This module only reads and writes files; the checks that name a damaged cache are in
``integrity``, the directory's reads and writes in ``storage``, the cache object in
``key_token_cache``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import NamedTuple

from ..atomic_files import fsync_path, owned_temp_dir, remove_stale_temp_dirs, write_file_atomically
from ..models.fingerprints import file_sha256

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
MANIFEST_FILE = "longppl_shards.json"  # the record of version 1 (read, and replaced at the next commit)
SHARD_FOLDER = "shards"
RECORD_KEY = "longppl_shards"
MANIFEST_FORMAT = "longppl-shards"
MANIFEST_VERSION = 1
RECORD_VERSION = 2
# <commit time in ns, 16 hex>-<random, 12 hex>.arrow: what write_shard names a shard
SHARD_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{12}\.arrow")
# datasets' own keys of state.json, as save_to_disk writes them for a Dataset without format or split
_NEW_STATE = {
    "_format_columns": None,
    "_format_kwargs": {},
    "_format_type": None,
    "_output_all_columns": False,
    "_split": None,
}


class Record(NamedTuple):
    """What a cache directory holds, as its files say (:func:`read_record`).

    Attributes:
        base: the base's Arrow files (names in the folder), in order; ``[]`` without a base.
        shards: ``[{"file", "rows", "bytes", "sha256"}, ...]``, the committed shards in commit order.
        state: ``state.json`` as read, or ``None`` where there is none.
        legacy: the shards are listed in ``longppl_shards.json`` (version 1), not in ``state.json``.
    """

    base: list[str]
    shards: list[dict]
    state: dict | None
    legacy: bool


def has_manifest(path: str) -> bool:
    """Whether the directory ``path`` holds a shard manifest of version 1 (``longppl_shards.json``)."""
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def has_record(path: str) -> bool:
    """Whether the directory ``path`` holds a ``state.json`` that records shards (a cache of ours)."""
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as handle:
            return RECORD_KEY in json.load(handle)
    except (OSError, ValueError, TypeError):
        return False


def interrupted_first_commit(path: str) -> bool:
    """Whether the existing directory ``path`` holds nothing but a ``shards/`` folder of shard files
    (or none): what an earlier version's first commit left when it was killed before its manifest."""
    folder = os.path.join(path, SHARD_FOLDER)
    if os.listdir(path) != [SHARD_FOLDER] or not os.path.isdir(folder) or os.path.islink(folder):
        return False
    return all(SHARD_NAME.fullmatch(name) and os.path.isfile(os.path.join(folder, name)) for name in os.listdir(folder))


def _entries(shards, what: str) -> list[dict]:
    entries = [
        {"file": str(e["file"]), "rows": int(e["rows"]), "bytes": int(e["bytes"]), "sha256": str(e["sha256"])}
        for e in shards
    ]
    for entry in entries:
        folder, name = os.path.split(entry["file"])
        if folder != SHARD_FOLDER or not name or name in (".", ".."):
            raise ValueError(f"its {what} names {entry['file']!r}, not a file in {SHARD_FOLDER}/")
    return entries


def read_manifest(path: str) -> list[dict]:
    """The shard entries of the version-1 manifest ``longppl_shards.json`` of ``path`` (``[]`` without).

    Raises:
        ValueError: the manifest is unreadable, of another format, or names a file outside
            ``shards/`` (the message says which).
    """
    record = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(record):
        return []
    what = f"shard manifest {MANIFEST_FILE}"
    try:
        with open(record, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
        shards = manifest["shards"]
        return _entries(shards, what)
    except (OSError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"its {what} is unreadable ({type(err).__name__}: {err})") from err
    except ValueError as err:
        if str(err).startswith("its "):
            raise
        raise ValueError(f"its {what} is unreadable ({type(err).__name__}: {err})") from err


def read_record(path: str) -> Record:
    """The base files and committed shards of the cache directory ``path`` (see the module docstring).

    Raises:
        ValueError: ``state.json`` or the manifest is unreadable, names a file outside the folder or
            ``shards/``, or lists other files than its shard record (the message says which).
    """
    state = None
    file = os.path.join(path, STATE_FILE)
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as handle:
                state = json.load(handle)
            named = [str(item["filename"]) for item in state["_data_files"]]
            record = state.get(RECORD_KEY)
            if record is not None and (
                record.get("format") != MANIFEST_FORMAT or record.get("version") != RECORD_VERSION
            ):
                raise ValueError(
                    f"its shard record is of format {record.get('format')!r} version {record.get('version')!r}"
                )
            shards = None if record is None else record["shards"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"its file {STATE_FILE} is unreadable ({type(err).__name__}: {err})") from err
        if shards is not None:
            entries = _entries(shards, f"file {STATE_FILE}")
            base = [name for name in named if not name.startswith(SHARD_FOLDER + "/")]
            if named != base + [entry["file"] for entry in entries]:
                raise ValueError(
                    f"its file {STATE_FILE} lists the Arrow files {named}, but records the shards "
                    f"{[entry['file'] for entry in entries]} after the base {base}"
                )
        else:
            base, entries = named, read_manifest(path)
        for name in base:
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"its file {STATE_FILE} names {name!r}, not a file of the cache's folder")
        return Record(base, entries, state, shards is None and has_manifest(path))
    return Record([], read_manifest(path), None, has_manifest(path))


def shard_problem(path: str, entry: dict) -> str | None:
    """What is wrong with one listed shard of the cache ``path`` (missing, or of another size than
    committed), or ``None``; its content is checked against ``entry["sha256"]`` by the reader."""
    file = os.path.join(path, entry["file"])
    if not os.path.isfile(file):
        return f"its record names the shard {entry['file']}, which is missing"
    size = os.path.getsize(file)
    if size != entry["bytes"]:
        return (
            f"its shard {entry['file']} is {size} bytes, but {entry['bytes']} were committed (truncated or overwritten)"
        )
    return None


def write_shard(path: str, rows: int, write: Callable[[str], None]) -> tuple[str, dict]:
    """Write a shard's file for the cache ``path`` in a temporary folder beside it (not yet committed).

    Args:
        rows: how many rows the shard holds (recorded in ``state.json``).
        write: ``write(file)`` writes the Arrow stream file ``file``.
    Returns:
        ``(temporary folder, entry)``: pass both to :func:`commit_shard` (under the cache's lock), or
        remove the folder. On an error the folder is removed and the error raised. The file is on
        the disk (flushed) when this returns.
    """
    remove_stale_temp_dirs(path)  # shards of writers killed before their commit
    tmp = owned_temp_dir(path, "shard")
    # commit time first (shards list in the order they were written), then the folder's random part
    name = f"{time.time_ns():016x}-{tmp.rsplit('-', 1)[-1]}.arrow"
    try:
        file = os.path.join(tmp, name)
        write(file)
        fsync_path(file)
        entry = {
            "file": f"{SHARD_FOLDER}/{name}",
            "rows": rows,
            "bytes": os.path.getsize(file),
            "sha256": file_sha256(file),
        }
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, entry


def _state(record: Record, shards: list[dict]) -> dict:
    """``state.json`` naming the base's files and ``shards``; datasets' other keys kept as they were."""
    files = record.base + [entry["file"] for entry in shards]
    # load_from_disk takes this as the Dataset's fingerprint (the key of datasets' own caches): it
    # changes with the content
    digest = hashlib.sha256(json.dumps([files, [e["sha256"] for e in shards]]).encode()).hexdigest()[:16]
    state = dict(_NEW_STATE) if record.state is None else dict(record.state)
    state.update(
        _data_files=[{"filename": name} for name in files],
        _fingerprint=digest,
        **{RECORD_KEY: {"format": MANIFEST_FORMAT, "version": RECORD_VERSION, "shards": shards}},
    )
    return state


def _write_json(path: str, value: dict, sort_keys: bool = True) -> None:
    write_file_atomically(path, lambda handle: json.dump(value, handle, indent=2, sort_keys=sort_keys))


def write_record(
    path: str, record: Record, shards: list[dict], info: dict, prepare: Callable[[str], None] | None = None
) -> None:
    """Make ``shards`` the committed shards of the existing cache directory ``path`` (whose current
    ``record`` the caller read under the cache's exclusive lock, which it still holds).

    In this order, so that a kill between any two steps leaves a cache that reads as before or as
    after: ``dataset_info.json`` (``info``) where missing, ``prepare(path)`` (the caller's own files),
    ``state.json`` (the commit), then ``longppl_shards.json`` of version 1 removed.
    """
    if not os.path.isfile(os.path.join(path, INFO_FILE)):
        _write_json(os.path.join(path, INFO_FILE), info, sort_keys=False)
    if prepare is not None:
        prepare(path)
    _write_json(os.path.join(path, STATE_FILE), _state(record, shards))
    if has_manifest(path):  # its entries are in state.json now
        os.remove(os.path.join(path, MANIFEST_FILE))
        fsync_path(path)


def commit_shard(path: str, tmp: str, entry: dict, info: dict, prepare: Callable[[str], None] | None = None) -> None:
    """Move the shard written by :func:`write_shard` into the cache ``path`` and name it in
    ``state.json``. The caller holds the cache's exclusive lock.

    Args:
        info: ``dataset_info.json`` of the cache (the columns), written where it is missing.
        prepare: see :func:`write_record`.
    """
    name = os.path.basename(entry["file"])
    try:
        if not os.path.exists(path):  # the first commit: the folder is built whole, then renamed in
            new = owned_temp_dir(path, "new")
            try:
                os.mkdir(os.path.join(new, SHARD_FOLDER))
                os.rename(os.path.join(tmp, name), os.path.join(new, entry["file"]))
                _write_json(os.path.join(new, INFO_FILE), info, sort_keys=False)
                _write_json(os.path.join(new, STATE_FILE), _state(Record([], [], None, False), [entry]))
                fsync_path(os.path.join(new, SHARD_FOLDER))
                os.rename(new, path)
            except BaseException:
                shutil.rmtree(new, ignore_errors=True)
                raise
            fsync_path(os.path.dirname(path))
            return
        record = read_record(path)
        folder = os.path.join(path, SHARD_FOLDER)
        if not os.path.isdir(folder):
            os.mkdir(folder)
            fsync_path(path)
        os.rename(os.path.join(tmp, name), os.path.join(path, entry["file"]))
        fsync_path(folder)  # the shard's name is on the disk before state.json names it
        write_record(path, record, record.shards + [entry], info, prepare)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
