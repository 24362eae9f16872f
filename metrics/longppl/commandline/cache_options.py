"""Command-line options shared by the scripts that read a key-token cache: where the cache is, which
of its evaluator/settings combinations to use, and the key-token rule to apply to it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

# Light at import (no torch, no datasets): the scripts build their parsers, and answer `--help`,
# before loading the cache machinery.
from ..settings import DEFAULT_ALPHA, DEFAULT_BETA

if TYPE_CHECKING:
    from ..cache.key_token_cache import KeyTokenCache, KeyTokenSettings


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--key-tokens``, ``--split``, ``--evaluator``, ``--trunc-len``, ``--sliding-window``,
    ``--alpha``, ``--beta``, ``--no-lcl``."""
    parser.add_argument(
        "--key-tokens", required=True, help="the key-token cache: a directory or a Hub dataset (required)"
    )
    parser.add_argument("--split", default="train", help="split of a Hub cache (default: train)")
    parser.add_argument(
        "--evaluator",
        help="pick the cache's rows of this evaluator (its name, folder name or fingerprint start) "
        "(default: any; needed when the cache holds several)",
    )
    parser.add_argument(
        "--trunc-len",
        type=int,
        help="pick the cache's rows with this K (default: any; needed when the cache holds several)",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        help="pick the cache's rows with this d (default: any; needed when the cache holds several)",
    )
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="key iff LSD > alpha (default %(default)s)")
    parser.add_argument("--beta", type=float, default=DEFAULT_BETA, help="and LCL > beta (default %(default)s)")
    parser.add_argument(  # as use_lcl, the rule's field: KeyTokenRule.of(args) reads it by name
        "--no-lcl",
        dest="use_lcl",
        action="store_false",
        help="drop the LCL condition (paper ablation; default: keep it)",
    )


def open_selected(args: argparse.Namespace) -> tuple[KeyTokenCache, KeyTokenSettings, str, list[int]]:
    """``(cache, settings, evaluator_fingerprint, rows)`` of the combination the options pick
    (see :meth:`KeyTokenCache.select`)."""
    from ..cache.key_token_cache import open_cache

    cache = open_cache(args.key_tokens, args.split, "--key-tokens")
    settings, fingerprint, rows = cache.select(
        args.evaluator, trunc_len=args.trunc_len, sliding_window=args.sliding_window
    )
    return cache, settings, fingerprint, rows
