#!/usr/bin/env python
"""Evaluators larger than one GPU: one GPU vs tensor parallelism (TP) vs ``device_map="auto"``.

For each ``--shapes`` shape (random bf16 weights, drawn parameter by parameter from a seed that
depends on the parameter's name only, so every layout holds the same weights without a checkpoint
on disk), and each layout:

- ``one``: the whole evaluator on the first GPU (skipped for shapes in ``--too-big``);
- ``device_map``: accelerate's layer split over ``--gpus`` GPUs (``dispatch_model``, what
  ``longppl-score --device auto`` gets from ``from_pretrained(device_map="auto")``);
- ``tp``: ``--gpus`` processes under torchrun, the evaluator split by ``longppl.parallel.tensor_parallel``
  as ``longppl-score --tensor-parallel`` splits it, with sequence parallelism (the norms and residual
  adds on ``1/N`` of the tokens; built on the meta device, split, then each rank's shards drawn on
  its own GPU: a 72B model is never whole anywhere);
- ``tp_plain``: ``tp`` without sequence parallelism (``sequence_parallel=False``: the hidden states
  whole on every rank, an all-reduce where ``tp`` reduce-scatters and all-gathers);

it times ``score_with_evaluator`` (K=4096, d=1024, per document) on one document of ``--doc-tokens``
tokens and on a small corpus (``--corpus-docs`` documents of ``--corpus-tokens``), cut from the CRS
reports with a byte-level tokenizer (one token per byte), and reads the peak memory of every GPU.
The rows of each layout are compared with the ``one`` rows (and with the ``device_map`` rows): largest
log-prob difference, key tokens under the default rule, and the top 5% of tokens by LSD (a random
model has few key tokens at alpha=2, so the second set shows how far bf16 rounding moves a threshold).

Where the time goes, in the same run:

- ``--warmup N`` (default 1) scores the corpus N times untimed first, in every layout, so first-call
  costs (allocator, kernel choice, NCCL communicators) stay out of the figures;
- ``--repeats R`` (default 1) times each part R times: every time, and the median as ``seconds``;
  each part also counts the backbone's forward passes and the tokens they run;
- ``--profile`` scores the corpus once more under ``torch.profiler`` (CPU, and CUDA on GPU) and keeps
  a summary per rank (``profile-<shape>-<layout>-<rank>.json`` in ``--work``, and in the JSON): the
  25 ops with the most self device time (self CPU time on CPU), the time of each group (collectives,
  attention, LM-head side, matmul, DTensor dispatch, launches, other), and wall time against the
  summed device time: a device idle much of the wall time is launch- or dispatch-bound;
- ``--probe-allreduce`` (tp_plain layout) times all-reduces of the row-parallel outputs' size (longest
  document's tokens x hidden size, the model's dtype) alone: bus bandwidth, and "all-reduce alone
  would take X s of the Y s" of each part (the plan's row-wise layers per forward pass, times the
  part's forward tokens).

    python scripts/bench/bench_tensor_parallel.py --gpus 2 --shapes llama-3.1-8b qwen2-72b --too-big qwen2-72b \\
        --json bench_tp.json
    python scripts/bench/bench_tensor_parallel.py --cpu --shapes tiny --doc-tokens 600 --corpus-tokens 300  # smoke, gloo

Where the time of TP=2 goes at the 8B shape, with and without sequence parallelism, against one GPU,
in one short run on 2 GPUs:

    python scripts/bench/bench_tensor_parallel.py --gpus 2 --shapes llama-3.1-8b --layouts one tp tp_plain --warmup 1 \\
        --repeats 3 --profile --probe-allreduce --corpus-docs 2 --corpus-tokens 8192 --doc-tokens 32768 \\
        --json bench_tp_profile.json

A shape that runs out of memory in a layout is recorded as such and, with ``--fallback SHAPE``,
replaced by SHAPE for the remaining runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from common import (
    CRS,
    LLAMA_SHAPES,
    MISTRAL_LARGE_2_SHAPE,
    TINY_LLAMA_SHAPE,
    byte_documents,
    byte_level_config,
    compare_saved_rows,
    random_model,
    random_parameter,
    save_rows,
    timed_on,
    write_json,
)

from longppl.commandline.running import tool_parser
from longppl.settings import KeyTokenSettings, require_int

# torch, transformers and accelerate load inside the functions that use them: `--help` is immediate.

K, D = 4096, 1024
SHAPES = {  # config fields (model_type included); the byte-level tokenizer uses 259 rows of the vocabulary
    "llama-3.1-8b": dict(model_type="llama", **LLAMA_SHAPES["llama-3.1-8b"]),
    "qwen2-72b": dict(  # Qwen2-72B-Instruct's config
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "mistral-large-2": dict(model_type="mistral", **MISTRAL_LARGE_2_SHAPE),  # 123B: 246 GB in bf16
    "tiny": dict(model_type="llama", **TINY_LLAMA_SHAPE),
}
# --profile's groups: a kernel (GPU) or an operator (CPU) belongs to the first group one of whose
# fragments its lower-cased name holds. Collectives come first ("all_gather" holds "gather"), attention
# before matmul (attention kernels are named after cutlass and sm90 too). The last two name CPU-side
# work only: DTensor's dispatch (its profiler ranges, outside the aten operators they wrap) and CUDA
# kernel launches. longppl.parallel.tensor_parallel splits with plain tensors, so dtensor_dispatch reads about 0
# for the tp layout: kept to show that it does.
PROFILE_GROUPS = {
    "collectives": ("nccl", "all_reduce", "allreduce", "c10d", "gloo"),
    "attention": ("sdpa", "flash", "attention", "efficient", "fmha"),
    "lm_head_side": ("log_softmax", "logsoftmax", "logsumexp", "gather", "cross_entropy", "nll_loss"),
    "matmul": ("aten::mm", "addmm", "bmm", "gemm", "cutlass", "sm90", "nvjet", "xmma", "matmul", "linear"),
    "dtensor_dispatch": ("pythonsubclass", "pythondispatchmode", "redistribute", "torchtensor", "dtensor"),
    "launch": ("cudalaunch", "culaunch"),
}
TOP_OPS = 25  # ops listed by --profile, by self time
# The layouts split by longppl.parallel.tensor_parallel (processes under torchrun), with their sequence_parallel
# (None: the library's default, on for these shapes)
SPLIT_LAYOUTS = {"tp": None, "tp_plain": False}
LAYOUTS = ("one", *SPLIT_LAYOUTS, "device_map")


def texts(doc_tokens: int, corpus_docs: int, corpus_tokens: int, path: str = CRS) -> tuple[str, list[str]]:
    """One document of ``doc_tokens`` tokens and ``corpus_docs`` of ``corpus_tokens`` (``<s>`` counted),
    cut in order from the CRS reports (``common.byte_documents``)."""
    cuts = byte_documents(path, [doc_tokens] + [corpus_tokens] * corpus_docs)
    return cuts[0], cuts[1:]


def config_of(shape: str):
    return byte_level_config(SHAPES[shape])


def build(shape: str, layout: str, gpus: int, std: float, seed: int, device: str):
    """The random evaluator of ``shape`` in ``layout`` (one of :data:`LAYOUTS`)."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    from longppl.parallel import tensor_parallel

    config, dtype = config_of(shape), (torch.float32 if device == "cpu" else torch.bfloat16)
    if layout in SPLIT_LAYOUTS:
        mesh = tensor_parallel.group_mesh(gpus, torch.device(device).type)
        return random_model(config, dtype, device, std, seed, mesh, SPLIT_LAYOUTS[layout])
    if layout == "one":
        return random_model(config, dtype, device, std, seed)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    budget = {index: f"{int(torch.cuda.get_device_properties(index).total_memory * 0.85 / 2**30)}GiB"
              for index in range(gpus)}  # fmt: skip
    # "balanced", as from_pretrained(device_map="auto") spreads a model that would fit on fewer GPUs
    budget = get_balanced_memory(model, max_memory=budget, no_split_module_classes=model._no_split_modules)
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)
    placed = dict(device_map)
    with torch.no_grad():
        for name, parameter in list(model.named_parameters()):
            owner = max((key for key in placed if key == "" or name.startswith(key + ".")), key=len)
            target = placed[owner]
            target = f"cuda:{target}" if isinstance(target, int) else target
            set_module_tensor_to_device(
                model, name, target, value=random_parameter(name, tuple(parameter.shape), dtype, target, std, seed)
            )
    return dispatch_model(model, device_map).eval()


