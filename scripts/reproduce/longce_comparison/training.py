"""The training arms: the ``extend`` stage (extended start models), the ``cache`` stage (the datasets
with cached key-token weights) and the ``finetune`` stage (every run, its step times and its curve).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from ..common import stages
from ..common.config import Population
from ..common.fine_tuning import in_order_trainer, step_timer
from ..common.run_folder import RunFolder, read_texts
from .config import (
    METHODS,
    START,
    Arm,
    Comparison,
    Setting,
    arm_folder,
    arms,
    chosen_settings,
    evaluator_names,
    extended_folder,
    model_specs,
    per_step,
    pool_names,
    selected_methods,
    setting_training,
    validation_name,
)

# ------------------------------------------------------------------ extend


def benchmark_cases(pop: Population, run: RunFolder, setting: Setting | None = None) -> dict[str, list]:
    """The cases of an accuracy point: ``"512"`` (the base's gate length, asked line anywhere) and
    each primary length (asked line beyond K); for a ``setting``: ``"start"`` (its start length,
    asked line anywhere) and its primary lengths."""
    if setting is None:
        cases = stages.read_benchmark_cases(pop, run, with_needle=False)
        return {"512": cases["gate"], **{str(n): group for n, group in cases["lines"].items()}}
    return {
        "start": stages.read_cases(run, stages.gate_cases_name(setting.start_length)),
        **{str(n): stages.read_cases(run, stages.lines_cases_name(n)) for n in setting.lines_lengths},
    }


def first_cases(cases: dict[str, list], limit: int | None) -> dict[str, list]:
    """The first ``limit`` cases of each group of ``cases`` (all of them when ``None``): the subset a
    curve point is measured on."""
    return {key: group[:limit] for key, group in cases.items()}


#: The short group of an accuracy point's cases, and the key its accuracy is recorded under.
SHORT_GROUPS = {"512": "acc512", "start": "acc_start"}


def accuracy_point(model, tokenizer, cases: dict[str, list], pop: Population, step: int) -> dict:
    """``{"step", "acc512" (or "acc_start", a setting's start length), "primary": {length: accuracy},
    "mean"}`` (``mean``: over the primary lengths), in the model's own precision, as the 'evaluate'
    stage measures."""
    was_training = model.training
    model.eval()
    found = {key: stages.lines_result(model, tokenizer, group, pop)["accuracy"] for key, group in cases.items()}
    model.train(was_training)
    primary = {key: value for key, value in found.items() if key not in SHORT_GROUPS}
    short = {SHORT_GROUPS[key]: value for key, value in found.items() if key in SHORT_GROUPS}
    return {"step": step, **short, "primary": primary, "mean": sum(primary.values()) / len(primary)}


def extension_targets(config: Comparison, pop: Population, run: RunFolder, selection=None) -> list[tuple]:
    """``(name, start model, extension, positions, fine-tuning seq_len, setting or None)`` of every
    extended model: B by each extension (a config without settings), or each selected setting's
    start model."""
    if not config.settings:
        seq_len = config.finetune.training.seq_len
        return [(e.name, pop.base.name, e, pop.data.length, seq_len, None) for e in config.extensions]
    names = selection.settings if selection is not None else None
    return [(s.name, s.start, s.extension, s.seq_len, s.seq_len, s) for s in chosen_settings(config, names)]


def stage_extend(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    """Each start model (B, or each setting's) extended (no fine-tuning), and its accuracy at the
    start length (512) and on the primary benchmark."""
    from transformers import AutoModelForCausalLM

    from ..common.family import Variant, is_trained, train_variant

    tokenizer = stages.load_tokenizer(run)
    device = stages.device_of(pop)
    for name, start_name, extension, length, seq_len, setting in extension_targets(config, pop, run, selection):
        base = stages.model_folder(run, start_name)
        if not is_trained(base):
            raise ValueError(f"The start model {start_name} is not in {base}: run the 'start' stage first.")
        folder = extended_folder(run, name)
        if not is_trained(folder):
            model_config, attention = stages.extended_config(pop, base, extension, length)
            training = dataclasses.replace(setting_training(config, seq_len), steps=0)
            variant = Variant(
                name,
                {"base": start_name, "extension": dataclasses.asdict(extension)},
                training.settings(pop.seed),
            )

            def start(model_config=model_config, attention=attention, base=base):
                return AutoModelForCausalLM.from_pretrained(base, config=model_config, attn_implementation=attention)

            batches = stages.batches(run, training.seq_len, config.finetune.mix, pop.seed)
            train_variant(variant, tokenizer, batches, folder, device, run.log, start_from=start)
        if run.has("eval", "extended", f"{name}.json"):
            continue
        model, tokenizer = stages.load_member(folder, device)
        # the whole benchmark, and the curves' first point on their subset of it (the void rule's reference)
        cases, limit = benchmark_cases(pop, run, setting), config.finetune.curve_cases
        benchmark = accuracy_point(model, tokenizer, cases, pop, 0)
        record = {
            "extension": dataclasses.asdict(extension),
            "start_model": start_name,
            "benchmark": benchmark,
            "curve_point": benchmark
            if limit is None
            else accuracy_point(model, tokenizer, first_cases(cases, limit), pop, 0),
        }
        if setting is not None:
            record["setting"] = dataclasses.asdict(setting)
        run.write_json(record, "eval", "extended", f"{name}.json")
        point = record["benchmark"]
        short = point.get("acc512", point.get("acc_start"))
        run.log(f"extend: {name} accuracy at the start length {short:.3f}, primary {point['mean']:.3f}")


# ------------------------------------------------------------------ cache


def saved_dataset(run: RunFolder, name: str, key: dict, build, log: str):
    """The dataset ``build()`` returns, made once and saved to ``data/<name>/`` with ``key`` (what it
    was made from), then loaded memory-mapped by every run and later call; a changed key makes it again."""
    from datasets import load_from_disk

    from longppl.atomic_files import replace_directory_atomically

    folder = os.path.dirname(run.path("data", name, "x"))
    if not (run.has("data", name, "key.json") and run.read_json("data", name, "key.json") == key):
        found = build()

        def write(tmp: str) -> None:
            found.save_to_disk(os.path.join(tmp, "dataset"))
            with open(os.path.join(tmp, "key.json"), "w", encoding="utf-8") as handle:
                json.dump(key, handle)  # last: a folder with its key is complete

        replace_directory_atomically(folder, write)
        run.log(f"{log} -> {folder}")
    return load_from_disk(os.path.join(folder, "dataset"))


def pool_key(config: Comparison, run: RunFolder, tokenizer, pool: str = "finetune", length: int | None = None) -> dict:
    """What the tokenized pool ``data/<pool>.jsonl`` depends on: its texts, the tokenizer, the
    sequence length (default the config's fine-tuning length)."""
    from longppl.models.fingerprints import file_sha256, tokenizer_fingerprint

    return {
        "length": length or config.finetune.training.seq_len,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "finetune_sha256": file_sha256(run.path("data", f"{pool}.jsonl")),
    }


def weights_dataset(
    config: Comparison,
    pop: Population,
    run: RunFolder,
    tokenizer,
    label: str,
    model: str,
    pool: str = "finetune",
    length: int | None = None,
    name: str = "finetune-cache-weights",
):
    """The pool ``data/<pool>.jsonl`` with ``longce_weights`` (``longce.add_key_token_weights``) from
    the key-token cache (LongCE's window) of the model in folder ``model`` (``label`` names its
    cache), made once: ``data/<name>/``. E1's weights for ``cache``; a setting's start model's own
    for ``frozen``."""
    from datasets import Dataset

    from longce import add_key_token_weights
    from longppl.cache.key_token_cache import CHECKSUM_FILE
    from longppl.models.fingerprints import file_sha256

    length = length or config.finetune.training.seq_len
    cache = stages.evaluator_cache(
        pop, run, label, config.finetune.window, pool, folder_of_model=model, max_length=max(length, pop.data.length)
    )
    key = {
        **pool_key(config, run, tokenizer, pool, length),
        "evaluator": model,
        "gamma": config.finetune.gamma,
        # the cache's own record of its files: it changes whenever the cache is rewritten
        "cache_checksums_sha256": file_sha256(os.path.join(cache, CHECKSUM_FILE)),
    }

    def build():
        return add_key_token_weights(
            Dataset.from_dict({"text": read_texts(run.path("data", f"{pool}.jsonl"))}),
            key_tokens=cache,
            tokenizer=tokenizer,
            gamma=key["gamma"],
            max_length=key["length"],
            evaluator=key["evaluator"],  # the cache keeps another evaluator's rows beside: take this one's
            add_special_tokens=False,  # the population's convention: no BOS, every token of a text counts
        ).remove_columns(["text"])

    named = "" if pool == "finetune" else f" {pool}"
    return saved_dataset(run, name, key, build, f"cache: the pool{named} with {label}'s LongCE weights")


def cache_weights_dataset(config: Comparison, pop: Population, run: RunFolder, tokenizer):
    """The fine-tuning pool with E1's ``longce_weights`` from E1's key-token cache of the pool
    (LongCE's window), made once: ``data/finetune-cache-weights/``."""
    first, _ = evaluator_names(config, pop)
    return weights_dataset(config, pop, run, tokenizer, first, stages.model_folder(run, first))


def stage_cache(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    """The fine-tuning pool, tokenized (and with E1's weights for ``cache``), made here once, so that
    ``finetune`` calls running side by side (``--seeds`` split over processes) only read them. With
    settings: per selected setting and selected method, the dataset its runs read (the pool and the
    fresh pool tokenized, the outside evaluator's weights for ``cache``, the start model's for
    ``frozen``)."""
    tokenizer = stages.load_tokenizer(run)
    if config.settings:
        for setting in chosen_settings(config, selection.settings if selection else None):
            for method in selected_methods(config, selection):
                if method != START:
                    setting_dataset(config, pop, run, setting, method, tokenizer)
        if START in selected_methods(config, selection):  # the evaluations' alpha and caches, before any runs
            prepare_scoring(config, pop, run, selection)
        return
    for method in dict.fromkeys("cache" if m == "cache" else "ce" for m in config.finetune.methods):
        finetune_dataset(config, pop, run, method, tokenizer)


def tokens_dataset(config: Comparison, run: RunFolder, tokenizer, pool: str, length: int, name: str):
    """The pool ``data/<pool>.jsonl`` as ``input_ids`` of at most ``length`` tokens, tokenized once
    (``data/<name>/``)."""
    from datasets import Dataset

    key = pool_key(config, run, tokenizer, pool, length)

    def build():
        def tokenize(batch: dict) -> dict:
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [row[: key["length"]] for row in ids]}

        texts = read_texts(run.path("data", f"{pool}.jsonl"))
        return Dataset.from_dict({"text": texts}).map(tokenize, batched=True).remove_columns(["text"])

    named = "" if pool == "finetune" else f" {pool}"
    return saved_dataset(run, name, key, build, f"finetune: the pool{named} tokenized")


def setting_dataset(config: Comparison, pop: Population, run: RunFolder, setting: Setting, method: str, tokenizer):
    """The unordered rows ``method``'s runs of ``setting`` read (``ce-fresh``: ``(pool, fresh pool)``):
    the setting's pool tokenized (shared by the settings of one length), with the outside evaluator's
    weights for ``cache`` (shared likewise), with the extended start model's own for ``frozen``."""
    main, fresh = pool_names(setting.seq_len)
    length = setting.seq_len
    if method == "cache":
        folder = stages.model_folder(run, setting.evaluator)
        return weights_dataset(
            config, pop, run, tokenizer, setting.evaluator, folder, main, length, f"{main}-weights-{setting.evaluator}"
        )
    if method == "frozen":
        label = f"start-{setting.name}"
        folder = extended_folder(run, setting.name)
        return weights_dataset(config, pop, run, tokenizer, label, folder, main, length, f"{main}-weights-{label}")
    rows = tokens_dataset(config, run, tokenizer, main, length, f"{main}-tokens")
    if method == "ce-fresh":
        return rows, tokens_dataset(config, run, tokenizer, fresh, length, f"{fresh}-tokens")
    return rows


# ------------------------------------------------------------------ finetune


def wallclock_steps(steps: int, self_step_seconds: float, ce_step_seconds: float) -> int:
    """CE's steps in the wall time of ``steps`` LongCE ``self`` steps: ``round(steps * self / ce)``."""
    if not (self_step_seconds > 0 and ce_step_seconds > 0):
        raise ValueError(
            f"Step times self {self_step_seconds!r} s and ce {ce_step_seconds!r} s must be > 0 to set ce-wallclock's steps."
        )
    return max(1, round(steps * self_step_seconds / ce_step_seconds))


def arm_steps(config: Comparison, run: RunFolder, arm: Arm) -> tuple[int, float | None]:
    """``(steps, measured self / ce step-time ratio or None)`` of ``arm``."""
    from ..common.family import TRAINING_RECORD

    steps = config.finetune.training.steps
    if arm.method != "ce-wallclock":
        return steps, None
    seconds = {}
    for method in ("self", "ce"):
        other = Arm(arm.extension, method, arm.seed, arm.rerun)
        if not run.has("models", "finetuned", other.name, TRAINING_RECORD):
            raise ValueError(f"{arm.name} needs {other.name}'s step time: train it first (the 'finetune' stage).")
        seconds[method] = run.read_json("models", "finetuned", other.name, TRAINING_RECORD)["step_seconds"]["median"]
    return wallclock_steps(steps, seconds["self"], seconds["ce"]), seconds["self"] / seconds["ce"]


def finetune_dataset(config: Comparison, pop: Population, run: RunFolder, method: str, tokenizer):
    """The pool as ``input_ids`` of at most ``seq_len`` tokens (the same rows for every method, so a
    seed orders them alike), with E1's ``longce_weights`` for ``cache``; tokenized once
    (``data/finetune-tokens/``)."""
    if method == "cache":
        return cache_weights_dataset(config, pop, run, tokenizer)
    return tokens_dataset(config, run, tokenizer, "finetune", config.finetune.training.seq_len, "finetune-tokens")


def ordered_rows(config: Comparison, pop: Population, run: RunFolder, arm: Arm, tokenizer) -> tuple:
    """``(dataset in training order, steps, fresh or None)`` of a setting's run.

    Every method of a seed reads the pool in one order, a permutation drawn from the seed alone;
    ``ce-fresh`` reads exactly those rows first, then the fresh pool (its own seeded order) up to
    ``round(fresh_factor x steps)`` steps in all, or to the pool's last whole step when it holds
    fewer (``fresh`` records how many steps were planned and run)."""
    import numpy as np
    from datasets import concatenate_datasets

    setting, training = arm.setting, setting_training(config, arm.setting.seq_len)
    per, steps = per_step(training), training.steps
    found = setting_dataset(config, pop, run, setting, arm.method, tokenizer)
    rows, extra = found if arm.method == "ce-fresh" else (found, None)
    if len(rows) < steps * per:
        raise ValueError(
            f"The pool of {setting.name} holds {len(rows)} rows, fewer than {steps} steps x {per}: run 'start' again."
        )
    order = np.random.default_rng([arm.seed, 0]).permutation(len(rows))[: steps * per]
    ordered = rows.select(order.tolist())
    if extra is None:
        return ordered, steps, None
    planned = round(config.finetune.fresh_factor * steps)
    fresh_steps = min(planned - steps, len(extra) // per)
    fresh_order = np.random.default_rng([arm.seed, 1]).permutation(len(extra))[: fresh_steps * per]
    ordered = concatenate_datasets([ordered, extra.select(fresh_order.tolist())])
    fresh = {
        "planned_steps": planned,
        "steps": steps + fresh_steps,
        "fresh_rows": len(extra),
        "stopped_early": steps + fresh_steps < planned,
    }
    return ordered, steps + fresh_steps, fresh


def arm_void(config: Comparison, curve: list[dict]) -> dict:
    """The plan's void rule of one run: its accuracy at the start length at step ``void.at_step``
    below ``void.min_ratio`` times the start model's (``curve[0]``, the same cases) -> void."""
    at = config.void.at_step
    point = next((p for p in curve if p["step"] == at), None)
    start = curve[0]["acc_start"]
    if point is None:
        return {"at_step": at, "acc_start": None, "start_acc_start": start, "void": None}
    rule = void_rule([point["acc_start"]], start, config.void.min_ratio)  # the rule on this one run
    return {
        "at_step": at,
        "acc_start": point["acc_start"],
        "start_acc_start": start,
        "threshold": rule["threshold"],
        "void": rule["void"],
    }


def finetune(config: Comparison, pop: Population, run: RunFolder, arm: Arm) -> None:
    """One run with ``LongCETrainer`` from the extended B: accuracy points at ``eval_steps`` (and the
    last step), the time of every step; saved with its record to ``models/finetuned/<arm>/``."""
    import shutil

    import torch
    from transformers import DataCollatorWithFlattening

    from longce import LongCEConfig, LongCETrainer
    from longppl.atomic_files import replace_directory_atomically

    from ..common.family import TRAINING_RECORD, count_parameters

    tuning, training = config.finetune, config.finetune.training
    device = stages.device_of(pop)
    on_gpu = device.startswith("cuda")
    lr = training.lr * (config.rerun.lr_factor if arm.rerun else 1.0)
    setting, fresh = arm.setting, None
    if setting is None:
        steps, ratio = arm_steps(config, run, arm)
        model, tokenizer = stages.load_member(extended_folder(run, arm.extension), device)
        dataset = finetune_dataset(config, pop, run, arm.method, tokenizer)
        start_record = ("eval", "extended", f"{arm.extension.name}.json")
    else:
        # a setting's runs read their rows in an order set by the seed alone (ordered_rows)
        training, ratio = setting_training(config, setting.seq_len), None
        model, tokenizer = stages.load_member(extended_folder(run, setting.name), device)
        dataset, steps, fresh = ordered_rows(config, pop, run, arm, tokenizer)
        start_record = ("eval", "extended", f"{setting.name}.json")
    model.train()
    sequences = per_step(training)
    micro = max(1, min(sequences, (training.micro_batch_tokens or training.batch_tokens) // training.seq_len))
    while sequences % micro:  # equal micro-batches, so every step sees the same number of sequences
        micro -= 1
    cases = first_cases(benchmark_cases(pop, run, setting), tuning.curve_cases)
    points = set(tuning.eval_steps) | {steps}
    curve = [run.read_json(*start_record)["curve_point"]]
    step_seconds: list[float] = []
    # The Trainer's output folder: made here, in the run folder, and removed after (nothing is saved in it).
    scratch = tempfile.mkdtemp(prefix=f".trainer-{arm.name}-", dir=run.root)
    args = LongCEConfig(
        output_dir=scratch,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=sequences // micro,
        learning_rate=lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": training.min_lr_ratio},
        warmup_steps=training.warmup_steps,
        weight_decay=training.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=training.log_every,
        save_strategy="no",
        report_to=[],
        seed=arm.seed,
        data_seed=arm.seed,  # the data order: one per seed, the same for every method
        bf16=on_gpu,
        use_cpu=not on_gpu,
        disable_tqdm=True,
        dataloader_num_workers=0,
        longce_trunc_len=tuning.window.trunc_len,
        longce_sliding_window=tuning.window.sliding_window,
        longce_gamma=tuning.gamma,
        longce_max_tokens_per_batch=pop.evaluation.max_tokens_per_batch,
        **METHODS[arm.method],
    )

    def accuracy_at(state, model):
        if state.global_step in points:
            curve.append(accuracy_point(model, tokenizer, cases, pop, state.global_step))
            point = curve[-1]
            run.log(
                f"  [{arm.name}] step {state.global_step}/{steps}: at the start length "
                f"{point.get('acc512', point.get('acc_start')):.3f}, primary {point['mean']:.3f}"
            )

    torch.manual_seed(arm.seed)
    trainer = (LongCETrainer if setting is None else in_order_trainer())(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorWithFlattening(),
        processing_class=tokenizer,
        callbacks=[step_timer(step_seconds, on_gpu, accuracy_at)],
    )
    run.log(f"finetune: {arm.name} ({steps} steps x {sequences} sequences, lr {lr:g})")
    start = time.perf_counter()
    try:
        result = trainer.train()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - start
    # the first step pays one-off costs (allocator warm-up, kernel selection): the median is the step time
    ordered = sorted(step_seconds[1:] or step_seconds)
    record = {
        "name": arm.name,
        "model": {
            "base": setting.start if setting else pop.base.name,
            "extension": dataclasses.asdict(arm.extension),
        },
        "setting": setting.name if setting else None,
        "sequences_per_step": sequences,
        "fresh": fresh,
        "method": arm.method,
        "seed": arm.seed,
        "rerun": arm.rerun,
        "steps": steps,
        "lr": lr,
        "self_ce_step_ratio": ratio,
        "settings": {key: value for key, value in args.to_dict().items() if key.startswith("longce_")},
        "parameters": count_parameters(model),
        "seconds": seconds,
        "step_seconds": {
            "median": ordered[len(ordered) // 2],
            "mean": sum(ordered) / len(ordered),
            "all": step_seconds,
        },
        "final_loss": float(result.training_loss),
        "log_history": trainer.state.log_history,
        "curve": curve,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }
    if setting is not None:
        record["void"] = arm_void(config, curve)

    def write(tmp: str) -> None:
        trainer.model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)

    replace_directory_atomically(arm_folder(run, arm), write)
    run.add_seconds("finetune", arm.name, seconds)
    run.log(f"finetune: {arm.name}: {seconds:.1f}s, {record['step_seconds']['median'] * 1e3:.1f} ms a step")


def train_arms(config: Comparison, pop: Population, run: RunFolder, selected: list[Arm]) -> None:
    from ..common.family import is_trained, stale_record

    for name in dict.fromkeys(arm.setting.name if arm.setting else arm.extension.name for arm in selected):
        if not run.has("eval", "extended", f"{name}.json"):
            raise ValueError(
                f"No extended base {name} in {run.path('eval', 'extended')}: run the 'extend' stage first."
            )
    for arm in selected:
        if is_trained(arm_folder(run, arm)):
            run.log(f"finetune: {arm.name} trained, kept")
            continue
        if stale := stale_record(arm_folder(run, arm)):
            run.log(f"finetune: {stale}")
        finetune(config, pop, run, arm)


def stage_finetune(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    train_arms(config, pop, run, arms(config, selection=selection))


def setting_alpha(config: Comparison, pop: Population, run: RunFolder, setting: Setting) -> float:
    """``scoring.alpha``, or the calibrated alpha of the setting's outside evaluator (the population's
    calibration, run on that evaluator first if need be: E1's is the population run's)."""
    if config.scoring.alpha != "calibrated":
        return config.scoring.alpha
    parts = stages.calibration_parts(pop, setting.evaluator)
    if not run.has(*parts):
        stages.calibrate_one(pop, run, model_specs(config, pop)[setting.evaluator])
    return stages.calibrated_alpha(run, parts)


def setting_validation_cache(config: Comparison, pop: Population, run: RunFolder, setting: Setting) -> str:
    """The outside evaluator's key-token cache of the validation documents at the setting's L."""
    documents, length = validation_name(pop, setting.seq_len), max(setting.seq_len, pop.data.length)
    return stages.evaluator_cache(pop, run, setting.evaluator, config.scoring.window, documents, max_length=length)


def prepare_scoring(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    """Each selected setting's alpha and validation cache, made once before the evaluations that read them."""
    for setting in chosen_settings(config, selection.settings if selection else None):
        setting_alpha(config, pop, run, setting)
        setting_validation_cache(config, pop, run, setting)


def void_rule(ce_acc512: list[float], extended_acc512: float, min_ratio: float) -> dict:
    """The plan's void rule: CE's accuracy at 512 at the rule's step (``[seeds]``, their mean) below
    ``min_ratio`` times the extended base's -> the accuracy comparison is void."""
    if not ce_acc512:
        raise ValueError("The void rule needs CE's accuracy at 512 of at least one seed.")
    mean = sum(ce_acc512) / len(ce_acc512)
    threshold = min_ratio * extended_acc512
    return {"ce_acc512": mean, "extended_acc512": extended_acc512, "threshold": threshold, "void": mean < threshold}
