"""The memory of one task of the datatrove step, against the corpus's size.

    python scripts/bench/bench_pipeline_memory.py --documents 10000 100000 1000000 --tasks 100 \\
        --json pipeline_memory.json

For each corpus size it writes that many tiny documents (a few dozen words each) as ``--files``
JSONL files, and runs task 0 of ``--tasks`` of ``[JsonlReader, ScoreKeyTokens, JsonlWriter]`` in a
fresh process (datatrove's ``_run_for_rank``, as every executor calls it) with a tiny random
evaluator built in code (``longppl.commandline.synthetic``: two layers, a word tokenizer), committing to a
fresh cache, then runs the same task again (everything cached: the resume path). It reports the
process's peak resident memory (``ru_maxrss``) and its RSS at the end, with the documents the task
read (``--former``: also the same task of the former ``ScoreKeyTokens(options)`` form, which read
the whole corpus as one JSONL file). The number of tasks is the same for every size, so a task's share grows with the corpus:
flat figures mean the step streams its share, holding one block, not its share or the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def write_corpus(folder: str, documents: int, files: int, words: int, seed: int = 0) -> None:
    """``documents`` texts of ``words`` random words ``w0 … w127``, spread over ``files`` JSONL files."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    per_file = -(-documents // files)
    written = 0
    for f in range(files):
        with open(os.path.join(folder, f"part{f:05d}.jsonl"), "w", encoding="utf-8") as handle:
            for _ in range(min(per_file, documents - written)):
                text = " ".join(f"w{rng.randrange(128)}" for _ in range(words))
                handle.write(json.dumps({"text": text}) + "\n")
                written += 1


def rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_task(args) -> dict:
    """Run task ``args.rank`` of ``args.tasks`` in this process; return its figures."""
    import torch
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from transformers import MistralForCausalLM

    from longppl.commandline.synthetic import copy_model_config, word_tokenizer
    from longppl.settings import KeyTokenSettings
    from longppl.tools.score_pipeline import ScoreKeyTokens

    torch.manual_seed(0)
    torch.set_num_threads(1)
    evaluator = MistralForCausalLM(copy_model_config()).eval()
    if args.former:  # the former form: longppl score's options, the whole corpus read by the task
        import warnings

        folder = os.path.join(args.cache + "-former-evaluator")
        evaluator.save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)
        corpus = os.path.join(args.input + "-former.jsonl")
        with open(corpus, "w", encoding="utf-8") as out:
            for name in sorted(os.listdir(args.input)):
                with open(os.path.join(args.input, name), encoding="utf-8") as handle:
                    out.write(handle.read())
        options = ["--corpus", corpus, "--evaluator", folder, "--output", args.cache + "-former",
                   "--trunc-len", "8", "--sliding-window", "4"]  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            step = ScoreKeyTokens(options)
        pipeline = [step]
    else:
        step = ScoreKeyTokens(
            evaluator, KeyTokenSettings(8, 4), cache=args.cache, tokenizer=word_tokenizer(), shard_documents=256
        )
        pipeline = [JsonlReader(args.input), step, JsonlWriter(args.output, compression=None)]
    executor = LocalPipelineExecutor(pipeline, tasks=args.tasks, logging_dir=args.logs)
    began = time.perf_counter()
    executor._run_for_rank(args.rank)
    seconds = time.perf_counter() - began
    stats = {name: value.total for name, value in step.stats.stats.items()}
    if args.former:  # it counts its share ("documents") and what it scored of it
        stats = dict(scored=stats.get("scored", 0), cached=stats.get("documents", 0) - stats.get("scored", 0))
    return dict(
        seconds=round(seconds, 1),
        documents=int(stats.get("scored", 0) + stats.get("cached", 0)),
        scored=int(stats.get("scored", 0)),
        cached=int(stats.get("cached", 0)),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        end_rss_mib=round(rss_mib(), 1),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--tasks", type=int, default=100, help="tasks the corpus is split over (default 100)")
    parser.add_argument("--files", type=int, default=200, help="input files (default 200)")
    parser.add_argument("--words", type=int, default=24, help="words per document (default 24)")
    parser.add_argument("--work", default="pipeline_memory_work", help="a scratch folder (created)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument(
        "--former", action="store_true", help="also run the former ScoreKeyTokens(options) form, for comparison"
    )
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)  # internal: one task
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    for name in ("input", "cache", "output", "logs"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        print(json.dumps(one_task(args)))
        return
    results = []
    for documents in args.documents:
        root = os.path.join(args.work, str(documents))
        write_corpus(os.path.join(root, "input"), documents, args.files, args.words)
        for run in ("first", "rerun") + (("former",) if args.former else ()):
            command = [sys.executable, os.path.abspath(__file__), "--task", "--tasks", str(args.tasks)]
            command += ["--former"] if run == "former" else []
            for name in ("input", "cache", "output", "logs"):
                command += [f"--{name}", os.path.join(root, name if name != "logs" else f"logs-{run}")]
            env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            row = dict(
                corpus_documents=documents, tasks=args.tasks, run=run, **json.loads(done.stdout.splitlines()[-1])
            )
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
