"""Benchmark: ``longppl score`` committing shards as it goes, over a large corpus.

    # CPU, a tiny evaluator built here (no download): 100k documents of 64 tokens
    python scripts/bench/bench_cache_shards.py --documents 100000 --output-dir bench/shards
    # GPU, a real evaluator: the share of scoring time spent committing shards
    python scripts/bench/bench_cache_shards.py --evaluator meta-llama/Llama-3.1-8B --corpus docs.jsonl \\
        --device cuda --trunc-len 4096 --sliding-window 1024 --output-dir bench/shards-gpu

Runs ``compute_key_tokens.main`` in this process with ``append_rows`` timed: per committed shard,
the seconds per document of its scoring, the seconds of its commit (writing, hashing, renaming and
naming the shard) and the process's resident memory; then the seconds to open the finished cache
(``KeyTokenCache.load``, every checksum verified) and to read one row. Writes ``shards.json`` in
``--output-dir`` and prints a summary: the commit share of the run's time, and the first and last
tenth of the shards' time per document and memory (flat when the cache's growth costs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def rss_mib() -> float:
    """The process's resident memory now (Linux ``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def tiny_setup(folder: str, documents: int, length: int) -> tuple[str, str]:
    """A random two-layer evaluator with a word tokenizer (``longppl.commandline.synthetic``) and a JSONL
    corpus of ``documents`` documents of ``length`` uniformly random words; returns their paths."""
    import torch
    from transformers import AutoModelForCausalLM

    from longppl.commandline.synthetic import VOCAB_SIZE, copy_model_config, word_tokenizer

    evaluator, corpus = os.path.join(folder, "evaluator"), os.path.join(folder, "corpus.jsonl")
    if not os.path.isdir(evaluator):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(copy_model_config()).save_pretrained(evaluator)
        word_tokenizer().save_pretrained(evaluator)
    if not os.path.isfile(corpus):
        generator = torch.Generator().manual_seed(0)
        with open(corpus, "w", encoding="utf-8") as handle:
            for start in range(0, documents, 10_000):
                ids = torch.randint(VOCAB_SIZE, (min(10_000, documents - start), length), generator=generator)
                for row in ids.tolist():
                    handle.write(json.dumps({"text": " ".join(f"w{i}" for i in row)}) + "\n")
    return evaluator, corpus


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="where the corpus, evaluator, cache and results go")
    parser.add_argument("--documents", type=int, default=100_000, help="tiny setup: documents (default %(default)s)")
    parser.add_argument("--length", type=int, default=64, help="tiny setup: words per document (default %(default)s)")
    parser.add_argument("--evaluator", help="a real evaluator (default: the tiny one built here)")
    parser.add_argument("--corpus", help="its corpus (required with --evaluator)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    parser.add_argument("--trunc-len", type=int, default=16, help="K (default %(default)s)")
    parser.add_argument("--sliding-window", type=int, default=8, help="d (default %(default)s)")
    parser.add_argument("--shard-documents", type=int, default=256, help="documents per shard (default %(default)s)")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.evaluator:
        if not args.corpus:
            parser.error("--evaluator needs --corpus")
        evaluator, corpus = args.evaluator, args.corpus
    else:
        evaluator, corpus = tiny_setup(args.output_dir, args.documents, args.length)

    import longppl.cache.key_token_cache as cache_module
    from longppl.cache.key_token_cache import KeyTokenCache
    from longppl.tools import compute_key_tokens

    output = os.path.join(args.output_dir, "cache")
    shards, append_rows = [], cache_module.append_rows
    last = [time.perf_counter()]

    def timed_append(path, rows):
        began = time.perf_counter()
        result = append_rows(path, rows)
        done = time.perf_counter()
        scoring = began - last[0]
        shards.append(dict(documents=len(rows), scoring_s=scoring, commit_s=done - began, rss_mib=rss_mib()))
        print(f"shard {len(shards)}: {1000 * scoring / len(rows):.2f} ms/document, commit "
              f"{1000 * (done - began):.1f} ms, {shards[-1]['rss_mib']:.0f} MiB", flush=True)  # fmt: skip
        last[0] = done
        return result

    cache_module.append_rows = timed_append
    score = compute_key_tokens.ScoringJob.score

    def timed_score(self, *args, **kwargs):  # the first shard's time starts here, after the set-up
        last[0] = time.perf_counter()
        return score(self, *args, **kwargs)

    compute_key_tokens.ScoringJob.score = timed_score
    began = time.perf_counter()
    summary = compute_key_tokens.main(
        [
            "--corpus",
            corpus,
            "--evaluator",
            evaluator,
            "--output",
            output,
            "--device",
            args.device,
            "--trunc-len",
            str(args.trunc_len),
            "--sliding-window",
            str(args.sliding_window),
            "--shard-documents",
            str(args.shard_documents),
        ]  # fmt: skip
    )
    total = time.perf_counter() - began
    opened = time.perf_counter()
    cache = KeyTokenCache.load(output)
    open_s = time.perf_counter() - opened
    read = time.perf_counter()
    cache.scores(len(cache) - 1)
    read_s = time.perf_counter() - read

    def tenth(part: list[dict]) -> dict:
        docs = sum(s["documents"] for s in part)
        return dict(
            ms_per_document=1000 * sum(s["scoring_s"] for s in part) / docs,
            commit_ms=1000 * sum(s["commit_s"] for s in part) / len(part),
            rss_mib=max(s["rss_mib"] for s in part),
        )

    cut = max(1, len(shards) // 10)
    result = dict(
        setup_s=total - sum(s["scoring_s"] + s["commit_s"] for s in shards),
        command=" ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        cpu_count=os.cpu_count(),
        documents=summary["documents"],
        tokens=summary["tokens"],
        shards=len(shards),
        total_s=total,
        commit_s=sum(s["commit_s"] for s in shards),
        commit_share=sum(s["commit_s"] for s in shards) / total,
        first_tenth=tenth(shards[:cut]),
        last_tenth=tenth(shards[-cut:]),
        open_s=open_s,
        read_row_s=read_s,
        cache_mib=sum(os.path.getsize(f["filename"]) for f in cache.dataset.cache_files) / 2**20,
        per_shard=shards,
    )
    with open(os.path.join(args.output_dir, "shards.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_shard"}, indent=1))
    return result


if __name__ == "__main__":
    main()