def count_forwards(model) -> dict:
    """``{"calls": 0, "tokens": 0}``, then counting the backbone's forward passes and the tokens they run
    (``input_ids.numel()``, padding included: the rows a row-parallel layer all-reduces), through a
    pre-hook on ``model.base_model``. Reset the counts by assigning them."""
    counts = dict(calls=0, tokens=0)

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["calls"] += 1
        counts["tokens"] += 0 if ids is None else int(ids.numel())

    model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def time_part(run, repeats: int, counts: dict, devices: list[int], distributed: bool) -> tuple[dict, list]:
    """``run()`` timed ``repeats`` times: ``(record, rows of the last run)``; the record holds every time,
    their median as ``seconds``, and the last run's peak GiB per GPU and forward passes (``counts``)."""
    times = []
    for _ in range(repeats):
        counts.update(calls=0, tokens=0)
        seconds, peak, scores = timed_on(run, devices, distributed)
        times.append(seconds)
    median = statistics.median(times)
    tokens = sum(int(row.input_ids.shape[0]) for row in scores)
    record = dict(
        seconds=round(median, 3),
        repeats=[round(seconds, 3) for seconds in times],
        tokens=tokens,
        tokens_per_s=round(tokens / median, 1),
        peak_gib=peak,
        longest=max(int(row.input_ids.shape[0]) for row in scores),
        forwards=counts["calls"],
        forward_tokens=counts["tokens"],
    )
    return record, scores


