"""The population's models: the members trained (claimed one process at a time when several share a
call), evaluated and scored for Figure 5(b), and the export of B and E1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from ..common.config import Population
from ..common.run_folder import RunFolder
from ..common.stages import (
    batches,
    benchmark_results,
    cache_scores,
    calibrated_alpha,
    calibration_parts,
    check_gate,
    device_of,
    evaluator_cache,
    extended_config,
    load_member,
    load_tokenizer,
    longppl_of,
    model_folder,
    pretrain,
    read_benchmark_cases,
    read_cases,
    selected_evaluators,
)

# ------------------------------------------------------------------ training


def member_folder(run: RunFolder, name: str) -> str:
    return os.path.dirname(run.path("models", "members", name, "x"))


def stage_evaluators(config: Population, run: RunFolder, members=None, evaluators=None) -> None:
    for spec in selected_evaluators(config, evaluators):
        pretrain(config, run, spec)


def parse_shard(value: str) -> tuple[int, int]:
    """``"i/n"`` (``0 <= i < n``) as ``(i, n)``: the i-th of n interleaved slices of the members."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{value!r} is not a shard; give i/n with 0 <= i < n, e.g. 0/4")
    return index, count


def selected_members(config: Population, names, shard: tuple[int, int] | None = None):
    """The members named in ``names`` (all when empty), in the config's order; with ``shard``
    ``(i, n)`` only every n-th of them from the i-th (interleaved, so that each slice holds every
    step count: one process per GPU gets about equal work)."""
    members = config.members()
    known = [m.name for m in members]
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"--members names {unknown}, which are not members of the config's population: {known}.")
    chosen = [m for m in members if names is None or m.name in names]
    return chosen[shard[0] :: shard[1]] if shard else chosen


def claim_order(members: list) -> list:
    """The order processes sharing a call (``--claim``) take members in: every first seed before any
    second one (config order within), so that a call cut short leaves whole replicates undone
    rather than whole configurations."""
    return sorted(members, key=lambda m: m.replicate)


def claimed(run: RunFolder, claim: str | None, stage: str, member: str) -> bool:
    """With ``claim`` (``--claim``, one id per call shared by the processes working side by side):
    whether ANOTHER process of this call has taken ``member`` for ``stage``; else this process takes
    it now (the file ``claims/<claim>/<stage>/<member>`` is created exclusively, so exactly one
    process gets each member). Without ``claim``: ``False``. Claims of an earlier call (another id)
    are ignored, so a member a cut-off call left half done is taken up again."""
    if not claim:
        return False
    path = run.path("claims", claim, stage, member)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    return False


