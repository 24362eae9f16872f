#!/usr/bin/env python
"""Multi-GPU checks, each against a one-GPU baseline run by the same script on the same machine.

``score``: ``compute_key_tokens.py`` on one GPU, then under ``accelerate launch --multi_gpu`` on
``--gpus`` GPUs, over ``--documents`` documents of ``--tokens`` tokens cut from the CRS reports
(``tests/data/govreport_crs.jsonl``), with a random-weight evaluator shaped like Llama-3.1-8B
(or ``--shape llama-3.2-1b``) and a byte-level tokenizer, saved to a temporary folder first. It
prints both wall times, their ratio, and whether the two caches are identical (same rows, every
column equal, NaNs in the same places).

``train``: ``train_longce.py --config configs/llama1b_shape_16k.yaml`` on one GPU with per-device
batch ``--gpus`` (the baseline), then under ``accelerate launch --config_file
configs/accelerate/<setup>.yaml`` for each setup (``ddp``, ``fsdp2``, ``zero3``) with per-device
batch 1: the same global batch, seed and sequence order, all starting from one saved copy of the
recipe's random initial model. Setup ``ga`` runs one GPU with per-device
batch 1 and ``--gpus`` gradient-accumulation steps: the same sums in another order, which shows
how far bf16 rounding alone moves the curve. ``fsdp2:1`` and ``zero3:1`` run that engine on one GPU
with per-device batch ``--gpus``: its own bf16 regime (DeepSpeed's bf16 trains bf16 weights), one
process. It prints the loss of every step for
each setup, the largest difference from the baseline, the steps that logged the LongCE
statistics, and the training time.

``train --weights cache`` first scores every document of ``--data`` (whole) into a key-token cache
with a random ``--evaluator-shape`` evaluator (byte-level tokenizer, one process: the first GPU, or
the CPU with ``--cpu``) at the recipe's K and d, then gives every run, the baseline included,
``--longce_weights cache --key_tokens <cache>``: the same checks with weights read from the data.

    python scripts/bench/bench_multi_gpu.py score --gpus 2 --documents 8 --tokens 32768
    python scripts/bench/bench_multi_gpu.py train --gpus 2 --setups ga ddp fsdp2 zero3
    python scripts/bench/bench_multi_gpu.py train --gpus 2 --weights cache --setups ddp fsdp2 zero3 -- --max_steps 10
    python scripts/bench/bench_multi_gpu.py train --cpu --config configs/tiny_cpu.yaml --setups ddp --weights cache \\
        -- --max_steps 3 --logging_steps 1 --save_strategy no   # smoke run, gloo (scores all of --data: ~80 s)
    python scripts/bench/bench_multi_gpu.py score --cpu --shape tiny --documents 4 --tokens 600   # smoke run, gloo

Everything after ``--`` goes to every ``train_longce.py`` run (e.g. ``-- --max_steps 5``).
``--json PATH`` also writes the results as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import CRS, LLAMA_SHAPES, ROOT, TINY_LLAMA_SHAPE, write_json

from longppl.commandline.running import tool_parser

# datasets, torch and transformers load inside the functions that use them: `--help` is immediate.

SHAPES = {  # LlamaConfig fields; the byte-level tokenizer uses 259 rows of the vocabulary
    **LLAMA_SHAPES,
    "tiny": TINY_LLAMA_SHAPE,
}
STAT_KEYS = ("ce_loss", "longce_mean_weight", "longce_weight_gt1_share", "longce_max_weight")


def crs_documents(path: str, documents: int, tokens: int) -> list[str]:
    """``documents`` texts of ``tokens`` bytes each, cut in order from the reports joined by blank lines.

    With the byte-level tokenizer (one token per byte, plus ``<s>``) each text is at least ``tokens``
    tokens; ``--max-length`` then cuts them to exactly that. Raises ``ValueError`` when the reports
    hold fewer than ``documents * tokens`` bytes.
    """
    from longppl.commandline.corpus import read_jsonl_texts

    corpus = "\n\n".join(read_jsonl_texts(path)).encode("utf-8")
    if len(corpus) < documents * tokens:
        raise ValueError(
            f"{path} holds {len(corpus):,} bytes, fewer than {documents} x {tokens:,}; ask for fewer "
            "or shorter documents."
        )
    # A cut inside a multi-byte character drops its pieces ("ignore"): a text can lose a few bytes.
    return [corpus[i * tokens : (i + 1) * tokens].decode("utf-8", errors="ignore") for i in range(documents)]


def save_random_model(folder: str, fields: dict, dtype: str, device: str, seed: int = 0) -> None:
    """A random-weight model of ``fields`` (``model_type`` and config fields) with the byte-level tokenizer.

    The tokenizer's size and special-token ids fill the fields the recipe leaves out, as
    ``longce-train`` does for ``model_config``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longce.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    fields = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **fields,
    }
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):  # initialising an 8B model on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_random_evaluator(folder: str, shape: str, device: str, **fields) -> None:
    """A random-weight Llama evaluator of ``SHAPES[shape]`` (plus ``fields``) with the byte-level tokenizer.

    bf16 on a GPU, float32 on the CPU, as ``compute_key_tokens.py`` then loads it.
    """
    start = time.perf_counter()
    fields = dict(SHAPES[shape], model_type="llama", max_position_embeddings=131072, **fields)
    save_random_model(folder, fields, "bfloat16" if device == "cuda" else "float32", device)
    print(f"random {shape} evaluator saved in {time.perf_counter() - start:.1f} s", flush=True)