def profile_group(name: str) -> str:
    """The group of :data:`PROFILE_GROUPS` of a kernel or operator ``name`` (``"other"`` if none)."""
    lower = name.lower()
    return next((group for group, parts in PROFILE_GROUPS.items() if any(part in lower for part in parts)), "other")


def grouped_ms(events, microseconds) -> dict[str, float]:
    """``{group: ms}``: ``microseconds(event)`` of ``events`` (rows of ``key_averages()``) summed by
    :func:`profile_group`, every group present."""
    groups = dict.fromkeys([*PROFILE_GROUPS, "other"], 0.0)
    for event in events:
        groups[profile_group(event.key)] += microseconds(event) / 1e3
    return groups


def profile_summary(profiler, wall_seconds: float, on_gpu: bool) -> dict:
    """A small summary of a finished ``torch.profiler.profile`` (not its trace), times in ms.

    The ops are the device's kernels (and copies) timed by self device time on GPU, the operators timed
    by self CPU time on CPU: ``top`` lists the :data:`TOP_OPS` first, ``groups_ms`` splits them all by
    :func:`profile_group`, so the groups sum to ``busy_ms``, and ``busy_share`` is ``busy_ms`` over the
    wall time (above 1 where streams overlap). ``cpu_groups_ms`` splits the operators' self CPU time
    (the same as ``groups_ms`` on CPU), summed in ``cpu_ops_ms``. A device busy for a small share of
    the wall time while the CPU is busy means launch- or dispatch-bound (``dtensor_dispatch``: DTensor's
    Python dispatch and redistribution), not device-bound. A collective's time includes waiting for
    the slowest rank.
    """
    from torch.autograd import DeviceType

    averages = profiler.key_averages()
    cpu_ops = [event for event in averages if event.device_type == DeviceType.CPU]
    # On the GPU, a user annotation (as ProcessGroupNCCL's "nccl:all_reduce") times the range of the
    # kernels it wraps, which are listed too: counting both would count each collective twice.
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    ops = kernels if on_gpu else cpu_ops
    own = (lambda event: event.self_device_time_total) if on_gpu else (lambda event: event.self_cpu_time_total)
    whole = (lambda event: event.device_time_total) if on_gpu else (lambda event: event.cpu_time_total)
    groups = grouped_ms(ops, own)
    cpu_groups = grouped_ms(cpu_ops, lambda event: event.self_cpu_time_total)
    busy = sum(groups.values())
    top = [
        dict(name=event.key[:120], group=profile_group(event.key), count=event.count,
             self_ms=round(own(event) / 1e3, 3), total_ms=round(whole(event) / 1e3, 3))
        for event in sorted(ops, key=own, reverse=True)[:TOP_OPS]
    ]  # fmt: skip
    return dict(
        timed="self device time of kernels" if on_gpu else "self CPU time of operators",
        wall_ms=round(wall_seconds * 1e3, 3),
        busy_ms=round(busy, 3),
        busy_share=round(busy / (wall_seconds * 1e3), 3),
        groups_ms={group: round(ms, 3) for group, ms in groups.items()},
        cpu_ops_ms=round(sum(cpu_groups.values()), 3),
        cpu_groups_ms={group: round(ms, 3) for group, ms in cpu_groups.items()},
        top=top,
    )


