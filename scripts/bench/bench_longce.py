#!/usr/bin/env python
"""Benchmark: one LongCE training step vs stock cross-entropy vs the reference LongCE, in one process.

A random-weight model shaped like Llama-3.2-1B (vocabulary 128256, tied embeddings), bf16
weights, SDPA attention, gradient checkpointing, one sequence of random tokens. For each length
it times one forward + backward step of

- ``ce``: the stock Trainer loss (``model(input_ids, labels=...).loss``, full logits);
- ``reference d=...``: the reference LongCE re-implemented faithfully: short windows one by one
  (batch 1, full logits of each window), then the full-logits training pass weighted by
  ``min(exp(lp_long - lp_short), gamma)``;
- ``ours d=...``: ``LongCETrainer.compute_loss`` (packed windows scored at their last d positions
  only, fused chunked weighted cross-entropy in the gradient pass);
- ``ours, cache weights``: ``LongCETrainer.compute_loss`` with ``longce_weights="cache"``: the
  weights come with the batch (random, in ``[0.5, gamma]``), no short-context pass;

and prints seconds and peak GiB (``torch.cuda.max_memory_allocated``, weights and gradients
included) with ratios against the reference and stock CE. ``--loss-kernels`` also compares the
LM-head loss alone (hidden states -> weighted loss + gradients): full logits, our fused function,
our chunked-checkpoint function and, when installed, Liger-Kernel's fused linear cross-entropy with
``reduction="none"`` (its gradients are checked against ours).

    # the figures of docs/benchmarks.md (one GPU):
    python scripts/bench/bench_longce.py --lengths 32768 65536 --loss-kernels
    python scripts/bench/bench_longce.py --model smollm2-135m --lengths 8192 32768 --windows 1024   # a real model
    python scripts/bench/bench_longce.py --tiny --lengths 300 500     # CPU smoke run
"""

from __future__ import annotations

import math
import sys
import tempfile

from common import LLAMA_SHAPES, measure

from longppl.commandline.running import tool_parser
from longppl.settings import DEFAULT_GAMMA, DEFAULT_MAX_TOKENS_PER_BATCH


def load_dependencies() -> None:
    """Import torch, the trainer and the benchmark helpers as this module's globals, once the
    arguments are parsed: `--help` then answers without loading torch."""
    global torch, F, LongCEConfig, LongCETrainer, fused_weighted_linear_cross_entropy
    global chunked_weighted_cross_entropy, liger_available, liger_weighted_linear_cross_entropy, longce_weights
    global resolve_lm_head
    import torch
    import torch.nn.functional as F

    try:  # `longce` (trainer/longce/) is importable once the project is installed
        from longce import LongCEConfig, LongCETrainer, fused_weighted_linear_cross_entropy
        from longce.weighted_loss import (
            chunked_weighted_cross_entropy,
            liger_available,
            liger_weighted_linear_cross_entropy,
            longce_weights,
        )
        from longppl.core.logprobs import resolve_lm_head
    except ImportError:
        sys.exit("install the project first: pip install -e .")


