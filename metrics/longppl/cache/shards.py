"""Immutable shards of a key-token cache: rows committed as they are scored, never rewritten.

A cache directory holds, besides (or instead of) the folder that ``Dataset.save_to_disk`` writes
(its *base*: ``data-*.arrow``, ``state.json``, ``dataset_info.json``, ``longppl_checksums.json``):

- ``shards/<name>.arrow``: Arrow stream files with the cache's schema (``CACHE_FEATURES``, as
  ``datasets``' own cache files), each written once, renamed into place whole, never changed;
- ``longppl_shards.json``, the manifest: ``{"format": "longppl-shards", "version": 1, "shards":
  [{"file": "shards/<name>.arrow", "rows": n, "bytes": b, "sha256": h}, ...]}`` in commit order.
  A shard counts only once the manifest names it: a file in ``shards/`` the manifest does not name
  (its writer was killed between the rename and the manifest) is ignored and removed by the next
  compaction.

The cache's rows are the base's, then each listed shard's, in manifest order; each file is
memory-mapped (``datasets.Dataset.from_file``), and the whole opens as one ``datasets.Dataset``
without copying. A commit holds the cache's lock (``atomic_files.directory_lock``) only for the
rename and the manifest's atomic rewrite: the shard's bytes are written and hashed before, in a
temporary folder beside the cache owned by the writer (removed once its writer is gone). So a kill
at any point loses at most the rows of the shard being written. Compaction (``longppl cache
compact``, or any :meth:`KeyTokenCache.save` to the cache's own directory) writes base and shards
as one new base and swaps it in (the shards go with the old copy).

This module only reads and writes files; the checks that name a damaged cache, and the cache
object, are in ``key_token_cache``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable

from ..atomic_files import owned_temp_dir, remove_stale_temp_dirs, write_file_atomically
from ..models.fingerprints import file_sha256

MANIFEST_FILE = "longppl_shards.json"
SHARD_FOLDER = "shards"
MANIFEST_FORMAT = "longppl-shards"
MANIFEST_VERSION = 1


def has_manifest(path: str) -> bool:
    """Whether the directory ``path`` holds a shard manifest."""
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def read_manifest(path: str) -> list[dict]:
    """The shard entries of the cache directory ``path`` (``[]`` without a manifest).

    Returns:
        ``[{"file": str, "rows": int, "bytes": int, "sha256": str}, ...]`` in commit order.
    Raises:
        ValueError: the manifest is unreadable, of another format, or names a file outside
            ``shards/`` (the message says which).
    """
    record = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(record):
        return []
    try:
        with open(record, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
        entries = [
            {"file": str(e["file"]), "rows": int(e["rows"]), "bytes": int(e["bytes"]), "sha256": str(e["sha256"])}
            for e in manifest["shards"]
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"its shard manifest {MANIFEST_FILE} is unreadable ({type(err).__name__}: {err})") from err
    for entry in entries:
        folder, name = os.path.split(entry["file"])
        if folder != SHARD_FOLDER or not name or name in (".", ".."):
            raise ValueError(
                f"its shard manifest {MANIFEST_FILE} names {entry['file']!r}, not a file in {SHARD_FOLDER}/"
            )
    return entries


def shard_problem(path: str, entry: dict) -> str | None:
    """What is wrong with one listed shard of the cache ``path`` (missing, or of another size than
    committed), or ``None``; its content is checked against ``entry["sha256"]`` by the reader."""
    file = os.path.join(path, entry["file"])
    if not os.path.isfile(file):
        return f"its manifest {MANIFEST_FILE} names the shard {entry['file']}, which is missing"
    size = os.path.getsize(file)
    if size != entry["bytes"]:
        return (
            f"its shard {entry['file']} is {size} bytes, but {entry['bytes']} were committed (truncated or overwritten)"
        )
    return None


def write_shard(path: str, rows: int, write: Callable[[str], None]) -> tuple[str, dict]:
    """Write a shard's file for the cache ``path`` in a temporary folder beside it (not yet committed).

    Args:
        rows: how many rows the shard holds (recorded in the manifest).
        write: ``write(file)`` writes the Arrow stream file ``file``.
    Returns:
        ``(temporary folder, entry)``: pass both to :func:`commit_shard` (under the cache's lock), or
        remove the folder. On an error the folder is removed and the error raised.
    """
    remove_stale_temp_dirs(path)  # shards of writers killed before their commit
    tmp = owned_temp_dir(path, "shard")
    # commit time first (shards list in the order they were written), then the folder's random part
    name = f"{time.time_ns():016x}-{tmp.rsplit('-', 1)[-1]}.arrow"
    try:
        file = os.path.join(tmp, name)
        write(file)
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


def commit_shard(path: str, tmp: str, entry: dict) -> None:
    """Move the shard written by :func:`write_shard` into the cache ``path`` and name it in the
    manifest. The caller holds the cache's exclusive lock; ``path`` exists or is created."""
    try:
        entries = read_manifest(path) if os.path.isdir(path) else []
        os.makedirs(os.path.join(path, SHARD_FOLDER), exist_ok=True)
        os.rename(os.path.join(tmp, os.path.basename(entry["file"])), os.path.join(path, entry["file"]))
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "shards": entries + [entry]}
        write_file_atomically(
            os.path.join(path, MANIFEST_FILE), lambda handle: json.dump(manifest, handle, indent=1, sort_keys=True)
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
