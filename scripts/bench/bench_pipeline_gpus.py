#!/usr/bin/env python
"""The datatrove pipeline on N GPUs, one task per GPU, killed at random moments and run again.

    python scripts/bench/bench_pipeline_gpus.py --gpus 2 --json pipeline_gpus.json
    python scripts/bench/bench_pipeline_gpus.py --cpu --gpus 2 --shape tiny --documents 8 --tokens 300 \
        --trunc-len 64 --sliding-window 32 --kills 2   # a smoke run on CPU processes (about a minute)

On a machine with N GPUs it runs ``[JsonlReader, ScoreKeyTokens, JsonlWriter]`` under datatrove's
``LocalPipelineExecutor`` over ``--documents`` documents of ``--tokens`` tokens (cut from the CRS
reports of tests/data, as ``--files`` JSONL files), with ``--evaluator`` (a Hub id or folder) or, by
default, a random-weight evaluator shaped like Llama-3.1-8B (``--shape``) with the byte-level
tokenizer, saved under ``--work`` once:

1. ``one_gpu``: 1 task on the first GPU, uninterrupted: the reference cache and the baseline rate;
2. ``n_gpus``: N tasks, N at once (task r on GPU r), uninterrupted: the rate against one GPU, and
   whether its cache equals the reference row for row;
3. ``killed``: N tasks into a fresh cache, the whole executor (its process group) killed with SIGKILL
   ``--kills`` times at random moments (uniform over 5-95 % of the uninterrupted N-GPU run's time,
   ``--seed``), run again after each kill, and finally run to the end. Against the reference: rows
   lost (documents without a row), duplicated (a key committed twice; harmless, compaction drops
   them), wrong (a row whose arrays differ); the rows committed at each kill; the total time.

Two rates are given for the uninterrupted runs. ``tokens_per_s`` counts the evaluator tokens of the
corpus over the whole run, each task's start included (Python, torch, datatrove, loading the
evaluator, the first kernels): on a corpus one GPU scores in minutes the start weighs on it.
``steady`` is the rate while every task is scoring: a step after ``ScoreKeyTokens`` notes when
each document leaves it (a block leaves once its rows are committed), and the rate counts the
tokens that left between the moment the last task's first block left and the moment the first task's
last block left, over that window. Each task's start (launch to its first block) is recorded
beside it, so the two rates can be told apart by measurement.

It prints one line per run and writes everything to ``--json`` (after each phase, so a run cut
short keeps its figures). Estimated, not measured: about 10 minutes on 2 H100s with the defaults,
the random evaluator's saving (16 GB) included; ``--documents`` and ``--kills`` scale it. Rates
count the evaluator tokens of the corpus over the wall time of a run, model loading included (each
task loads the evaluator).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import time

from common import CRS

try:
    from datatrove.pipeline.base import PipelineStep
except ImportError:  # --help answers without datatrove; a run imports it again and says it is missing
    PipelineStep = object

HERE = os.path.dirname(os.path.abspath(__file__))


class PassTimes(PipelineStep):
    """Pass the documents on unchanged, noting per task (``folder/<rank>.jsonl``, a line each, flushed)
    the wall time each leaves the step before and its evaluator tokens (``longppl_tokens``)."""

    name = "pass times"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data, rank: int = 0, world_size: int = 1):
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{rank:05d}.jsonl"), "w", encoding="utf-8") as handle:
            for doc in data:
                handle.write(json.dumps([time.time(), doc.metadata.get("longppl_tokens", 0)]) + "\n")
                handle.flush()
                yield doc


def steady_rate(folder: str, launched: float, tasks: int | None = None) -> dict:
    """From the times :class:`PassTimes` noted: each task's start (seconds from ``launched``, the
    run's launch, to its first block leaving the scoring step) and the rate while all tasks scored.
    ``tasks``: read the files of ranks ``0 .. tasks - 1`` only (a run's own; each truncates its
    file when it starts), default every file of ``folder``.

    The window runs from the latest task's first block to the earliest task's last block; the rate is
    the tokens of the documents that left inside it (after its start, up to its end) over its length.
    ``tokens_per_s`` is None when the window is empty (a task with a single block)."""
    names = sorted(os.listdir(folder)) if tasks is None else [f"{rank:05d}.jsonl" for rank in range(tasks)]
    found = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            found.append([json.loads(line) for line in handle if line.strip()])
    tasks = [times for times in found if times]
    low, high = max(times[0][0] for times in tasks), min(times[-1][0] for times in tasks)
    tokens = sum(n for times in tasks for t, n in times if low < t <= high)
    return dict(
        task_start_s=[round(times[0][0] - launched, 1) for times in tasks],
        window_s=round(high - low, 1),
        window_tokens=tokens,
        tokens_per_s=round(tokens / (high - low), 1) if high > low else None,
    )


def write_corpus(folder: str, documents: int, tokens: int, files: int) -> None:
    """``documents`` texts of ``tokens`` bytes (byte-level tokenizer: about one token each), cut from the
    reports joined by blank lines, each starting elsewhere (so all differ), spread over ``files`` files."""
    from longppl.commandline.corpus import read_jsonl_texts

    corpus = "\n\n".join(read_jsonl_texts(CRS)).encode("utf-8")
    corpus = corpus * (1 + tokens // len(corpus) + 1)
    os.makedirs(folder, exist_ok=True)
    stride = 7919  # a prime: start offsets differ for every document
    texts = []
    for i in range(documents):
        start = (i * stride) % (len(corpus) - tokens)
        texts.append(corpus[start : start + tokens].decode("utf-8", errors="ignore"))
    for f in range(files):
        with open(os.path.join(folder, f"part{f:04d}.jsonl"), "w", encoding="utf-8") as handle:
            for text in texts[f::files]:
                handle.write(json.dumps({"text": text}) + "\n")


def run_pipeline(config: dict) -> None:
    """Run the pipeline of ``config`` in this process (``--run``)."""
    from bench_pipeline_gpus import PassTimes  # by its module's name: the spawned tasks import it so
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from longppl.settings import KeyTokenSettings
    from longppl.tools.score_pipeline import ScoreKeyTokens

    step = ScoreKeyTokens(
        config["evaluator"],
        KeyTokenSettings(config["trunc_len"], config["sliding_window"]),
        cache=config["cache"],
        max_length=config["tokens"],
        shard_documents=config["shard_documents"],
    )
    pipeline = [JsonlReader(config["input"]), step]
    if config.get("times"):
        pipeline.append(PassTimes(config["times"]))
    pipeline.append(JsonlWriter(config["output"], compression=None))
    LocalPipelineExecutor(
        pipeline, tasks=config["tasks"], workers=config["tasks"], logging_dir=config["logs"], start_method="spawn"
    ).run()


def start(config: dict, work: str, name: str, log) -> subprocess.Popen:
    path = os.path.join(work, f"{name}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    env = dict(os.environ, HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    if config["tasks"] == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--run", path],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a session of its own: the kill takes the executor and every task
    )


def finish(process: subprocess.Popen, what: str) -> None:
    if process.wait() != 0:
        raise SystemExit(f"{what} failed (exit {process.returncode}); see its log under --work")


def corpus_tokens(cache_path: str) -> int:
    from longppl.cache.key_token_cache import KeyTokenCache

    data = KeyTokenCache.load(cache_path).dataset
    seen, total = set(), 0
    for fingerprint, ids in zip(data["text_fingerprint"], data["input_ids"]):
        if fingerprint not in seen:
            seen.add(fingerprint)
            total += len(ids)
    return total


def compare(reference: str, got: str) -> dict:
    """Rows lost, duplicated and wrong in the cache ``got`` against ``reference`` (matched by key)."""
    import numpy as np

    from longppl.cache.key_token_cache import KeyTokenCache

    def rows(path):
        data = KeyTokenCache.load(path).dataset
        keyed: dict = {}
        for row in data:
            key = (row["text_fingerprint"], row["evaluator_fingerprint"], row["trunc_len"], row["sliding_window"])
            keyed.setdefault(key, []).append(row)
        return keyed, len(data)

    want, _ = rows(reference)
    have, count = rows(got)
    lost = sorted(set(want) - set(have))
    duplicated = count - len(have)
    wrong = 0
    for key, copies in have.items():
        expected = want.get(key, [None])[0]
        for row in copies:
            same = expected is not None and all(
                np.array_equal(
                    np.asarray(row[c], dtype=np.float64), np.asarray(expected[c], dtype=np.float64), equal_nan=True
                )
                for c in ("input_ids", "offsets", "lp_long", "lp_short")
            )
            wrong += not same
    return dict(rows_lost=len(lost), rows_duplicated=duplicated, rows_wrong=wrong, rows=count, distinct=len(have))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="N tasks, one per GPU (default: every GPU)")
    parser.add_argument("--evaluator", default=None, help="Hub id or folder (default: a random --shape model)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="the random evaluator's shape (default %(default)s)")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096, help="evaluator tokens per document (default 4096)")
    parser.add_argument("--trunc-len", type=int, default=1024)
    parser.add_argument("--sliding-window", type=int, default=256)
    parser.add_argument("--files", type=int, default=24, help="input JSONL files (default 24)")
    parser.add_argument("--shard-documents", type=int, default=4, help="documents per committed shard (default 4)")
    parser.add_argument("--kills", type=int, default=3, help="random kills of the N-GPU pipeline (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="pipeline_gpus_work", help="a scratch folder (created)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on CPU processes (with --shape tiny)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one pipeline run
    args = parser.parse_args(argv)
    if args.run:
        with open(args.run, encoding="utf-8") as handle:
            run_pipeline(json.load(handle))
        return {}

    import torch

    gpus = args.gpus or torch.cuda.device_count()
    if not args.cpu and (gpus < 1 or torch.cuda.device_count() < gpus):
        raise SystemExit(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPUs")
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    write_corpus(os.path.join(work, "input"), args.documents, args.tokens, args.files)
    evaluator = args.evaluator
    if evaluator is None:
        evaluator = os.path.join(work, f"evaluator-{args.shape}")
        if not os.path.isdir(evaluator):
            # bench_multi_gpu's random evaluator (the same 8B shape and byte-level tokenizer), read by path
            save_random_evaluator = runpy.run_path(os.path.join(HERE, "bench_multi_gpu.py"))["save_random_evaluator"]
            save_random_evaluator(evaluator, args.shape, "cpu" if args.cpu else "cuda")

    def config(name: str, tasks: int) -> dict:
        return dict(evaluator=evaluator, input=os.path.join(work, "input"), cache=os.path.join(work, name, "cache"),
                    output=os.path.join(work, name, "output"), logs=os.path.join(work, name, "logs"), tasks=tasks,
                    times=os.path.join(work, name, "times") if name in ("one_gpu", "n_gpus") else None,
                    trunc_len=args.trunc_len, sliding_window=args.sliding_window, tokens=args.tokens,
                    shard_documents=args.shard_documents)  # fmt: skip

    results = dict(gpus=gpus, gpu="cpu" if args.cpu else torch.cuda.get_device_name(0), evaluator=args.evaluator or f"random {args.shape}",
                   documents=args.documents, tokens_per_document=args.tokens, trunc_len=args.trunc_len,
                   sliding_window=args.sliding_window, shard_documents=args.shard_documents)  # fmt: skip
    log = open(os.path.join(work, "runs.log"), "a", encoding="utf-8")
    for name, tasks in (("one_gpu", 1), ("n_gpus", gpus)):
        values = config(name, tasks)
        launched, began = time.time(), time.perf_counter()
        finish(start(values, work, name, log), name)
        seconds = time.perf_counter() - began
        tokens = corpus_tokens(values["cache"])
        steady = steady_rate(values["times"], launched, tasks)
        results[name] = dict(
            tasks=tasks,
            seconds=round(seconds, 1),
            tokens=tokens,
            tokens_per_s=round(tokens / seconds, 1),
            steady=steady,
        )
        print(
            f"{name}: {tasks} task(s), {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s; steady {steady}", flush=True
        )
        save(results, args.json)
    reference = config("one_gpu", 1)["cache"]
    results["n_gpus"]["speedup"] = round(results["n_gpus"]["tokens_per_s"] / results["one_gpu"]["tokens_per_s"], 2)
    one, many = results["one_gpu"]["steady"]["tokens_per_s"], results["n_gpus"]["steady"]["tokens_per_s"]
    results["n_gpus"]["steady"]["speedup"] = round(many / one, 2) if one and many else None
    results["n_gpus"]["against_one_gpu"] = compare(reference, config("n_gpus", gpus)["cache"])
    print(
        f"n_gpus: {results['n_gpus']['speedup']}x one GPU, steady {results['n_gpus']['steady']['speedup']}x; "
        f"{results['n_gpus']['against_one_gpu']}",
        flush=True,
    )

    rng = random.Random(args.seed)
    values = config("killed", gpus)
    kills, began = [], time.perf_counter()
    for k in range(args.kills):
        after = rng.uniform(0.05, 0.95) * results["n_gpus"]["seconds"]
        process = start(values, work, f"killed-{k}", log)
        try:
            process.wait(timeout=after)
            kills.append(dict(after_s=round(after, 1), killed=False, note="the run ended before the kill"))
            break
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        from longppl.cache.key_token_cache import KeyTokenCache

        committed = len(KeyTokenCache.load(values["cache"])) if os.path.isdir(values["cache"]) else 0
        kills.append(dict(after_s=round(after, 1), killed=True, rows_committed=committed))
        save(dict(results, killed=dict(kills=kills, note="in progress")), args.json)
        print(f"kill {k + 1}: after {after:.1f} s, {committed} rows committed", flush=True)
    finish(start(values, work, "killed-final", log), "the final rerun")
    results["killed"] = dict(
        kills=kills, seconds_total=round(time.perf_counter() - began, 1), **compare(reference, values["cache"])
    )
    print(f"killed: {results['killed']}", flush=True)
    save(results, args.json)
    return results


def save(results: dict, path: str | None) -> None:
    """Write the results so far (after each phase: a run cut short still leaves its figures)."""
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
