"""LongCE against CE from a base that keeps the task (the second attempt at the paper's Section 5).

    python scripts/reproduce_longce.py --config configs/reproduce/longce_comparison_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2-longce/ \\
        [--base-model repro2/models/B --evaluator repro2/models/E1]

The base B of the LongPPL population (``longppl_reproduce.population``) is extended by YaRN and
fine-tuned by each method, each seed, on the same data in the same order per seed:

- ``ce``: plain cross-entropy; ``self``: LongCE scored by the model being trained (the paper's);
- ``cache``: LongCE with E1's weights (its key-token cache of the fine-tuning data);
- ``ce-wallclock``: CE for ``self``'s wall time, ``round(steps * self / ce step time)`` steps, the
  step times measured on the same seed's ``ce`` and ``self`` runs.

The config (:class:`Comparison`) names a population config, whose data, benchmarks and models
(tokenizer, B, E1, optional E2, test cases, validation documents) this experiment shares: B and E1
are either given (model folders of a population run or its export: ``base_model``, ``evaluator``,
``--base-model``, ``--evaluator``; copied into this run folder), found in it (``--output-dir`` the
population run's own folder: its tokenizer, data and models are kept), or trained here by the
population's own stage functions (``longppl_reproduce.stages``), from the same config and seeds.

Stages (``--stages``, comma separated, or ``all``), each resumable (files written atomically, a
stage skips what its files say is done):

- ``start``: tokenizer, data (the population's ``data`` stage, plus the fine-tuning mix's task
  documents and ``data/finetune.jsonl``, the fine-tuning pool shared by every run), B and E1 (E2)
  given or trained, each through its gate.
- ``extend``: B extended by each of ``extensions`` -> ``models/extended/<name>/``, no fine-tuning;
  its lines accuracy at 512 and on the primary benchmark -> ``eval/extended/<name>.json``.
- ``cache``: E1's key-token cache of the fine-tuning pool (LongCE's window) and the pool with its
  weights -> ``data/finetune-cache-weights/`` (only when ``cache`` is a method).
- ``finetune``: every run -> ``models/finetuned/<extension>-<method>-s<seed>/``, with its step
  times and its accuracy curve at ``finetune.eval_steps`` (accuracy at 512 and on the primary
  benchmark); a finished run is never retrained, one cut off (or whose weights went after its
  training record was written) is trained again from its start.
  ``--seeds`` splits the runs over calls.
- ``evaluate``: per run -> ``eval/finetuned/<run>.json``: lines accuracy at the primary lengths
  (asked line beyond K), at 512, needle, the answer digits' log-likelihood, PPL and LongPPL under
  an evaluator that supplied no training weights (E2 when there is one, else E1 for every method
  but ``cache``).
- ``rerun``: when the void rule holds for an extension (CE's accuracy at 512 at step
  ``void.at_step``, mean over seeds, below ``void.min_ratio`` of the extended base's; ``rerun.when:
  void``, or ``always`` / ``never``), ``rerun.methods`` again at ``rerun.lr_factor`` times the
  learning rate, trained and evaluated as above (``<extension>-<method>-rerun-s<seed>``).
- ``report``: ``results.json`` (every run and seed, mean and standard deviation per method, the
  paired difference of each method against ``ce`` across seeds with its t interval, the void rule,
  the verdict), ``report.md``, ``figures/accuracy_vs_steps-<extension>.png``.

Several starting points (``settings:``, docs/reproduction.md "LongCE beyond one setting"): each
setting names its start model (B, an evaluator, or a model of ``pretrained:``, trained here by the
population's stages), its extension, its fine-tuning length L, its start length, its primary lengths
and its outside evaluator. ``start`` writes each length's pool of distinct book windows
(``data/finetune-<L>.jsonl``, and ``-fresh`` for ``ce-fresh``) and the settings' cases;
``extend`` makes ``models/extended/<setting>/``; ``cache`` the datasets the runs read (``frozen``:
the extended start model's own cached weights; ``cache``: the outside evaluator's) and, with
method ``start`` selected, the evaluators' alpha and validation caches; ``finetune`` trains
``<setting>-<method>-s<seed>`` in a seed's order of the pool (``ce-fresh`` goes on with fresh rows
for ``fresh_factor`` times the steps); ``evaluate`` scores every run and each start model
(``<setting>-start``). ``--settings``, ``--seeds``, ``--methods`` and ``--models`` pick what a call
does, so several processes share a GPU; there are no reruns. ``report`` reads the records alone
(``eval/``, the training records, ``timings.json``) and writes the plan's statistics and decisions
(``longppl_reproduce.longce_settings_report``): per setting the runs, void runs and arms, mean ± sd,
the paired differences against ``ce`` and the start model, pooled over the settings in the records
(a missing setting, seed or arm is named and left out), ``figures/accuracy_vs_steps-<setting>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

from longppl.commandline.running import command_line, run_command, tool_parser

from . import stages
from .config import (
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
from .report_text import closing_sections, fmt, spread
from .run_folder import RunFolder, finite, read_record

STAGES = ("start", "extend", "cache", "finetune", "evaluate", "rerun", "report")
#: The fine-tuning methods and the ``LongCEConfig`` fields that select them (``ce-wallclock`` is CE).
METHODS = {
    "ce": {"longce_plain_ce": True},
    "self": {"longce_weights": "self"},
    "cache": {"longce_weights": "cache"},
    "frozen": {"longce_weights": "cache"},  # the start model's own weights, scored once before fine-tuning
    "ce-fresh": {"longce_plain_ce": True},  # CE for fresh_factor x the steps, no sequence seen twice
    "ce-wallclock": {"longce_plain_ce": True},
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


def import_model(run: RunFolder, source: str, name: str) -> None:
    """Copy the model folder ``source`` (a population run's model or an export) into ``models/<name>``,
    with a training record saying where it came from (kept when there)."""
    import shutil

    from longppl.atomic_files import replace_directory_atomically

    from .family import TRAINING_RECORD, is_trained

    target = stages.model_folder(run, name)
    if os.path.abspath(source) == target:  # the population's own run folder: the model is already here
        return
    if is_trained(target):
        record = run.read_json("models", name, TRAINING_RECORD)
        if record.get("imported_from") != source:
            origin = record.get("imported_from") or "this run's training"
            raise ValueError(
                f"{target} holds {name} from {origin}, not {source}: the runs of this output "
                "folder start from it; use another --output-dir for another model."
            )
        return

    def write(tmp: str) -> None:
        for entry in os.listdir(source):
            if os.path.isfile(os.path.join(source, entry)):
                shutil.copy2(os.path.join(source, entry), os.path.join(tmp, entry))
        record = {"name": name, "model": {}}
        if os.path.isfile(os.path.join(source, TRAINING_RECORD)):
            damaged = "give another model folder (a population run's models/<name> or its export)"
            record = read_record(os.path.join(source, TRAINING_RECORD), remedy=damaged)
        record["imported_from"] = source
        with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)

    replace_directory_atomically(target, write)
    run.log(f"start: {name} from {source}")


def import_tokenizer(run: RunFolder, source: str) -> None:
    """The tokenizer of the given B as the run's (a run's own tokenizer must be the same)."""
    from transformers import AutoTokenizer

    from longppl.atomic_files import replace_directory_atomically
    from longppl.models.fingerprints import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(source)
    if run.has("tokenizer", "tokenizer.json"):
        if tokenizer_fingerprint(stages.load_tokenizer(run)) != tokenizer_fingerprint(tokenizer):
            raise ValueError(
                f"The tokenizer in {run.path('tokenizer')} is not the one of --base-model {source}: the data of this "
                "output folder was made with another tokenizer; use another --output-dir."
            )
        return
    replace_directory_atomically(os.path.dirname(run.path("tokenizer", "x")), tokenizer.save_pretrained)
    run.log(f"start: the tokenizer of {source}")


# ------------------------------------------------------------------ start


def stage_start(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    """Tokenizer, data, B, E1 (E2): given (copied in) or trained by the population's stages (with
    settings: :func:`start_settings`)."""
    if config.settings:
        return start_settings(config, pop, run, selection or Selection())
    if config.base_model:
        import_tokenizer(run, config.base_model)
    else:
        stages.stage_tokenizer(pop, run)
    stages.stage_data(pop, run)
    write_finetune_data(config, pop, run)
    if config.base_model:
        import_model(run, config.base_model, pop.base.name)
        stages.check_gate(pop, run, pop.base)
    else:
        stages.stage_base(pop, run)
    first, second = evaluator_names(config, pop)
    given = {first: config.evaluator, second: config.second_evaluator}
    specs = {spec.name: spec for spec in pop.evaluators}
    for name in (first, second):
        if name is None:
            continue
        if given[name]:
            import_model(run, given[name], name)
            if name in specs and specs[name].enabled:  # a disabled spec has no gate cases
                stages.check_gate(pop, run, specs[name])
        else:
            stages.pretrain(pop, run, specs[name])


def per_step(training: Training) -> int:
    """Sequences of ``seq_len`` tokens per optimizer step."""
    return max(1, training.batch_tokens // training.seq_len)


def as_text(tokenizer, ids, length: int) -> str:
    """The text of a token sequence, cut so that it tokenizes back into at most ``length`` tokens.

    The fine-tuning data is text, because the ``cache`` method's weights come from the evaluator's
    key-token cache, which is keyed by text; decoding and re-encoding a byte-level BPE may merge
    tokens differently at a few places, so a text can come back a token or two longer and is then
    cut at the offset of its ``length``-th token."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offsets) <= length else text[: offsets[length - 1][1]]


