#!/usr/bin/env python
"""Benchmark: online LongPPL vs plain PPL vs the reference (official) algorithm, in one process.

Two random-weight models shaped like Llama-3.1-8B (vocabulary 128256), one the evaluator and one
the evaluated model, bf16, SDPA attention, on documents of random tokens. For each length it runs

- ``ppl``: plain perplexity from the evaluated model's full logits (what a PPL harness does);
- ``reference``: the official algorithm re-implemented faithfully: batch 1, one short window per
  forward, full logits kept (the evaluator's long-pass output stays alive during the windows),
  models called with their default arguments, key tokens collected token by token in Python as
  the official loop does; ``reference-vec`` is the same with one ``nonzero()`` per window;
- ``ours``: this library's core (chunked LM head, packed windows, first window reused);

and prints seconds and peak GiB (``torch.cuda.max_memory_allocated``, weights of both models
included) with ratios. Tokens are random ids shared by both models, so no tokenizer is involved
(character-span mapping is CPU work of a few milliseconds either way).

    # the README's figures (one H200):
    python scripts/bench/bench_longppl.py --lengths 32768 --repeat 3 --vectorized-reference --compile
    python scripts/bench/bench_longppl.py --lengths 65536 131072 --compile
    python scripts/bench/bench_longppl.py --tiny --lengths 600 1000       # CPU smoke run
    python scripts/bench/bench_longppl.py --agreement                     # key tokens: ours vs reference

``--cache``: evaluating a second model against a warm key-token cache vs plain PPL on the same
documents. The evaluator scores each document into a cache on disk (``cache-build``) and is freed;
then, per length, in one process: ``ppl`` (tokenize, one forward with full logits, as a PPL harness
does), ``ppl-chunked`` (this library's PPL pass alone: chunked LM head) and ``cached`` (what
``evaluate_longppl.py`` and ``compute(key_tokens=...)`` do: open the cache from disk, look the
document up, tokenize and score it with the evaluated model, map key tokens across, aggregate).
Documents are random words of a word-level tokenizer shared by both models; a low ``--alpha`` makes
about half the tokens key, so that the character-span mapping has real work to do.

    python scripts/bench/bench_longppl.py --cache --lengths 32768 131072 --repeat 3 --alpha 0 --beta -100
    python scripts/bench/bench_longppl.py --cache --tiny --lengths 600 1000 --trunc-len 64 --sliding-window 32 --alpha 0 --beta -100
"""

from __future__ import annotations

import gc
import math
import shutil
import time

from common import LLAMA_SHAPES, measure, write_json

from longppl.commandline.running import tool_parser
from longppl.settings import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_MAX_TOKENS_PER_BATCH, KeyTokenRule, WindowSettings


def load_dependencies() -> None:
    """Import numpy, torch and the scoring core as this module's globals, once the arguments are
    parsed: `--help` then answers without loading torch."""
    global np, torch, F, key_token_mask, long_context_log_probs, short_context_log_probs, compiled_blocks
    import numpy as np
    import torch
    import torch.nn.functional as F

    from longppl import short_context_log_probs
    from longppl.core.batching import long_context_log_probs
    from longppl.core.compilation import compiled_blocks
    from longppl.rules.key_tokens import key_token_mask


