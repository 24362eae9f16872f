"""What the benchmarks in scripts/ share (``bench_longppl.py``, ``bench_longce.py``, ``bench_multi_gpu.py``,
``bench_tensor_parallel.py``): the model shapes they build, timing one call with its peak GPU memory,
and writing their JSON results. The scripts do not import each other; they import this.

Light at import (no torch): the benchmarks answer ``--help`` before loading torch.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


#: ``LlamaConfig`` fields of the model shapes the benchmarks build with random weights (architecture
#: only: each benchmark sets its own positions and RoPE base).
LLAMA_SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}


#: ``LlamaConfig`` fields of the tiny random model of the multi-GPU benchmarks' CPU smoke runs (gloo).
TINY_LLAMA_SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def measure(fn: Callable[[], T], device: str) -> tuple[float, float, T]:
    """Run ``fn()`` once and time it.

    Garbage is collected first and, on CUDA, the allocator's cache emptied and its peak statistics
    reset, so that the peak is this call's own; the clock is read after a device synchronization on
    both sides, since CUDA kernels run asynchronously.

    Args:
        fn: the work to time, called with no arguments.
        device: ``"cuda"`` or another torch device type (``"cpu"``): peak memory is measured on
            CUDA only.

    Returns:
        ``(seconds, peak_gib, value)``: wall seconds, ``torch.cuda.max_memory_allocated()`` during
        the call in GiB (everything allocated, weights included; NaN off CUDA), and ``fn()``'s value.
    """
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return seconds, peak, value


def write_json(path: str, value, indent: int = 1) -> None:
    """``value`` as JSON in ``path``, written whole or not at all (a temporary file, then a rename), so
    a benchmark cut off while writing leaves its previous results, never half of new ones."""
    from longppl.atomic_files import write_file_atomically

    write_file_atomically(path, lambda handle: json.dump(value, handle, indent=indent))
