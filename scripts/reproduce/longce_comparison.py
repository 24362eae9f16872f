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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

from longppl.tools.cli import command_line, run_command, tool_parser

from . import stages
from .config import (
    Extension,
    Mix,
    Population,
    Training,
    Window,
    checked,
    each,
    non_negative,
    positive,
    read_config,
    read_population,
    share,
)
from .report_text import closing_sections, fmt
from .run_folder import RunFolder, finite, read_record

STAGES = ("start", "extend", "cache", "finetune", "evaluate", "rerun", "report")
#: The fine-tuning methods and the ``LongCEConfig`` fields that select them (``ce-wallclock`` is CE).
METHODS = {
    "ce": {"longce_plain_ce": True},
    "self": {"longce_weights": "self"},
    "cache": {"longce_weights": "cache"},
    "ce-wallclock": {"longce_plain_ce": True},
}
Method = Literal["ce", "self", "cache", "ce-wallclock"]


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

    def problems(self):
        if self.training.steps == 0:
            yield "training.steps", "must be > 0 (the extension alone is the 'extend' stage)"
        if not self.methods or len(set(self.methods)) != len(self.methods):
            yield "methods", f"must list each of {list(METHODS)} at most once, at least one"
        if "ce-wallclock" in self.methods and not {"ce", "self"} <= set(self.methods):
            yield "methods", "ce-wallclock needs ce and self (its steps come from their step-time ratio)"
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
class Comparison:
    """The LongCE-vs-CE experiment (see the module's docstring).

    ``population``: the population config (a path, relative to this config's folder) whose data,
    benchmarks, B and evaluators are shared; ``base_model`` / ``evaluator`` / ``second_evaluator``:
    model folders to take B, E1, E2 from instead of training them (``None``: trained here, E2 only
    when the population config enables one).
    """

    population: str
    extensions: tuple[Extension, ...]
    finetune: Finetuning
    scoring: Scoring
    void: VoidRule = field(default_factory=VoidRule)
    rerun: Rerun = field(default_factory=Rerun)
    level: float = checked(share, default=0.95)
    base_model: str | None = None
    evaluator: str | None = None
    second_evaluator: str | None = None

    def problems(self):
        if not self.extensions:
            yield "extensions", "must list at least one extension of B"
        names = [e.name for e in self.extensions]
        if len(set(names)) != len(names):
            yield "extensions", "names must be distinct (they name folders)"
        if self.void.at_step not in self.finetune.eval_steps:
            yield "void.at_step", f"must be one of finetune.eval_steps {list(self.finetune.eval_steps)}"
        if not set(self.rerun.methods) <= set(self.finetune.methods):
            yield "rerun.methods", f"must be among finetune.methods {list(self.finetune.methods)}"


@dataclass(frozen=True)
class Arm:
    """One fine-tuning run: ``method`` from B extended by ``extension``, with ``seed``; a rerun
    trains at the rerun's learning rate."""

    extension: Extension
    method: str
    seed: int
    rerun: bool = False

    @property
    def name(self) -> str:
        return f"{self.extension.name}-{self.method}{'-rerun' if self.rerun else ''}-s{self.seed}"


def arms(config: Comparison, rerun: bool = False, seeds=None) -> list[Arm]:
    """The runs in training order: per extension and seed, the methods in config order, so that a
    seed's ``ce`` and ``self`` come before its ``ce-wallclock``."""
    methods = config.rerun.methods if rerun else config.finetune.methods
    order = sorted(methods, key=list(METHODS).index)
    return [
        Arm(extension, method, seed, rerun)
        for extension in config.extensions
        for seed in config.finetune.seeds
        if seeds is None or seed in seeds
        for method in order
    ]


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
    if config.finetune.training.seq_len > length:
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


# ------------------------------------------------------------------ models: names and folders


def evaluator_names(config: Comparison, pop: Population) -> tuple[str, str | None]:
    """``(E1, E2 or None)``: the names of the evaluators' folders in ``models/``."""
    second = pop.evaluators[1] if len(pop.evaluators) > 1 else None
    second_name = second.name if second is not None else "E2"
    has_second = config.second_evaluator is not None or (second is not None and second.enabled)
    return pop.evaluators[0].name, second_name if has_second else None


def extended_folder(run: RunFolder, extension: Extension) -> str:
    return os.path.dirname(run.path("models", "extended", extension.name, "x"))


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