def build_model(tiny: bool, device: str, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tiny:
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1 << 17,
        )
        dtype = torch.float32
    else:  # Llama-3.1-8B's shape
        config = LlamaConfig(**LLAMA_SHAPES["llama-3.1-8b"], max_position_embeddings=131072, rope_theta=500000.0)
        dtype = torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def reference_longppl(evaluator, model, ids, K, d, alpha, beta, vectorized=False, return_keys=False):
    """The official ``find_key_token`` + ``compute_longppl`` on token ids (same tokenizer).

    As in the official code, key tokens are collected by a Python loop that tests each token of
    a window (one device sync per token); ``vectorized=True`` replaces that loop by one
    ``nonzero()`` per window, a kinder baseline reported alongside.
    """
    input_ids = ids[None]
    n = ids.shape[0]
    loss_f = torch.nn.CrossEntropyLoss(reduction="none")
    with torch.no_grad():
        output_full = evaluator(input_ids)
        key_tokens = []
        window = d
        for start in range(0, n - K, d):
            if start + K + window > n:
                window = n - start - K
            output_short = evaluator(input_ids[:, start : start + K + window])
            loss_full = loss_f(
                output_full.logits[0, start + K - 1 : start + K + window - 1], ids[start + K : start + K + window]
            )
            loss_short = loss_f(output_short.logits[0, K - 1 : K + window - 1], ids[start + K : start + K + window])
            is_key = torch.logical_and((loss_short - loss_full) > alpha, loss_full < -beta)
            if vectorized:
                key_tokens += (start + K + is_key.nonzero()[:, 0]).tolist()
            else:
                for i, flag in enumerate(is_key):
                    if flag:
                        key_tokens.append(start + K + i)
            del output_short
        del output_full
        output = model(input_ids)
        loss_overall = loss_f(output.logits[0, :-1], ids[1:]).float()
    if return_keys:
        return key_tokens
    key = torch.tensor(key_tokens, dtype=torch.long, device=ids.device) - 1
    longppl = math.exp(loss_overall[key].mean().item()) if key.numel() else float("nan")
    return longppl, math.exp(loss_overall.mean().item()), len(key_tokens)


def plain_ppl(model, ids):
    """PPL as the official code computes it: cross-entropy over the model's full (bf16) logits."""
    with torch.no_grad():
        logits = model(ids[None]).logits
        loss = F.cross_entropy(logits[0, :-1], ids[1:], reduction="none").float()
    return math.exp(loss.mean().item())


def our_longppl(evaluator, model, ids, K, d, alpha, beta, budget, phases=None, compile_blocks=False):
    """This library's path; ``phases`` (a dict) receives the seconds of each stage."""
    marks = [time.perf_counter()]

    def mark():
        if ids.is_cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    with torch.inference_mode():
        with compiled_blocks(evaluator, compile_blocks):
            lp_long = long_context_log_probs(evaluator, [ids], budget)
            mark()
            lp_short = short_context_log_probs(
                evaluator, [ids], WindowSettings(K, d), max_tokens_per_batch=budget, long_log_probs=lp_long
            )
            mark()
        key = torch.from_numpy(key_token_mask(lp_long[0].numpy(), lp_short[0].numpy(), KeyTokenRule(alpha, beta)))
        with compiled_blocks(model, compile_blocks):
            lp = long_context_log_probs(model, [ids], budget)[0]
        mark()
    if phases is not None:
        phases.update(zip(["evaluator_long", "evaluator_windows", "model"], [b - a for a, b in zip(marks, marks[1:])]))
    nll = -lp[1:].double()
    longppl = math.exp(nll[key[1:]].mean().item()) if key.any() else float("nan")
    return longppl, math.exp(nll.mean().item()), int(key.sum())


def key_token_agreement(device: str) -> None:
    """Our key tokens vs the reference's on a model that really uses long context (float32 and bf16).

    Random-weight models have no key tokens, so this trains the synthetic copy model (a few seconds
    to a minute on CPU) and compares the two key-token sets on 16 of its documents (K=32, d=16).
    """
    from longppl.commandline.synthetic import sample_documents, train_copy_model

    trained = train_copy_model(steps=600, seed=0)
    docs = sample_documents(16, num_segments=3, generator=torch.Generator().manual_seed(7))
    copied = int((docs.copy_rank >= 1).sum())
    for dtype in (torch.float32, torch.bfloat16):
        m = trained.to(device, dtype)
        ours_total = ref_total = common = 0
        for row in docs.ids:
            ids = row.to(device)
            with torch.inference_mode():
                lp_long = long_context_log_probs(m, [ids], 32768)
                lp_short = short_context_log_probs(
                    m, [ids], WindowSettings(32, 16), max_tokens_per_batch=32768, long_log_probs=lp_long
                )
            ours = set(key_token_mask(lp_long[0].numpy(), lp_short[0].numpy()).nonzero()[0].tolist())
            ref = set(reference_longppl(m, m, ids, 32, 16, 2.0, -2.0, vectorized=True, return_keys=True))
            ours_total, ref_total, common = ours_total + len(ours), ref_total + len(ref), common + len(ours & ref)
        print(
            f"key-token agreement, copy model, {dtype}: ours {ours_total}, reference {ref_total}, "
            f"common {common} (copied tokens after the first: {copied})",
            flush=True,
        )


