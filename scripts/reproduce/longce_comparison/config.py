"""The LongCE comparison's config (:class:`Comparison`, its settings and arms), read and checked, and the
names and folders of its models and runs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from ..common import stages
from ..common.config import (
    Extension,
    Mix,
    Population,
    Pretrained,
    Training,
    Window,
    checked,
    each,
    folder_name,
    gate_lines_conflict,
    non_negative,
    positive,
    read_config,
    read_population,
    share,
)
from ..common.run_folder import RunFolder

#: The fine-tuning methods and the ``LongCEConfig`` fields that select them (``ce-wallclock`` is CE).
METHODS = {
    "ce": {"longce_weights": "none"},
    "self": {"longce_weights": "self"},
    "cache": {"longce_weights": "cache"},
    "frozen": {"longce_weights": "cache"},  # the start model's own weights, scored once before fine-tuning
    "ce-fresh": {"longce_weights": "none"},  # CE for fresh_factor x the steps, no sequence seen twice
    "ce-wallclock": {"longce_weights": "none"},
}
Method = Literal["ce", "self", "cache", "frozen", "ce-fresh", "ce-wallclock"]
#: The pseudo-method of ``--methods`` that selects a setting's start model (its evaluation at step 0).
START = "start"


# ------------------------------------------------------------------ config


@dataclass(frozen=True)
class Finetuning:
    """The fine-tuning runs: every method of ``methods`` for every seed of ``seeds``, ``training``
    on ``mix``; accuracy curves at ``eval_steps`` (on the first ``curve_cases`` cases of each
    benchmark length, all when ``None``); LongCE's window and ``gamma``."""

    training: Training
    mix: Mix
    methods: tuple[Method, ...]
    seeds: tuple[int, ...] = checked(each(non_negative))
    eval_steps: tuple[int, ...] = checked(each(positive))
    window: Window
    gamma: float = checked(positive, default=5.0)
    curve_cases: int | None = checked(positive, default=None)
    # ce-fresh: CE for round(fresh_factor x steps) steps, its first `steps` on ce's sequences
    fresh_factor: float = checked(positive, default=3.3)

    def problems(self):
        if self.training.steps == 0:
            yield "training.steps", "must be > 0 (the extension alone is the 'extend' stage)"
        if not self.methods or len(set(self.methods)) != len(self.methods):
            yield "methods", f"must list each of {list(METHODS)} at most once, at least one"
        if "ce-wallclock" in self.methods and not {"ce", "self"} <= set(self.methods):
            yield "methods", "ce-wallclock needs ce and self (its steps come from their step-time ratio)"
        if "ce-fresh" in self.methods and self.fresh_factor < 1:
            yield "fresh_factor", "must be >= 1 (ce-fresh's first steps are ce's)"
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            yield "seeds", "must list at least 2 distinct seeds (the paired t interval needs 2)"
        if not self.eval_steps or list(self.eval_steps) != sorted(set(self.eval_steps)):
            yield "eval_steps", "must list increasing step counts"
        elif self.eval_steps[-1] > self.training.steps:
            yield "eval_steps", f"must not pass training.steps {self.training.steps}"


@dataclass(frozen=True)
class Scoring:
    """LongPPL of the fine-tuned models: ``window`` (K, d), key iff LSD > ``alpha`` and LCL > ``beta``;
    ``alpha: calibrated`` takes the population's calibration of alpha on E1 (its ``calibrate`` stage,
    run here on the same E1 and documents, so the value is the population run's)."""

    window: Window
    alpha: float | Literal["calibrated"]
    beta: float = -2.0


@dataclass(frozen=True)
class VoidRule:
    """The accuracy comparison is void when CE's accuracy at 512 at step ``at_step`` (mean over
    seeds) is below ``min_ratio`` times the extended base's."""

    at_step: int = checked(positive, default=250)
    min_ratio: float = checked(share, default=0.5)


@dataclass(frozen=True)
class Rerun:
    """``methods`` again at ``lr_factor`` times the learning rate: ``when`` the void rule holds
    (``void``), or ``always`` / ``never``."""

    when: Literal["void", "always", "never"] = "void"
    lr_factor: float = checked(positive, default=0.5)
    methods: tuple[Literal["ce", "self"], ...] = ("ce", "self")


