"""What the benchmarks of scripts/bench/ share (``bench_longppl.py``, ``bench_longce.py``, ``bench_multi_gpu.py``,
``bench_tensor_parallel.py``, ``bench_fp8.py``, ...): the model shapes they build, random-weight models
built in place on the GPUs (whole or split by tensor parallelism: a 123B model is never whole
anywhere) and their configs, documents cut from a JSONL of texts, timing one call with its peak GPU
memory, comparing the rows of two runs, and writing their JSON results. The scripts do not import each other; they
import this (``from common import ...``: a script run as ``python scripts/bench/<name>.py`` has its own
folder first on ``sys.path``). It is not part of the installed package.

Light at import (no torch): the benchmarks answer ``--help`` before loading torch.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: The repository's root (this folder is scripts/bench/): the benchmarks run from a checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The CRS reports of the tests' data: the benchmarks' default texts.
CRS = os.path.join(ROOT, "tests", "data", "govreport_crs.jsonl")


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
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
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


#: ``MistralConfig`` fields of Mistral Large 2 (123B), the paper's largest evaluator class: 246 GB in
#: bf16, so it runs split over GPUs only (``random_model`` with a mesh).
MISTRAL_LARGE_2_SHAPE = dict(
    vocab_size=32768,
    hidden_size=12288,
    intermediate_size=28672,
    num_hidden_layers=88,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    sliding_window=None,  # MistralConfig's default (4096) would be an attention window
    tie_word_embeddings=False,
)


#: ``Gemma3TextConfig`` fields of Gemma 3 270M (five window layers of 512 tokens to one full layer).
GEMMA3_270M_SHAPE = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
)


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


def byte_documents(path: str, sizes: list[int]) -> list[str]:
    """Documents of ``sizes[i]`` tokens under a byte-level tokenizer with a BOS (``longce.data
    .byte_level_tokenizer``: one token per byte, so ``size - 1`` bytes each), cut one after the other
    from the texts of the JSONL file ``path`` (the CRS reports in tests/data: ASCII almost throughout).

    Raises:
        ValueError: the file holds fewer bytes than the sizes ask for.
    """
    from longppl.commandline.corpus import read_jsonl_texts

    corpus = "\n\n".join(read_jsonl_texts(path)).encode("utf-8")
    cuts, start = [], 0
    for size in sizes:
        cuts.append(corpus[start : start + size - 1].decode("utf-8", errors="ignore"))
        start += size - 1
    if start > len(corpus):
        raise ValueError(f"{path} holds {len(corpus):,} bytes, fewer than the {start:,} asked for.")
    return cuts


#: Tiles per dimension of a random parameter (fewer where the dimension is not a multiple): the seed of
#: each tile depends on its position only, so any part of a parameter, a tensor-parallel rank's slice
#: included, is drawn without drawing the rest (a multiple of 8 splits evenly over 1, 2, 4 or 8 ranks).
TILES = 8


def random_parameter(name: str, shape, dtype, device, std: float, seed: int, index: tuple | None = None):
    """Parameter ``name`` of whole shape ``shape``, or its part ``index`` (a tuple of ``slice``s with
    unit step, one per dimension, as ``tensor_parallel.local_slice`` gives): ones for norms, else
    normal(0, std) drawn tile by tile (:data:`TILES`), each tile from a seed that depends on ``name``,
    ``seed`` and the tile's position only. So every layout (one GPU, a split over N, a device map)
    holds the same values without a checkpoint, and a rank draws only the tiles its part overlaps:
    the whole parameter is never built on it (the temporary memory is one tile).
    """
    import itertools
    import math
    import zlib

    import torch

    shape = tuple(shape)
    index = tuple(index) if index is not None else tuple(slice(None) for _ in shape)
    bounds = [part.indices(n)[:2] for part, n in zip(index, shape)]  # [start, stop) per dimension
    local = tuple(stop - start for start, stop in bounds)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(local, dtype=dtype, device=device)
    out = torch.empty(local, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    sizes = [n // math.gcd(n, TILES) if n else 1 for n in shape]  # each tile's extent per dimension
    ranges = [range(start // size, -(-stop // size)) for (start, stop), size in zip(bounds, sizes)]
    base = seed * 1_000_003 + zlib.crc32(name.encode())
    for position in itertools.product(*ranges):
        tile = tuple(slice(p * size, (p + 1) * size) for p, size in zip(position, sizes))
        number = sum(p * TILES**k for k, p in enumerate(reversed(position)))  # the tile's place, row-major
        generator.manual_seed(base + 7_919 * number)
        value = torch.empty(tuple(t.stop - t.start for t in tile), dtype=dtype, device=device)
        value.normal_(0.0, std, generator=generator)
        # the overlap of this tile with the part asked for, in the tile's and in the part's coordinates
        within = tuple(
            slice(max(b0, t.start) - t.start, min(b1, t.stop) - t.start) for (b0, b1), t in zip(bounds, tile)
        )
        into = tuple(slice(max(b0, t.start) - b0, min(b1, t.stop) - b0) for (b0, b1), t in zip(bounds, tile))
        out[into] = value[within]
    return out


def byte_level_config(fields: dict):
    """The ``transformers`` config of ``fields`` (its ``model_type`` and the config's fields, e.g.
    ``dict(model_type="llama", **LLAMA_SHAPES[...])``) for documents of the byte-level tokenizer
    (``longce.data.byte_level_tokenizer``: ``<s>`` = 256, ``</s>`` = 257), with 131072 positions."""
    from transformers import AutoConfig

    fields = dict(fields, max_position_embeddings=131072, bos_token_id=256, eos_token_id=257)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def whole_shape(local_shape, index, size: int) -> tuple[int, ...]:
    """The whole shape of a parameter whose rank holds ``local_shape`` at ``index`` (``local_slice``'s,
    over ``size`` ranks): the split dimension times ``size``, the others as they are."""
    return tuple(n if part == slice(None) else n * size for n, part in zip(local_shape, index))


def random_model(config, dtype, device: str, std: float = 0.02, seed: int = 0, mesh=None, sequence_parallel=None,
                 each_block: Callable | None = None):  # fmt: skip
    """``config``'s causal LM with :func:`random_parameter` weights on ``device``, in eval mode.

    Built on the meta device; with ``mesh`` (``tensor_parallel.group_mesh``) split there first
    (``tensor_parallel.shard_model``, ``sequence_parallel`` as it takes it), each rank drawing only its
    slice of a split parameter (``local_slice``; :func:`random_parameter` draws tile by tile). Weights get memory one parameter at a
    time, the transformer blocks last, one block after the other: ``each_block(block)`` runs on each
    block once its weights are drawn (e.g. converting it to fp8), so a rank holds at most its finished
    blocks and one block in ``dtype``. Buffers (RoPE's ``inv_freq``), computed on the CPU when the
    model is built, are moved to ``device``; tied embeddings are tied again.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from longppl.core.compilation import repeated_blocks
    from longppl.parallel import tensor_parallel

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    rank, size = 0, 1
    if mesh is not None:
        tensor_parallel.shard_model(model, mesh, sequence_parallel)
        rank, size = mesh.get_local_rank(), mesh.size()

    def draw(name: str, parameter) -> None:
        index = tensor_parallel.local_slice(model, name, rank) if mesh is not None else None
        shape = tuple(parameter.shape) if index is None else whole_shape(parameter.shape, index, size)
        value = random_parameter(name, shape, dtype, device, std, seed, index)  # this rank's part only
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)

    blocks = repeated_blocks(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    prefix = {id(module): name for name, module in model.named_modules()}
    with torch.no_grad():
        # tied parameters once (named_parameters); the blocks' last, one block finished before the next
        for name, parameter in list(model.named_parameters()):
            if id(parameter) not in in_blocks:
                draw(name, parameter)
        for block in blocks:
            for name, parameter in list(block.named_parameters(prefix=prefix[id(block)])):
                draw(name, parameter)
            if each_block is not None:
                each_block(block)
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def peak_gib(devices: list[int]) -> list[float]:
    """``torch.cuda.max_memory_allocated`` of each CUDA device index of ``devices``, in GiB."""
    import torch

    return [round(torch.cuda.max_memory_allocated(index) / 2**30, 2) for index in devices]


def timed_on(run: Callable[[], T], devices: list[int], distributed: bool = False) -> tuple[float, list[float], T]:
    """``(seconds, [peak GiB per device], value)`` of ``run()`` on the CUDA devices ``devices`` (none: the
    CPU, no peaks): their peaks reset first, and, with ``distributed``, all ranks in step on both sides
    (a barrier), so a rank's time is the group's."""
    import torch

    for index in devices:
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
    if distributed:
        torch.distributed.barrier()
    start = time.perf_counter()
    value = run()
    for index in devices:
        torch.cuda.synchronize(index)
    if distributed:
        torch.distributed.barrier()
    return time.perf_counter() - start, peak_gib(devices), value


def save_rows(path: str, scores) -> None:
    """The log-probs of ``scores`` (``EvaluatorScores`` per document) in the ``.npz`` file ``path``, for
    :func:`compare_saved_rows` to compare runs of other processes."""
    import numpy as np

    arrays = {f"{kind}_{i}": getattr(row, kind) for i, row in enumerate(scores) for kind in ("lp_long", "lp_short")}
    np.savez(path, **arrays)


def compare_saved_rows(got: str, want: str) -> dict | None:
    """:func:`compare_rows` of the rows :func:`save_rows` wrote to ``got`` and ``want``; ``None`` when
    either file is missing (its run failed or was skipped)."""
    import os

    import numpy as np

    if not (os.path.exists(got) and os.path.exists(want)):
        return None
    runs = [np.load(path, allow_pickle=False) for path in (got, want)]
    documents = [name[len("lp_long_") :] for name in runs[1].files if name.startswith("lp_long_")]
    return compare_rows(*([(run[f"lp_long_{i}"], run[f"lp_short_{i}"]) for i in documents] for run in runs))


def compare_rows(got: list[tuple], want: list[tuple]) -> dict:
    """Two runs' rows of the same documents, ``[(lp_long, lp_short), ...]`` per document: the largest
    log-prob difference, whether the default rule's key tokens (alpha 2, beta -2) are identical, and
    how many of ``want``'s top 5% of tokens by LSD (a threshold at its 95th percentile: a random model
    has few key tokens at alpha 2, so this set shows how far a perturbation moves a threshold inside
    the bulk of the distribution) ``got`` puts above that threshold too."""
    import numpy as np

    from longppl.rules.key_tokens import key_token_mask
    from longppl.settings import KeyTokenRule

    default_rule = KeyTokenRule()
    diff, default_same, default_keys, top_same, top_keys = 0.0, True, 0, 0, 0
    for (long_a, short_a), (long_b, short_b) in zip(got, want):
        for a, b in ((long_a, long_b), (short_a, short_b)):
            both = ~np.isnan(a) & ~np.isnan(b)
            diff = max(diff, float(np.abs(a[both] - b[both]).max()) if both.any() else 0.0)
        mask_a, mask_b = key_token_mask(long_a, short_a, default_rule), key_token_mask(long_b, short_b, default_rule)
        default_same &= bool((mask_a == mask_b).all())
        default_keys += int(mask_b.sum())
        lsd = long_b - short_b
        if np.isfinite(lsd).any():
            top = KeyTokenRule(alpha=float(np.nanquantile(lsd, 0.95)), use_lcl=False)
            top_a, top_b = key_token_mask(long_a, short_a, top), key_token_mask(long_b, short_b, top)
            top_same += int((top_a & top_b).sum())
            top_keys += int(top_b.sum())
    return dict(
        max_abs_logprob_diff=diff,
        default_rule_key_tokens=default_keys,
        default_rule_identical=default_same,
        top5pct_lsd_tokens=top_keys,
        top5pct_lsd_shared=top_same,
    )
