#!/usr/bin/env python
"""What one long-context pass costs on CPU: seconds and peak memory of a document of N tokens.

Each length runs in a fresh process (peak RSS is per process): a random-weight Llama-shaped model
in float32 scores one document of random tokens with ``long_context_log_probs`` (the evaluator's
long pass, the evaluated model's pass), with progress reported per decoder layer (the bars of
``longppl.core.progress``). Prints one JSON line per length: seconds, peak RSS growth over the model's
own footprint (MiB), and layer steps reported.

    # the figures of longppl/progress.py's docstring (2-core CPU, OMP_NUM_THREADS=1):
    OMP_NUM_THREADS=1 python scripts/bench/bench_long_pass.py --shape tiny --lengths 32768 131072
    OMP_NUM_THREADS=1 python scripts/bench/bench_long_pass.py --shape smollm2-135m --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from longppl.core.batching import long_context_log_probs
from longppl.core.progress import Progress

SHAPES = {
    # the tests' tiny Llama (tests/helpers.py)
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=600,
    ),
    # HuggingFaceTB/SmolLM2-135M's shape (the Space's default evaluated model)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(shape: str, n_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max(n_tokens, 8192), **SHAPES[shape])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(3, config.vocab_size, (n_tokens,))
    steps = []
    reporter = Progress(enabled=True, callback=lambda *event: steps.append(event), desc="long pass")
    with torch.inference_mode():
        long_context_log_probs(model, [ids[:16]], 32768)  # warm-up, and the one-off head probe
        before = _peak_rss_mib()
        start = time.perf_counter()
        long_context_log_probs(model, [ids], 32768, progress=reporter)
        seconds = time.perf_counter() - start
    return dict(
        shape=shape,
        tokens=n_tokens,
        seconds=round(seconds, 2),
        peak_rss_growth_mib=round(_peak_rss_mib() - before, 1),
        model_rss_mib=round(before, 1),
        layer_steps=sum(1 for desc, _, _ in steps if "pass of" in desc),
        threads=torch.get_num_threads(),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length here
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.shape, args.one)))
        return
    for n_tokens in args.lengths:
        out = subprocess.run(
            [sys.executable, __file__, "--shape", args.shape, "--one", str(n_tokens)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