@dataclass(frozen=True)
class Setting:
    """One starting point of the comparison: the model ``start`` (B, an evaluator of the population
    or one of the comparison's ``pretrained`` models) extended by ``extension`` and fine-tuned at
    ``seq_len`` tokens (L; ``finetune.training.batch_tokens`` per step, so L sets the sequences per
    step); accuracy at ``start_length`` (the gate cases of that length: does the short task survive),
    the primary benchmark at ``lines_lengths`` (asked line beyond K), LongPPL under ``evaluator``.
    ``beyond_start``: also the primary benchmark with the asked line beyond ``start_length`` (the
    start model's own context). A config without ``settings`` has one implicit setting per extension
    (B, the population's lengths, E1): the second attempt's runs, named and stored as they were."""

    name: str = checked(folder_name)
    start: str = checked(folder_name)
    extension: Extension
    seq_len: int = checked(positive)
    start_length: int = checked(positive)
    lines_lengths: tuple[int, ...] = checked(each(positive))
    evaluator: str = checked(folder_name)
    beyond_start: bool = False
    # set (not from a file) for the implicit settings of a config without ``settings``
    implicit: bool = field(default=False, init=False, compare=False)

    def problems(self):
        if not self.lines_lengths:
            yield "lines_lengths", "must list at least one length"
        elif max(self.lines_lengths) > self.seq_len:
            yield "lines_lengths", f"must not pass seq_len {self.seq_len}"
        if self.start_length >= self.seq_len:
            yield "start_length", f"must be below seq_len {self.seq_len} (the context before the extension)"


@dataclass(frozen=True)
class Comparison:
    """The LongCE-vs-CE experiment (see the module's docstring).

    ``population``: the population config (a path, relative to this config's folder) whose data,
    benchmarks, B and evaluators are shared; ``base_model`` / ``evaluator`` / ``second_evaluator``:
    model folders to take B, E1, E2 from instead of training them (``None``: trained here, E2 only
    when the population config enables one).
    """

    population: str
    finetune: Finetuning
    scoring: Scoring
    void: VoidRule = field(default_factory=VoidRule)
    rerun: Rerun = field(default_factory=Rerun)
    level: float = checked(share, default=0.95)
    base_model: str | None = None
    evaluator: str | None = None
    second_evaluator: str | None = None
    extensions: tuple[Extension, ...] = ()
    # several starting points (the third LongCE plan); none: one implicit setting per extension of B
    settings: tuple[Setting, ...] = ()
    # models trained here besides the population's (e.g. B at 256 tokens, E1's recipe at 2048), by
    # the population's pretraining and gate stages
    pretrained: tuple[Pretrained, ...] = ()
    # the passage-recall task: cases of L - recall_margin tokens, the span beyond K (None: not measured)
    recall_cases: int | None = checked(positive, default=None)
    recall_margin: int = checked(positive, default=32)

    def problems(self):
        if not self.extensions and not self.settings:
            yield "extensions", "must list at least one extension of B (or give settings)"
        if self.extensions and self.settings:
            yield "extensions", "give extensions of B (the second attempt's form) or settings, not both"
        names = [e.name for e in self.extensions] + [s.name for s in self.settings]
        if len(set(names)) != len(names):
            yield "extensions", "names must be distinct (they name folders)"
        if self.recall_cases and not self.settings:
            yield "recall_cases", "the passage-recall task is measured in configs with settings"
        if not self.settings and {"frozen", "ce-fresh"} & set(self.finetune.methods):
            yield "finetune.methods", "frozen and ce-fresh need settings (their pools are the settings')"
        if self.void.at_step not in self.finetune.eval_steps:
            yield "void.at_step", f"must be one of finetune.eval_steps {list(self.finetune.eval_steps)}"
        if not set(self.rerun.methods) <= set(self.finetune.methods):
            yield "rerun.methods", f"must be among finetune.methods {list(self.finetune.methods)}"


@dataclass(frozen=True)
class Arm:
    """One fine-tuning run: ``method`` from B extended by ``extension`` (or from ``setting``'s start
    model, extended by its extension), with ``seed``; a rerun trains at the rerun's learning rate.
    Method ``start`` stands for the setting's start model itself (evaluated, never trained)."""

    extension: Extension
    method: str
    seed: int
    rerun: bool = False
    setting: Setting | None = None

    @property
    def name(self) -> str:
        prefix = self.setting.name if self.setting else self.extension.name
        if self.method == START:
            return f"{prefix}-{START}"
        return f"{prefix}-{self.method}{'-rerun' if self.rerun else ''}-s{self.seed}"


@dataclass(frozen=True)
class Selection:
    """What one call runs (``None``: everything): ``--seeds``, ``--settings``, ``--methods`` (``start``
    among them: the settings' start models), ``--models`` (the models the ``start`` stage trains)."""

    seeds: tuple[int, ...] | None = None
    settings: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None


