"""The integrity of a key-token cache directory: the checksums of its files, and the error that
names a damaged one.

Each shard's size and SHA-256 are in ``state.json``, checked at every load like the
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

Here: :func:`verify_checksums` (the base's files) and ``_open_shards`` (each shard, as committed
in ``state.json`` by ``shards``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import datasets
import pyarrow as pa

from ..atomic_files import write_file_atomically
from ..models.fingerprints import file_sha256
from .schema import _DESCRIPTION, _HOW_TO_BUILD, CACHE_FEATURES
from .shards import STATE_FILE, shard_problem

CHECKSUM_FILE = "longppl_checksums.json"


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