def write_finetune_data(config: Comparison, pop: Population, run: RunFolder) -> None:
    """The mix's task documents, and ``data/finetune.jsonl``: ``training.steps x per_step`` sequences
    drawn once (the run's seed); a run's seed orders them (the same order for every method), and
    a run longer than ``training.steps`` (``ce-wallclock``) goes round them again."""
    if run.has("data", "finetune.jsonl"):
        return
    import numpy as np

    training, mix = config.finetune.training, config.finetune.mix
    tokenizer = stages.load_tokenizer(run)
    stream = np.load(run.path("data", "train_tokens.npy"), allow_pickle=False)
    for kind in mix.task_shares():
        stages.write_pool(pop, run, tokenizer, stream, kind, training.seq_len, mix.asked_within)
    batches = stages.batches(run, training.seq_len, mix, pop.seed)
    rows = batches.sequences(training.steps * per_step(training))
    texts = [as_text(tokenizer, row, training.seq_len) for row in rows]
    stages.write_jsonl(run.path("data", "finetune.jsonl"), [{"text": text} for text in texts])
    run.log(f"start: {len(texts)} fine-tuning sequences of at most {training.seq_len} tokens")


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


def settings_data_jobs(
    config: Comparison, pop: Population, run: RunFolder, settings: list[Setting], models=None
) -> list[tuple]:
    """The files of ``settings`` (and of the ``pretrained`` models they use, or ``models``) still to
    write, as ``(kind, *arguments)``, each independent and written atomically (``settings_data_job``)."""
    jobs, has = [], lambda *parts: run.has("data", *parts)
    used = set(models or ()) | {name for s in settings for name in (s.start, s.evaluator)}
    pretrained = [spec for spec in config.pretrained if spec.name in used]
    for spec in pretrained:
        for kind in spec.mix.task_shares():
            if not has("pools", stages.pool_name(kind, spec.training.seq_len, spec.mix.asked_within)):
                jobs.append(("pool", kind, spec.training.seq_len, spec.mix.asked_within))
    starts, lengths = {spec.gate.length for spec in stages.gate_specs(pop)}, set()
    for spec in pretrained:
        if spec.gate.length not in starts | lengths and not has("cases", stages.gate_cases_name(spec.gate.length)):
            jobs.append(("gate", spec.gate.length, spec.gate.cases, spec.gate.lines))
        lengths.add(spec.gate.length)
    mix = config.finetune.mix
    for setting in settings:
        length = setting.seq_len
        if setting.start_length not in starts | lengths and not has(
            "cases", stages.gate_cases_name(setting.start_length)
        ):
            jobs.append(("gate", setting.start_length, pop.evaluation.cases, None))
        lengths.add(setting.start_length)
        for kind in mix.task_shares():
            if not has("pools", stages.pool_name(kind, length, mix.asked_within)):
                jobs.append(("pool", kind, length, mix.asked_within))
        for n in setting.lines_lengths:
            jobs += [("lines", n, None)] if not has("cases", stages.lines_cases_name(n)) else []
            if setting.beyond_start and not has("cases", stages.lines_cases_name(n, setting.start_length)):
                jobs.append(("lines", n, setting.start_length))
        if not has("cases", f"needle-{max(setting.lines_lengths)}.jsonl"):
            jobs.append(("needle", max(setting.lines_lengths)))
        if not has(f"{validation_name(pop, length)}.jsonl"):
            jobs.append(("validation", length))
        if config.recall_cases and not has("cases", f"recall-{length}.jsonl"):
            jobs.append(("recall", length))
    # the fine-tuning pools last: they read the task-document pools of the jobs above
    pools = [("finetune", s.seq_len) for s in settings if not pools_written(config, run, s.seq_len)]
    return list(dict.fromkeys(jobs)), list(dict.fromkeys(pools))  # settings of one length share their files