def build_model(tiny: bool, device: str, source: str | None = None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if source is not None:  # a real model: a short name (smollm2-135m), a *.gguf file or a saved folder
        from longppl.models.sources import check_model_source

        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(check_model_source(source, "--model"), dtype=dtype).to(device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()
    if tiny:
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1 << 17,
            tie_word_embeddings=True,
        )
        dtype = torch.float32
    else:  # Llama-3.2-1B's shape
        config = LlamaConfig(**LLAMA_SHAPES["llama-3.2-1b"], max_position_embeddings=131072, rope_theta=500000.0)
        dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def ce_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()


def reference_step(model, ids, K, d, gamma):
    """The reference LongCE: windows one by one with full logits, then the full-logits weighted pass."""
    n = ids.shape[1]
    lp_short = torch.full((n,), float("nan"), device=ids.device)
    with torch.no_grad():
        for start in range(0, n - K, d):
            end = min(start + K + d, n)
            logits = model(input_ids=ids[:, start:end]).logits
            lp_short[start + K : end] = -F.cross_entropy(
                logits[0, K - 1 : end - start - 1].float(), ids[0, start + K : end], reduction="none"
            )
            del logits
    logits = model(input_ids=ids).logits
    nll = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")
    weights = longce_weights(-nll.detach(), lp_short[1:], gamma)
    loss = (weights * nll).mean()
    loss.backward()
    return loss.item()


def make_trainer(model, K, d, gamma, budget, output_dir, compile_windows=False, loss_kernel="auto", weights="self"):
    args = LongCEConfig(
        output_dir=output_dir,
        report_to=[],
        bf16=model.dtype == torch.bfloat16,
        use_cpu=model.device.type == "cpu",
        longce_trunc_len=K,
        longce_sliding_window=d,
        longce_gamma=gamma,
        longce_max_tokens_per_batch=budget,
        longce_compile_windows=compile_windows,
        longce_loss_kernel=loss_kernel,
        longce_weights=weights,
    )
    return LongCETrainer(model=model, args=args)


def our_step(trainer, model, ids, weights=None):
    inputs = {"input_ids": ids, "labels": ids}
    if weights is not None:  # longce_weights="cache": [1, n] per-token weights, as LongCEWeightsCollator gives them
        inputs["longce_weights"] = weights
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.item()


def loss_kernels(device, tokens, hidden_size, vocab, dtype, gamma=5.0):
    """Hidden states -> weighted loss + gradients, for each implementation; rows of (name, s, GiB, check)."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    lp_short = torch.randn(tokens, device=device) - 12.0
    lp_short[: tokens // 4] = float("nan")

    def full_logits():
        logits = (hidden @ weight.t()).float()
        nll = F.cross_entropy(logits, targets, reduction="none")
        (longce_weights(-nll.detach(), lp_short, gamma) * nll).sum().backward()

    def fused():
        fused_weighted_linear_cross_entropy(hidden, weight, None, targets, lp_short, gamma)[0].backward()

    def chunked():
        chunked_weighted_cross_entropy(hidden, lambda h: h @ weight.t(), vocab, targets, lp_short, gamma)[0].backward()

    def fused_small_chunks():
        fused_weighted_linear_cross_entropy(hidden, weight, None, targets, lp_short, gamma, chunk_bytes=1 << 28)[
            0
        ].backward()

    candidates = [
        ("full logits (torch)", full_logits),
        ("ours: fused chunked function (1 GiB chunks)", fused),
        ("ours: fused, 256 MiB chunks", fused_small_chunks),
        ("ours: chunked + checkpoint", chunked),
    ]
    if liger_available():

        def liger():
            liger_weighted_linear_cross_entropy(hidden, weight, None, targets, lp_short, gamma)[0].backward()

        candidates.append(("Liger-Kernel fused linear CE, reduction='none'", liger))
    else:
        print("liger_kernel not installed: its row is skipped", flush=True)

    rows, reference = [], None
    for name, fn in candidates:
        hidden.grad = weight.grad = None
        fn()  # warm-up (kernels, allocator)
        hidden.grad = weight.grad = None
        seconds, peak, _ = measure(fn, device)
        grads = (hidden.grad.float(), weight.grad.float())
        if reference is None:
            reference, error = grads, 0.0
        else:
            error = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference))
        rows.append((name, seconds, peak, error))
    return rows


def profile_step(fn, device):
    """Print the 20 most expensive kernels/ops of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60), flush=True)


