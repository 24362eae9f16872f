#!/usr/bin/env python
"""Real evaluators on a GPU: precision (key-token agreement with float32) and speed against the official code.

Two modes, each appending one JSON object a measurement to ``--records`` (JSON lines), so that a run cut
off by a device call's limit resumes where it stopped (a record already there is not measured again),
and a third, ``report``, that builds the tables of docs/benchmarks.md from the records alone (on any
machine).

**precision**: the evaluator (``--model``: a short name such as ``gemma-3-270m``, a ``*.gguf`` file or a
saved folder) scores each document (``--texts`` JSONL, cut to ``--lengths`` evaluator tokens: a text
too short for a length is left out of it) as ``longppl score`` builds a cache row
(``score_with_evaluator(per_document=True)``), once per precision:

- ``fp32``: float32 weights, float32 matmuls (TF32 off), SDPA attention;
- ``tf32``: the same weights, TF32 tensor-core matmuls (``torch.backends.cuda.matmul.allow_tf32``);
- ``bf16``: bfloat16 weights (the library's default on a GPU);
- ``fp8``: bfloat16 with the blocks' Linear layers in float8 (``evaluator_precision="fp8"``, torchao).

Each record: seconds (after an untimed first call per precision), peak GiB
(``max_memory_allocated``, weights included), the key-token indices (alpha=2, beta=-2), the evaluator's
own LongPPL and PPL. ``report`` compares every precision with ``fp32`` on the same document:
token-level Jaccard of the key-token sets and the relative change of LongPPL, means with 95%
bootstrap intervals over documents.

**speed**: the official ``compute_longppl`` (the file ``--official``, e.g. ``longppl/longppl.py`` of
PKU-ML/LongPPL) against this library's drop-in ``longppl.compute_longppl``, same process, same bf16
model as evaluator and evaluated model (the issue's self-evaluation setting), each document timed
``--repeats`` times after an untimed first call: seconds, peak GiB, LongPPL of both.

    python scripts/bench/bench_real_models.py precision --model gemma-3-270m --texts docs.jsonl \\
        --lengths 8192 32768 --records precision.jsonl
    python scripts/bench/bench_real_models.py speed --model gemma-3-270m --official official/longppl.py \\
        --texts docs.jsonl --lengths 8192 32768 --records speed.jsonl
    python scripts/bench/bench_real_models.py report --records precision.jsonl speed.jsonl --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PRECISIONS = ("fp32", "tf32", "bf16", "fp8")


def read_records(paths) -> list[dict]:
    """Every JSON object of the JSON-lines files ``paths`` (a missing file: none)."""
    records = []
    for path in paths:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                records += [json.loads(line) for line in handle if line.strip()]
    return records


def append_record(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def documents(path: str, tokenizer, length: int, limit: int) -> list[tuple[str, str]]:
    """``(id, text)`` of the first ``limit`` texts of ``path`` holding at least ``length`` tokens, each cut
    after its ``length``-th token (by the tokenizer's character offsets)."""
    chosen = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            offsets = tokenizer(row["text"], return_offsets_mapping=True)["offset_mapping"]
            if len(offsets) < length:
                continue
            chosen.append((str(row["id"]), row["text"][: offsets[length - 1][1]]))
            if len(chosen) == limit:
                break
    return chosen


def _timed(fn, torch):
    """``(fn(), seconds, peak GiB)``; the peak is 0 on a CPU (a smoke run)."""
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if gpu:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0


def _device(torch) -> tuple[str, str]:
    """``(device, its name)``: the GPU, or the CPU for a smoke run."""
    return ("cuda", torch.cuda.get_device_name()) if torch.cuda.is_available() else ("cpu", "cpu")


def _variant(base, precision: str, torch):
    """The model for ``precision`` (float32 ones share ``base``) and the TF32 switch to use with it."""
    import copy

    from longppl.models.precision import to_precision

    if precision in ("fp32", "tf32"):
        return base, precision == "tf32"
    model = copy.deepcopy(base).to(torch.bfloat16)
    if precision == "fp8":
        to_precision(model, "fp8")
    return model, False


def _record_head(mode: str, args, device_name: str, length: int, doc: str) -> dict:
    """The fields every record starts with: what was measured, on which model, device and document."""
    return {
        "mode": mode,
        "model": args.name or args.model,
        "device": device_name,
        "length": length,
        "doc": doc,
        "attention": args.attention,
    }


def _load(args, device: str, dtype, torch):
    """The model of ``--model`` in ``dtype`` with the attention of ``--attention`` (``flex_attention``:
    sliding-window layers skip the blocks outside their window)."""
    from transformers import AutoModelForCausalLM

    from longppl.models.loading import load_model
    from longppl.models.sources import check_model_source

    if args.attention == "sdpa-masked":
        # The baseline of the window layers' attention in blocks: every layer under transformers' SDPA
        # with its (L, L) mask, as the official code runs it.
        import longppl.core.attention as attention

        attention.use_windowed_attention = lambda model: False
        args = argparse.Namespace(**{**vars(args), "attention": "sdpa"})
    rope_factor = getattr(args, "rope_factor", None)
    if args.attention == "sdpa" and not rope_factor:
        return load_model(args.model, device, dtype)
    folder = check_model_source(args.model)
    kwargs = {"attn_implementation": args.attention}
    if rope_factor:
        kwargs["config"] = scaled_rope_config(folder, rope_factor)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return model.to(device).eval()


def scaled_rope_config(folder: str, factor: float):
    """The model's configuration with linear RoPE scaling by ``factor`` on its full-attention layers
    (Gemma 3's recipe for its longer-context sizes: the window layers keep their positions, as they
    never see far ones) and ``max_position_embeddings`` multiplied by ``factor``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": float(factor)}
    else:
        config.rope_parameters = {**(params or {}), "rope_type": "linear", "factor": float(factor)}
    config.max_position_embeddings = int(config.max_position_embeddings * factor)
    return config


def run_precision(args) -> None:
    import numpy as np
    import torch

    from longppl.core.scoring import score_with_evaluator
    from longppl.models.loading import load_tokenizer
    from longppl.settings import KeyTokenRule, KeyTokenSettings

    name = args.name or args.model
    records = read_records([args.records])
    done = {(r["length"], r["doc"], r["precision"]) for r in records if r["mode"] == "precision" and r["model"] == name}
    tokenizer = load_tokenizer(args.model)
    device, device_name = _device(torch)
    base = _load(args, device, torch.float32, torch)
    settings = KeyTokenSettings(trunc_len=args.trunc_len, sliding_window=args.sliding_window)
    rule = KeyTokenRule()
    chosen = {length: documents(args.texts, tokenizer, length, args.docs) for length in args.lengths}  # once
    for precision in args.precisions:
        model, tf32 = _variant(base, precision, torch)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        warmed = False
        for length in args.lengths:
            for doc, text in chosen[length]:
                if (length, doc, precision) in done:
                    continue
                if not warmed:  # first call: kernels, allocator, fp8 compilation
                    score_with_evaluator(model, tokenizer, [text], settings, per_document=True, progress=False)
                    warmed = True
                [scores], seconds, peak = _timed(
                    lambda: score_with_evaluator(model, tokenizer, [text], settings, per_document=True, progress=False),
                    torch,
                )
                mask = scores.key_mask(rule)
                scored = ~np.isnan(scores.lp_long)
                record = {
                    **_record_head("precision", args, device_name, length, doc),
                    "precision": precision,
                    "seconds": seconds,
                    "peak_gib": peak,
                    "tokens": int(len(scores.input_ids)),
                    "key": np.flatnonzero(mask).tolist(),
                    "longppl": float(np.exp(-scores.lp_long[mask].mean())) if mask.any() else None,
                    "ppl": float(np.exp(-scores.lp_long[scored].mean())),
                }
                append_record(args.records, record)
                print(
                    f"{precision:>4} {length:>6} {doc:>18}: {seconds:7.2f} s {peak:6.2f} GiB, "
                    f"{int(mask.sum())} key tokens, LongPPL {record['longppl']}",
                    flush=True,
                )
        if model is not base:
            del model
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False


def _load_official(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("official_longppl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_longppl


def run_speed(args) -> None:
    import torch

    import longppl
    from longppl.models.loading import load_tokenizer

    name = args.name or args.model
    records = read_records([args.records])
    done = {
        (r["length"], r["doc"], r["implementation"]) for r in records if r["mode"] == "speed" and r["model"] == name
    }
    official = _load_official(args.official)
    tokenizer = load_tokenizer(args.model)
    device, device_name = _device(torch)
    model = _load(args, device, torch.bfloat16, torch)
    implementations = {"official": official, "ours": longppl.compute_longppl}
    kwargs = dict(trunc_len=args.trunc_len, sliding_window=args.sliding_window)
    for length in args.lengths:
        docs = documents(args.texts, tokenizer, length, args.docs)
        for name, compute in implementations.items():
            if all((length, doc, name) in done for doc, _ in docs):
                continue
            try:
                compute(docs[0][1], model, model, tokenizer, tokenizer, **kwargs)  # untimed first call
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()  # the timed calls below record it
            for doc, text in docs:
                if (length, doc, name) in done:
                    continue
                times, peaks = [], []
                try:
                    for _ in range(args.repeats):
                        out, seconds, peak = _timed(
                            lambda: compute(text, model, model, tokenizer, tokenizer, **kwargs), torch
                        )
                        times.append(seconds)
                        peaks.append(peak)
                except torch.cuda.OutOfMemoryError:
                    # The official code holds the whole [length, vocabulary] logits: at 128k tokens and a
                    # 262k-token vocabulary that is more than a GPU has. Recorded as such.
                    append_record(
                        args.records,
                        {
                            **_record_head("speed", args, device_name, length, doc),
                            "implementation": name,
                            "seconds": None,
                            "error": "out of memory",
                            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                        },
                    )
                    print(f"{name:>8} {length:>6} {doc:>18}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                record = {
                    **_record_head("speed", args, device_name, length, doc),
                    "implementation": name,
                    "seconds": min(times),
                    "all_seconds": times,
                    "peak_gib": max(peaks),
                    "longppl": None if out["longppl"] is None else float(out["longppl"]),
                    "n_key_token": None if out["n_key_token"] is None else int(out["n_key_token"]),
                    "ppl": float(out["ppl"]),
                }
                append_record(args.records, record)
                print(f"{name:>8} {length:>6} {doc:>18}: {min(times):7.3f} s {max(peaks):6.2f} GiB", flush=True)
                torch.cuda.empty_cache()


def bootstrap_mean(values, draws: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` with its 95% percentile bootstrap interval (resampling the values)."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (draws, len(values)))].mean(axis=1)
    return float(values.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def jaccard(a, b) -> float:
    """``|a ∩ b| / |a ∪ b|`` of two sets of token indices (1 when both are empty)."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def precision_table(records: list[dict]) -> list[dict]:
    """Per model, length and precision: median seconds and peak, and agreement with fp32 on each
    document (Jaccard of key-token sets; relative LongPPL change), means with bootstrap intervals."""
    import numpy as np

    rows = []
    by = {}
    for r in records:
        if r["mode"] == "precision":
            by[(r["model"], r["length"], r["doc"], r["precision"])] = r
    groups = sorted({(m, n, p) for m, n, _, p in by}, key=lambda g: (g[0], g[1], PRECISIONS.index(g[2])))
    for model, length, precision in groups:
        docs = sorted(d for m, n, d, p in by if (m, n, p) == (model, length, precision))
        mine = [by[(model, length, d, precision)] for d in docs]
        pairs = [
            (by[(model, length, d, "fp32")], by[(model, length, d, precision)])
            for d in docs
            if (model, length, d, "fp32") in by
        ]
        row = {
            "model": model,
            "length": length,
            "precision": precision,
            "documents": len(docs),
            "seconds_median": float(np.median([r["seconds"] for r in mine])),
            "peak_gib_max": max(r["peak_gib"] for r in mine),
            "key_share": float(np.mean([len(r["key"]) / r["tokens"] for r in mine])),
        }
        if pairs and precision != "fp32":
            row["jaccard"] = bootstrap_mean([jaccard(a["key"], b["key"]) for a, b in pairs])
            changes = [b["longppl"] / a["longppl"] - 1 for a, b in pairs if a["longppl"] and b["longppl"]]
            row["longppl_change"] = bootstrap_mean(changes) if changes else None
            fp32_seconds = {a["doc"]: a["seconds"] for a, _ in pairs}
            row["time_vs_fp32"] = float(np.median([b["seconds"] / fp32_seconds[b["doc"]] for _, b in pairs]))
        rows.append(row)
    return rows


def speed_table(records: list[dict]) -> list[dict]:
    """Per model and length: official and ours, median seconds and peak, and ours/official ratios
    (per document, then median over documents)."""
    import numpy as np

    by = {}
    for r in records:
        if r["mode"] == "speed":
            by[(r["model"], r["length"], r["doc"], r["implementation"])] = r
    rows = []
    for model, length in sorted({(m, n) for m, n, _, _ in by}):
        docs = sorted(
            {
                d
                for m, n, d, i in by
                if (m, n) == (model, length) and (m, n, d, "official") in by and (m, n, d, "ours") in by
            }
        )
        if not docs:
            continue
        official = [by[(model, length, d, "official")] for d in docs]
        ours = [by[(model, length, d, "ours")] for d in docs]
        if any(r["seconds"] is None for r in official + ours):
            # an implementation ran out of memory (recorded with "error"): no ratio to give
            rows.append(
                {
                    "model": model,
                    "length": length,
                    "documents": len(docs),
                    "official_error": sorted({r.get("error", "") for r in official if r["seconds"] is None}),
                    "ours_error": sorted({r.get("error", "") for r in ours if r["seconds"] is None}),
                    "official_seconds": _median_or_none([r["seconds"] for r in official]),
                    "ours_seconds": _median_or_none([r["seconds"] for r in ours]),
                    "ours_peak_gib": max(r["peak_gib"] for r in ours),
                }
            )
            continue
        rows.append(
            {
                "model": model,
                "length": length,
                "documents": len(docs),
                "official_seconds": float(np.median([r["seconds"] for r in official])),
                "ours_seconds": float(np.median([r["seconds"] for r in ours])),
                "time_ratio": [float(o["seconds"] / r["seconds"]) for o, r in zip(ours, official)],
                "official_peak_gib": max(r["peak_gib"] for r in official),
                "ours_peak_gib": max(r["peak_gib"] for r in ours),
                "longppl_rel_diff": [
                    (o["longppl"] / r["longppl"] - 1) if o["longppl"] and r["longppl"] else None
                    for o, r in zip(ours, official)
                ],
            }
        )
    return rows


def _median_or_none(values):
    """The median of the values that are not ``None`` (``None`` when all are)."""
    import numpy as np

    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def run_report(args) -> None:
    records = read_records(args.records)
    result = {"precision": precision_table(records), "speed": speed_table(records)}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)

    def interval(value, scale=1.0, digits=3):
        if not value:
            return ""
        mean, low, high = (v * scale for v in value)
        return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"

    print(
        "| model | tokens | precision | docs | s / doc | peak GiB | time / fp32 | key share | Jaccard vs fp32 | LongPPL change % |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---|")
    for r in result["precision"]:
        ratio = f"{r['time_vs_fp32']:.2f}x" if "time_vs_fp32" in r else ""
        print(
            f"| {r['model']} | {r['length'] // 1024}k | {r['precision']} | {r['documents']} | {r['seconds_median']:.2f} | "
            f"{r['peak_gib_max']:.2f} | {ratio} | {100 * r['key_share']:.2f}% | {interval(r.get('jaccard'))} | "
            f"{interval(r.get('longppl_change'), 100, 2)} |"
        )
    print(
        "\n| model | tokens | docs | official s | ours s | ours / official (per doc) | official GiB | ours GiB | peak ratio |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in result["speed"]:
        if "time_ratio" not in r:
            official = ", ".join(r["official_error"]) or f"{r['official_seconds']:.2f}"
            ours = ", ".join(r["ours_error"]) or f"{r['ours_seconds']:.2f}"
            print(
                f"| {r['model']} | {r['length'] // 1024}k | {r['documents']} | {official} | {ours} | | | "
                f"{r['ours_peak_gib']:.1f} | |"
            )
            continue
        ratios = ", ".join(f"{x:.2f}" for x in r["time_ratio"])
        print(
            f"| {r['model']} | {r['length'] // 1024}k | {r['documents']} | {r['official_seconds']:.2f} | {r['ours_seconds']:.2f} | "
            f"{ratios} | {r['official_peak_gib']:.1f} | {r['ours_peak_gib']:.1f} | {r['ours_peak_gib'] / r['official_peak_gib']:.2f} |"
        )


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("precision", "speed"):
        p = sub.add_parser(mode)
        p.add_argument("--model", required=True, help="short name, *.gguf file or saved folder of the evaluator")
        p.add_argument("--name", help="the model's name in the records (default: --model)")
        p.add_argument("--texts", required=True, help="JSONL with 'id' and 'text'")
        p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
        p.add_argument("--docs", type=int, default=8, help="documents per length (default %(default)s)")
        p.add_argument("--trunc-len", type=int, default=4096)
        p.add_argument("--sliding-window", type=int, default=1024)
        p.add_argument("--records", required=True, help="JSON-lines file appended to (and read to resume)")
        p.add_argument(
            "--attention",
            default="sdpa",
            help="attn_implementation (default %(default)s: window layers in blocks); sdpa-masked: window layers "
            "under a full mask, as the official code runs them",
        )
        if mode == "precision":
            p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
        else:
            p.add_argument("--official", required=True, help="the official longppl.py (PKU-ML/LongPPL)")
            p.add_argument("--repeats", type=int, default=2)
            p.add_argument(
                "--rope-factor",
                type=float,
                help="linear RoPE scaling of the full-attention layers (past the trained length)",
            )
    p = sub.add_parser("report")
    p.add_argument("--records", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    {"precision": run_precision, "speed": run_speed, "report": run_report}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
