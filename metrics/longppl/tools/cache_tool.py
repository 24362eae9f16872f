"""Look after a key-token cache on disk: what it holds, and compaction of its shards.

    longppl cache info key_tokens/govreport-llama3.1-8b
    longppl cache compact key_tokens/govreport-llama3.1-8b

``longppl score`` commits its rows as immutable shards (``shards/*.arrow``, named in
``longppl_shards.json``) and never rewrites a file of the cache; a cache read opens them all as one
memory-mapped ``datasets.Dataset``. ``info`` lists the rows (per evaluator and settings) and the
files they are in, after verifying every checksum. ``compact`` writes the cache as one folder (what
``Dataset.save_to_disk`` writes: fewer, larger files; each key once) and swaps it in atomically
under the cache's lock: concurrent scoring runs wait for the swap, then go on committing shards.
Compaction is never needed to read a cache; it rewrites every row, so it is an explicit command.
"""

from __future__ import annotations

import argparse
import os

from longppl.tools.cli import run_command, tool_parser

PROG = "longppl-cache"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no datasets, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("action", choices=["info", "compact"], help="what to do with the cache")
    parser.add_argument("path", help="the cache's directory")
    return parser


def main(argv=None, prog: str = PROG) -> dict:
    """Run the tool; returns ``{"path", "rows", "shards", ...}`` (``compact``: also ``rows_before``).

    Raises:
        ValueError: not a cache, or a damaged one (one line naming the file and what to do).
        FileNotFoundError: no cache there.
    """
    args = build_parser(prog).parse_args(argv)
    import datasets

    from longppl.cache.key_token_cache import KeyTokenCache, compact_cache
    from longppl.cache.shards import read_manifest

    datasets.disable_progress_bars()
    if args.action == "compact":
        summary = compact_cache(args.path)
        print(
            f"{summary['path']}: {summary['shards']} shards compacted, {summary['rows']} rows "
            f"({summary['rows_before'] - summary['rows']} repeated rows dropped)",
            flush=True,
        )
        return summary
    cache = KeyTokenCache.load(args.path)  # verifies every checksum
    entries = read_manifest(cache.path)
    files = {item["filename"] for item in cache.dataset.cache_files}
    size = sum(os.path.getsize(name) for name in files)
    print(f"{cache.path}: {len(cache)} rows in {len(files)} files ({size / 2**20:,.1f} MiB), {len(entries)} shards")
    print(cache.describe(), flush=True)
    return dict(path=cache.path, rows=len(cache), shards=len(entries), files=len(files), bytes=size)


def cli(argv=None) -> int:
    """The ``longppl-cache`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
