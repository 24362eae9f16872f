"""Evaluate one or more models against a key-token cache: one perplexity pass per model, no evaluator.

    longppl-evaluate --key-tokens key_tokens/govreport-llama3.1-8b \\
        --models Qwen/Qwen2-7B mistralai/Mistral-7B-v0.1 --output-dir results/

prints a table (model, LongPPL, PPL, key tokens, tokens) and writes ``results.json`` (per-text
values too) and ``results.csv`` into ``--output-dir``: a new or empty folder, or one of an earlier run
(its ``longppl_outputs.json`` lists the files that run wrote; those this run does not write go). A
folder of other files is refused, so no file of yours is overwritten. With ``--benchmark-scores scores.csv``
(columns ``model,score``, e.g. LongBench averages) it also reports the Pearson and Spearman
correlations of LongPPL and of PPL with the scores and draws them like the paper's Figure 1(b)
(``correlation.png``, short model names, least-squares lines; needs matplotlib). Models without key
tokens (LongPPL NaN) get a warning saying why; with fewer than 2 models of finite LongPPL and PPL the
correlation and its figure are skipped.

The cache (``longppl-score``) is a directory or a Hub dataset name; the texts are the cache's own.
A cache holding several evaluators or settings needs ``--evaluator`` (its name, folder name or the
start of its fingerprint, as the error lists them) and/or ``--trunc-len`` / ``--sliding-window`` to pick one.

(``scripts/evaluate_longppl.py`` and ``python -m longppl.tools.evaluate_models`` run the same command.)
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys

# Only the standard library at import time: ``--help`` must not wait for torch, transformers or
# matplotlib, which are imported inside the functions that need them.
from longppl.commandline.running import run_command, tool_parser

# The name in usage lines and messages when main() is called from Python; commands show the name they
# were started by (commandline/running.py).
PROG = "evaluate_longppl.py"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    from longppl.commandline.cache_options import add_cache_arguments
    from longppl.settings import AGGREGATIONS, DEFAULT_AGGREGATION, DEFAULT_GAMMA, DEFAULT_MAX_TOKENS_PER_BATCH

    parser = tool_parser(prog, __doc__)
    add_cache_arguments(parser)
    parser.add_argument(
        "--models", nargs="+", required=True, help="Hub ids or local paths of the models to evaluate (required)"
    )
    parser.add_argument(
        "--output-dir",
        default="longppl_results",
        help="where results.json, results.csv and correlation.png go (default: %(default)s)",
    )
    parser.add_argument(
        "--benchmark-scores",
        help="CSV with columns model,score: correlate LongPPL and PPL with the scores and plot "
        "them (default: none, no correlation)",
    )
    parser.add_argument(
        "--benchmark-name",
        default="benchmark score",
        help="y-axis label of the correlation plot (default: %(default)s)",
    )
    parser.add_argument(
        "--soft",
        action="store_true",
        help="soft weights min(exp(LSD), gamma) instead of hard key tokens (paper Table 2; default: hard)",
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=DEFAULT_GAMMA,
        help="cap of the soft weights, used with --soft (default: %(default)g)",
    )
    parser.add_argument(
        "--aggregation",
        choices=tuple(AGGREGATIONS),
        default=DEFAULT_AGGREGATION,
        help="how per-text values make the corpus LongPPL and PPL; "
        + "; ".join(f"{name}: {words}" for name, words in AGGREGATIONS.items())
        + " (default: %(default)s)",
    )
    parser.add_argument(
        "--add-special-tokens",
        action="store_true",
        help="tokenize for the evaluated models with their special tokens (default: without, as the official code)",
    )
    parser.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=DEFAULT_MAX_TOKENS_PER_BATCH,
        help="token budget of one forward batch of an evaluated model; lower it if the GPU "
        "runs out of memory (default: %(default)s)",
    )
    parser.add_argument("--device", default=None, help="cuda, cpu or auto (default: GPU if available)")
    parser.add_argument(
        "--torch-dtype",
        default=None,
        help="dtype of the models: float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU)",
    )
    parser.add_argument(
        "--torch-compile", action="store_true", help="compile the models' transformer blocks (default: off)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars (default: shown)")
    return parser


def parse_args(argv=None, prog: str = PROG):
    return build_parser(prog).parse_args(argv)


def read_benchmark_scores(path: str, models: list[str]) -> dict[str, float]:
    """``{model: score}`` from a CSV with a header holding ``model`` and ``score``.

    Raises:
        ValueError: a missing column, a score that is not a number, a model listed twice, or a
            model that was not evaluated (with the line, and what to do).
    """
    scores: dict[str, float] = {}
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"model", "score"} <= set(reader.fieldnames):
            raise ValueError(f"{path} needs a header with the columns 'model' and 'score' (found {reader.fieldnames}).")
        for line, record in enumerate(reader, 2):
            name = (record["model"] or "").strip()
            try:
                score = float(record["score"])
            except (TypeError, ValueError):
                raise ValueError(
                    f"{path}, line {line}: score {record['score']!r} of {name!r} is not a number."
                ) from None
            if name in scores:
                raise ValueError(f"{path}, line {line}: model {name!r} is listed twice.")
            scores[name] = score
    unknown = [name for name in scores if name not in models]
    if unknown:
        raise ValueError(
            f"{path} names models that were not evaluated: {unknown} (evaluated: {models}). Add them to "
            "--models or remove them from the file; names must match --models exactly."
        )
    return scores


def correlations(rows: list[tuple[str, dict]], scores: dict[str, float]) -> dict:
    """Pearson and Spearman of LongPPL and of PPL with the benchmark scores, over the models that
    have a score and a finite LongPPL and PPL."""
    from longppl.commandline.correlation import pearson, spearman

    used = [(name, r) for name, r in rows if name in scores and math.isfinite(r["longppl"]) and math.isfinite(r["ppl"])]
    x_long = [r["longppl"] for _, r in used]
    x_ppl = [r["ppl"] for _, r in used]
    y = [scores[name] for name, _ in used]
    return {
        "models": [name for name, _ in used],
        "longppl": {"pearson": pearson(x_long, y), "spearman": spearman(x_long, y)},
        "ppl": {"pearson": pearson(x_ppl, y), "spearman": spearman(x_ppl, y)},
    }


def check_output_dir(path: str) -> None:
    """Refuse an ``--output-dir`` the results cannot go to (under a file, through a loop of links, not
    writable) or must not go to (a folder of the user's own files: :func:`~longppl.commandline.reports.check_results_folder`),
    before the models are scored rather than when the results are written."""
    from longppl.commandline.reports import check_results_folder

    check_results_folder(path, "--output-dir")


def warn(prog: str, message: str) -> None:
    print(f"{prog}: warning: {message}", file=sys.stderr)


def main(argv=None, prog: str = PROG) -> dict:
    """Run the tool; returns ``{"results": [(model, result)], "correlations": ... or None}``
    (``None`` also when fewer than 2 models have a finite LongPPL and PPL: nothing is correlated).

    Raises:
        ValueError: a cache or score file the tool cannot use, with what to do; the command prints it
            as ``<prog>: error: ...``.
    """
    args = parse_args(argv, prog)
    from longppl.settings import KeyTokenRule

    rule = KeyTokenRule.of(args)  # checked before any loading
    check_output_dir(args.output_dir)
    # Where the cache and the models are (here, or on the Hub: asked once) is settled before torch
    # loads or any model is scored, so that a wrong name fails in a second (longppl.models.sources).
    from longppl.models.sources import check_model_source, locate_cache

    locate_cache(args.key_tokens, "--key-tokens")
    for name in args.models:
        check_model_source(name, "--models", tokenizer=True)
    from longppl.commandline.cache_options import open_selected
    from longppl.commandline.reports import (
        explain_missing_key_tokens,
        format_table,
        write_outputs,
        write_results_csv,
        write_results_json,
    )
    from longppl.core.scoring import document_results, score_with_model, summarize_results, text_key_weights
    from longppl.models.loading import load_causal_lm

    cache, settings, fingerprint, rows = open_selected(args)
    scores = read_benchmark_scores(args.benchmark_scores, args.models) if args.benchmark_scores else None
    texts = cache.texts(rows)
    evaluator_scores = [cache.scores(row) for row in rows]
    evaluator = cache.row(rows[0])["evaluator_name"] if rows else ""
    print(
        f"{len(texts)} texts of the key-token cache (evaluator {evaluator or '(unnamed)'}, {settings.describe()}); "
        f"corpus values by aggregation={args.aggregation}"
    )

    results = []
    for name in args.models:
        model, tokenizer = load_causal_lm(name, args.device, args.torch_dtype)
        model_scores = score_with_model(
            model,
            tokenizer,
            texts,
            args.max_tokens_per_batch,
            add_special_tokens=args.add_special_tokens,
            progress=not args.no_progress,
            torch_compile=args.torch_compile,
        )
        del model
        gc.collect()
        weights = text_key_weights(texts, evaluator_scores, model_scores, rule=rule)
        per_text = document_results(model_scores, weights)
        results.append((name, summarize_results(per_text, args.aggregation, rule.soft)))
    print("\n" + format_table(results, soft=rule.soft))
    keyless = [name for name, r in results if not math.isfinite(r["longppl"])]
    if keyless:
        reason = explain_missing_key_tokens(evaluator_scores, rule, settings.trunc_len)
        warn(prog, f"no key tokens for {', '.join(keyless)}, so LongPPL is NaN: {reason}")

    meta = dict(
        key_tokens=args.key_tokens,
        evaluator=evaluator,
        evaluator_fingerprint=fingerprint,
        **vars(settings),
        **vars(rule),
        aggregation=args.aggregation,
        texts=len(texts),
    )
    found = None
    outputs = {}  # {file name in --output-dir: write(path)}, written at the end
    if scores is not None:
        found = correlations(results, scores)
        if len(found["models"]) < 2:
            warn(
                prog,
                f"correlation with {args.benchmark_name} skipped, and no correlation.png drawn: only "
                f"{len(found['models'])} of the {len(scores)} models with a score have a finite LongPPL and "
                "PPL, and a correlation needs at least 2.",
            )
            found = None
        else:
            print(f"\nCorrelation with {args.benchmark_name} over {len(found['models'])} models:")
            for metric in ("longppl", "ppl"):
                values = found[metric]
                print(f"  {metric:<8} Pearson {values['pearson']:+.3f}   Spearman {values['spearman']:+.3f}")
            from longppl.commandline.correlation import undefined_because

            chosen = dict(results)
            why = undefined_because(
                {
                    "the benchmark scores": [scores[name] for name in found["models"]],
                    "LongPPL": [chosen[name]["longppl"] for name in found["models"]],
                    "PPL": [chosen[name]["ppl"] for name in found["models"]],
                }
            )
            if why:
                print(f"  (nan: {why})")
            if len(found["models"]) < 3:
                print("  (fewer than 3 models: a correlation is not meaningful)")
            from longppl.commandline.figures import correlation_scatter

            chosen = [(name, r) for name, r in results if name in found["models"]]
            outputs["correlation.png"] = lambda path: correlation_scatter(
                path,
                [n for n, _ in chosen],
                [r["longppl"] for _, r in chosen],
                [r["ppl"] for _, r in chosen],
                [scores[n] for n, _ in chosen],
                args.benchmark_name,
            )
        meta["correlations"] = found
    outputs["results.json"] = lambda path: write_results_json(path, results, meta)
    outputs["results.csv"] = lambda path: write_results_csv(path, results)
    # the folder's files of an earlier run that this one does not make (an old correlation.png) go
    write_outputs(args.output_dir, "longppl evaluate", outputs)
    print(
        f"\nwrote {os.path.join(args.output_dir, 'results.json')}, results.csv" + (", correlation.png" if found else "")
    )
    return {"results": results, "correlations": found}


def cli(argv=None) -> int:
    """The ``longppl-evaluate`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
