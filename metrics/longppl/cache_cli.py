"""Command-line options shared by the scripts that read a key-token cache: where the cache is, which
of its evaluator/settings combinations to use, and the key-token rule to apply to it."""

from __future__ import annotations

import argparse

from .key_token_cache import KeyTokenCache, KeyTokenSettings, open_cache
from .key_tokens import DEFAULT_ALPHA, DEFAULT_BETA


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--key-tokens``, ``--split``, ``--evaluator``, ``--trunc-len``, ``--sliding-window``,
    ``--alpha``, ``--beta``, ``--no-lcl``."""
    parser.add_argument("--key-tokens", required=True, help="the key-token cache: a directory or a Hub dataset")
    parser.add_argument("--split", default="train", help="split of a Hub cache (default: train)")
    parser.add_argument("--evaluator", help="pick the cache's rows of this evaluator (name or fingerprint start)")
    parser.add_argument("--trunc-len", type=int, help="pick the cache's rows with this K")
    parser.add_argument("--sliding-window", type=int, help="pick the cache's rows with this d")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="key iff LSD > alpha (default 2)")
    parser.add_argument("--beta", type=float, default=DEFAULT_BETA, help="and LCL > beta (default -2)")
    parser.add_argument("--no-lcl", action="store_true", help="drop the LCL condition (paper ablation)")


def open_selected(args: argparse.Namespace) -> tuple[KeyTokenCache, KeyTokenSettings, str, list[int]]:
    """``(cache, settings, evaluator_fingerprint, rows)`` of the combination the options pick
    (see :meth:`KeyTokenCache.select`)."""
    cache = open_cache(args.key_tokens, args.split)
    settings, fingerprint, rows = cache.select(args.evaluator, trunc_len=args.trunc_len,
                                               sliding_window=args.sliding_window)
    return cache, settings, fingerprint, rows