def settings_data_job(configs: tuple, root: str, job: tuple) -> str:
    """Write one file of :func:`settings_data_jobs` into the run folder at ``root`` (``configs``:
    ``(comparison, population)``); returns the line to log."""
    import numpy as np

    from . import corpus_chunks

    config, pop = configs
    run = RunFolder(root, log=lambda *_: None)
    tokenizer = stages.load_tokenizer(run)
    kind, arguments = job[0], job[1:]
    if kind == "pool":
        stream = np.load(run.path("data", "train_tokens.npy"), mmap_mode="r", allow_pickle=False)
        return stages.write_pool(pop, run, tokenizer, stream, *arguments)
    if kind == "gate":
        length, cases, num_lines = arguments
        gate = dataclasses.replace(pop.base.gate, length=length, cases=cases, lines=num_lines)
        spec = dataclasses.replace(pop.base, name=f"cases-{length}", gate=gate)
        return stages.write_gate_cases(pop, run, tokenizer, spec)
    if kind == "lines":
        return stages.write_lines_cases_beyond(pop, run, tokenizer, *arguments)
    if kind == "needle":
        return stages.write_needle_cases(pop, run, tokenizer, arguments[0])
    (length,) = arguments
    if kind == "finetune":
        write_setting_pools(config, pop, run, length)
        return f"data: the fine-tuning pools of {length} tokens"
    validation_ids = stages.book_ids(tokenizer, stages.validation_books(pop))
    if kind == "validation":
        data = pop.data
        count = max(1, data.validation_documents * data.length // length)  # the population's tokens
        documents = corpus_chunks.body_chunks(
            validation_ids,
            length,
            count,
            skip_fraction=data.skip_fraction,
            per_book_cap=data.per_book_cap,
            seed=pop.seed,
        )
        texts = tokenizer.batch_decode(documents.tolist())
        stages.write_jsonl(run.path("data", f"{validation_name(pop, length)}.jsonl"), [{"text": t} for t in texts])
        return f"data: {len(texts)} validation documents of {length} tokens"
    return write_recall_cases(config, pop, run, validation_ids, length)


def write_recall_cases(config: Comparison, pop: Population, run: RunFolder, validation_ids: list, length: int) -> str:
    """The held-out passage-recall cases of a setting of ``length`` tokens: ``recall_cases`` cases of
    ``length - recall_margin`` tokens from the validation books, the span beyond K."""
    from . import passage_recall

    cases = passage_recall.passage_recall_cases(
        validation_ids,
        length - config.recall_margin,
        config.finetune.window.trunc_len,
        config.recall_cases,
        pop.seed + length,
    )
    passage_recall.write_passage_recall_cases(run.path("data", "cases", f"recall-{length}.jsonl"), cases)
    return f"data: {len(cases)} passage-recall cases of {length - config.recall_margin} tokens"


def distinct_pool(stream, documents: list, seq_len: int, share: float, count: int, seed) -> tuple:
    """``(rows [n, seq_len], document_of_row [n])``: up to ``count`` sequences, each a different
    stretch of the book stream (``stream``'s non-overlapping windows, in a random order), with
    probability ``share`` a task document of ``documents`` at its end, each document used once
    (in a random order; -1: none). Fewer than ``count`` rows when the windows or the documents run
    out: no two rows share a window or a document, so no sequence is seen twice."""
    import numpy as np

    rng = np.random.default_rng(seed)
    windows = rng.permutation(stream.shape[0] // seq_len)
    order = rng.permutation(len(documents))
    rows, used, taken = [], [], 0
    for window in windows[:count]:
        row = np.array(stream[window * seq_len : (window + 1) * seq_len], dtype=np.int64)
        document = -1
        if share > 0 and rng.random() < share:
            if taken == len(order):
                break  # no unused document left: the pool stops here
            document, taken = int(order[taken]), taken + 1
            tail = documents[document][-seq_len:]
            row[seq_len - tail.shape[0] :] = tail
        rows.append(row)
        used.append(document)
    return np.array(rows, dtype=np.int64).reshape(-1, seq_len), np.array(used, dtype=np.int64)


def write_setting_pools(config: Comparison, pop: Population, run: RunFolder, length: int) -> None:
    """``data/finetune-<L>.jsonl`` (``steps x per_step`` sequences, shared by every method of every
    setting at L) and, for ``ce-fresh``, ``data/finetune-<L>-fresh.jsonl`` (the sequences after them,
    up to ``round(fresh_factor x steps)`` steps in all, whole steps only): distinct book windows
    (:func:`distinct_pool`), 5%-style task documents each used once."""
    import numpy as np

    if pools_written(config, run, length):
        return
    main, fresh = pool_names(length)
    tuning = config.finetune
    training = setting_training(config, length)
    per, steps = per_step(training), training.steps
    total = round(tuning.fresh_factor * steps) if fresh_extends(config) else steps
    tokenizer = stages.load_tokenizer(run)
    stream = np.load(run.path("data", "train_tokens.npy"), mmap_mode="r", allow_pickle=False)
    shares = tuning.mix.task_shares()
    if len(shares) > 1:
        raise ValueError(
            "finetune.mix: the settings' pools take one kind of task document (lines or needle), not several."
        )
    kind, share = next(iter(shares.items()), ("lines", 0.0))
    documents = stages.pool(run, kind, length, tuning.mix.asked_within) if share > 0 else []
    rows, _ = distinct_pool(stream, documents, length, share, total * per, [pop.seed, length, 5])
    if rows.shape[0] < steps * per:
        raise ValueError(
            f"The training books give {rows.shape[0]} distinct sequences of {length} tokens, fewer than the "
            f"{steps * per} of {steps} fine-tuning steps: give more books or fewer steps."
        )
    texts = [as_text(tokenizer, row, length) for row in rows]
    stages.write_jsonl(run.path("data", f"{main}.jsonl"), [{"text": t} for t in texts[: steps * per]])
    if fresh_extends(config):
        whole = (len(texts) - steps * per) // per * per  # whole steps of fresh sequences
        fresh_texts = texts[steps * per : steps * per + whole]
        stages.write_jsonl(run.path("data", f"{fresh}.jsonl"), [{"text": t} for t in fresh_texts])
        run.log(f"start: {len(fresh_texts)} fresh sequences of {length} tokens for ce-fresh ({whole // per} steps)")
    run.log(f"start: {steps * per} fine-tuning sequences of at most {length} tokens")


def pools_written(config: Comparison, run: RunFolder, length: int) -> bool:
    main, fresh = pool_names(length)
    return run.has("data", f"{main}.jsonl") and (not fresh_extends(config) or run.has("data", f"{fresh}.jsonl"))


def setting_training(config: Comparison, length: int) -> Training:
    """The fine-tuning of a setting at ``length`` tokens: the config's, at that sequence length
    (``batch_tokens`` per step, so ``batch_tokens // length`` sequences)."""
    return dataclasses.replace(config.finetune.training, seq_len=length)


def start_settings(config: Comparison, pop: Population, run: RunFolder, selection) -> None:
    """The ``start`` stage of a config with settings: tokenizer and the population's data, the
    settings' cases and pools, then the models of the selected settings (their start models and
    outside evaluators; ``--models`` names others, or ``none``), each through its gate."""
    stages.stage_tokenizer(pop, run)
    stages.stage_data(pop, run)
    settings = chosen_settings(config, selection.settings)
    files, pools = settings_data_jobs(config, pop, run, settings, selection.models)
    stages.run_data_jobs((config, pop), run, files, worker=settings_data_job)
    stages.run_data_jobs((config, pop), run, pools, worker=settings_data_job)
    specs = model_specs(config, pop)
    wanted = selection.models
    if wanted is None:
        wanted = list(dict.fromkeys(n for s in settings for n in (s.start, s.evaluator)))
    for name in wanted:
        stages.pretrain(pop, run, specs[name])


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

    from .family import Variant, is_trained, train_variant

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
            Dataset.from_dict({"text": stages.read_texts(run.path("data", f"{pool}.jsonl"))}),
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

        texts = stages.read_texts(run.path("data", f"{pool}.jsonl"))
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
    from .family import TRAINING_RECORD

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


def in_order_trainer():
    """``LongCETrainer`` reading its dataset in order (the order is the dataset's, set by the seed)."""
    from torch.utils.data import SequentialSampler

    from longce import LongCETrainer

    class InOrder(LongCETrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the signature differs across transformers versions
            dataset = args[0] if args and args[0] is not None else kwargs.get("train_dataset") or self.train_dataset
            return SequentialSampler(dataset)

    return InOrder


def finetune(config: Comparison, pop: Population, run: RunFolder, arm: Arm) -> None:
    """One run with ``LongCETrainer`` from the extended B: accuracy points at ``eval_steps`` (and the
    last step), the time of every step; saved with its record to ``models/finetuned/<arm>/``."""
    import shutil

    import torch
    from transformers import DataCollatorWithFlattening, TrainerCallback

    from longce import LongCEConfig, LongCETrainer
    from longppl.atomic_files import replace_directory_atomically

    from .family import TRAINING_RECORD, count_parameters

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

    class Measure(TrainerCallback):
        """Times each optimizer step (synchronised on the GPU); the accuracy points fall outside the timing."""

        def on_step_begin(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.started)
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
        callbacks=[Measure()],
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
    from .family import is_trained, stale_record

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
    from .family import is_trained

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


def setting_cases(config: Comparison, pop: Population, run: RunFolder, setting: Setting) -> dict:
    """A setting's evaluation cases: ``lines`` per primary length, ``gate`` (the start length),
    ``needle`` (the longest primary length), ``beyond_start`` and ``recall`` when configured."""
    from . import needle

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
        from . import passage_recall

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
    from .family import is_trained

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
            from . import passage_recall

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


def void_rule(ce_acc512: list[float], extended_acc512: float, min_ratio: float) -> dict:
    """The plan's void rule: CE's accuracy at 512 at the rule's step (``[seeds]``, their mean) below
    ``min_ratio`` times the extended base's -> the accuracy comparison is void."""
    if not ce_acc512:
        raise ValueError("The void rule needs CE's accuracy at 512 of at least one seed.")
    mean = sum(ce_acc512) / len(ce_acc512)
    threshold = min_ratio * extended_acc512
    return {"ce_acc512": mean, "extended_acc512": extended_acc512, "threshold": threshold, "void": mean < threshold}


def void_of(config: Comparison, run: RunFolder, extension: Extension, rerun: bool = False, seeds=None) -> dict:
    """The void rule of ``extension`` from the ``ce`` runs' curves (every seed of ``seeds``, default
    the config's, must be trained), or from the rerun's ``ce`` runs."""
    from .family import TRAINING_RECORD

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


# ------------------------------------------------------------------ report


def arm_row(run: RunFolder, arm: Arm) -> dict:
    """A run's row of the results: its training record's steps and times, and its evaluation."""
    from .family import TRAINING_RECORD

    trained = run.read_json("models", "finetuned", arm.name, TRAINING_RECORD)
    found = run.read_json("eval", "finetuned", f"{arm.name}.json")
    primary = {n: v["accuracy"] for n, v in found["lines"].items()}
    likelihood = {n: sum(v) / len(v) for n, v in found["log_likelihood"].items()}
    return {
        "run": arm.name,
        "extension": arm.extension.name,
        "method": arm.method,
        "seed": arm.seed,
        "rerun": arm.rerun,
        "steps": trained["steps"],
        "lr": trained["lr"],
        "self_ce_step_ratio": trained["self_ce_step_ratio"],
        "step_seconds": trained["step_seconds"]["median"],
        "seconds": trained["seconds"],
        "final_loss": trained["final_loss"],
        "curve": trained["curve"],
        "accuracy": primary,
        "primary_accuracy": sum(primary.values()) / len(primary),
        "acc512": found["acc512"]["accuracy"],
        "needle": found["needle"]["accuracy"],
        "log_likelihood": sum(likelihood.values()) / len(likelihood),
        "log_likelihood_by_length": likelihood,
        "ppl": found["ppl"],
        "longppl": found["longppl"],
        "longppl_evaluator": found["longppl_evaluator"],
        "key_tokens": found["key_tokens"],
        "alpha": found["alpha"],
        "device": trained["device"],
    }


#: The measures summarised and compared across seeds (the first is the primary outcome).
MEASURES = ("primary_accuracy", "acc512", "needle", "log_likelihood", "ppl", "longppl", "step_seconds")


def compare(rows: list[dict], methods: list[str], level: float) -> dict:
    """Per method: ``{measure: mean and sd}``; per LongCE variant (and ``ce-wallclock``): the paired
    difference against ``ce`` over the seeds both have (``self`` also against ``ce-wallclock``),
    with its t interval, for every measure with finite values."""
    from .statistics import paired_t_interval

    by = {m: {r["seed"]: r for r in rows if r["method"] == m} for m in methods}
    summary = {m: {k: spread([r[k] for r in by[m].values()]) for k in MEASURES} for m in methods}
    pairs = [(m, "ce") for m in methods if m != "ce" and "ce" in methods]
    if "ce-wallclock" in methods and "self" in methods:
        pairs.append(("self", "ce-wallclock"))
    differences = {}
    for variant, baseline in pairs:
        seeds = sorted(set(by[variant]) & set(by[baseline]))
        entry = {}
        for measure in MEASURES:
            a = [by[variant][s][measure] for s in seeds]
            b = [by[baseline][s][measure] for s in seeds]
            kept = [(x, y) for x, y in zip(a, b) if finite(x) and finite(y)]
            if len(kept) < 2:
                entry[measure] = {"skipped": f"{len(kept)} seeds with finite values of both; 2 are needed"}
                continue
            entry[measure] = paired_t_interval([x for x, _ in kept], [y for _, y in kept], level)
        differences[f"{variant} - {baseline}"] = entry
    return {"summary": summary, "differences": differences}


def verdict(void: dict, differences: dict) -> str:
    """The plan's success rule: ``self``'s paired difference against ``ce`` in primary accuracy above
    0 with its interval excluding 0 -> reproduced; a void comparison counts for nothing."""
    if void["void"]:
        return "void"
    found = differences.get("self - ce", {}).get("primary_accuracy", {})
    if "low" not in found:
        return "undecided: no paired self - ce difference in primary accuracy"
    return "reproduced" if found["low"] > 0 else "not reproduced"


def stage_report(config: Comparison, pop: Population, run: RunFolder, selection=None) -> dict:
    """``results.json`` and ``report.md`` over ``seeds`` (default: every seed of the config; fewer
    when a run could not finish them all, which the report then states)."""
    if config.settings:
        return settings_report(config, pop, run, selection or Selection())
    seeds = list((selection.seeds if selection else None) or config.finetune.seeds)
    if len(seeds) < 2:
        raise ValueError(f"The report compares methods across seeds: --seeds names {seeds}; name at least 2.")
    unfinished = sorted(
        {arm.seed for arm in arms(config, seeds=seeds) if not run.has("eval", "finetuned", f"{arm.name}.json")}
    )
    if unfinished:
        finished = [seed for seed in seeds if seed not in unfinished]
        raise ValueError(
            f"Seeds {unfinished} have runs not evaluated in {run.path('eval', 'finetuned')}: run the 'finetune' and "
            f"'evaluate' stages for them, or report the finished seeds with --seeds {','.join(map(str, finished))}."
        )
    extensions = {}
    for extension in config.extensions:
        rows = [arm_row(run, arm) for arm in arms(config, seeds=seeds) if arm.extension == extension]
        void = void_of(config, run, extension, seeds=seeds)
        found = compare(rows, list(config.finetune.methods), config.level)
        reruns = [arm for arm in arms(config, rerun=True, seeds=seeds) if arm.extension == extension]
        rerun = None
        if all(run.has("eval", "finetuned", f"{arm.name}.json") for arm in reruns):
            rerun_rows = [arm_row(run, arm) for arm in reruns]
            rerun = {"runs": rerun_rows, **compare(rerun_rows, list(config.rerun.methods), config.level)}
            rerun["void"] = void_of(config, run, extension, rerun=True, seeds=seeds)
            rerun["verdict"] = verdict(rerun["void"], rerun["differences"])
        if not void["void"]:
            final = verdict(void, found["differences"])
        elif rerun is not None:
            final = f"void at the configured lr; at {config.rerun.lr_factor:g} x lr: {rerun['verdict']}"
        else:
            final = f"void: the rerun at {config.rerun.lr_factor:g} x the learning rate is due (stage 'rerun')"
        extensions[extension.name] = {
            "extension": dataclasses.asdict(extension),
            "extended_base": run.read_json("eval", "extended", f"{extension.name}.json"),
            "void": void,
            "rerun_due": void["void"] and rerun is None,
            "runs": rows,
            **found,
            "verdict": final,
            "rerun": rerun,
        }
    first, second = evaluator_names(config, pop)
    results = {
        "command": command_line("longppl-reproduce-longce"),
        "config": dataclasses.asdict(config),
        "population_config": dataclasses.asdict(pop),
        "seeds": {
            "run": pop.seed,
            "finetune": seeds,  # the seeds reported
            "configured": list(config.finetune.seeds),
            pop.base.name: pop.base.seed,
        },
        "evaluators": {"E1": first, "E2": second},
        "longppl": {
            **dataclasses.asdict(config.scoring.window),
            "alpha": next(iter(extensions.values()))["runs"][0]["alpha"],  # the number, calibrated or given
            "beta": config.scoring.beta,
        },
        "base_gate": run.read_json("eval", "gates", f"{pop.base.name}.json")["accuracy"],
        "extensions": extensions,
        "timings": run.timings(),
    }
    results["figures"] = draw_curves(run, extensions)
    return run.write_report(results, format_report(results))


def setting_row(run: RunFolder, arm: Arm) -> dict:
    """A run's (or start model's) row: its evaluation's outcomes and, for a run, its training record's
    steps, step time, fresh steps and void rule."""
    from .family import TRAINING_RECORD

    found = run.read_json("eval", "finetuned", f"{arm.name}.json")
    accuracy = {n: v["accuracy"] for n, v in found["lines"].items()}
    likelihood = [sum(v) / len(v) for v in found["log_likelihood"].values()]
    beyond = found.get("beyond_start")
    row = {
        "run": arm.name,
        "setting": arm.setting.name,
        "method": arm.method,
        "seed": arm.seed,
        "accuracy": accuracy,
        "primary_accuracy": sum(accuracy.values()) / len(accuracy),
        "acc_start": found["acc_start"]["accuracy"],
        "beyond_start": sum(v["accuracy"] for v in beyond.values()) / len(beyond) if beyond else None,
        "recall": found["recall"]["accuracy"] if found.get("recall") else None,
        "needle": found["needle"]["accuracy"],
        "log_likelihood": sum(likelihood) / len(likelihood),
        "ppl": found["ppl"],
        "longppl": found["longppl"],
        "step_seconds": None,
        "void": False,
    }
    if arm.method != START:
        trained = run.read_json("models", "finetuned", arm.name, TRAINING_RECORD)
        row.update(
            steps=trained["steps"],
            step_seconds=trained["step_seconds"]["median"],
            fresh=trained.get("fresh"),
            void=bool(trained["void"]["void"]),
            void_rule=trained["void"],
            curve=trained["curve"],
        )
    return row


def settings_report(config: Comparison, pop: Population, run: RunFolder, selection: Selection) -> dict:
    """``results.json`` and ``report.md`` of a config with settings, from the records alone
    (``eval/finetuned/``, each run's training record, ``timings.json``): per setting the start model,
    every evaluated run, void runs and arms, mean and sd per arm and the plan's paired differences
    with their t intervals; the pooled statistics over the settings in the records; the plan's
    decisions (``longppl_reproduce.longce_settings_report``). A setting, seed or arm not in the
    records is listed as missing and left out."""
    from . import longce_settings_report as analysis

    seeds = list(selection.seeds or config.finetune.seeds)
    methods = list(config.finetune.methods)
    settings = {}
    for setting in chosen_settings(config, selection.settings):
        start = Arm(setting.extension, START, 0, False, setting)
        runs = arms(config, seeds=seeds, selection=Selection(settings=(setting.name,)))
        done = [a for a in runs if run.has("eval", "finetuned", f"{a.name}.json")]
        rows = [setting_row(run, a) for a in done]
        start_row = setting_row(run, start) if run.has("eval", "finetuned", f"{start.name}.json") else None
        settings[setting.name] = {
            "setting": dataclasses.asdict(setting),
            "start": start_row,
            "runs": rows,
            "missing": [a.name for a in runs if a not in done],
            **analysis.analyse_setting(rows, start_row, methods, len(seeds), config.level),
        }
    if analysis.absent_settings(settings) == list(settings):  # not one setting in the records
        raise ValueError(
            f"No evaluation records of settings {', '.join(settings)} in {run.path('eval', 'finetuned')}: run the "
            "'evaluate' stage, or untar the device's records-<phase>.tgz into --output-dir."
        )
    pooled = analysis.pool_settings(settings, config.level)
    decisions = analysis.decide({name: found["differences"] for name, found in settings.items()}, pooled)
    results = {
        "command": command_line("longppl-reproduce-longce"),
        "config": dataclasses.asdict(config),
        "seeds": seeds,
        "settings": settings,
        "pooled": pooled,
        "decisions": decisions,
        "timings": run.timings(),
    }
    results["figures"] = draw_curves(run, {name: found for name, found in settings.items() if found["runs"]})
    return run.write_report(results, analysis.format_settings_report(results))


def draw_curves(run: RunFolder, extensions: dict) -> list[str]:
    """Mean primary accuracy against fine-tuning steps, a line per run, a colour per method (none
    without matplotlib; ``results.json`` holds the curves)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    from longppl.atomic_files import write_file_atomically

    drawn = []
    for name, found in extensions.items():
        colours = {}
        figure, axis = plt.subplots(figsize=(6, 4))
        for row in found["runs"]:
            colour = colours.setdefault(row["method"], f"C{len(colours)}")
            axis.plot(
                [p["step"] for p in row["curve"]],
                [p["mean"] for p in row["curve"]],
                color=colour,
                alpha=0.8,
                marker="o",
                markersize=3,
            )
        for method, colour in colours.items():
            axis.plot([], [], color=colour, label=method)
        axis.set_xlabel("fine-tuning step")
        axis.set_ylabel("primary lines accuracy")
        axis.set_ylim(-0.02, 1.02)  # a fraction: autoscaling would blow one right answer up to a spike
        axis.legend(title="method")
        figure.tight_layout()
        path = run.path("figures", f"accuracy_vs_steps-{name}.png")
        write_file_atomically(
            path, lambda handle, figure=figure: figure.savefig(handle, format="png", dpi=120), binary=True
        )
        plt.close(figure)
        drawn.append(os.path.relpath(path, run.root))
    return drawn


def _table(rows: list[dict]) -> list[str]:
    out = ["| run | method | seed | steps | lr | primary acc | acc512 | needle | answer LL | PPL | LongPPL | step ms |"]
    out.append("|---" * 12 + "|")
    for r in rows:
        out.append(
            f"| {r['run']} | {r['method']} | {r['seed']} | {r['steps']} | {r['lr']:g} | {fmt(r['primary_accuracy'])} | "
            f"{fmt(r['acc512'])} | {fmt(r['needle'])} | {fmt(r['log_likelihood'])} | {fmt(r['ppl'], 2)} | "
            f"{fmt(r['longppl'], 2)} | {fmt(r['step_seconds'] * 1e3, 1)} |"
        )
    return out


def _comparison_tables(found: dict) -> list[str]:
    out = ["| method | " + " | ".join(MEASURES) + " |", "|---" * (len(MEASURES) + 1) + "|"]
    for method, summary in found["summary"].items():
        cells = [f"{fmt(s['mean'])} ± {fmt(s['sd'])}" if s["n"] else "n/a" for s in summary.values()]
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| paired difference (95% t interval) | " + " | ".join(MEASURES) + " |",
        "|---" * (len(MEASURES) + 1) + "|",
    ]
    for pair, entry in found["differences"].items():
        cells = [
            f"{fmt(d['value'])} [{fmt(d['low'])}, {fmt(d['high'])}]" if "value" in d else "n/a" for d in entry.values()
        ]
        out.append(f"| {pair} | " + " | ".join(cells) + " |")
    return out


def format_report(results: dict) -> str:
    """``report.md``: per extension, the extended base, the void rule, every run, mean ± sd per
    method, the paired differences, the verdict, the rerun; wall times."""
    out = ["# LongCE against CE from a base that keeps the task", "", "```", results["command"], "```", ""]
    evaluators = results["evaluators"]
    out.append(
        f"B's gate accuracy: {fmt(results['base_gate'])}. LongPPL evaluator: "
        + (
            f"{evaluators['E2']}, the second evaluator."
            if evaluators["E2"]
            else f"{evaluators['E1']}, the first evaluator (none for the cache method, which it weighted)."
        )
        + " Key tokens: K {trunc_len}, d {sliding_window}, LSD > {alpha:g}, LCL > {beta:g}.".format(
            **results["longppl"]
        )
    )
    reported, configured = results["seeds"]["finetune"], results["seeds"]["configured"]
    if reported != configured:
        missing = [seed for seed in configured if seed not in reported]
        out.append(
            f"Seeds reported: {len(reported)} of the {len(configured)} configured ({', '.join(map(str, reported))}; "
            f"not reported: {', '.join(map(str, missing))})."
        )
    for name, found in results["extensions"].items():
        base, void = found["extended_base"]["benchmark"], found["void"]
        out += ["", f"## {name}", ""]
        out.append(
            f"Extended base, no fine-tuning: accuracy at 512 {fmt(base['acc512'])}, primary {fmt(base['mean'])}."
        )
        out.append(
            f"Void rule: CE's accuracy at 512 at step {void['at_step']} is {fmt(void['ce_acc512'])} against a threshold of "
            f"{fmt(void['threshold'])}: " + ("**void**" if void["void"] else "not void") + "."
        )
        if found["rerun_due"]:
            out.append(
                "The accuracy comparison is void: the rerun at the rerun's learning rate is due (stage `rerun`)."
            )
        out += ["", *_table(found["runs"]), "", *_comparison_tables(found), "", f"**Verdict: {found['verdict']}.**"]
        if found["rerun"]:
            rerun, void = found["rerun"], found["rerun"]["void"]
            out += ["", "### Rerun", "", *_table(rerun["runs"]), "", *_comparison_tables(rerun), ""]
            out.append(
                f"Void rule of the rerun: CE's accuracy at 512 {fmt(void['ce_acc512'])}, threshold "
                f"{fmt(void['threshold'])}. Verdict of the rerun: {rerun['verdict']}."
            )
    return "\n".join(out + closing_sections(results)) + "\n"


# ------------------------------------------------------------------ command line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="the comparison's YAML config (required)")
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument("--corpus", help="training books; overrides the population config's")
    parser.add_argument("--validation-corpus", help="validation books; overrides the population config's")
    parser.add_argument(
        "--base-model", help="B's model folder (a population run's models/B or its export); overrides the config's"
    )
    parser.add_argument("--evaluator", help="E1's model folder; overrides the config's")
    parser.add_argument("--second-evaluator", help="E2's model folder; overrides the config's")
    parser.add_argument(
        "--stages",
        type=lambda value: stages.parse_stages(value, STAGES),
        default=list(STAGES),
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (default)",
    )
    parser.add_argument(
        "--seeds",
        help="comma-separated fine-tuning seeds to train / evaluate / report in this call (default: all); "
        "a report over fewer seeds than the config's says so",
    )
    parser.add_argument(
        "--settings", help="comma-separated settings (a config with settings) this call runs (default: all)"
    )
    parser.add_argument(
        "--methods",
        help="comma-separated methods this call trains / evaluates / makes the datasets of (default: all); "
        "'start' selects the settings' start models (their evaluation, and in the cache stage the "
        "evaluators' alpha and validation caches)",
    )
    parser.add_argument(
        "--models",
        help="comma-separated models the start stage trains (a config with settings; default: the selected "
        "settings' start models and outside evaluators; 'none': the data only)",
    )
    return parser


def parse_seeds(value: str | None, config: Comparison) -> list[int] | None:
    if not value:
        return None
    try:
        seeds = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {value!r}.") from None
    unknown = [s for s in seeds if s not in config.finetune.seeds]
    if unknown:
        raise ValueError(
            f"--seeds names {unknown}, which are not in the config's finetune.seeds {list(config.finetune.seeds)}."
        )
    return seeds


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config, pop = read_comparison(
        args.config, args.corpus, args.validation_corpus, args.base_model, args.evaluator, args.second_evaluator
    )
    seeds = parse_seeds(args.seeds, config)
    selection = Selection(
        tuple(seeds) if seeds is not None else None,
        parse_names(args.settings, "--settings", [s.name for s in config.settings]),
        parse_names(args.methods, "--methods", [*config.finetune.methods, START]),
        parse_names(args.models, "--models", list(model_specs(config, pop)), empty="none"),
    )
    if not config.settings and (selection.settings or selection.methods or selection.models):
        raise ValueError(
            "--settings, --methods and --models select parts of a config with settings; this one has none."
        )
    run = RunFolder(args.output_dir)
    return run.run_stages(args.stages, lambda stage: globals()[f"stage_{stage}"](config, pop, run, selection))


def parse_names(value: str | None, flag: str, known: list[str], empty: str | None = None) -> tuple[str, ...] | None:
    """The comma-separated names of ``value`` (``None`` when not given; ``empty``: none at all), each one of ``known``."""
    if value is None:
        return None
    if empty is not None and value.strip() == empty:
        return ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag} names {unknown or value!r}; choose from {', '.join(known)}.")
    return names


def cli(argv=None) -> int:
    """The ``longppl-reproduce-longce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
