"""Look after a key-token cache on disk: what it holds, compaction of its shards, curation columns.

    longppl cache info key_tokens/govreport-llama3.1-8b
    longppl cache compact key_tokens/govreport-llama3.1-8b
    longppl cache curate key_tokens/govreport-llama3.1-8b --output govreport-curation.parquet
    longppl cache repair key_tokens/govreport-llama3.1-8b

``longppl score`` commits its rows as immutable shards (``shards/*.arrow``, named in
``longppl_shards.json``) and never rewrites a file of the cache; a cache read opens them all as one
memory-mapped ``datasets.Dataset``. ``info`` lists the rows (per evaluator and settings) and the
files they are in, after verifying every checksum. ``compact`` writes the cache as one folder (what
``Dataset.save_to_disk`` writes: fewer, larger files; each key once) and swaps it in atomically
under the cache's lock: concurrent scoring runs wait for the swap, then go on committing shards.
Compaction is never needed to read a cache (``datasets.load_from_disk`` opens it as it is too); it
rewrites every row, so it is an explicit command. ``repair`` drops the shards that are damaged
(truncated, changed, missing) from the cache's record, keeping every other row: run the same
``longppl score`` command again to score their documents.
``curate`` writes one row per document with its key-token count and share, LSD mean and 90th
percentile, the evaluator's own LongPPL and PPL, and the LSD near and far in the context
(``longppl.cache.curation``), computed from the cached log-probs under ``--alpha`` / ``--beta``:
no forward pass. Filter or rank a corpus with them in ``datasets`` (docs/cache.md).
"""

from __future__ import annotations

import argparse
import os

from longppl.commandline.running import run_command, tool_parser
from longppl.settings import DEFAULT_ALPHA, DEFAULT_BETA

PROG = "longppl-cache"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no datasets, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("action", choices=["info", "compact", "curate", "repair"], help="what to do with the cache")
    parser.add_argument("path", help="the cache's directory")
    parser.add_argument("--output", help="curate: the Parquet file to write, a new one (required for curate)")
    parser.add_argument(
        "--overwrite", action="store_true", help="curate: replace the --output file if it exists (default: refuse)"
    )
    parser.add_argument(
        "--evaluator", help="curate: the evaluator's rows to use, name or fingerprint start (default: the only one)"
    )
    parser.add_argument("--trunc-len", type=int, help="curate: the rows with this K (default: the only one)")
    parser.add_argument("--sliding-window", type=int, help="curate: the rows with this d (default: the only one)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="key iff LSD > alpha (default %(default)s)")
    parser.add_argument("--beta", type=float, default=DEFAULT_BETA, help="and LCL > beta (default %(default)s)")
    return parser


def main(argv=None, prog: str = PROG) -> dict:
    """Run the tool; returns ``{"path", "rows", "shards", ...}`` (``compact``: also ``rows_before``).

    Raises:
        ValueError: not a cache, or a damaged one (one line naming the file and what to do).
        FileNotFoundError: no cache there.
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.action == "curate" and not args.output:
        parser.error("curate needs --output, the Parquet file to write")
    if args.action == "curate":  # before the cache is read: a wrong --output fails at once
        args.output = check_output(args.output, args.overwrite)
    import datasets

    from longppl.cache.key_token_cache import KeyTokenCache, compact_cache, repair_cache
    from longppl.cache.shards import read_record

    datasets.disable_progress_bars()
    if args.action == "repair":
        summary = repair_cache(args.path)
        for shard in summary["dropped"]:
            print(f"dropped {shard['file']} ({shard['rows']} rows): {shard['problem']}", flush=True)
        print(
            f"{summary['path']}: "
            + (
                f"{len(summary['dropped'])} damaged shards dropped, {summary['rows']} rows kept; run the same "
                "`longppl score` command again to score their documents"
                if summary["dropped"]
                else f"no damaged shard, {summary['rows']} rows"
            ),
            flush=True,
        )
        return summary
    if args.action == "compact":
        summary = compact_cache(args.path)
        print(
            f"{summary['path']}: {summary['shards']} shards compacted, {summary['rows']} rows "
            f"({summary['rows_before'] - summary['rows']} repeated rows dropped)",
            flush=True,
        )
        return summary
    cache = KeyTokenCache.load(args.path)  # verifies every checksum
    if args.action == "curate":
        return curate(cache, args)
    entries = read_record(cache.path).shards
    files = {item["filename"] for item in cache.dataset.cache_files}
    size = sum(os.path.getsize(name) for name in files)
    print(f"{cache.path}: {len(cache)} rows in {len(files)} files ({size / 2**20:,.1f} MiB), {len(entries)} shards")
    print(cache.describe(), flush=True)
    return dict(path=cache.path, rows=len(cache), shards=len(entries), files=len(files), bytes=size)


def check_output(output: str, overwrite: bool) -> str:
    """``--output`` of curate, ``~`` expanded, if a file can be written there: a folder, a path under
    a file or through a loop of links, and (without ``overwrite``) an existing file are refused
    with one line (a ValueError)."""
    from longppl.atomic_files import cannot_create

    path = os.path.expanduser(output)
    problem = cannot_create(path)
    if problem is not None:
        raise ValueError(f"--output {output!r} {problem}; pass the path of the Parquet file to write.")
    if os.path.lexists(path) and not overwrite:
        raise ValueError(
            f"--output {output!r} exists; pass --overwrite to replace it, or another path for the Parquet file."
        )
    return path


def curate(cache, args) -> dict:
    """Write the curation columns of the rows ``args`` select to ``args.output`` (Parquet, atomically)."""
    from longppl.atomic_files import write_file_atomically
    from longppl.cache.curation import curation_table
    from longppl.settings import KeyTokenRule

    settings, _, rows = cache.select(args.evaluator, trunc_len=args.trunc_len, sliding_window=args.sliding_window)
    table = curation_table(cache, rows, settings.trunc_len, KeyTokenRule.of(args))
    write_file_atomically(args.output, lambda handle: table.to_parquet(handle), binary=True)
    print(f"{len(table)} documents ({settings.describe()}) -> {args.output}", flush=True)
    return dict(path=cache.path, rows=len(table), output=args.output)


def cli(argv=None) -> int:
    """The ``longppl-cache`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