def cache_benchmark(args, device):
    """``--cache`` (see the module docstring): rows of seconds and peak GiB per length and method."""
    import tempfile

    from longppl import (
        KeyTokenCache,
        KeyTokenSettings,
        document_results,
        score_with_evaluator,
        score_with_model,
        summarize_results,
        text_key_weights,
    )
    from longppl.cache.key_token_cache import cached_evaluator_scores, key_token_rows
    from longppl.commandline.synthetic import word_tokenizer
    from longppl.core.scoring import document_result
    from longppl.models.fingerprints import ModelIdentity

    K, d, budget = args.trunc_len, args.sliding_window, args.budgets[0]
    settings = KeyTokenSettings(K, d, add_special_tokens=False)
    evaluator = build_model(args.tiny, device, seed=1)
    vocab = evaluator.config.vocab_size
    tokenizer = word_tokenizer(vocab - 2)  # ids 0 .. vocab-1 with <unk> and <pad>

    def words(n, seed):
        return " ".join(
            f"w{i}" for i in torch.randint(vocab - 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        )

    texts = {n: words(n, n) for n in args.lengths}
    warm = words(K + 2 * d + 7, 0)
    folder = tempfile.mkdtemp(prefix="longppl-bench-cache-")
    identity = ModelIdentity.of_model(evaluator)
    rows = []

    def build(text, path):
        scores = score_with_evaluator(
            evaluator,
            tokenizer,
            [text],
            max_tokens_per_batch=budget,
            settings=settings,
            progress=False,
            per_document=True,
        )
        KeyTokenCache(key_token_rows([text], scores, settings, identity)).save(path)

    build(warm, f"{folder}/warm")
    for n, text in texts.items():
        seconds, peak, _ = measure(lambda: build(text, f"{folder}/{n}"), device)
        rows.append({"tokens": n, "method": "cache-build", "seconds": seconds, "peak_gib": peak})
        print(f"{n:>7} cache-build      {seconds:8.2f}s {peak:7.1f} GiB", flush=True)
    evaluator = None  # free its memory before the next phase
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = build_model(args.tiny, device, seed=2)

    def ppl_full(text):  # a plain PPL harness: token ids only (no offsets), full logits
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], device=device)
        return plain_ppl(model, ids)

    def ppl_chunked(text):
        lp = score_with_model(model, tokenizer, [text], budget, progress=False)[0].lp
        return document_result(lp, np.zeros_like(lp)).ppl

    def cached(text, path, phases):
        marks = [time.perf_counter()]

        def mark():
            if device == "cuda":
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

        cache = KeyTokenCache.load(path)
        evaluator_scores = cached_evaluator_scores(cache, [text], settings, None, None)
        mark()
        model_scores = score_with_model(model, tokenizer, [text], budget, progress=False)
        mark()
        weights = text_key_weights([text], evaluator_scores, model_scores, args.alpha, args.beta)
        result = summarize_results(document_results(model_scores, weights))
        mark()
        phases.update(zip(["cache_load", "model", "key_tokens"], [b - a for a, b in zip(marks, marks[1:])]))
        return result["longppl"], result["ppl"], result["n_key_tokens"][0]

    ppl_full(warm), ppl_chunked(warm), cached(warm, f"{folder}/warm", {})
    for n, text in texts.items():
        phases = {}
        methods = [
            ("ppl", lambda: ppl_full(text)),
            ("ppl-chunked", lambda: ppl_chunked(text)),
            ("cached", lambda: cached(text, f"{folder}/{n}", phases)),
        ]
        for name, fn in methods:
            best = None
            for _ in range(args.repeat):
                try:
                    result = measure(fn, device)
                except torch.cuda.OutOfMemoryError:  # full logits of a long text may not fit next to the model
                    result = (float("nan"), float("nan"), "out of memory")
                    gc.collect()
                    torch.cuda.empty_cache()
                if best is None or result[0] < best[0] or best[0] != best[0]:  # fastest run; NaN = failed
                    best = result
            row = {"tokens": n, "method": name, "seconds": best[0], "peak_gib": best[1], "value": best[2]}
            if name == "cached":
                row["phases"] = {k: round(v, 4) for k, v in phases.items()}
            rows.append(row)
            print(
                f"{n:>7} {name:<16} {best[0]:8.2f}s {best[1]:7.1f} GiB  {best[2]}  {row.get('phases', '')}", flush=True
            )
    shutil.rmtree(folder, ignore_errors=True)

    print("\n| tokens | method | seconds | peak GiB | time / PPL | time / PPL (chunked head) |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in rows:
        same = {r["method"]: r for r in rows if r["tokens"] == row["tokens"]}
        ratio = lambda base: f"{row['seconds'] / base['seconds']:.3f}x" if base["seconds"] == base["seconds"] else "-"
        print(
            f"| {row['tokens']} | {row['method']} | {row['seconds']:.3f} | {row['peak_gib']:.1f} | "
            f"{ratio(same['ppl'])} | {ratio(same['ppl-chunked'])} |"
        )
    return rows


def write_rows(path: str, rows: list[dict], device: str, trunc_len: int, sliding_window: int) -> None:
    """The benchmark's ``rows`` with the device, torch version and window they were measured with, as JSON."""
    import torch

    write_json(
        path,
        {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "trunc_len": trunc_len,
            "sliding_window": sliding_window,
            "rows": rows,
        },
    )


def main(argv=None):
    parser = tool_parser(None, __doc__)
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[32768, 65536, 131072],
        help="document lengths in tokens, one timed document each (default: 32768 65536 131072)",
    )
    parser.add_argument("--trunc-len", type=int, default=4096, help="K (default %(default)s)")
    parser.add_argument("--sliding-window", type=int, default=1024, help="d (default %(default)s)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="key iff LSD > alpha (default %(default)s)")
    parser.add_argument("--beta", type=float, default=DEFAULT_BETA, help="and LCL > beta (default %(default)s)")
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[DEFAULT_MAX_TOKENS_PER_BATCH],
        help=f"max_tokens_per_batch values for ours (default: {DEFAULT_MAX_TOKENS_PER_BATCH})",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="timed runs per method and length (best is kept; default %(default)s)"
    )
    parser.add_argument(
        "--skip-reference-above",
        type=int,
        default=1 << 30,
        help="skip the (slow) reference for documents longer than this many tokens (default: never skip)",
    )
    parser.add_argument("--vectorized-reference", action="store_true", help="also run reference-vec (default: off)")
    parser.add_argument(
        "--compile", action="store_true", help="also run ours with torch_compile (compiled in warm-up; default: off)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny random models (CPU smoke run, one torch thread unless OMP_NUM_THREADS is set)",
    )
    parser.add_argument(
        "--agreement",
        action="store_true",
        help="only compare our key tokens with the reference's on the trained copy model",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="only time evaluating a second model against a warm key-token cache vs plain PPL",
    )
    parser.add_argument("--out", help="write the results as JSON here (default: print only)")
    args = parser.parse_args(argv)
    load_dependencies()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (args.tiny or args.agreement):
        from longppl.commandline.threads import choose_torch_threads

        choose_torch_threads(1)  # tiny models: extra intra-op threads only wait
    if args.agreement:
        return key_token_agreement(device)
    if args.cache:
        rows = cache_benchmark(args, device)
        if args.out:
            write_rows(args.out, rows, device, args.trunc_len, args.sliding_window)
        return rows
    t0 = time.perf_counter()
    evaluator = build_model(args.tiny, device, seed=1)
    model = build_model(args.tiny, device, seed=2)
    print(
        f"built two models in {time.perf_counter() - t0:.1f}s on {device}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""),
        flush=True,
    )
    vocab = model.config.vocab_size
    K, d = args.trunc_len, args.sliding_window

    # Warm-up on a short document: kernels, cuBLAS handles, allocator.
    warm = torch.randint(vocab, (K + 2 * d + 7,), device=device)
    plain_ppl(model, warm)
    reference_longppl(evaluator, model, warm, K, d, args.alpha, args.beta)
    our_longppl(evaluator, model, warm, K, d, args.alpha, args.beta, args.budgets[0])
    if args.compile:
        start = time.perf_counter()
        our_longppl(evaluator, model, warm, K, d, args.alpha, args.beta, args.budgets[0], compile_blocks=True)
        print(f"one-off compilation (warm-up document): {time.perf_counter() - start:.1f}s", flush=True)

    rows = []
    for n in args.lengths:
        ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(n)).to(device)
        methods = [("ppl", lambda: plain_ppl(model, ids))]
        if n <= args.skip_reference_above:
            methods.append(("reference", lambda: reference_longppl(evaluator, model, ids, K, d, args.alpha, args.beta)))
            if args.vectorized_reference:
                methods.append(
                    (
                        "reference-vec",
                        lambda: reference_longppl(evaluator, model, ids, K, d, args.alpha, args.beta, vectorized=True),
                    )
                )
        phases = {}
        for budget in args.budgets:
            methods.append(
                (
                    f"ours(b={budget})",
                    lambda b=budget: our_longppl(
                        evaluator, model, ids, K, d, args.alpha, args.beta, b, phases.setdefault(f"ours(b={b})", {})
                    ),
                )
            )
        if args.compile:
            b = args.budgets[0]
            methods.append(
                (
                    "ours+compile",
                    lambda: our_longppl(
                        evaluator,
                        model,
                        ids,
                        K,
                        d,
                        args.alpha,
                        args.beta,
                        b,
                        phases.setdefault("ours+compile", {}),
                        True,
                    ),
                )
            )
        for name, fn in methods:
            best = None
            for _ in range(args.repeat):
                seconds, peak, value = measure(fn, device)
                if best is None or seconds < best[0]:
                    best = (seconds, peak, value)
            row = {
                "tokens": n,
                "method": name,
                "seconds": best[0],
                "peak_gib": best[1],
                "value": best[2] if isinstance(best[2], float) else list(best[2]),
            }
            if name.startswith("ours"):
                row["phases"] = {k: round(v, 3) for k, v in phases[name].items()}
            rows.append(row)
            print(
                f"{n:>7} {name:<16} {best[0]:8.2f}s {best[1]:7.1f} GiB  {best[2]}  {row.get('phases', '')}", flush=True
            )

    print("\n| tokens | method | seconds | peak GiB | time / reference | peak / reference | time / PPL |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        same = {r["method"]: r for r in rows if r["tokens"] == row["tokens"]}
        ref, ppl = same.get("reference"), same["ppl"]
        ratio = lambda key, base: f"{row[key] / base[key]:.2f}x" if base and base[key] == base[key] else "-"
        print(
            f"| {row['tokens']} | {row['method']} | {row['seconds']:.2f} | {row['peak_gib']:.1f} | "
            f"{ratio('seconds', ref)} | {ratio('peak_gib', ref)} | {ratio('seconds', ppl)} |"
        )
    if args.out:
        write_rows(args.out, rows, device, K, d)
    return rows


if __name__ == "__main__":
    main()
