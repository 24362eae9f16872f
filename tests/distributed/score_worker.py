"""Worker of test_cache_shards.py: ``longppl score`` that kills itself (SIGKILL) at a chosen point.

    python tests/distributed/score_worker.py [--die RANK:POINT:N] SCORE-OPTIONS...

(or under ``accelerate launch``, one such process per rank). ``--die`` kills the process of rank
RANK (``RANK`` of the launcher, 0 alone) at its N-th shard commit, at POINT:

- ``written``: the shard's file is written and hashed beside the cache, not yet moved in (the
  cache's lock is held);
- ``renamed``: the file is in ``shards/``, ``state.json`` does not name it yet (at a first commit:
  in the folder being built beside the cache);
- ``committed``: right after the commit.

A process killed by SIGKILL leaves no trace (no handler, no ``finally``): what a preempted job or an
out-of-memory kill leaves.
"""

from __future__ import annotations

import os
import signal
import sys

import longppl.cache.key_token_cache as cache_module
import longppl.cache.shards as shards_module
import longppl.cache.storage as storage_module
from longppl.tools import compute_key_tokens


def die_at(point: str, n: int) -> None:
    """Patch the commit path so that the process kills itself at its ``n``-th commit, at ``point``."""
    commits = {"count": 0}

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    commit_shard, append_rows, write_manifest = (
        storage_module.commit_shard,
        cache_module.append_rows,
        shards_module.write_file_atomically,
    )

    def counting_commit(path, tmp, entry, *args, **kwargs):
        commits["count"] += 1
        if point == "written" and commits["count"] == n:
            kill()
        return commit_shard(path, tmp, entry, *args, **kwargs)

    def manifest(path, write, *args, **kwargs):
        if point == "renamed" and commits["count"] == n:
            kill()
        return write_manifest(path, write, *args, **kwargs)

    def counting_append(path, rows):
        result = append_rows(path, rows)
        if point == "committed" and commits["count"] == n:
            kill()
        return result

    storage_module.commit_shard = counting_commit
    shards_module.write_file_atomically = manifest
    cache_module.append_rows = counting_append


def main(argv: list[str]) -> None:
    if argv[:1] == ["--die"]:  # (no "--" separator: accelerate launch drops it)
        rank, point, n = argv[1].split(":")
        if int(os.environ.get("RANK", "0")) == int(rank):
            die_at(point, int(n))
        argv = argv[2:]
    compute_key_tokens.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