def run(command: list[str], env: dict[str, str], log: str, timeout: float) -> float:
    """Run ``command`` with its output appended to ``log``; returns its wall seconds. Raises on failure."""
    start = time.perf_counter()
    with open(log, "a") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        status = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout)
    seconds = time.perf_counter() - start
    if status.returncode != 0:
        with open(log) as handle:
            tail = handle.read()[-4000:]
        raise RuntimeError(f"{command[:4]} ... failed with exit status {status.returncode}; end of {log}:\n{tail}")
    return seconds


def launcher(num_processes: int, config_file: str | None = None) -> list[str]:
    """``accelerate launch`` for ``num_processes`` processes, from ``config_file`` or plain ``--multi_gpu``.

    (``--multi_gpu`` is accelerate's torchrun launcher; without GPUs ``compute_key_tokens.py`` joins
    the processes over gloo, while accelerate's ``--cpu`` would start one process.)
    """
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes)]
    if config_file is not None:
        return command + ["--config_file", config_file]
    return command + ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def child_env(cpu: bool, visible: int | None = None) -> dict[str, str]:
    from longppl.commandline.threads import child_thread_env

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:  # tiny smoke-run models: one thread per process (as many processes as cores), unless the user chose
        env = child_thread_env(env, 1)
    elif visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(visible))
    return env


def key_tokens_command(
    corpus: str,
    evaluator: str,
    output: str,
    trunc_len: int,
    sliding_window: int,
    max_length: int | None = None,
    text_column: str = "text",
) -> list[str]:
    """``compute_key_tokens.py``'s arguments: ``corpus`` scored by ``evaluator`` with K, d into ``output``."""
    command = ["scripts/compute_key_tokens.py", "--corpus", corpus, "--evaluator", evaluator, "--output", output]
    command += ["--text-column", text_column, "--trunc-len", str(trunc_len), "--sliding-window", str(sliding_window)]
    return command + ([] if max_length is None else ["--max-length", str(max_length)])


def caches_identical(first: str, second: str) -> tuple[bool, str]:
    """Whether two key-token caches hold the same rows with equal columns; and what differs, if anything."""
    from longppl.cache.key_token_cache import KeyTokenCache

    return rows_identical(KeyTokenCache.load(first).dataset, KeyTokenCache.load(second).dataset)


def rows_identical(a, b) -> tuple[bool, str]:
    """Whether two ``datasets.Dataset`` of cache rows hold the same rows (matched by ``text_fingerprint``,
    in any order) with equal columns; and what differs, if anything."""
    if a.column_names != b.column_names or len(a) != len(b):
        return False, f"columns {a.column_names} / {b.column_names}, rows {len(a)} / {len(b)}"
    a, b = (cache.select(np.argsort(cache["text_fingerprint"], kind="stable").tolist()) for cache in (a, b))
    for column in a.column_names:
        for row, (x, y) in enumerate(zip(a[column], b[column])):
            if isinstance(x, list):
                x, y = np.asarray(x), np.asarray(y)
                same = x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
            else:
                same = x == y
            if not same:
                detail = ""
                if isinstance(x, np.ndarray) and x.shape == y.shape and x.dtype.kind == "f":
                    detail = f", largest difference {np.nanmax(np.abs(x - y)):.3g}"
                return False, f"column {column!r} differs in row {row}{detail}"
    return True, f"{len(a)} rows, columns {', '.join(a.column_names)}"


