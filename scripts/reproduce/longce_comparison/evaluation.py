"""The ``evaluate`` stage (every run and each start model scored) and the ``rerun`` stage (the void
rule, and its reruns at another learning rate).
"""

from __future__ import annotations

import time

from ..common import stages
from ..common.config import (
    Extension,
    Population,
)
from ..common.run_folder import RunFolder
from .config import START, Arm, Comparison, Setting, arm_folder, arms, evaluator_names, extended_folder, start_arms
from .training import setting_alpha, setting_validation_cache, train_arms, void_rule

# ------------------------------------------------------------------ evaluate


def longppl_evaluator(config: Comparison, pop: Population, arm: Arm) -> str | None:
    """The evaluator of ``arm``'s LongPPL: E2 when there is one, else E1 unless E1 weighted its training."""
    first, second = evaluator_names(config, pop)
    if second is not None:
        return second
    return None if arm.method == "cache" else first


def scoring_alpha(config: Comparison, pop: Population, run: RunFolder) -> float:
    """``scoring.alpha``, or the population's calibrated alpha (calibrated here first if need be)."""
    if config.scoring.alpha != "calibrated":
        return config.scoring.alpha
    stages.stage_calibrate(pop, run)
    return stages.calibrated_alpha(run)


def evaluate_arms(config: Comparison, pop: Population, run: RunFolder, selected: list[Arm]) -> None:
    """Every benchmark, PPL and LongPPL of each trained run in ``selected`` -> ``eval/finetuned/<run>.json``."""
    from ..common.family import is_trained

    window = config.scoring.window
    pending = [arm for arm in selected if not run.has("eval", "finetuned", f"{arm.name}.json")]
    if not pending:
        return
    alpha = scoring_alpha(config, pop, run)
    cases = stages.read_benchmark_cases(pop, run)
    caches = {}
    for arm in pending:
        folder = arm_folder(run, arm)
        if not is_trained(folder):
            raise ValueError(f"{arm.name} is not trained ({folder}): run the 'finetune' stage first.")
        start = time.perf_counter()
        evaluator = longppl_evaluator(config, pop, arm)
        # PPL needs a cache's texts only: E1's serves when E1 gives no LongPPL for this run
        cache = stages.evaluator_cache(pop, run, evaluator or evaluator_names(config, pop)[0], window, "validation")
        if cache not in caches:
            caches[cache] = stages.cache_scores(cache)
        column = {"cache": cache, "alpha": alpha, "beta": config.scoring.beta, "soft": False}
        model, tokenizer = stages.load_member(folder, stages.device_of(pop))
        record = {"run": arm.name, "method": arm.method, "seed": arm.seed, "rerun": arm.rerun}
        # every benchmark keeps its outputs (what the model answered), as the population's records do
        record.update(stages.benchmark_results(model, tokenizer, cases, pop))
        finish_evaluation(config, pop, run, arm, (model, tokenizer), record, (column, caches, evaluator), start)
        run.log(
            f"evaluate: {arm.name} primary accuracy {primary_mean(record):.3f}, "
            f"acc512 {record['acc512']['accuracy']:.3f}, PPL {record['ppl']:.2f}"
        )


def primary_mean(record: dict) -> float:
    return sum(v["accuracy"] for v in record["lines"].values()) / len(record["lines"])


def finish_evaluation(
    config, pop, run: RunFolder, arm: Arm, loaded: tuple, record: dict, scoring: tuple, start
) -> None:
    """PPL and LongPPL of the model in ``loaded`` (``(model, tokenizer)``) on the cache of ``scoring``
    (``(column, caches, evaluator)``; LongPPL only when ``evaluator`` is not ``None``) into ``record``,
    then the record written to ``eval/finetuned/<run>.json`` with its seconds since ``start``."""
    (model, tokenizer), (column, caches, evaluator) = loaded, scoring
    scores = stages.longppl_of(
        model, tokenizer, {"scored": column}, caches, config.finetune.gamma, pop.evaluation.max_tokens_per_batch
    )["scored"]
    record["ppl"] = scores["ppl"]
    record["longppl"] = scores["longppl"] if evaluator else None
    record["longppl_evaluator"] = evaluator
    record["alpha"], record["beta"] = column["alpha"], column["beta"]
    record["key_tokens"] = scores["key_tokens"] if evaluator else None
    record["seconds"] = time.perf_counter() - start
    run.write_json(record, "eval", "finetuned", f"{arm.name}.json")
    run.add_seconds("evaluate", arm.name, record["seconds"])


def setting_cases(config: Comparison, pop: Population, run: RunFolder, setting: Setting) -> dict:
    """A setting's evaluation cases: ``lines`` per primary length, ``gate`` (the start length),
    ``needle`` (the longest primary length), ``beyond_start`` and ``recall`` when configured."""
    from ..common import needle

    longest = max(setting.lines_lengths)
    cases = {
        "lines": {n: stages.read_cases(run, stages.lines_cases_name(n)) for n in setting.lines_lengths},
        "gate": stages.read_cases(run, stages.gate_cases_name(setting.start_length)),
        "needle": needle.read_needle_cases(run.path("data", "cases", f"needle-{longest}.jsonl")),
    }
    if setting.beyond_start:
        cases["beyond_start"] = {
            n: stages.read_cases(run, stages.lines_cases_name(n, setting.start_length)) for n in setting.lines_lengths
        }
    if config.recall_cases:
        from ..common import passage_recall

        cases["recall"] = passage_recall.read_passage_recall_cases(
            run.path("data", "cases", f"recall-{setting.seq_len}.jsonl")
        )
    return cases