def profiled(run, devices: list[int], distributed: bool) -> dict:
    """One more ``run()``, timed under ``torch.profiler.profile`` (CPU activity, and CUDA's on GPU):
    its :func:`profile_summary`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if devices else [])
    with profile(activities=activities) as profiler:
        seconds, _, _ = timed_on(run, devices, distributed)
    return profile_summary(profiler, seconds, bool(devices))


def allreduce_seconds(tensor, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of ``tensor`` over the default group, warm (one untimed first):
    the ranks start together (a barrier before each), the clock stops when this rank's device is done."""
    import torch

    def synchronize():
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    torch.distributed.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        synchronize()
        start = time.perf_counter()
        torch.distributed.all_reduce(tensor)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_allreduce(model, record: dict) -> dict:
    """What all-reduce alone costs the tp layout's timed parts of ``record``.

    Per part: an all-reduce of ``[longest document's tokens, hidden_size]`` in the model's dtype (a
    row-parallel layer's output on the long pass), timed by :func:`allreduce_seconds`, as bus bandwidth
    (``bytes / s * 2 (n - 1) / n``); the all-reduces of one forward pass are the modules the plan
    splits row-wise (two per layer for Llama). The estimate scales that time by the tokens of all the
    part's forward passes (long pass and short windows, as counted): large all-reduces are
    bandwidth-bound, so their time grows with their rows.
    """
    import torch

    from longppl.parallel.tensor_parallel import RowwiseLinear

    size = torch.distributed.get_world_size()
    per_forward = sum(isinstance(module, RowwiseLinear) for module in model.modules())  # the split made them
    hidden, device = model.config.hidden_size, model.get_input_embeddings().weight.device
    out = dict(all_reduces_per_forward=per_forward, hidden_size=hidden, dtype=str(model.dtype).replace("torch.", ""))
    for part in ("document", "corpus"):
        timing = record[part]
        tensor = torch.zeros(timing["longest"], hidden, dtype=model.dtype, device=device)
        seconds = allreduce_seconds(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        estimate = seconds * per_forward * timing["forward_tokens"] / timing["longest"]
        out[part] = dict(
            tokens=timing["longest"],
            mib=round(nbytes / 2**20, 2),
            seconds=round(seconds, 6),
            bus_gbps=round(nbytes / seconds * 2 * (size - 1) / size / 1e9, 2),
            all_reduces=per_forward * timing["forwards"],
            estimate_seconds=round(estimate, 3),
            says=f"all-reduce alone would take {estimate:.3f} s of the {timing['seconds']:.3f} s",
        )
    return out


def worker(args) -> None:
    """One process of a layout run: every shape of ``--shapes`` in ``--layout``; results to ``--work``."""
    import gc

    import torch

    from longce.data import byte_level_tokenizer
    from longppl.core.scoring import score_with_evaluator

    cpu = args.cpu or not torch.cuda.is_available()
    distributed = args.layout in SPLIT_LAYOUTS
    if distributed:
        from accelerate import PartialState

        state = PartialState(cpu=cpu)
        # "cpu", not accelerate's "cpu:0": a generator made for "cpu:0" draws other numbers than one for "cpu"
        rank, device = state.process_index, ("cpu" if cpu else str(state.device))
    else:
        rank, device = 0, ("cpu" if cpu else "cuda:0")
    devices = (
        [] if cpu else ([torch.device(device).index] if distributed or args.layout == "one" else list(range(args.gpus)))
    )
    tokenizer = byte_level_tokenizer()
    document, corpus = texts(args.doc_tokens, args.corpus_docs, args.corpus_tokens, args.data)
    shapes = list(args.shapes)
    for shape in shapes:
        if args.layout == "one" and shape in args.too_big:
            continue
        record = dict(shape=shape, layout=args.layout, gpus=1 if args.layout == "one" else args.gpus, rank=rank)
        record["warmup"] = args.warmup
        try:
            seconds, peak, model = timed_on(
                lambda: build(shape, args.layout, args.gpus, args.init_std, args.seed, device), devices, distributed
            )
            record.update(build_seconds=round(seconds, 2), weights_gib=peak)
            counts = count_forwards(model)
            runs = {
                part: (lambda part_texts=part_texts: score_with_evaluator(
                    model, tokenizer, part_texts, KeyTokenSettings(K, D), progress=False, per_document=True))
                for part, part_texts in (("document", [document]), ("corpus", corpus))
            }  # fmt: skip
            for _ in range(args.warmup):  # first-call costs (allocator, kernel choice, communicators) out
                runs["corpus"]()
            for part, run in runs.items():
                record[part], scores = time_part(run, args.repeats, counts, devices, distributed)
                if rank == 0:
                    save_rows(os.path.join(args.work, f"{shape}-{args.layout}-{part}.npz"), scores)
            if args.profile:
                record["profile"] = profiled(runs["corpus"], devices, distributed)
                write_json(os.path.join(args.work, f"profile-{shape}-{args.layout}-{rank}.json"), record["profile"])
            if args.probe_allreduce and args.layout == "tp_plain":  # tp reduce-scatters and all-gathers
                record["allreduce_probe"] = probe_allreduce(model, record)
        except torch.OutOfMemoryError as err:
            record["out_of_memory"] = str(err).splitlines()[0][:200]
            if args.fallback and args.fallback not in shapes:
                shapes.append(args.fallback)
        model = scores = runs = None
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
        print(json.dumps(record), flush=True)
        with open(os.path.join(args.work, f"results-{args.layout}-{rank}.jsonl"), "a") as handle:
            handle.write(json.dumps(record) + "\n")
    if distributed:
        state.destroy_process_group()


def compare(work: str, shape: str, layout: str, reference: str) -> dict | None:
    """Rows of ``layout`` against ``reference``'s for ``shape`` (both parts), or ``None`` if either is missing."""
    out = {}
    for part in ("document", "corpus"):
        found = compare_saved_rows(*(os.path.join(work, f"{shape}-{name}-{part}.npz") for name in (layout, reference)))
        if found is None:
            return None
        out[part] = found
    return out


def main(argv=None) -> dict:
    parser = tool_parser(None, __doc__)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the device_map and TP runs (default 2)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-3.1-8b", "qwen2-72b"])
    parser.add_argument("--too-big", nargs="*", default=["qwen2-72b"], help="shapes not run on one GPU")
    parser.add_argument(
        "--fallback", choices=sorted(SHAPES), default=None, help="shape run when one runs out of memory"
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["one", "tp", "device_map"])
    parser.add_argument(
        "--doc-tokens", type=int, default=32768, help="tokens of the long document (default %(default)s)"
    )
    parser.add_argument(
        "--corpus-docs", type=int, default=4, help="documents of the small corpus (default %(default)s)"
    )
    parser.add_argument("--corpus-tokens", type=int, default=8192, help="tokens of each (default %(default)s)")
    parser.add_argument("--data", default=CRS, help="the CRS reports' JSONL (default: tests/data/govreport_crs.jsonl)")
    parser.add_argument("--init-std", type=float, default=0.02, help="std of the random weights (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed to each layout's run")
    parser.add_argument(
        "--work", default=None, help="folder for rows and per-process results (default: a new temporary one)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo (smoke run; no device_map)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed scorings of the corpus before the timed parts (default 1)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timings of each part; the median is reported (default 1)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="one more scoring of the corpus under torch.profiler, summarised"
    )
    parser.add_argument(
        "--probe-allreduce", action="store_true", help="tp_plain layout: time all-reduces of the model's sizes alone"
    )
    parser.add_argument("--layout", default=None, help=argparse_hidden())
    args = parser.parse_args(argv)
    try:
        require_int("--warmup", args.warmup, minimum=0)
        require_int("--repeats", args.repeats)
    except ValueError as err:
        parser.error(str(err))
    if args.layout is not None:
        worker(args)
        return {}
    import tempfile

    work = args.work or tempfile.mkdtemp(prefix="bench-tp-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--json",)]
    if args.json in passed:
        passed.remove(args.json)
    ran = {}
    for layout in args.layouts:
        if layout == "device_map" and args.cpu:
            continue
        if layout in SPLIT_LAYOUTS:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(args.gpus),
            ]
        else:
            command = [sys.executable]
        command += [os.path.abspath(__file__), *passed, "--work", work, "--layout", layout]
        start = time.perf_counter()
        try:
            status = subprocess.run(command, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
        ran[layout] = dict(status=status, wall_seconds=round(time.perf_counter() - start, 1))
    records = []
    for name in sorted(os.listdir(work)):
        if name.startswith("results-"):
            with open(os.path.join(work, name)) as handle:
                records += [json.loads(line) for line in handle]
    comparisons = {}
    for shape in {record["shape"] for record in records}:
        pairs = [(layout, "one") for layout in (*SPLIT_LAYOUTS, "device_map")]
        for layout, reference in pairs + [(layout, "device_map") for layout in SPLIT_LAYOUTS]:
            found = compare(work, shape, layout, reference)
            if found is not None:
                comparisons[f"{shape}: {layout} vs {reference}"] = found
    found = dict(runs=ran, comparisons=comparisons, **findings(records))
    result = dict(found, warmup=args.warmup, repeats=args.repeats, records=records, work=work, argv=passed)
    print(json.dumps(found, indent=1))
    if args.json:
        write_json(args.json, result)
    return result


def findings(records: list[dict]) -> dict:
    """The profile and probe figures of ``records`` in brief, by ``"shape layout rank r"``: each
    profile without its top ops, and what each probe says."""
    profiles, probes = {}, {}
    for record in records:
        name = f"{record['shape']} {record['layout']} rank {record['rank']}"
        if "profile" in record:
            profiles[name] = {key: value for key, value in record["profile"].items() if key != "top"}
        if "allreduce_probe" in record:
            probe = record["allreduce_probe"]
            probes[name] = {
                part: f"{probe[part]['says']} ({probe[part]['bus_gbps']} GB/s)" for part in ("document", "corpus")
            }
    return dict(profiles=profiles, allreduce_probes=probes)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