def selected_methods(config: Comparison, selection: Selection | None) -> list[str]:
    """The configured methods (and ``start``) that ``selection`` names, in config order."""
    methods = [*config.finetune.methods, START]
    wanted = selection.methods if selection is not None else None
    return [m for m in methods if wanted is None or m in wanted]


def arms(config: Comparison, rerun: bool = False, seeds=None, selection: Selection | None = None) -> list[Arm]:
    """The runs in training order: per extension (setting) and seed, the methods in config order, so
    that a seed's ``ce`` and ``self`` come before its ``ce-wallclock``; ``selection`` narrows them
    (its seeds, settings and methods; ``start`` is not a run)."""
    methods = config.rerun.methods if rerun else config.finetune.methods
    if selection is not None:
        seeds = selection.seeds if selection.seeds is not None else seeds
        methods = [m for m in methods if selection.methods is None or m in selection.methods]
    order = sorted(methods, key=list(METHODS).index)
    if config.settings:
        chosen = chosen_settings(config, selection.settings if selection else None)
        return [
            Arm(setting.extension, method, seed, rerun, setting)
            for setting in chosen
            for seed in config.finetune.seeds
            if seeds is None or seed in seeds
            for method in order
        ]
    return [
        Arm(extension, method, seed, rerun)
        for extension in config.extensions
        for seed in config.finetune.seeds
        if seeds is None or seed in seeds
        for method in order
    ]


def start_arms(config: Comparison, selection: Selection | None = None) -> list[Arm]:
    """The selected settings' start models as evaluation targets (when ``start`` is selected)."""
    if START not in selected_methods(config, selection):
        return []
    chosen = chosen_settings(config, selection.settings if selection else None)
    return [Arm(setting.extension, START, 0, False, setting) for setting in chosen]


def _resolve(path: str | None, base_folder: str) -> str | None:
    if path is None or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_folder, path))


def read_comparison(
    path: str,
    corpus: str | None = None,
    validation_corpus: str | None = None,
    base_model: str | None = None,
    evaluator: str | None = None,
    second_evaluator: str | None = None,
) -> tuple[Comparison, Population]:
    """The comparison config at ``path`` and the population config it names (the command line's
    corpora and model folders replace the files'); model folders are checked to exist."""
    overrides = {"base_model": base_model, "evaluator": evaluator, "second_evaluator": second_evaluator}
    config = read_config(Comparison, path, overrides)
    folder = os.path.dirname(os.path.abspath(path))
    # Paths from the file are relative to its folder; those of the command line to the working directory.
    resolved = {
        key: os.path.abspath(given) if given else _resolve(getattr(config, key), folder)
        for key, given in overrides.items()
    }
    config = dataclasses.replace(config, population=_resolve(config.population, folder), **resolved)
    for key, flag in (
        ("base_model", "--base-model"),
        ("evaluator", "--evaluator"),
        ("second_evaluator", "--second-evaluator"),
    ):
        value = getattr(config, key)
        if value is not None and not os.path.isfile(os.path.join(value, "config.json")):
            raise ValueError(
                f"{path}: {key} ({flag}) = {value!r} is not a model folder (no config.json in it): give the "
                "folder of a population run's model (<run>/models/<name>) or of its export, or leave it out "
                "to train the model here."
            )
    if not os.path.isfile(config.population):
        raise ValueError(
            f"{path}: population = {config.population!r}: no such file; give the population config's path "
            "(relative to this config's folder)."
        )
    pop = read_population(config.population, corpus, validation_corpus)
    length = pop.data.length
    where = f"{path}: "
    check_settings(config, pop, where)
    if config.finetune.training.seq_len > length and not config.settings:
        raise ValueError(
            f"{where}finetune.training.seq_len = {config.finetune.training.seq_len}: must not pass the population's data.length {length}."
        )
    for key in ("finetune.window", "scoring.window"):
        window = config.finetune.window if key == "finetune.window" else config.scoring.window
        if window.trunc_len >= length:
            raise ValueError(
                f"{where}{key}.trunc_len = {window.trunc_len}: must be below the population's data.length {length}."
            )
    return config, pop


