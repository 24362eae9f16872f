"""LongPPL in one command: ``longppl-quickstart``.

With no arguments (no network; 45 s to 2 minutes on two CPU cores, by their load): trains a tiny model on a
synthetic task whose only long-context tokens are copies of segments seen 64 tokens earlier, then
scores it twice with the ``longppl`` evaluate metric: with its full context, and with its
attention cut to the last 48 tokens. LongPPL, computed over the key tokens, explodes when the
context is cut; PPL, averaged over all tokens, barely moves.

With real models (downloads from the Hub; a GPU helps):

    longppl-quickstart --model Qwen/Qwen2-1.5B --evaluator meta-llama/Llama-3.1-8B \\
        --texts my_long_documents.jsonl

(``scripts/quickstart.py``, the README's first command, and ``python -m longppl.tools.quickstart`` run
the same command.)
"""

from __future__ import annotations

import argparse
import sys
import time

# Only light modules before the arguments are parsed (`--help` must not wait for torch): the
# `longppl` package loads its torch-based parts on first use.
import longppl
from longppl.commandline.running import run_command, tool_parser
from longppl.settings import (
    DEFAULT_AGGREGATION,
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
)

# The name in usage lines and messages when main() is called from Python; commands show the name they
# were started by (commandline/running.py).
PROG = "quickstart.py"
# K and d of the toy demo: its copies lie 64 tokens back (synthetic.DISTANCE), beyond K.
TOY_TRUNC_LEN, TOY_SLIDING_WINDOW = 32, 16


def read_texts(path: str, column: str) -> list[str]:
    """Texts from a JSONL file (one object per line, text in ``column``) or a plain text file."""
    from longppl.commandline.corpus import read_jsonl_texts

    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as handle:
            return [handle.read()]
    try:
        return read_jsonl_texts(path, column)
    except ValueError as err:
        sys.exit(str(err))


def print_table(rows: list[tuple[str, dict]]) -> None:
    from longppl.commandline.reports import format_table

    print("\n" + format_table(rows))


def toy_demo(args) -> None:
    import evaluate
    import torch

    from longppl.commandline.synthetic import (
        DISTANCE,
        cut_context,
        default_cache_dir,
        sample_documents,
        train_copy_model,
        word_tokenizer,
    )
    from longppl.commandline.threads import choose_torch_threads

    # A tiny model: more threads only wait (unless OMP_NUM_THREADS says). A bad OMP_NUM_THREADS is a
    # ValueError, which the command reports as `<prog>: error: ...` (commandline/running.py).
    threads = choose_torch_threads(1)
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
        f"K={args.trunc_len}, d={args.sliding_window}, alpha={DEFAULT_ALPHA:g}, beta={DEFAULT_BETA:g}, "
        f"aggregation={DEFAULT_AGGREGATION}"
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
    print(
        f"\n{len(texts)} texts; evaluator: {args.evaluator}; K={args.trunc_len}, d={args.sliding_window}, "
        f"aggregation={DEFAULT_AGGREGATION}"
    )
    print_table([(args.model, result)])


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument(
        "--model",
        help="Hub id, path or short name (smollm2-135m) of the model to evaluate (needs --evaluator and --texts; default: the toy demo)",
    )
    parser.add_argument(
        "--evaluator",
        help="Hub id, path or short name of the evaluator, e.g. gemma-3-270m or meta-llama/Llama-3.1-8B (default: the toy demo)",
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
    parser.add_argument(
        "--trunc-len", type=int, default=None, help=f"K (default {DEFAULT_TRUNC_LEN}; {TOY_TRUNC_LEN} for the toy demo)"
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help=f"d (default {DEFAULT_SLIDING_WINDOW}; {TOY_SLIDING_WINDOW} for the toy demo)",
    )
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
    return parser


def main(argv=None, prog: str = PROG) -> None:
    """Run the toy demo, or with ``--model``/``--evaluator``/``--texts`` score real models.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is not a positive integer (the command prints it as
            ``<prog>: error: ...``).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if (args.model is None) != (args.evaluator is None):
        parser.error("--model and --evaluator go together")
    toy = args.model is None
    # the toy demo scores its own synthetic documents: options about the reader's texts would be ignored
    ignored = [
        option
        for option, value, default in (
            ("--texts", args.texts, None),
            ("--column", args.column, "text"),
            ("--max-length", args.max_length, None),
            ("--device", args.device, None),
        )
        if value != default
    ]
    if toy and ignored:
        parser.error(
            f"{', '.join(ignored)} need(s) --model and --evaluator (the models to score your texts with); without "
            "them the quickstart runs its toy demo on synthetic documents."
        )
    # None is "not given" (0 is a value, refused below, not the default)
    if args.trunc_len is None:
        args.trunc_len = TOY_TRUNC_LEN if toy else DEFAULT_TRUNC_LEN
    if args.sliding_window is None:
        args.sliding_window = TOY_SLIDING_WINDOW if toy else DEFAULT_SLIDING_WINDOW
    check_numbers(parser, args)
    (toy_demo if toy else hub_demo)(args)


def check_numbers(parser: argparse.ArgumentParser, args) -> None:
    """Refuse counts that are not positive (``--steps -5`` would train nothing and print NaN) and K and d
    as the metric refuses them, with one usage line, before any model is trained or loaded."""
    from longppl.settings import WindowSettings, require_int

    try:
        WindowSettings(args.trunc_len, args.sliding_window)
        for option in ("--steps", "--documents", "--window"):
            require_int(option, getattr(args, option[2:]))
        if args.max_length is not None:
            require_int("--max-length", args.max_length, minimum=2)
    except ValueError as err:
        parser.error(str(err))


def cli(argv=None) -> int:
    """The ``longppl-quickstart`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