def score(args) -> dict:
    device = "cpu" if args.cpu else "cuda"
    work = tempfile.mkdtemp(prefix="bench-multi-gpu-score-", dir=args.workdir)
    log = os.path.join(work, "log.txt")
    evaluator, corpus = os.path.join(work, "evaluator"), os.path.join(work, "corpus.jsonl")
    save_random_evaluator(evaluator, args.shape, device)
    with open(corpus, "w", encoding="utf-8") as handle:
        for text in crs_documents(args.data, args.documents, args.tokens):
            handle.write(json.dumps({"text": text}) + "\n")

    def script(output: str) -> list[str]:
        return key_tokens_command(corpus, evaluator, output, args.trunc_len, args.sliding_window, args.tokens)

    one, many = os.path.join(work, "cache-1"), os.path.join(work, f"cache-{args.gpus}")
    seconds_one = run([sys.executable] + script(one), child_env(args.cpu, 1), log, args.timeout)
    print(f"1 {device} process: {seconds_one:.1f} s", flush=True)
    seconds_many = run(launcher(args.gpus) + script(many), child_env(args.cpu, args.gpus), log, args.timeout)
    print(f"{args.gpus} {device} processes: {seconds_many:.1f} s", flush=True)
    identical, detail = caches_identical(one, many)
    scored = [float(m) for m in re.findall(r"evaluator tokens, .*?, ([0-9.]+) s ->", open(log).read())]
    result = dict(
        shape=args.shape,
        documents=args.documents,
        tokens=args.tokens,
        processes=args.gpus,
        wall_seconds_1=seconds_one,
        wall_seconds_n=seconds_many,
        ratio=seconds_many / seconds_one,
        script_seconds=scored,
        identical=identical,
        detail=detail,
        log=log,
    )
    print(
        f"\n{args.documents} documents x {args.tokens:,} tokens, {args.shape} evaluator, K={args.trunc_len}, "
        f"d={args.sliding_window}"
    )
    print(
        f"  wall time: 1 process {seconds_one:.1f} s, {args.gpus} processes {seconds_many:.1f} s "
        f"(ratio {result['ratio']:.2f}); the scripts' own timings (after imports): "
        f"{', '.join(f'{s:.1f} s' for s in scored)}"
    )
    print(f"  caches identical: {identical} ({detail})")
    return result


def shared_initial_model(config_path: str, folder: str, device: str) -> str:
    """Save the recipe's random initial model once; returns a copy of the recipe that loads it.

    Under ZeRO-3, transformers builds a ``model_config`` model inside ``deepspeed.zero.Init``,
    which initialises the weights in another order than a plain build: the same seed gives other
    weights than on one GPU. Every setup therefore starts from this one saved checkpoint.
    """
    import yaml

    from longce.arguments import BYTE_LEVEL

    with open(config_path) as handle:
        recipe = yaml.safe_load(handle)
    if "model_config" not in recipe or recipe.get("tokenizer_name_or_path") != BYTE_LEVEL:
        raise ValueError(f"{config_path} needs a model_config and tokenizer_name_or_path: {BYTE_LEVEL}.")
    dtype = recipe.get("torch_dtype", "auto").replace("auto", "float32")  # longce-train's model_config default
    save_random_model(folder, recipe.pop("model_config"), dtype, device, recipe.get("seed", 0))
    recipe.update(model_name_or_path=folder, tokenizer_name_or_path=folder)
    derived = os.path.join(os.path.dirname(folder), "recipe.yaml")
    with open(derived, "w") as handle:
        yaml.safe_dump(recipe, handle)
    return derived