def main(argv=None):
    parser = tool_parser(None, __doc__)
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[32768, 65536],
        help="sequence lengths in tokens, one timed step each (default: 32768 65536)",
    )
    parser.add_argument("--trunc-len", type=int, default=4096, help="K (default %(default)s; 64 with --tiny)")
    parser.add_argument(
        "--windows",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="values of d to run (default: 1024 4096; 32 with --tiny)",
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=DEFAULT_GAMMA,
        help="LongCE's weight cap: min(exp(LSD), gamma) (default %(default)s)",
    )
    parser.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=DEFAULT_MAX_TOKENS_PER_BATCH,
        help="longce_max_tokens_per_batch: tokens of short windows per batch (default %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="timed steps per method (after one warm-up; best is kept; default %(default)s)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="CPU smoke run with a tiny model (K=64, d=32; one torch thread unless OMP_NUM_THREADS is set)",
    )
    parser.add_argument(
        "--model",
        help="a real model instead of the random Llama-3.2-1B shape: a short name (smollm2-135m), a *.gguf file "
        "or a saved folder; documents are random ids of its vocabulary (default: the random model)",
    )
    parser.add_argument(
        "--skip-reference", action="store_true", help="do not run the (slow) reference LongCE (default: run it)"
    )
    parser.add_argument(
        "--loss-kernels", action="store_true", help="also compare LM-head loss implementations (default: off)"
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time our two phases alone: the short-context pass and the gradient pass (default: off)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler table of one of our steps per length (default: off)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also run ours with longce_compile_windows=True (default: off)"
    )
    parser.add_argument(
        "--kernels-in-step",
        action="store_true",
        help="also run ours (first d) with longce_loss_kernel='ours' and 'liger' explicitly (default: off)",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="*",
        default=[],
        help="also run ours (first d) with these longce_max_tokens_per_batch values (default: none)",
    )
    args = parser.parse_args(argv)
    load_dependencies()

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and args.tiny:
        from longppl.commandline.threads import choose_torch_threads

        choose_torch_threads(1)  # a tiny model: extra intra-op threads only wait
    K = 64 if args.tiny else args.trunc_len
    windows = [32] if args.tiny else args.windows
    model = build_model(args.tiny, device, args.model)
    print(
        f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"K={K}, gamma={args.gamma}, budget={args.max_tokens_per_batch}",
        flush=True,
    )
    output_dir = tempfile.mkdtemp(prefix="bench_longce_")
    trainers = {d: make_trainer(model, K, d, args.gamma, args.max_tokens_per_batch, output_dir) for d in windows}

    warmups = []  # seconds of each row's first call (compilation included), in the order of the rows

    def timed(fn):
        for p in model.parameters():
            p.grad = None
        warmups.append(measure(fn, device)[0])  # warm-up: its time is what compiling costs once
        best = None
        for _ in range(args.repeat):
            for p in model.parameters():
                p.grad = None
            result = measure(fn, device)
            best = result if best is None or result[0] < best[0] else best
        return best

    table = []
    for n in args.lengths:
        warmups.clear()
        torch.manual_seed(n)
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        rows = [("ce (stock Trainer loss)", *timed(lambda: ce_step(model, ids)))]
        cached = make_trainer(model, K, windows[0], args.gamma, args.max_tokens_per_batch, output_dir, weights="cache")
        cache_weights = torch.rand(ids.shape, device=device) * (args.gamma - 0.5) + 0.5
        rows.append(("ours, cache weights", *timed(lambda: our_step(cached, model, ids, cache_weights))))
        for d in windows:
            if not args.skip_reference:
                rows.append((f"reference LongCE d={d}", *timed(lambda: reference_step(model, ids, K, d, args.gamma))))
            rows.append((f"ours d={d}", *timed(lambda: our_step(trainers[d], model, ids))))
            if args.compile:
                compiled = make_trainer(model, K, d, args.gamma, args.max_tokens_per_batch, output_dir, True)
                rows.append((f"ours d={d} compiled windows", *timed(lambda: our_step(compiled, model, ids))))
        if args.kernels_in_step:
            for kernel in ("ours", "liger") if liger_available() else ("ours",):
                other = make_trainer(
                    model, K, windows[0], args.gamma, args.max_tokens_per_batch, output_dir, args.compile, kernel
                )
                label = " compiled windows" if args.compile else ""
                rows.append((f"ours d={windows[0]}{label}, loss {kernel}", *timed(lambda: our_step(other, model, ids))))
        for budget in args.budgets:
            other = make_trainer(model, K, windows[0], args.gamma, budget, output_dir)
            rows.append((f"ours d={windows[0]} budget {budget}", *timed(lambda: our_step(other, model, ids))))
        if args.phases:
            for d in windows:
                trainer = trainers[d]
                head = resolve_lm_head(model)
                inputs = {"input_ids": ids, "labels": ids}
                rows.append(
                    (
                        f"  phase: short pass d={d}",
                        *timed(lambda: trainer._short_context_pass(model, head, inputs).nansum().item()),
                    )
                )
            plain = make_trainer(model, K, windows[0], args.gamma, args.max_tokens_per_batch, output_dir)
            plain.args.longce_weights = "none"  # every weight 1: no short-context pass
            rows.append(("  phase: gradient pass", *timed(lambda: our_step(plain, model, ids))))
        if args.profile:
            profile_step(lambda: our_step(trainers[windows[0]], model, ids), device)
        ce_time, ce_peak = rows[0][1], rows[0][2]
        for (name, seconds, peak, loss), first in zip(rows, warmups):
            d_of = next((w for w in name.split() if w.startswith("d=")), None)
            ref = next((r for r in rows if r[0] == f"reference LongCE {d_of}"), None)
            vs_ref = f"{seconds / ref[1]:.2f}x" if ref and name.startswith("ours") else ""
            table.append((n, name, seconds, peak, loss, vs_ref, seconds / ce_time, peak / ce_peak))
            print(
                f"{n:>7} | {name:<24} | {seconds:7.3f} s | {peak:6.1f} GiB | loss {loss:.4f} | time/ref {vs_ref:>6} "
                f"| time/ce {seconds / ce_time:.2f}x | peak/ce {peak / ce_peak:.2f}x | first step {first:.1f} s",
                flush=True,
            )

    print("\n| tokens | method | seconds | peak GiB | loss | time / reference | time / CE | peak / CE |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, name, seconds, peak, loss, vs_ref, vs_ce, peak_ce in table:
        print(
            f"| {n // 1024}k | {name} | {seconds:.2f} | {peak:.1f} | {loss:.4f} | {vs_ref} | {vs_ce:.2f}x | {peak_ce:.2f}x |"
        )

    if args.loss_kernels:
        del trainers, model
        tokens, hidden_size, vocab = (512, 64, 1000) if args.tiny else (32768, 2048, 128256)
        dtype = torch.float32 if args.tiny else torch.bfloat16
        print(f"\nLM-head loss alone: {tokens} tokens, hidden {hidden_size}, vocabulary {vocab}, {dtype}")
        print("| implementation | seconds | peak GiB | gradient rel. error vs full logits |")
        print("|---|---:|---:|---:|")
        for name, seconds, peak, error in loss_kernels(device, tokens, hidden_size, vocab, dtype):
            print(f"| {name} | {seconds:.3f} | {peak:.2f} | {error:.2e} |")
    if any(math.isnan(row[4]) for row in table):
        sys.exit("a loss was NaN")


if __name__ == "__main__":
    main()
