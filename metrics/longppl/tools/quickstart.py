#!/usr/bin/env python
"""LongPPL in one command.

With no arguments (no network, about a minute on two CPU cores): trains a tiny model on a
synthetic task whose only long-context tokens are copies of segments seen 64 tokens earlier, then
scores it twice with the ``longppl`` evaluate metric: with its full context, and with its
attention cut to the last 48 tokens. LongPPL, computed over the key tokens, explodes when the
context is cut; PPL, averaged over all tokens, barely moves.

With real models (downloads from the Hub; a GPU helps):

    python scripts/quickstart.py --model Qwen/Qwen2-1.5B --evaluator meta-llama/Llama-3.1-8B \\
        --texts my_long_documents.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

# Only light modules before the arguments are parsed (`--help` must not wait for torch): the
# `longppl` package loads its torch-based parts on first use.
import longppl


def read_texts(path: str, column: str) -> list[str]:
    """Texts from a JSONL file (one object per line, text in ``column``) or a plain text file."""
    from longppl.tools.corpus import read_jsonl_texts

    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as handle:
            return [handle.read()]
    try:
        return read_jsonl_texts(path, column)
    except ValueError as err:
        sys.exit(str(err))


def print_table(rows: list[tuple[str, dict]]) -> None:
    from longppl.tools.reports import format_table

    print("\n" + format_table(rows))


def toy_demo(args) -> None:
    import evaluate
    import torch

    from longppl.tools.synthetic import (
        DISTANCE,
        cut_context,
        default_cache_dir,
        sample_documents,
        train_copy_model,
        word_tokenizer,
    )
    from longppl.tools.threads import choose_torch_threads

    try:
        threads = choose_torch_threads(1)  # a tiny model: more threads only wait (unless OMP_NUM_THREADS says)
    except ValueError as err:
        sys.exit(f"quickstart.py: error: {err}")
    start = time.perf_counter()
    print(
        f"Training a tiny model to copy words seen {DISTANCE} tokens back ({args.steps} steps on CPU, "
        f"{threads} torch thread{'s' if threads > 1 else ''})..."
    )
    trained = []

    def log(step, loss):
        trained.append(step)
        if step % 100 == 0:
            print(f"  step {step:4d}  loss {loss:.3f}")

    model = train_copy_model(
        steps=args.steps, seed=args.seed, log=log, cache_dir=None if args.retrain else default_cache_dir()
    )
    if trained:
        print(f"trained in {time.perf_counter() - start:.0f}s")
    else:
        print(
            f"loaded the model this quickstart trained before, from {default_cache_dir()} (--retrain trains it again)"
        )
    tokenizer = word_tokenizer()
    # One 8-word copy per 160-word document: ~4% of the tokens need long context.
    docs = sample_documents(
        args.documents, num_segments=1, segment_length=8, generator=torch.Generator().manual_seed(args.seed + 1)
    )
    metric = evaluate.load(longppl.METRIC_PATH)
    common = dict(
        predictions=docs.texts(),
        tokenizer=tokenizer,
        evaluator_model=model,
        evaluator_tokenizer=tokenizer,
        trunc_len=args.trunc_len,
        sliding_window=args.sliding_window,
        progress=False,
    )
    full = metric.compute(model=model, **common)
    cut = metric.compute(model=cut_context(model, args.window), **common)
    print(
        f"\n{args.documents} documents of {docs.ids.shape[1]} words; evaluator: the full-context model; "
        f"K={args.trunc_len}, d={args.sliding_window}, alpha=2, beta=-2"
    )
    print_table([("full context", full), (f"context cut to {args.window} tokens", cut)])
    print(
        f"\nCutting the context multiplies LongPPL by {cut['longppl'] / full['longppl']:.1f} "
        f"and PPL by only {cut['ppl'] / full['ppl']:.2f}. ({time.perf_counter() - start:.0f}s in all)"
    )


def hub_demo(args) -> None:
    import evaluate

    if not args.texts:
        sys.exit("With --model/--evaluator, pass --texts FILE (.jsonl with a 'text' field per line, or a .txt file).")
    texts = read_texts(args.texts, args.column)
    metric = evaluate.load(longppl.METRIC_PATH)
    result = metric.compute(
        predictions=texts,
        model_id=args.model,
        evaluator_model_id=args.evaluator,
        trunc_len=args.trunc_len,
        sliding_window=args.sliding_window,
        max_length=args.max_length,
        device=args.device,
    )
    print(f"\n{len(texts)} texts; evaluator: {args.evaluator}; K={args.trunc_len}, d={args.sliding_window}")
    print_table([(args.model, result)])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", help="Hub id or path of the model to evaluate (needs --evaluator and --texts; default: the toy demo)"
    )
    parser.add_argument(
        "--evaluator", help="Hub id or path of the evaluator, e.g. meta-llama/Llama-3.1-8B (default: the toy demo)"
    )
    parser.add_argument(
        "--texts", help="with --model: a .jsonl file (one JSON object per line) or a .txt file (no default)"
    )
    parser.add_argument("--column", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="keep the first N evaluator tokens of each text (default: no truncation)",
    )
    parser.add_argument("--device", default=None, help="cuda, cpu or auto (default: GPU if available)")
    parser.add_argument("--trunc-len", type=int, default=None, help="K (default 4096; 32 for the toy demo)")
    parser.add_argument("--sliding-window", type=int, default=None, help="d (default 1024; 16 for the toy demo)")
    parser.add_argument("--steps", type=int, default=600, help="toy demo: training steps (default 600)")
    parser.add_argument("--documents", type=int, default=8, help="toy demo: number of documents scored (default 8)")
    parser.add_argument(
        "--window", type=int, default=48, help="toy demo: tokens of context left to the cut model (default 48)"
    )
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="toy demo: train the model again instead of loading the one a previous run kept in "
        "$LONGPPL_CACHE_DIR or ~/.cache/longppl (default: load it when there)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="toy demo: seed of the training and the documents (default 0)"
    )
    args = parser.parse_args(argv)
    if (args.model is None) != (args.evaluator is None):
        parser.error("--model and --evaluator go together")
    toy = args.model is None
    args.trunc_len = args.trunc_len or (32 if toy else 4096)
    args.sliding_window = args.sliding_window or (16 if toy else 1024)
    (toy_demo if toy else hub_demo)(args)


if __name__ == "__main__":
    main()