def log_history(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        return json.load(handle)["log_history"]


def score_training_texts(train_command: list[str], work: str, log: str, args) -> str:
    """Score the documents the runs train on into a key-token cache, once; returns its folder.

    A random ``--evaluator-shape`` evaluator (byte-level tokenizer, ``initializer_range``
    ``--evaluator-init``: a larger one than the default 0.02 gives it sharp, context-dependent
    predictions, so that the weights vary) scores every document of ``--data`` whole, with the K, d
    and text column that ``train_command`` (``train_longce.py`` and its arguments) trains with, on one
    process (the first GPU, or the CPU with ``--cpu``). The trained model needs no particular
    evaluator tokenizer: ``add_key_token_weights`` carries the weights to its tokens by characters.
    """
    from longce.arguments import parse_args

    # The runs' own arguments (the recipe and the overrides after `--`); bf16 off: the parent may have no GPU.
    _, data_args, training_args = parse_args(train_command[1:] + ["--bf16", "false"])
    device = "cpu" if args.cpu else "cuda"
    evaluator, output = os.path.join(work, "evaluator"), os.path.join(work, "key-tokens")
    save_random_evaluator(evaluator, args.evaluator_shape, device, initializer_range=args.evaluator_init)
    command = key_tokens_command(
        args.data,
        evaluator,
        output,
        training_args.longce_trunc_len,
        training_args.longce_sliding_window,
        text_column=data_args.text_column,
    )
    seconds = run([sys.executable] + command, child_env(args.cpu, 1), log, args.timeout)
    print(
        f"key-token cache of {args.data} (K={training_args.longce_trunc_len}, d={training_args.longce_sliding_window}) "
        f"scored on 1 {device} process in {seconds:.1f} s: {output}",
        flush=True,
    )
    return output


def train(args) -> dict:
    work = tempfile.mkdtemp(prefix="bench-multi-gpu-train-", dir=args.workdir)
    log = os.path.join(work, "log.txt")
    recipe = shared_initial_model(args.config, os.path.join(work, "initial-model"), "cpu" if args.cpu else "cuda")
    common = ["scripts/train_longce.py", "--config", recipe, "--data_files", args.data] + args.train_args
    key_tokens = None
    if args.weights == "cache":  # every run, the baseline included, takes its weights from one cache
        key_tokens = score_training_texts(common, work, log, args)
        common += ["--longce_weights", "cache", "--key_tokens", key_tokens]
    runs: dict[str, dict] = {}
    setups = [("1 GPU", None)] + [("1 GPU, GA" if setup == "ga" else setup, setup) for setup in args.setups]
    for name, setup in setups:
        output_dir = os.path.join(work, (setup or "one").replace(":", "-on-"))
        if setup is None:
            command = [sys.executable] + common + ["--per_device_train_batch_size", str(args.gpus)]
            env = child_env(args.cpu, 1)
        elif setup == "ga":  # the same global batch as micro-batches of 1: the noise floor of summation order
            command = (
                [sys.executable]
                + common
                + ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", str(args.gpus)]
            )
            env = child_env(args.cpu, 1)
        else:  # "zero3": on --gpus processes; "zero3:1": the same engine on one process, per-device batch --gpus
            engine, _, one = setup.partition(":")
            config_file = os.path.join("configs", "accelerate", f"{engine}.yaml")
            processes = 1 if one else args.gpus
            command = (
                launcher(processes, config_file)
                + common
                + ["--per_device_train_batch_size", str(args.gpus // processes)]
            )
            env = child_env(args.cpu, processes)
        try:
            wall = run(command + ["--output_dir", output_dir], env, log, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"{name}: FAILED: {err}", flush=True)
            runs[name] = dict(error=str(err)[-2000:])
            continue
        history = log_history(output_dir)
        steps = [entry for entry in history if "loss" in entry]
        runs[name] = dict(
            wall_seconds=wall,
            train_runtime=next((e["train_runtime"] for e in history if "train_runtime" in e), float("nan")),
            loss=[entry["loss"] for entry in steps],
            stats_steps=[entry["step"] for entry in steps if all(key in entry for key in STAT_KEYS)],
            steps=[entry["step"] for entry in steps],
            **{key: [entry.get(key) for entry in steps] for key in STAT_KEYS},
        )
        print(
            f"{name}: {len(steps)} logged steps, loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, "
            f"{runs[name]['train_runtime']:.1f} s training ({wall:.1f} s wall)",
            flush=True,
        )
        if args.json:  # kept up to date, so that a run cut short by a time limit still leaves its figures
            write_json(args.json, dict(config=args.config, gpus=args.gpus, weights=args.weights, runs=runs, log=log))

    base = runs["1 GPU"].get("loss")
    names = [name for name, _ in setups if "loss" in runs[name]]
    print(f"\nloss per step ({args.config}, global batch {args.gpus}, LongCE weights {args.weights})")
    print("step " + "".join(f"{name:>10}" for name in names))
    for index in range(max(len(runs[name]["loss"]) for name in names) if names else 0):
        cells = [runs[name]["loss"][index] if index < len(runs[name]["loss"]) else float("nan") for name in names]
        print(f"{index + 1:>4} " + "".join(f"{cell:>10.4f}" for cell in cells))

    def largest_difference(loss: list[float], reference: list[float] | None) -> float:
        if reference is None or len(loss) != len(reference):
            return float("nan")
        return float(np.max(np.abs(np.subtract(loss, reference))))

    for name in names:
        entry = runs[name]
        entry["max_abs_diff_vs_1gpu"] = largest_difference(entry["loss"], base)
        twin = runs.get(f"{name}:1", {}).get("loss")  # the same engine on one GPU
        versus_twin = ""
        if twin is not None:
            entry[f"max_abs_diff_vs_{name}:1"] = largest_difference(entry["loss"], twin)
            versus_twin = f", |loss - {name}:1| {entry[f'max_abs_diff_vs_{name}:1']:.4f}"
        once = entry["stats_steps"] == entry["steps"] == sorted(set(entry["steps"]))
        print(
            f"{name:>8}: max |loss - 1 GPU| {entry['max_abs_diff_vs_1gpu']:.4f}{versus_twin}; LongCE statistics "
            f"on {len(entry['stats_steps'])} of {len(entry['steps'])} logged steps, once per step: {once}; mean "
            f"weight {np.mean(entry['longce_mean_weight']):.4f}, share > 1 {np.mean(entry['longce_weight_gt1_share']):.4f}"
        )
    failed = [name for name, _ in setups if "error" in runs[name]]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see {log})")
    return dict(config=args.config, gpus=args.gpus, weights=args.weights, key_tokens=key_tokens, runs=runs, log=log)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    parser = tool_parser(None, __doc__)
    sub = parser.add_subparsers(
        dest="check",
        required=True,
        metavar="{score,train}",
        help="the check to run (`score --help`, `train --help` for its options)",
    )
    for name, what in (
        ("score", "compute_key_tokens.py on one GPU vs on --gpus GPUs"),
        ("train", "train_longce.py on one GPU vs under DDP, FSDP2, ZeRO-3 on --gpus GPUs"),
    ):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("--gpus", type=int, default=2, help="processes of the multi-process runs (default 2)")
        p.add_argument("--data", default=CRS, help="the CRS reports' JSONL (default: tests/data/govreport_crs.jsonl)")
        p.add_argument("--workdir", default=None, help="where the temporary folders go (default: the system's)")
        p.add_argument("--timeout", type=float, default=900, help="seconds allowed to each run (default 900)")
        p.add_argument("--json", default=None, help="also write the results to this JSON file (default: print only)")
        p.add_argument(
            "--cpu",
            action="store_true",
            help="CPU processes over gloo (a smoke run; one torch thread each unless OMP_NUM_THREADS is set)",
        )
    score_parser, train_parser = sub.choices["score"], sub.choices["train"]
    score_parser.add_argument(
        "--documents", type=int, default=8, help="documents cut from the CRS reports (default %(default)s)"
    )
    score_parser.add_argument("--tokens", type=int, default=32768, help="tokens per document (default %(default)s)")
    score_parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama-3.1-8b",
        help="shape of the random-weight evaluator (default %(default)s)",
    )
    score_parser.add_argument("--trunc-len", type=int, default=4096, help="K (default %(default)s)")
    score_parser.add_argument("--sliding-window", type=int, default=1024, help="d (default %(default)s)")
    train_parser.add_argument(
        "--config", default="configs/llama1b_shape_16k.yaml", help="the train_longce.py recipe (default: %(default)s)"
    )
    train_parser.add_argument(
        "--setups",
        nargs="+",
        choices=("ga", "ddp", "fsdp2", "zero3", "fsdp2:1", "zero3:1"),
        default=["ga", "ddp", "fsdp2", "zero3"],
        help="ga: one GPU, per-device batch 1 with gradient accumulation (the noise reference); "
        "fsdp2:1, zero3:1: that engine on one GPU (its own precision, one process) "
        "(default: ga ddp fsdp2 zero3)",
    )
    train_parser.add_argument(
        "--weights",
        choices=("self", "cache"),
        default="self",
        help="LongCE weights of every run: self (the trained model's short pass) or cache (a key-token cache "
        "of --data scored once by a random evaluator, then --longce_weights cache --key_tokens <it>) "
        "(default %(default)s)",
    )
    train_parser.add_argument(
        "--evaluator-shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="with --weights cache: shape of the random evaluator (default %(default)s)",
    )
    train_parser.add_argument(
        "--evaluator-init",
        type=float,
        default=1.0,
        help="with --weights cache: the evaluator's initializer_range; the default 0.02 of a random model "
        "gives nearly uniform predictions and weights near 1 (default %(default)s)",
    )
    args = parser.parse_args(argv)
    args.train_args = extra
    if args.gpus < 2:
        parser.error("--gpus must be >= 2 (the baseline is the one-GPU run)")
    result = score(args) if args.check == "score" else train(args)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