def stage_start(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
    """Tokenizer, data, B, E1 (E2): given (copied in) or trained by the population's stages."""
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


# ------------------------------------------------------------------ extend


def benchmark_cases(pop: Population, run: RunFolder) -> dict[str, list]:
    """The cases of an accuracy point: ``"512"`` (the base's gate length, asked line anywhere) and
    each primary length (asked line beyond K)."""
    cases = stages.read_benchmark_cases(pop, run, with_needle=False)
    return {"512": cases["gate"], **{str(n): group for n, group in cases["lines"].items()}}


def first_cases(cases: dict[str, list], limit: int | None) -> dict[str, list]:
    """The first ``limit`` cases of each group of ``cases`` (all of them when ``None``): the subset a
    curve point is measured on."""
    return {key: group[:limit] for key, group in cases.items()}


def accuracy_point(model, tokenizer, cases: dict[str, list], pop: Population, step: int) -> dict:
    """``{"step", "acc512", "primary": {length: accuracy}, "mean"}`` (``mean``: over the primary
    lengths), in the model's own precision, as the 'evaluate' stage measures."""
    was_training = model.training
    model.eval()
    found = {key: stages.lines_result(model, tokenizer, group, pop)["accuracy"] for key, group in cases.items()}
    model.train(was_training)
    primary = {key: value for key, value in found.items() if key != "512"}
    return {"step": step, "acc512": found["512"], "primary": primary, "mean": sum(primary.values()) / len(primary)}


def stage_extend(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
    """B extended by each extension (no fine-tuning), and its accuracy at 512 and on the primary benchmark."""
    from transformers import AutoModelForCausalLM

    from .family import Variant, is_trained, train_variant

    base = stages.model_folder(run, pop.base.name)
    if not is_trained(base):
        raise ValueError(f"The base {pop.base.name} is not in {base}: run the 'start' stage first.")
    tokenizer = stages.load_tokenizer(run)
    device = stages.device_of(pop)
    for extension in config.extensions:
        folder = extended_folder(run, extension)
        if not is_trained(folder):
            model_config, attention = stages.extended_config(pop, base, extension)
            training = dataclasses.replace(config.finetune.training, steps=0)
            variant = Variant(
                extension.name,
                {"base": pop.base.name, "extension": dataclasses.asdict(extension)},
                training.settings(pop.seed),
            )

            def start(model_config=model_config, attention=attention):
                return AutoModelForCausalLM.from_pretrained(base, config=model_config, attn_implementation=attention)

            batches = stages.batches(run, training.seq_len, config.finetune.mix, pop.seed)
            train_variant(variant, tokenizer, batches, folder, device, run.log, start_from=start)
        if run.has("eval", "extended", f"{extension.name}.json"):
            continue
        model, tokenizer = stages.load_member(folder, device)
        # the whole benchmark, and the curves' first point on their subset of it (the void rule's reference)
        cases, limit = benchmark_cases(pop, run), config.finetune.curve_cases
        benchmark = accuracy_point(model, tokenizer, cases, pop, 0)
        record = {
            "extension": dataclasses.asdict(extension),
            "benchmark": benchmark,
            "curve_point": benchmark
            if limit is None
            else accuracy_point(model, tokenizer, first_cases(cases, limit), pop, 0),
        }
        run.write_json(record, "eval", "extended", f"{extension.name}.json")
        point = record["benchmark"]
        run.log(f"extend: {extension.name} accuracy at 512 {point['acc512']:.3f}, primary {point['mean']:.3f}")


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


def pool_key(config: Comparison, run: RunFolder, tokenizer) -> dict:
    """What the tokenized pool depends on: its texts, the tokenizer, the sequence length."""
    from longppl.models.fingerprints import file_sha256, tokenizer_fingerprint

    return {
        "length": config.finetune.training.seq_len,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "finetune_sha256": file_sha256(run.path("data", "finetune.jsonl")),
    }


def cache_weights_dataset(config: Comparison, pop: Population, run: RunFolder, tokenizer):
    """The fine-tuning pool with E1's ``longce_weights`` (``longce.add_key_token_weights``) from E1's
    key-token cache of the pool (LongCE's window), made once: ``data/finetune-cache-weights/``."""
    from datasets import Dataset

    from longce import add_key_token_weights
    from longppl.cache.key_token_cache import CHECKSUM_FILE
    from longppl.models.fingerprints import file_sha256

    first, _ = evaluator_names(config, pop)
    cache = stages.evaluator_cache(pop, run, first, config.finetune.window, "finetune")
    key = {
        **pool_key(config, run, tokenizer),
        "evaluator": stages.model_folder(run, first),
        "gamma": config.finetune.gamma,
        # the cache's own record of its files: it changes whenever the cache is rewritten
        "cache_checksums_sha256": file_sha256(os.path.join(cache, CHECKSUM_FILE)),
    }

    def build():
        return add_key_token_weights(
            Dataset.from_dict({"text": stages.read_texts(run.path("data", "finetune.jsonl"))}),
            key_tokens=cache,
            tokenizer=tokenizer,
            gamma=key["gamma"],
            max_length=key["length"],
            evaluator=key["evaluator"],  # the cache keeps another evaluator's rows beside: take this one's
            add_special_tokens=False,  # the population's convention: no BOS, every token of a text counts
        ).remove_columns(["text"])

    return saved_dataset(run, "finetune-cache-weights", key, build, f"cache: the pool with {first}'s LongCE weights")


def stage_cache(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
    """The fine-tuning pool, tokenized (and with E1's weights for ``cache``), made here once, so that
    ``finetune`` calls running side by side (``--seeds`` split over processes) only read it."""
    tokenizer = stages.load_tokenizer(run)
    for method in dict.fromkeys("cache" if m == "cache" else "ce" for m in config.finetune.methods):
        finetune_dataset(config, pop, run, method, tokenizer)


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
    from datasets import Dataset

    if method == "cache":
        return cache_weights_dataset(config, pop, run, tokenizer)
    key = pool_key(config, run, tokenizer)

    def build():
        def tokenize(batch: dict) -> dict:
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [row[: key["length"]] for row in ids]}

        texts = stages.read_texts(run.path("data", "finetune.jsonl"))
        return Dataset.from_dict({"text": texts}).map(tokenize, batched=True).remove_columns(["text"])

    return saved_dataset(run, "finetune-tokens", key, build, "finetune: the pool tokenized")


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
    steps, ratio = arm_steps(config, run, arm)
    lr = training.lr * (config.rerun.lr_factor if arm.rerun else 1.0)
    model, tokenizer = stages.load_member(extended_folder(run, arm.extension), device)
    model.train()
    dataset = finetune_dataset(config, pop, run, arm.method, tokenizer)
    sequences = per_step(training)
    micro = max(1, min(sequences, (training.micro_batch_tokens or training.batch_tokens) // training.seq_len))
    while sequences % micro:  # equal micro-batches, so every step sees the same number of sequences
        micro -= 1
    cases = first_cases(benchmark_cases(pop, run), tuning.curve_cases)
    points = set(tuning.eval_steps) | {steps}
    curve = [run.read_json("eval", "extended", f"{arm.extension.name}.json")["curve_point"]]
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
                    f"  [{arm.name}] step {state.global_step}/{steps}: acc512 {point['acc512']:.3f}, primary {point['mean']:.3f}"
                )

    torch.manual_seed(arm.seed)
    trainer = LongCETrainer(
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
        "model": {"base": pop.base.name, "extension": dataclasses.asdict(arm.extension)},
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

    for extension in {arm.extension.name: arm.extension for arm in selected}.values():
        if not run.has("eval", "extended", f"{extension.name}.json"):
            raise ValueError(
                f"No extended base {extension.name} in {run.path('eval', 'extended')}: run the 'extend' stage first."
            )
    for arm in selected:
        if is_trained(arm_folder(run, arm)):
            run.log(f"finetune: {arm.name} trained, kept")
            continue
        if stale := stale_record(arm_folder(run, arm)):
            run.log(f"finetune: {stale}")
        finetune(config, pop, run, arm)


def stage_finetune(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
    train_arms(config, pop, run, arms(config, seeds=seeds))


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

    evaluation, window = pop.evaluation, config.scoring.window
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
        scores = stages.longppl_of(
            model, tokenizer, {"scored": column}, caches, config.finetune.gamma, evaluation.max_tokens_per_batch
        )["scored"]
        record["ppl"] = scores["ppl"]
        record["longppl"] = scores["longppl"] if evaluator else None
        record["longppl_evaluator"] = evaluator
        record["alpha"], record["beta"] = alpha, config.scoring.beta
        record["key_tokens"] = scores["key_tokens"] if evaluator else None
        record["seconds"] = time.perf_counter() - start
        run.write_json(record, "eval", "finetuned", f"{arm.name}.json")
        run.add_seconds("evaluate", arm.name, record["seconds"])
        mean = sum(v["accuracy"] for v in record["lines"].values()) / len(record["lines"])
        run.log(
            f"evaluate: {arm.name} primary accuracy {mean:.3f}, acc512 {record['acc512']['accuracy']:.3f}, PPL {record['ppl']:.2f}"
        )


def stage_evaluate(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
    evaluate_arms(config, pop, run, arms(config, seeds=seeds))


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


def stage_rerun(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> None:
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


def spread(values: list) -> dict:
    """Mean and sample standard deviation over the finite ``values`` (``n`` of them)."""
    defined = [float(v) for v in values if finite(v)]
    if not defined:
        return {"mean": None, "sd": None, "n": 0}
    mean = sum(defined) / len(defined)
    sd = math.sqrt(sum((v - mean) ** 2 for v in defined) / (len(defined) - 1)) if len(defined) > 1 else 0.0
    return {"mean": mean, "sd": sd, "n": len(defined)}


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


def stage_report(config: Comparison, pop: Population, run: RunFolder, seeds=None) -> dict:
    """``results.json`` and ``report.md`` over ``seeds`` (default: every seed of the config; fewer
    when a run could not finish them all, which the report then states)."""
    seeds = list(seeds or config.finetune.seeds)
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
    run = RunFolder(args.output_dir)
    return run.run_stages(args.stages, lambda stage: globals()[f"stage_{stage}"](config, pop, run, seeds))


def cli(argv=None) -> int:
    """The ``longppl-reproduce-longce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
