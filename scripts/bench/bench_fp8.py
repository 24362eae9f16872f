#!/usr/bin/env python
"""An fp8 evaluator (``evaluator_precision="fp8"``, ``longppl.models.precision``) against bf16, in three
parts, one command each; each writes its JSON into ``--out-dir`` (``speed.json``, ``fidelity.json``,
``parallel.json``) and prints a short table.

**A. speed** (one GPU): a random-weight evaluator of the Llama-3.1-8B shape scores one document per
length (default 32k and 128k tokens; K=4096, d=1024) as ``longppl score`` builds a cache row: its
full pass and its short windows (``score_with_evaluator(per_document=True)``; the Arrow write is left
out). Four variants in one process, one model: bf16 eager (the baseline), bf16 compiled, then the
model converted to fp8 (timed), fp8 eager, fp8 compiled. Each variant scores the first document once
untimed (compilation, allocator), then each length ``--repeats`` times: median seconds, peak GiB
(``max_memory_allocated``, weights included), and both as ratios to bf16 eager (time also to bf16
compiled). The rows of each variant are compared with bf16 eager's (largest log-prob difference, the
top 5% of tokens by LSD still above the threshold: random weights give few key tokens).

**B. fidelity** (trained models): for each ``--models`` folder (a Llama-architecture model saved
with ``save_pretrained``, with its tokenizer), the documents (``--texts`` JSONL, or a reproduction
run folder's ``data/validation.jsonl`` with ``--run-folder``) are scored in bf16, then the model is
converted and scores them again in fp8 (compiled by default, as the library does). Reported, each
with a bootstrap 95% interval over documents (``--bootstrap`` resamples): the Jaccard index of the
key-token sets (pooled over documents, and the mean over documents), flipped tokens per 1,000 scored
tokens (scored: with a short-context score), the relative change of the evaluator's own LongPPL
(each precision with its own key tokens and log-probs, pooled) and of its PPL, and, with
``--evaluated``, the relative change of other models' LongPPL under the fp8 key tokens against the
bf16 ones (the metric's use: only the evaluator is fp8). torchao's float8 needs Linear dimensions
that are multiples of 16 (hidden 384 and MLP 1024 qualify). Small trained models are a weak proxy
of large ones (outlier features grow with scale): ``--random-init`` adds each folder's architecture
with random weights, as a control.

**C. parallel** (4 GPUs): tensor parallelism at the Llama-3.1-8B shape, TP=4 against one GPU on a
32k document (the target: TP=4 <= 0.35x one GPU), the document timed twice; the Mistral Large 2
shape (123B, 246 GB in bf16) split TP=4 in bf16, on one 32k document timed once and a corpus of 2
documents of 32k; and TP=2 in fp8 (a rank holds 61 GB of float8 weights), the document timed once
(``--repeats``, ``--corpus-docs``). Weights are drawn on each rank's GPU from the parameter's name,
each rank its own slices only (``common.random_model``): the 123B model is never whole
anywhere, and the fp8 one is converted block by block as it is drawn (a real checkpoint is converted
after loading, so a rank must hold its bf16 share first: 123 GB at TP=2). A run's untimed first call
scores a document of the timed length where the run compiles (fp8, the library's default), so that
the timed ones run graphs already compiled (:func:`first_call_tokens`), and a short one otherwise.
Each run is a process (TP: torchrun); peak memory per GPU; the JSON is rewritten after every run, so
a run cut off keeps the ones before. The runs share ``--time-budget`` seconds (default 510, a
9-minute device call for one 123B run or the two 8B ones: a run that would start with less than 30
left is recorded as not run), each allowed what is left (``--timeout``: less). Before a run starts
its scoring time is estimated (:func:`run_estimate`: its FLOPs at :data:`ASSUMED_TFLOPS` per GPU)
and printed. A run past its time is stopped whole (:func:`stop_run`: launcher and ranks) and
recorded as ``"timeout"``; each rank appends its phases to a progress file in ``--work``, whose
first and last lines the run's record keeps. The parent process never touches a GPU (the workers
record its name). Whether the fp8 blocks compile under tensor parallelism is recorded: a compilation
error is kept and the run goes on eagerly.

    python scripts/bench/bench_fp8.py speed --out-dir bench_fp8                       # one GPU, ~5 min on an H100
    python scripts/bench/bench_fp8.py fidelity --out-dir bench_fp8 --models RUN/models/E1 --run-folder RUN \\
        --trunc-len 256 --sliding-window 128                                    # minutes
    python scripts/bench/bench_fp8.py parallel --out-dir bench_fp8/8b --runs 8b-one 8b-tp4   # 4 GPUs; each of
    python scripts/bench/bench_fp8.py parallel --out-dir bench_fp8/123b-tp4 --runs 123b-tp4  # these three fits
    python scripts/bench/bench_fp8.py parallel --out-dir bench_fp8/123b-fp8 --runs 123b-tp2-fp8  # 9 minutes
    python scripts/bench/bench_fp8.py speed --smoke --out-dir /tmp/fp8                # CPU: tiny shape, float32,
    python scripts/bench/bench_fp8.py parallel --smoke --out-dir /tmp/fp8             # no fp8 (skipped, with why)

On the CPU (``--smoke``) the fp8 variants are recorded as skipped with the library's own refusal,
"compiled" uses ``torch.compile``'s eager backend (inductor on a CPU takes minutes), and part B
compares bf16 with bf16 (``--against bf16``: Jaccard 1, nothing flips).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
from common import (
    CRS,
    LLAMA_SHAPES,
    MISTRAL_LARGE_2_SHAPE,
    TINY_LLAMA_SHAPE,
    byte_documents,
    byte_level_config,
    compare_rows,
    compare_saved_rows,
    measure,
    random_model,
    save_rows,
    timed_on,
    write_json,
)

from longppl.commandline.running import tool_parser
from longppl.settings import DEFAULT_ALPHA, DEFAULT_BETA, EVALUATOR_PRECISIONS, require_int

# torch, transformers and torchao load inside the functions that use them: `--help` is immediate.

SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", **LLAMA_SHAPES["llama-3.1-8b"]),
    "mistral-large-2": dict(model_type="mistral", **MISTRAL_LARGE_2_SHAPE),
    "tiny": dict(model_type="llama", **TINY_LLAMA_SHAPE),
}
#: Part C's runs: shape, tensor-parallel size (1: one GPU), precision, and what is scored: the document
#: ``repeats`` times (timed; the median kept), then a corpus of ``corpus_docs`` documents (0: none). The
#: 123B runs score less by default, so that each fits a device call of minutes (``--repeats``,
#: ``--corpus-docs`` change them).
PARALLEL_RUNS = {
    "8b-one": dict(shape="llama-3.1-8b", tp=1, precision="bf16", repeats=2, corpus_docs=0),
    "8b-tp4": dict(shape="llama-3.1-8b", tp=4, precision="bf16", repeats=2, corpus_docs=0),
    "123b-tp4": dict(shape="mistral-large-2", tp=4, precision="bf16", repeats=1, corpus_docs=2),
    "123b-tp2-fp8": dict(shape="mistral-large-2", tp=2, precision="fp8", repeats=1, corpus_docs=0),
}
#: Throughput assumed per GPU (TFLOP/s) by the estimate of a run's scoring time printed before it starts
#: (H100-class dense products as long passes reach them): for judging the time budget, not a measurement.
ASSUMED_TFLOPS = {"bf16": 400.0, "fp8": 700.0}
#: Part C's K and d (the smoke runs': 64, 16).
PARALLEL_WINDOWS, SMOKE_WINDOWS = (4096, 1024), (64, 16)
#: Lines of each rank's progress file kept in a run's record: its first ones (start, process group,
#: weights, first call) and its last ones.
PROGRESS_HEAD, PROGRESS_TAIL = 4, 8
#: Seconds a run's processes get to end after SIGTERM before they are killed.
STOP_GRACE = 10.0
#: The smoke runs' stand-ins: the tiny shape, 2 gloo processes for a split.
SMOKE_TP = 2
#: Part C's target: TP=4 time over one GPU's at the 8B shape on the 32k document.
TP4_TARGET = 0.35
#: Part B's statistics, from per-document sums ``s`` (one value, or one per bootstrap resample).
STATISTICS = {
    "jaccard_pooled": lambda s: s["inter"] / s["union"],
    "jaccard_mean": lambda s: s["jaccard_sum"] / s["jaccard_docs"],
    "flips_per_1000_scored": lambda s: 1000.0 * s["xor"] / s["scored"],
    "longppl_rel_change": lambda s: np.exp(s["key_nll_b"] / s["keys_b"] - s["key_nll_a"] / s["keys_a"]) - 1.0,
    "ppl_rel_change": lambda s: np.exp(s["nll_b"] / s["predicted_b"] - s["nll_a"] / s["predicted_a"]) - 1.0,
    "top5pct_lsd_jaccard_pooled": lambda s: s["top_inter"] / s["top_union"],
}
#: The statistics of an evaluated model's LongPPL under the two key-token sets.
EVALUATED_STATISTICS = {
    "longppl_rel_change": lambda s: np.exp(s["key_nll_b"] / s["keys_b"] - s["key_nll_a"] / s["keys_a"]) - 1.0,
}


def config_of(shape: str):
    return byte_level_config(SHAPES[shape])


def versions(device: str | None = "cuda") -> dict:
    """The libraries' versions, and the name of ``device`` (``None``: not asked, so that a parent process
    leaves the GPUs to its workers: asking creates a CUDA context there)."""
    import torch
    import transformers

    from longppl.models.precision import torchao_version

    found = dict(torch=torch.__version__, transformers=transformers.__version__, torchao=torchao_version())
    if device is not None:
        found["device"] = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return found


def fp8_refusal(device: str) -> str | None:
    """Why fp8 cannot run here (the library's own one-line refusal), or ``None``."""
    import torch

    from longppl.models.precision import check_precision

    try:
        check_precision("fp8", device, torch.bfloat16)
    except ValueError as err:
        return str(err)
    return None


def scorer(tokenizer, settings, smoke: bool):
    """``score(model, texts, compiled)``: ``score_with_evaluator`` per document, as ``longppl score``
    builds cache rows; on the CPU (``smoke``) compiled with ``torch.compile``'s eager backend."""
    from longppl.core.compilation import compiled_blocks
    from longppl.core.scoring import score_with_evaluator

    def score(model, texts, compiled: bool):
        library = compiled and not smoke  # the library's own compilation (inductor)
        with compiled_blocks(model, compiled and smoke, backend="eager"):
            return score_with_evaluator(
                model, tokenizer, texts, settings, progress=False, per_document=True, torch_compile=library
            )

    return score


def ratio(value, base) -> float | None:
    return round(value / base, 3) if value and base else None


# ---------------------------------------------------------------------------------------------- A


def speed(args) -> dict:
    import torch

    from longce.data import byte_level_tokenizer
    from longppl.models.precision import to_precision
    from longppl.settings import KeyTokenSettings

    device = "cpu" if args.smoke else "cuda"
    if device == "cpu":
        torch.set_num_threads(1)
    shape = "tiny" if args.smoke else args.shape
    dtype = torch.float32 if args.smoke else torch.bfloat16
    K, d = (64, 16) if args.smoke else (args.trunc_len, args.sliding_window)
    lengths = args.lengths or ([300, 500] if args.smoke else [32768, 131072])
    repeats = args.repeats or ([2, 1] if args.smoke else [3, 1])
    repeats = (repeats + [repeats[-1]] * len(lengths))[: len(lengths)]
    documents = byte_documents(args.data, lengths)
    score = scorer(byte_level_tokenizer(), KeyTokenSettings(K, d), args.smoke)
    refusal = fp8_refusal(device)
    out = dict(part="speed", shape=shape, trunc_len=K, sliding_window=d, lengths=lengths, repeats=repeats)
    out.update(versions(), rows=[], comparisons={}, conversion=None)
    model = random_model(config_of(shape), dtype, device, args.init_std, args.seed)
    rows_of = {}
    for precision, compiled in (("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)):
        variant = f"{precision} {'compiled' if compiled else 'eager'}"
        if precision == "fp8" and refusal is not None:
            out["rows"].append(dict(variant=variant, skipped=refusal))
            continue
        if precision == "fp8" and out["conversion"] is None:
            seconds, peak, _ = measure(lambda: to_precision(model, "fp8"), device)
            out["conversion"] = dict(seconds=round(seconds, 3), peak_gib=round(peak, 2))
        first, _, _ = measure(lambda: score(model, documents[:1], compiled), device)  # compiles, warms
        for length, document, count in zip(lengths, documents, repeats):
            times, peaks = [], []
            for _ in range(count):
                seconds, peak, scores = measure(lambda: score(model, [document], compiled), device)
                times.append(seconds)
                peaks.append(peak)
            median = statistics.median(times)
            out["rows"].append(
                dict(variant=variant, precision=precision, compiled=compiled, tokens=length,
                     seconds=round(median, 3), times=[round(t, 3) for t in times], first_call_seconds=round(first, 3),
                     tokens_per_s=round(length / median, 1),
                     peak_gib=round(max(peaks), 2) if device == "cuda" else None)
            )  # fmt: skip
            rows_of[variant, length] = [(s.lp_long, s.lp_short) for s in scores]
        print(f"{variant}: done ({time.strftime('%H:%M:%S')})", flush=True)
    timed = [row for row in out["rows"] if "seconds" in row]
    for row in timed:
        same = {r["variant"]: r for r in timed if r["tokens"] == row["tokens"]}
        base, compiled_base = same.get("bf16 eager"), same.get("bf16 compiled")
        row["time_vs_bf16_eager"] = ratio(row["seconds"], base and base["seconds"])
        row["time_vs_bf16_compiled"] = ratio(row["seconds"], compiled_base and compiled_base["seconds"])
        row["peak_vs_bf16_eager"] = ratio(row["peak_gib"], base and base["peak_gib"])
        if row["variant"] != "bf16 eager" and ("bf16 eager", row["tokens"]) in rows_of:
            found = compare_rows(rows_of[row["variant"], row["tokens"]], rows_of["bf16 eager", row["tokens"]])
            out["comparisons"][f"{row['variant']} vs bf16 eager, {row['tokens']} tokens"] = found
    write_json(os.path.join(args.out_dir, "speed.json"), out)
    print(f"\n{out['device']}, {shape} shape, K={K}, d={d}; ratios against bf16 eager in this process")
    print("| variant | tokens | s (median) | × bf16 eager | × bf16 compiled | peak GiB | × bf16 eager |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in out["rows"]:
        if "skipped" in row:
            print(f"| {row['variant']} | skipped: {row['skipped'][:90]}... |")
            continue
        print(
            f"| {row['variant']} | {row['tokens']} | {row['seconds']:.3f} | {row['time_vs_bf16_eager']} | "
            f"{row['time_vs_bf16_compiled']} | {row['peak_gib']} | {row['peak_vs_bf16_eager']} |"
        )
    return out


# ---------------------------------------------------------------------------------------------- B


def document_sums(a, b, rule) -> dict:
    """The per-document sums of :data:`STATISTICS` for one document scored twice (``a``: the
    reference, ``b``: the other precision; ``EvaluatorScores``)."""
    from longppl.core.scoring import document_result
    from longppl.rules.key_tokens import key_token_mask

    keys_a, keys_b = key_token_mask(a.lp_long, a.lp_short, rule), key_token_mask(b.lp_long, b.lp_short, rule)
    union = int((keys_a | keys_b).sum())
    result_a = document_result(a.lp_long, keys_a.astype(np.float64))  # the evaluator's own LongPPL and PPL
    result_b = document_result(b.lp_long, keys_b.astype(np.float64))
    lsd_a, lsd_b = a.lp_long - a.lp_short, b.lp_long - b.lp_short
    top_inter = top_union = 0
    if np.isfinite(lsd_a).any():
        threshold = np.nanquantile(lsd_a, 0.95)
        top_a, top_b = np.nan_to_num(lsd_a, nan=-np.inf) > threshold, np.nan_to_num(lsd_b, nan=-np.inf) > threshold
        top_inter, top_union = int((top_a & top_b).sum()), int((top_a | top_b).sum())
    return dict(
        inter=int((keys_a & keys_b).sum()),
        union=union,
        xor=int((keys_a ^ keys_b).sum()),
        scored=int((~np.isnan(a.lp_short)).sum()),
        jaccard_sum=(keys_a & keys_b).sum() / union if union else 0.0,
        jaccard_docs=1 if union else 0,
        key_nll_a=result_a.key_nll,
        keys_a=result_a.n_key_tokens,
        key_nll_b=result_b.key_nll,
        keys_b=result_b.n_key_tokens,
        nll_a=result_a.nll,
        predicted_a=result_a.n_predicted,
        nll_b=result_b.nll,
        predicted_b=result_b.n_predicted,
        top_inter=top_inter,
        top_union=top_union,
    )


def bootstrap(per_document: list[dict], statistics_: dict, samples: int, seed: int) -> dict:
    """Each statistic on the whole corpus, with a 95% interval from ``samples`` resamples of the
    documents with replacement (percentiles 2.5 and 97.5; a resample where a statistic is undefined,
    e.g. no key token, is left out of its interval): ``{name: {"value", "low", "high"}}``."""
    names = list(per_document[0])
    table = {name: np.array([float(doc[name]) for doc in per_document]) for name in names}
    picks = np.random.default_rng(seed).integers(0, len(per_document), size=(samples, len(per_document)))
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        whole = {name: values.sum() for name, values in table.items()}
        resampled = {name: values[picks].sum(axis=1) for name, values in table.items()}
        for name, statistic in statistics_.items():
            value, draws = float(statistic(whole)), statistic(resampled)
            draws = draws[np.isfinite(draws)]
            low, high = np.percentile(draws, [2.5, 97.5]) if draws.size else (np.nan, np.nan)
            out[name] = dict(value=value, low=float(low), high=float(high))
    return out


def read_texts(args) -> list[str]:
    from longppl.commandline.corpus import read_documents

    if (args.texts is None) == (args.run_folder is None):
        raise ValueError(
            "pass the documents as --texts FILE or --run-folder RUN (its data/validation.jsonl), one of them."
        )
    source = args.texts or os.path.join(args.run_folder, "data", "validation.jsonl")
    texts = read_documents(source, args.text_column, argument="--texts" if args.texts else "--run-folder")
    return texts[: args.documents] if args.documents else texts


def fidelity(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longppl.core.scoring import document_results, score_with_model, text_key_weights
    from longppl.models.loading import load_model, load_tokenizer
    from longppl.models.precision import check_precision, to_precision
    from longppl.settings import KeyTokenRule, KeyTokenSettings, evaluator_compiles

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    against = "bf16" if args.smoke else args.against
    texts = read_texts(args)
    settings, rule = KeyTokenSettings(args.trunc_len, args.sliding_window), KeyTokenRule.of(args)
    compiled = evaluator_compiles(args.torch_compile, against)
    out = dict(part="fidelity", against=against, compiled=compiled, documents=len(texts), trunc_len=args.trunc_len,
               sliding_window=args.sliding_window, alpha=args.alpha, beta=args.beta, bootstrap=args.bootstrap,
               pooled="LongPPL and PPL pooled over documents: exp(total NLL / count)", models=[])  # fmt: skip
    out.update(versions())
    evaluated = [(folder, load_tokenizer(folder)) for folder in args.evaluated]
    evaluated_scores = {}  # an evaluated model's scores do not depend on the evaluator: scored once
    entries = [(folder, False) for folder in args.models] + [
        (folder, True) for folder in args.models if args.random_init
    ]
    for folder, random_init in entries:
        name = folder + (" (random init)" if random_init else "")
        record = dict(model=name)
        out["models"].append(record)
        tokenizer = load_tokenizer(folder)
        if random_init:
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype).to(device).eval()
        else:
            model = load_model(folder, device, dtype)

        score = scorer(tokenizer, settings, args.smoke)
        record["bf16_seconds"], _, reference = measure(lambda: score(model, texts, False), device)  # eager
        try:
            check_precision(against, device, dtype)
            to_precision(model, against)
        except ValueError as err:
            record["skipped"] = str(err)
            continue
        record["other_seconds_compilation_included"], _, other = measure(lambda: score(model, texts, compiled), device)
        record["tokens"] = int(sum(s.input_ids.shape[0] for s in reference))
        record["max_abs_diff"] = {
            kind: max(float(np.nanmax(np.abs(getattr(a, kind) - getattr(b, kind)), initial=0.0))
                      for a, b in zip(reference, other)) for kind in ("lp_long", "lp_short")
        }  # fmt: skip
        per_document = [document_sums(a, b, rule) for a, b in zip(reference, other)]
        record["key_tokens"] = dict(bf16=int(sum(d["keys_a"] for d in per_document)),
                                    other=int(sum(d["keys_b"] for d in per_document)))  # fmt: skip
        record["scored_tokens"] = int(sum(d["scored"] for d in per_document))
        record["statistics"] = bootstrap(per_document, STATISTICS, args.bootstrap, args.seed)
        record["evaluated"] = {}
        for evaluated_folder, evaluated_tokenizer in evaluated:
            if evaluated_folder not in evaluated_scores:
                evaluated_model = load_model(evaluated_folder, device, dtype)
                evaluated_scores[evaluated_folder] = score_with_model(
                    evaluated_model, evaluated_tokenizer, texts, progress=False
                )
                evaluated_model = None  # freed before the next one loads
            model_scores = evaluated_scores[evaluated_folder]
            results = [
                document_results(model_scores, text_key_weights(texts, scores, model_scores, rule=rule))
                for scores in (reference, other)
            ]
            sums = [dict(key_nll_a=a.key_nll, keys_a=a.n_key_tokens, key_nll_b=b.key_nll, keys_b=b.n_key_tokens)
                    for a, b in zip(*results)]  # fmt: skip
            record["evaluated"][evaluated_folder] = bootstrap(sums, EVALUATED_STATISTICS, args.bootstrap, args.seed)
        model = None  # freed before the next one loads
        write_json(os.path.join(args.out_dir, "fidelity.json"), out)
    write_json(os.path.join(args.out_dir, "fidelity.json"), out)
    print(f"\n{out['device']}: {against} against bf16, {len(texts)} documents, K={args.trunc_len}, "
          f"d={args.sliding_window}, alpha={args.alpha}, beta={args.beta}; 95% bootstrap intervals over documents")  # fmt: skip
    print("| model | key tokens bf16 / other | Jaccard (pooled) | Jaccard (mean) | flips / 1000 | LongPPL Δ | PPL Δ |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for record in out["models"]:
        if "skipped" in record:
            print(f"| {record['model']} | skipped: {record['skipped'][:90]}... |")
            continue
        stats = record["statistics"]

        def cell(name, scale=1.0, digits=4):
            s = stats[name]
            return f"{s['value'] * scale:.{digits}f} [{s['low'] * scale:.{digits}f}, {s['high'] * scale:.{digits}f}]"

        print(
            f"| {record['model']} | {record['key_tokens']['bf16']} / {record['key_tokens']['other']} | "
            f"{cell('jaccard_pooled')} | {cell('jaccard_mean')} | {cell('flips_per_1000_scored', digits=2)} | "
            f"{cell('longppl_rel_change', 100, 2)}% | {cell('ppl_rel_change', 100, 3)}% |"
        )
    return out


# ---------------------------------------------------------------------------------------------- C


def parallel_sizes(args) -> dict:
    """Part C's runs as this invocation runs them (``--smoke``: the tiny shape, 2 gloo ranks, short texts)."""
    runs = {}
    for name in args.runs:
        run = dict(PARALLEL_RUNS[name])
        if args.repeats is not None:
            run["repeats"] = args.repeats
        if args.corpus_docs is not None and run["corpus_docs"]:
            run["corpus_docs"] = args.corpus_docs
        if args.smoke:
            run.update(shape="tiny", tp=SMOKE_TP if run["tp"] > 1 else 1, corpus_docs=min(run["corpus_docs"], 2))
        runs[name] = run
    return runs


def progress_path(work: str, name: str, rank: int) -> str:
    return os.path.join(work, f"progress-{name}-{rank}.txt")


def progress_writer(path: str):
    """``note(phase, **fields)``: appends ``HH:MM:SS +seconds phase key=value ...`` to ``path`` (seconds
    since this call), flushed at once, so that what a run cut off had done is on disk."""
    began = time.perf_counter()

    def note(phase: str, **fields) -> None:
        line = f"{time.strftime('%H:%M:%S')} +{time.perf_counter() - began:.1f}s {phase}"
        line += "".join(f" {key}={value}" for key, value in fields.items())
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")

    return note


def parallel_worker(args) -> None:
    """One process of the run ``--worker``: build, warm up, time the parts; its record to ``--work``, and
    its phases, as they end, to its progress file (:func:`progress_writer`)."""
    note = progress_writer(progress_path(args.work, args.worker, int(os.environ.get("RANK", "0"))))
    note("start", pid=os.getpid())  # the parent stops a run cut off by these pids
    import torch

    from longce.data import byte_level_tokenizer
    from longppl.models.precision import convert_blocks_to_fp8
    from longppl.parallel import tensor_parallel
    from longppl.settings import KeyTokenSettings

    run = parallel_sizes(args)[args.worker]
    cpu = args.smoke
    distributed, state = run["tp"] > 1, None
    if distributed:
        from accelerate import PartialState

        state = PartialState(cpu=cpu)
        rank, device = state.process_index, ("cpu" if cpu else str(state.device))
        note("process group up", world=state.num_processes, device=device)
    else:
        rank, device = 0, ("cpu" if cpu else "cuda:0")
    if cpu:
        torch.set_num_threads(1)
    devices = [] if cpu else [torch.device(device).index]
    doc_tokens = 600 if args.smoke else args.doc_tokens
    K, d = SMOKE_WINDOWS if args.smoke else PARALLEL_WINDOWS
    first_tokens = first_call_tokens(run, doc_tokens, K, d)
    cuts = byte_documents(args.data, [first_tokens, doc_tokens] + [doc_tokens] * run["corpus_docs"])
    parts = {"document": cuts[1:2]}
    if run["corpus_docs"]:
        parts["corpus"] = cuts[2:]
    score = scorer(byte_level_tokenizer(), KeyTokenSettings(K, d), args.smoke)
    record = dict(run=args.worker, rank=rank, **run, **versions(device))
    refusal = fp8_refusal(device) if run["precision"] == "fp8" else None
    if refusal is not None:  # recorded, not run
        record["skipped"] = refusal
    else:
        try:
            mesh = tensor_parallel.group_mesh(run["tp"], torch.device(device).type) if distributed else None
            convert = (lambda block: convert_blocks_to_fp8([block])) if run["precision"] == "fp8" else None
            dtype = torch.float32 if cpu else torch.bfloat16
            seconds, peak, model = timed_on(
                lambda: random_model(
                    config_of(run["shape"]), dtype, device, args.init_std, args.seed, mesh, None, convert
                ),
                devices,
                distributed,
            )
            record.update(build_seconds=round(seconds, 2), weights_gib=peak)
            note("weights built", seconds=round(seconds, 1), gib=peak)
            compiled = run_compiles(run)
            try:  # the first call compiles (and warms the allocator and the communicators)
                first = timed_on(lambda: score(model, cuts[:1], compiled), devices, distributed)[0]
            except Exception as err:  # noqa: BLE001 - compiled split layers are untried: record it, run eagerly
                if not compiled or isinstance(err, torch.OutOfMemoryError):
                    raise
                record["compile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                note("compilation failed, eager from here", error=record["compile_error"][:120])
                compiled = False
                first = timed_on(lambda: score(model, cuts[:1], False), devices, distributed)[0]
            record.update(first_call_seconds=round(first, 2), compiled=compiled)
            note("first call done", seconds=round(first, 1), compiled=compiled, tokens=first_tokens)
            for part, texts in parts.items():
                count = run["repeats"] if part == "document" else 1
                times, peaks = [], []
                for repeat in range(count):
                    seconds, peak, scores = timed_on(lambda: score(model, texts, compiled), devices, distributed)
                    times.append(seconds)
                    peaks.append(peak)
                    note(f"{part} {repeat + 1}/{count} done", seconds=round(seconds, 1), documents=len(texts),
                         peak_gib=peak)  # fmt: skip
                median = statistics.median(times)
                tokens = sum(int(s.input_ids.shape[0]) for s in scores)
                record[part] = dict(seconds=round(median, 3), times=[round(t, 3) for t in times], tokens=tokens,
                                    tokens_per_s=round(tokens / median, 1), peak_gib=[max(p) for p in zip(*peaks)])  # fmt: skip
                if rank == 0:
                    save_rows(os.path.join(args.work, f"{args.worker}-{part}.npz"), scores)
        except torch.OutOfMemoryError as err:
            record["out_of_memory"] = str(err).splitlines()[0][:200]
            note("out of memory", error=record["out_of_memory"][:120])
    write_json(record_path(args.work, args.worker, rank), record)
    note("record written")
    if state is not None:
        state.destroy_process_group()


def record_path(work: str, name: str, rank: int) -> str:
    return os.path.join(work, f"record-{name}-{rank}.json")


def scoring_estimate(config, tokens: int, K: int, d: int) -> dict:
    """Estimated FLOPs of scoring one ``tokens``-token document as ``longppl score`` does: the full pass,
    and the short windows from the second on (``windows.window_bounds``; the first window's scores are
    the full pass's). ``2 x parameters x tokens x (1 + factor)``, the parameters of the products
    (blocks and LM head, not the embedding lookup), ``factor`` the windows' tokens over ``tokens``
    (4.2 at 32k tokens, K=4096, d=1024), plus causal attention's ``2 x layers x heads x head_dim x n^2``
    per pass of ``n`` tokens."""
    from longppl.core.windows import window_bounds
    from longppl.settings import WindowSettings

    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * config.intermediate_size
    products = config.num_hidden_layers * per_layer + config.vocab_size * h
    passes = [tokens] + [end - start for start, end in window_bounds(tokens, WindowSettings(K, d))[1:]]
    factor = (sum(passes) - tokens) / tokens
    attention = 2 * config.num_hidden_layers * heads * head_dim * sum(n * n for n in passes)
    flops = 2 * products * tokens * (1 + factor) + attention
    return dict(product_parameters=products, short_window_token_factor=round(factor, 3), flops_per_document=flops)


def run_compiles(run: dict) -> bool:
    """Whether a run's evaluator compiles its blocks: the library's default for its precision
    (``settings.evaluator_compiles``: fp8 compiles, bf16 runs eagerly)."""
    from longppl.settings import evaluator_compiles

    return evaluator_compiles(None, run["precision"])


def first_call_tokens(run: dict, doc_tokens: int, K: int, d: int) -> int:
    """Tokens of the document a run scores in its untimed first call. Where the run compiles
    (:func:`run_compiles`), the timed documents' length: the first call then compiles every graph
    their passes need (one per kind of pass: one sequence, a batch of windows, windows padded with a
    mask), and the timed documents find them all; a shorter document, cheaper, may leave one out,
    which a timed document then compiles. Otherwise a short one (``K + 2d + 7``: a long pass and two
    short windows), which warms the allocator and the communicators."""
    return doc_tokens if run_compiles(run) else K + 2 * d + 7


def run_estimate(run: dict, doc_tokens: int, K: int, d: int) -> dict:
    """:func:`scoring_estimate` of a run's documents (the first call's, :func:`first_call_tokens`, and
    the timed ones) and their seconds at :data:`ASSUMED_TFLOPS` per GPU: the scoring only (start,
    build and compilation come on top)."""
    config = config_of(run["shape"])
    estimate = scoring_estimate(config, doc_tokens, K, d)
    timed = run["repeats"] + run["corpus_docs"]
    first = first_call_tokens(run, doc_tokens, K, d)
    flops = timed * estimate["flops_per_document"] + scoring_estimate(config, first, K, d)["flops_per_document"]
    tflops = ASSUMED_TFLOPS[run["precision"]]
    return dict(estimate, documents_timed=timed, first_call_tokens=first, assumed_tflops_per_gpu=tflops,
                estimated_scoring_seconds=round(flops / (tflops * 1e12 * run["tp"]), 1))  # fmt: skip


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def ours(pid: int) -> bool:
    """Whether ``pid`` is still a process of this script (not another that reused the number)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return os.path.basename(__file__).encode() in handle.read()
    except OSError:
        return alive(pid)


def stop_run(process: subprocess.Popen, pids: list[int]) -> None:
    """End a run cut off by its timeout, launcher and ranks, so that nothing keeps running or keeps the
    parent's stdout open. The launcher was started in a session of its own: its process group gets
    SIGTERM (torchrun passes it on to its workers, each of which it starts in a session of its own),
    then, after :data:`STOP_GRACE` seconds, SIGKILL; the ranks' process groups (``pids``, from their
    progress files) get SIGKILL where they are still alive."""

    def signal_group(pid: int, sig) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        pass
    signal_group(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.perf_counter() + STOP_GRACE
    while any(alive(pid) for pid in pids) and time.perf_counter() < deadline:
        for pid in pids:
            if alive(pid) and ours(pid):
                signal_group(pid, signal.SIGKILL)
        time.sleep(0.2)


def terminated(signum, frame) -> None:
    """SIGTERM's handler in the parent of Part C's runs: raises ``SystemExit`` (status 143, as the signal
    would), so that the run going on is stopped (:func:`stop_run`) on the way out."""
    raise SystemExit(128 + signum)


def read_progress(work: str, name: str, tp: int) -> tuple[dict, list[int]]:
    """The first :data:`PROGRESS_HEAD` and last :data:`PROGRESS_TAIL` lines of each rank's progress file
    (``{rank: [line, ...]}``, a line in between saying how many were left out) and the ranks' pids."""
    lines, pids = {}, []
    for rank in range(tp):
        path = progress_path(work, name, rank)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as handle:
            every = handle.read().splitlines()
        left_out = len(every) - PROGRESS_HEAD - PROGRESS_TAIL
        if left_out > 0:
            every = [*every[:PROGRESS_HEAD], f"... {left_out} lines left out", *every[-PROGRESS_TAIL:]]
        lines[rank] = every
        found = re.search(r" start pid=(\d+)$", every[0]) if every else None
        pids += [int(found.group(1))] if found else []
    return lines, pids


def parallel(args) -> dict:
    import tempfile

    runs = parallel_sizes(args)
    work = args.work or tempfile.mkdtemp(prefix="bench-fp8-")
    os.makedirs(work, exist_ok=True)
    import torch

    out = dict(part="parallel", runs={}, work=work, target_tp4_vs_one=TP4_TARGET, time_budget=args.time_budget)
    out.update(versions(None))  # the device's name comes from the workers
    signal.signal(signal.SIGTERM, terminated)  # an exception, so that a run going on is stopped first
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    K, d = SMOKE_WINDOWS if args.smoke else PARALLEL_WINDOWS
    doc_tokens = 600 if args.smoke else args.doc_tokens
    passed = ["parallel", "--out-dir", args.out_dir, "--work", work, "--doc-tokens", str(args.doc_tokens)]
    passed += ["--init-std", str(args.init_std), "--seed", str(args.seed), "--data", args.data, "--runs", *args.runs]
    passed += [] if args.repeats is None else ["--repeats", str(args.repeats)]
    passed += [] if args.corpus_docs is None else ["--corpus-docs", str(args.corpus_docs)]
    passed += ["--smoke"] if args.smoke else []
    for name, run in runs.items():
        left = args.time_budget - (time.perf_counter() - started)
        if run["precision"] == "fp8" and not torch.cuda.is_available():  # (a worker checks a GPU's capability)
            out["runs"][name] = dict(run, skipped=fp8_refusal("cpu"))
            continue
        if left < 30:
            out["runs"][name] = dict(
                run, skipped=f"not run: the time budget (--time-budget {args.time_budget:g} s) was spent"
            )
            continue
        estimate = run_estimate(run, doc_tokens, K, d)
        timeout = min(args.timeout or left, left)
        print(
            f"{name}: {estimate['documents_timed']} timed document(s) of {doc_tokens} tokens "
            f"({estimate['flops_per_document'] / 1e15:.1f} PFLOP each) after an untimed one of "
            f"{estimate['first_call_tokens']}; scoring estimated at {estimate['estimated_scoring_seconds']:g} s "
            f"at {estimate['assumed_tflops_per_gpu']:g} TFLOP/s per GPU x {run['tp']}, plus start, build and "
            f"compilation; timeout {timeout:.0f} s "
            f"({time.strftime('%H:%M:%S')})",
            flush=True,
        )
        for rank in range(run["tp"]):  # a reused --work folder: this run's files are its own
            for path in (record_path(work, name, rank), progress_path(work, name, rank)):
                if os.path.exists(path):
                    os.remove(path)
        command = [sys.executable]
        if run["tp"] > 1:
            command += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run["tp"])]
        command += [os.path.abspath(__file__), *passed, "--worker", name]
        start = time.perf_counter()
        # a session of its own, so that it is stopped whole; a terminal's Ctrl-C no longer reaches it, so
        # this process stops it on an interruption or SIGTERM too
        process = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_run(process, read_progress(work, name, run["tp"])[1])
            status = "timeout"
        except BaseException:
            stop_run(process, read_progress(work, name, run["tp"])[1])
            raise
        progress, pids = read_progress(work, name, run["tp"])
        ranks = []
        for rank in range(run["tp"]):
            path = record_path(work, name, rank)
            if os.path.exists(path):
                with open(path) as handle:
                    ranks.append(json.load(handle))
        out["runs"][name] = dict(run, status=status, wall_seconds=round(time.perf_counter() - start, 1), ranks=ranks,
                                 estimate=estimate, progress=progress, launcher_pid=process.pid, rank_pids=pids)  # fmt: skip
        if ranks and all("skipped" in r for r in ranks):
            out["runs"][name]["skipped"] = ranks[0]["skipped"]
        out.setdefault("device", next((r["device"] for r in ranks if "device" in r), None))
        summarize_parallel(out, work)
        write_json(os.path.join(args.out_dir, "parallel.json"), out)
        print(f"{name}: status {status} ({time.strftime('%H:%M:%S')})", flush=True)
        if status != 0:
            for rank, lines in progress.items():
                print(f"  rank {rank}, last: {lines[-1] if lines else '(nothing)'}", flush=True)
    summarize_parallel(out, work)
    write_json(os.path.join(args.out_dir, "parallel.json"), out)
    print_parallel(out)
    return out


def summarize_parallel(out: dict, work: str) -> None:
    """The 8B ratio TP=4 / one GPU (and its target), and the rows of TP=4 against one GPU's."""
    runs = out["runs"]
    one, tp4 = (runs.get(name, {}).get("ranks") or [{}] for name in ("8b-one", "8b-tp4"))
    seconds = [r[0].get("document", {}).get("seconds") for r in (one, tp4)]
    out["tp4_vs_one_document"] = ratio(seconds[1], seconds[0])
    if out["tp4_vs_one_document"] is not None:
        out["tp4_target_met"] = out["tp4_vs_one_document"] <= TP4_TARGET
    found = compare_saved_rows(*(os.path.join(work, f"{name}-document.npz") for name in ("8b-tp4", "8b-one")))
    if found is not None:
        out["tp4_rows_vs_one"] = found


def print_parallel(out: dict) -> None:
    print(f"\n{out.get('device')}; TP=4 / one GPU at 8B (32k document): {out.get('tp4_vs_one_document')} "
          f"(target <= {TP4_TARGET})")  # fmt: skip
    print("| run | GPUs | precision | compiled | document s | corpus s | peak GiB per GPU (document) | note |")
    print("|---|---:|---|---|---:|---:|---|---|")
    for name, run in out["runs"].items():
        if "skipped" in run:
            print(f"| {name} | {run['tp']} | {run['precision']} | | | | | skipped: {run['skipped'][:80]}... |")
            continue
        ranks = sorted(run["ranks"], key=lambda r: r["rank"])
        first = ranks[0] if ranks else {}
        note = first.get("out_of_memory") or first.get("compile_error") or f"status {run['status']}"
        peaks = [p for r in ranks for p in r.get("document", {}).get("peak_gib", [])]
        print(
            f"| {name} | {run['tp']} | {run['precision']} | {first.get('compiled')} | "
            f"{first.get('document', {}).get('seconds')} | {first.get('corpus', {}).get('seconds', '')} | "
            f"{', '.join(map(str, peaks))} | {note} |"
        )


# ---------------------------------------------------------------------------------------------- main


def build_parser():
    parser = tool_parser(None, __doc__)
    parts = parser.add_subparsers(dest="part", required=True)
    common = dict(init_std=0.02, seed=0)
    a = parts.add_parser("speed", help="A: bf16 / fp8, eager / compiled, one GPU")
    a.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    a.add_argument("--lengths", type=int, nargs="+", default=None, help="document tokens (default 32768 131072)")
    a.add_argument("--repeats", type=int, nargs="+", default=None,
                   help="timed runs per length, the last repeated for further lengths (default 3 1)")  # fmt: skip
    a.add_argument("--trunc-len", type=int, default=4096, help="K (default %(default)s)")
    a.add_argument("--sliding-window", type=int, default=1024, help="d (default %(default)s)")
    b = parts.add_parser("fidelity", help="B: key tokens, LongPPL and PPL in fp8 against bf16, trained models")
    b.add_argument("--models", nargs="+", required=True, help="model folders (save_pretrained, with their tokenizer)")
    b.add_argument("--texts", default=None, help="the documents: a JSONL file (or a datasets folder)")
    b.add_argument("--run-folder", default=None, help="or a reproduction run's folder: its data/validation.jsonl")
    b.add_argument("--text-column", default="text", help="field of the texts (default %(default)s)")
    b.add_argument("--documents", type=int, default=None, help="the first N documents only (default: all)")
    b.add_argument("--trunc-len", type=int, required=True, help="K")
    b.add_argument("--sliding-window", type=int, required=True, help="d")
    b.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="(default %(default)s)")
    b.add_argument("--beta", type=float, default=DEFAULT_BETA, help="(default %(default)s)")
    b.add_argument(
        "--against", choices=EVALUATOR_PRECISIONS, default="fp8", help="the precision compared (default fp8)"
    )
    b.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the converted model's blocks (default: the library's, on for fp8)")  # fmt: skip
    b.add_argument("--evaluated", nargs="*", default=[], help="models whose LongPPL is compared under both key sets")
    b.add_argument("--bootstrap", type=int, default=2000, help="resamples of the documents (default %(default)s)")
    b.add_argument("--random-init", action="store_true", help="also each folder's architecture with random weights")
    c = parts.add_parser("parallel", help="C: tensor parallelism, 8B TP=4 vs one GPU; 123B TP=4 bf16, TP=2 fp8")
    c.add_argument("--runs", nargs="+", choices=sorted(PARALLEL_RUNS), default=list(PARALLEL_RUNS))
    c.add_argument("--doc-tokens", type=int, default=32768, help="tokens of each document (default %(default)s)")
    c.add_argument("--repeats", type=int, default=None,
                   help="timed runs of the document (default: 2 in the 8B runs, 1 in the 123B ones)")  # fmt: skip
    c.add_argument("--corpus-docs", type=int, default=None,
                   help="documents of the corpus part, in the runs that have one (default: 2, in 123b-tp4)")  # fmt: skip
    c.add_argument("--timeout", type=float, default=None,
                   help="seconds allowed to each run (default: what is left of the time budget)")  # fmt: skip
    c.add_argument("--time-budget", type=float, default=510,
                   help="seconds for all runs: a run that would start with less than 30 left is recorded as not "
                   "run, and each gets at most what is left (default %(default)s: one 123B run, or the two 8B "
                   "ones, in a device call of 9 minutes)")  # fmt: skip
    c.add_argument("--work", default=None, help="folder of the runs' records (default: a new temporary one)")
    c.add_argument("--worker", choices=sorted(PARALLEL_RUNS), default=None, help=argparse.SUPPRESS)
    for sub in (a, b, c):
        sub.add_argument("--out-dir", required=True, help="folder for the JSON (created)")
        sub.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, float32, no fp8")
        sub.add_argument(
            "--data", default=CRS, help="JSONL the random-weight documents are cut from (default: the CRS reports)"
        )
        sub.add_argument(
            "--init-std", type=float, default=common["init_std"], help="std of random weights (default 0.02)"
        )
        sub.add_argument("--seed", type=int, default=common["seed"])
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for name in ("repeats", "lengths", "bootstrap", "documents", "doc_tokens", "corpus_docs"):
            for value in np.atleast_1d(getattr(args, name, None) or []):
                require_int(f"--{name.replace('_', '-')}", int(value))
    except ValueError as err:
        parser.error(str(err))
    os.makedirs(args.out_dir, exist_ok=True)
    if args.part == "parallel" and args.worker is not None:
        parallel_worker(args)
        return {}
    return {"speed": speed, "fidelity": fidelity, "parallel": parallel}[args.part](args)


if __name__ == "__main__":
    main()