def check_settings(config: Comparison, pop: Population, where: str) -> None:
    """Each setting's models exist (the population's or ``pretrained``), its start model reads its
    start length, its evaluator reads L, and its benchmarks fit inside L with the greedy answer."""
    taken = {pop.base.name, *(e.name for e in pop.evaluators)}
    for index, spec in enumerate(config.pretrained):
        if spec.name in taken:
            raise ValueError(f"{where}pretrained[{index}].name = {spec.name!r}: is taken by the population's models.")
        taken.add(spec.name)
    clash = gate_lines_conflict([*stages.gate_specs(pop), *config.pretrained])
    if clash:
        other, spec = clash
        raise ValueError(
            f"{where}pretrained[{config.pretrained.index(spec)}].gate.lines = {spec.gate.lines}: {other.name}'s gate "
            f"of the same length {spec.gate.length} asks {other.gate.lines}, and the two read one file of gate cases; "
            "give both the same lines."
        )
    specs = model_specs(config, pop)
    room = pop.evaluation.max_new_tokens
    for index, setting in enumerate(config.settings):
        key = f"{where}settings[{index}]"
        for field_name in ("start", "evaluator"):
            name = getattr(setting, field_name)
            if name not in specs:
                raise ValueError(f"{key}.{field_name} = {name!r}: no such model; choose from {', '.join(specs)}.")
        if setting.start == setting.evaluator:
            raise ValueError(f"{key}.evaluator = {setting.evaluator!r}: must not be the start model.")
        if specs[setting.evaluator].shape.max_position_embeddings < setting.seq_len:
            raise ValueError(
                f"{key}.evaluator = {setting.evaluator!r}: reads fewer than seq_len {setting.seq_len} tokens."
            )
        if max(setting.lines_lengths) > setting.seq_len - room:
            raise ValueError(
                f"{key}.lines_lengths = {list(setting.lines_lengths)}: must leave evaluation.max_new_tokens "
                f"inside seq_len {setting.seq_len} (<= {setting.seq_len - room})."
            )
        if setting.start_length > specs[setting.start].shape.max_position_embeddings:
            raise ValueError(f"{key}.start_length = {setting.start_length}: passes the start model's positions.")
    if config.settings and config.rerun.when != "never":
        raise ValueError(f"{where}rerun.when = {config.rerun.when!r}: a config with settings has no reruns; set never.")
    if config.settings and config.void.at_step not in config.finetune.eval_steps:
        raise ValueError(f"{where}void.at_step = {config.void.at_step}: must be one of finetune.eval_steps.")


# ------------------------------------------------------------------ models: names and folders


def evaluator_names(config: Comparison, pop: Population) -> tuple[str, str | None]:
    """``(E1, E2 or None)``: the names of the evaluators' folders in ``models/``."""
    second = pop.evaluators[1] if len(pop.evaluators) > 1 else None
    second_name = second.name if second is not None else "E2"
    has_second = config.second_evaluator is not None or (second is not None and second.enabled)
    return pop.evaluators[0].name, second_name if has_second else None


def extended_folder(run: RunFolder, extension: Extension | str) -> str:
    """``models/extended/<name>``: B extended by ``extension``, or a setting's extended start model."""
    name = extension if isinstance(extension, str) else extension.name
    return os.path.dirname(run.path("models", "extended", name, "x"))


def arm_folder(run: RunFolder, arm: Arm) -> str:
    return os.path.dirname(run.path("models", "finetuned", arm.name, "x"))


def per_step(training: Training) -> int:
    """Sequences of ``seq_len`` tokens per optimizer step."""
    return max(1, training.batch_tokens // training.seq_len)


# ------------------------------------------------------------------ settings: models, cases, pools


def model_specs(config: Comparison, pop: Population) -> dict[str, Pretrained]:
    """Every model this comparison may train, by name: B, the enabled evaluators, ``pretrained``."""
    specs = {pop.base.name: pop.base, **{e.name: e for e in pop.evaluators if e.enabled}}
    return {**specs, **{spec.name: spec for spec in config.pretrained}}


def chosen_settings(config: Comparison, names=None) -> list[Setting]:
    """The settings named in ``names`` (``--settings``; ``None``: every one), in config order."""
    return [s for s in config.settings if names is None or s.name in names]


def fresh_extends(config: Comparison) -> bool:
    return "ce-fresh" in config.finetune.methods


def validation_name(pop: Population, length: int) -> str:
    """The validation documents at ``length`` tokens: the population's, or ``validation-<length>``."""
    return "validation" if length == pop.data.length else f"validation-{length}"


def pool_names(length: int) -> tuple[str, str]:
    """``(pool, fresh pool)`` of the settings fine-tuned at ``length`` tokens (``data/<name>.jsonl``)."""
    return f"finetune-{length}", f"finetune-{length}-fresh"


def setting_training(config: Comparison, length: int) -> Training:
    """The fine-tuning of a setting at ``length`` tokens: the config's, at that sequence length
    (``batch_tokens`` per step, so ``batch_tokens // length`` sequences)."""
    return dataclasses.replace(config.finetune.training, seq_len=length)