def stage_members(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from ..common.family import Variant, is_trained, train_variant

    base = model_folder(run, config.base.name)
    if not is_trained(base):
        raise ValueError(f"The base {config.base.name} is not trained ({base}): run the 'base' stage first.")
    check_gate(config, run, config.base)
    tokenizer = load_tokenizer(run)
    chosen = selected_members(config, members)
    for member in claim_order(chosen) if claim else chosen:
        folder = member_folder(run, member.name)
        if is_trained(folder):
            run.log(f"members: {member.name} trained, kept")
            continue
        if claimed(run, claim, "members", member.name):
            continue
        model_config, attention = extended_config(config, base, member.extension)
        training = dataclasses.replace(config.finetune.training, steps=member.steps)
        variant = Variant(
            member.name,
            {"base": config.base.name, "extension": dataclasses.asdict(member.extension)},
            training.settings(member.seed),
        )

        def start(model_config=model_config, attention=attention):
            return AutoModelForCausalLM.from_pretrained(base, config=model_config, attn_implementation=attention)

        run.log(f"members: {member.name} ({member.extension.method}, {member.steps} steps, seed {member.seed})")
        mix = config.finetune.mix
        with run.timed("train", member.name):
            train_variant(
                variant,
                tokenizer,
                batches(run, training.seq_len, mix, member.seed),
                folder,
                device_of(config),
                run.log,
                start_from=start,
            )


# ------------------------------------------------------------------ evaluation


def longppl_columns(config: Population, run: RunFolder, alpha: float) -> dict[str, dict]:
    """``{column: {cache, alpha, beta, soft}}``: what LongPPL of every member is computed with."""
    scoring, first = config.scoring, config.evaluators[0].name
    primary = evaluator_cache(config, run, first, scoring.primary, "validation")
    columns = {
        "primary": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": False},
        "secondary": {
            "cache": evaluator_cache(config, run, first, scoring.secondary, "validation"),
            "alpha": alpha,
            "beta": scoring.beta,
            "soft": False,
        },
        "soft": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": True},
    }
    for a in (alpha, *scoring.sensitivity_alphas):
        for b in scoring.sensitivity_betas:
            columns[f"alpha={a:g},beta={b:g}"] = {"cache": primary, "alpha": a, "beta": b, "soft": False}
    for spec in config.evaluators[1:]:
        if spec.enabled:  # each evaluator with the alpha it calibrated itself
            own = calibrated_alpha(run, calibration_parts(config, spec.name))
            cache = evaluator_cache(config, run, spec.name, scoring.primary, "validation")
            columns[f"primary:{spec.name}"] = {"cache": cache, "alpha": own, "beta": scoring.beta, "soft": False}
    return columns


def stage_evaluate(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from ..common.family import is_trained

    chosen = selected_members(config, members)
    pending = [
        m for m in (claim_order(chosen) if claim else chosen) if not run.has("eval", "members", f"{m.name}.json")
    ]
    if not pending:
        return
    alpha = calibrated_alpha(run)
    columns = longppl_columns(config, run, alpha)
    caches = {column["cache"]: cache_scores(column["cache"]) for column in columns.values()}
    cases = read_benchmark_cases(config, run)
    for member in pending:
        path = ("eval", "members", f"{member.name}.json")
        folder = member_folder(run, member.name)
        if not is_trained(folder):
            if claim:  # another process of this call may still be training it: left for a later pass
                run.log(f"evaluate: {member.name} is not trained yet, left for a later pass")
                continue
            raise ValueError(f"Member {member.name} is not trained ({folder}): run the 'members' stage first.")
        if claimed(run, claim, "evaluate", member.name):
            continue
        start = time.perf_counter()
        model, tokenizer = load_member(folder, device_of(config))
        evaluation = config.evaluation
        record = {"member": member.name, "seed": member.seed, "steps": member.steps}
        record["extension"] = dataclasses.asdict(member.extension)
        record.update(benchmark_results(model, tokenizer, cases, config))
        record["longppl"] = longppl_of(
            model, tokenizer, columns, caches, config.scoring.gamma, evaluation.max_tokens_per_batch
        )
        seconds = time.perf_counter() - start
        record["seconds"] = seconds
        run.write_json(record, *path)
        run.add_seconds("evaluate", member.name, seconds)
        mean = sum(v["accuracy"] for v in record["lines"].values()) / len(record["lines"])
        run.log(
            f"evaluate: {member.name} primary accuracy {mean:.3f}, LongPPL {record['longppl']['primary']['longppl']:.3f}, "
            f"PPL {record['longppl']['primary']['ppl']:.3f} ({seconds:.1f}s)"
        )


def stage_answer_tokens(config: Population, run: RunFolder, members=None) -> None:
    """Figure 5(b) on E1: answer tokens vs the other answer-side tokens, by LSD alone and LSD + LCL,
    at the configured alphas and the calibrated one (counts, for Wilson intervals)."""
    if run.has("eval", "answer_tokens.json"):
        return
    import numpy as np

    from longppl.settings import WindowSettings

    from ..common import answer_tokens

    alpha = calibrated_alpha(run)
    evaluator = config.evaluators[0].name
    model, tokenizer = load_member(model_folder(run, evaluator), device_of(config))
    window = WindowSettings(config.scoring.primary.trunc_len, config.scoring.primary.sliding_window)
    scored = answer_tokens.answer_token_scores(model, tokenizer, read_cases(run, "answer_tokens.jsonl"), window=window)
    lsd, lcl, is_answer = (np.asarray(scored[k]) for k in ("lsd", "lcl", "is_answer"))
    by_alpha = {
        f"{a:g}": answer_tokens.classify_answer_tokens(lsd, lcl, is_answer, alpha=a, beta=config.scoring.beta)
        for a in dict.fromkeys((*config.answer_tokens.alphas, alpha))
    }
    record = {"evaluator": evaluator, "calibrated_alpha": alpha, "tokens": int(lsd.size)}
    record.update(answer_tokens=int(is_answer.sum()), by_alpha=by_alpha)
    run.write_json(record, "eval", "answer_tokens.json")
    run.log(f"answer_tokens: {record['answer_tokens']} answer tokens of {record['tokens']}")


# ------------------------------------------------------------------ export


def stage_export(config: Population, run: RunFolder, members=None, export_dir: str | None = None) -> None:
    """B and E1 in bf16 with shards of at most 15 MB (plus the tokenizer) into ``export_dir``."""
    if not export_dir:
        raise ValueError("The 'export' stage needs --export-dir (a folder for the exported models).")
    import torch

    from longppl.atomic_files import replace_directory_atomically

    for spec in (config.base, config.evaluators[0]):
        target = os.path.join(os.path.abspath(export_dir), spec.name)
        if os.path.exists(target):
            if os.path.isfile(os.path.join(target, "exported.json")):
                run.log(f"export: {target} exists, kept")
                continue
            raise ValueError(f"--export-dir: {target} exists and was not written by an export; give another folder.")
        model, tokenizer = load_member(model_folder(run, spec.name), "cpu")
        model = model.to(torch.bfloat16)

        def write(tmp: str, model=model, tokenizer=tokenizer, spec=spec) -> None:
            model.save_pretrained(tmp, max_shard_size="15MB")
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, "exported.json"), "w", encoding="utf-8") as handle:
                json.dump({"model": spec.name, "seed": spec.seed, "dtype": "bfloat16"}, handle)

        os.makedirs(os.path.dirname(target), exist_ok=True)
        replace_directory_atomically(target, write)
        run.log(f"export: {spec.name} -> {target}")