def evaluate_setting_arms(config: Comparison, pop: Population, run: RunFolder, selected: list[Arm]) -> None:
    """Every outcome of the plan for each run in ``selected`` (and each setting's start model, method
    ``start``) -> ``eval/finetuned/<run>.json``: lines accuracy at the primary lengths (asked beyond
    K), at the start length, beyond the start length when configured, needle at the longest length,
    the answer digits' log-likelihood, passage recall, PPL at L and LongPPL under the setting's
    outside evaluator (none for ``cache``, which that evaluator weighted). A run evaluated is kept."""
    from ..common.family import is_trained

    pending = [arm for arm in selected if not run.has("eval", "finetuned", f"{arm.name}.json")]
    caches, of_setting = {}, {}  # a setting's alpha, cache and cases, read once for all its runs
    for arm in pending:
        setting = arm.setting
        folder = extended_folder(run, setting.name) if arm.method == START else arm_folder(run, arm)
        if not is_trained(folder):
            stage = "extend" if arm.method == START else "finetune"
            raise ValueError(f"{arm.name} is not trained ({folder}): run the '{stage}' stage first.")
        start = time.perf_counter()
        if setting.name not in of_setting:
            alpha = setting_alpha(config, pop, run, setting)
            cache = setting_validation_cache(config, pop, run, setting)
            if cache not in caches:  # (a) and (b) share E1's
                caches[cache] = stages.cache_scores(cache)
            of_setting[setting.name] = (alpha, cache, setting_cases(config, pop, run, setting))
        alpha, cache, cases = of_setting[setting.name]
        scored = arm.method != "cache"  # the outside evaluator weighted cache's training
        column = {"cache": cache, "alpha": alpha, "beta": config.scoring.beta, "soft": False}
        device = stages.device_of(pop)
        model, tokenizer = stages.load_member(folder, device)
        record = {"run": arm.name, "setting": setting.name, "method": arm.method, "seed": arm.seed}
        record["start_length"], record["length"] = setting.start_length, setting.seq_len
        found = stages.benchmark_results(model, tokenizer, {k: cases[k] for k in ("lines", "gate", "needle")}, pop)
        record["acc_start"] = found.pop("acc512")  # the gate group holds the start length's cases
        record.update(found)
        if "beyond_start" in cases:
            record["beyond_start"] = {
                str(n): stages.lines_result(model, tokenizer, group, pop) for n, group in cases["beyond_start"].items()
            }
        if "recall" in cases:
            from ..common import passage_recall

            record["recall"] = passage_recall.passage_recall_accuracy(
                model, cases["recall"], pop.evaluation.batch_size, device=device
            )
        evaluator = setting.evaluator if scored else None
        finish_evaluation(config, pop, run, arm, (model, tokenizer), record, (column, caches, evaluator), start)
        run.log(
            f"evaluate: {arm.name} primary accuracy {primary_mean(record):.3f}, at {setting.start_length} "
            f"{record['acc_start']['accuracy']:.3f}, PPL {record['ppl']:.2f}"
        )


def stage_evaluate(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    if config.settings:
        return evaluate_setting_arms(
            config, pop, run, start_arms(config, selection) + arms(config, selection=selection)
        )
    evaluate_arms(config, pop, run, arms(config, selection=selection))


# ------------------------------------------------------------------ void rule and rerun


def void_of(config: Comparison, run: RunFolder, extension: Extension, rerun: bool = False, seeds=None) -> dict:
    """The void rule of ``extension`` from the ``ce`` runs' curves (every seed of ``seeds``, default
    the config's, must be trained), or from the rerun's ``ce`` runs."""
    from ..common.family import TRAINING_RECORD

    at = config.void.at_step
    values = []
    for seed in seeds or config.finetune.seeds:
        arm = Arm(extension, "ce", seed, rerun)
        if not run.has("models", "finetuned", arm.name, TRAINING_RECORD):
            raise ValueError(f"The void rule needs {arm.name}: run the 'finetune' stage first.")
        curve = run.read_json("models", "finetuned", arm.name, TRAINING_RECORD)["curve"]
        values.append(next(p["acc512"] for p in curve if p["step"] == at))
    extended = run.read_json("eval", "extended", f"{extension.name}.json")["curve_point"]["acc512"]
    return {"at_step": at, **void_rule(values, extended, config.void.min_ratio)}


def rerun_extensions(config: Comparison, void_by_extension: dict[str, bool]) -> list[Extension]:
    """The extensions whose ``rerun.methods`` are run again (``rerun.when``)."""
    if config.rerun.when == "never":
        return []
    return [e for e in config.extensions if config.rerun.when == "always" or void_by_extension[e.name]]


def stage_rerun(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    if config.settings:
        run.log("rerun: none (a config with settings has no reruns: void runs are reported as void)")
        return
    seeds = selection.seeds if selection else None
    void = {e.name: void_of(config, run, e)["void"] for e in config.extensions}
    chosen = {e.name for e in rerun_extensions(config, void)}
    if not chosen:
        run.log(f"rerun: none due (void: {void}, rerun.when {config.rerun.when})")
        return
    selected = [arm for arm in arms(config, rerun=True, seeds=seeds) if arm.extension.name in chosen]
    run.log(f"rerun: {', '.join(sorted(chosen))} at {config.rerun.lr_factor:g} x lr ({len(selected)} runs)")
    train_arms(config, pop, run, selected)
    evaluate_arms(config, pop, run, selected)
