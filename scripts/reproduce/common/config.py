"""An experiment's config: frozen dataclasses read once from a YAML file and checked as they are read.

:func:`read_config` turns a YAML mapping into nested dataclasses by their fields' type hints: an
unknown key, a missing one, a value of the wrong type or a bad value (a field's ``check``, or a
dataclass's ``problems()``) is a ``ValueError`` naming the file and the dotted key, e.g.
``population.yaml: base.training.lr = -1.0: must be > 0``. There are no defaults hidden in a
nested dict: a field's default is in its dataclass, so the config file and the dataclasses are the
whole truth.

The pieces (:class:`ModelShape`, :class:`Training`, :class:`Mix`, :class:`Gate`,
:class:`Pretrained`, :class:`Extension`, :class:`Data`, ...) are meant to be reused by other
experiments: each is a dataclass that knows how to check itself. :class:`Population` is the
LongPPL population experiment (``longppl_reproduce.population``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from longce import context_extension

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# ------------------------------------------------------------------ checks (field metadata)


def positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def share(value) -> str | None:
    return None if 0 <= value <= 1 else "must lie in [0, 1]"


def correlation_bound(value) -> str | None:
    return None if -1 <= value <= 1 else "must lie in [-1, 1] (a correlation)"


def folder_name(value) -> str | None:
    return None if _NAME.fullmatch(value) else "must be letters, digits, '.', '_' or '-' (it names a folder)"


def each(check):
    """A check applied to every item of a tuple."""

    def check_items(values) -> str | None:
        for value in values:
            problem = check(value)
            if problem:
                return f"item {value!r} {problem}"
        return None

    return check_items


def checked(check, **kwargs):
    """A dataclass field whose value must pass ``check(value) -> problem or None``."""
    return field(metadata={"check": check}, **kwargs)


# ------------------------------------------------------------------ the reader


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(v) for v in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {type(None): "null", int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, str(hint)
    )


class _Mismatch(Exception):
    """A value that does not fit a type hint (caught where the hint's alternatives are tried)."""


def _convert(hint, value, key: str, file: str):
    """``value`` as type ``hint`` (nested dataclasses read by :func:`read_dataclass`)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _convert(option, value, key, file)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in typing.get_args(hint) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if origin is tuple:
        if not isinstance(value, list):
            raise _Mismatch
        item = typing.get_args(hint)[0]
        return tuple(_convert_or_fail(item, v, f"{key}[{i}]", file) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _Mismatch
        return read_dataclass(hint, value, key, file)
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"config.py cannot read type {hint!r} (field {key})")


def _convert_or_fail(hint, value, key: str, file: str):
    try:
        return _convert(hint, value, key, file)
    except _Mismatch:
        raise ValueError(f"{file}: {key} = {value!r}: must be {_type_name(hint)}.") from None


def read_dataclass(cls, raw: dict, where: str, file: str):
    """An instance of dataclass ``cls`` from the mapping ``raw`` (found at dotted key ``where`` of ``file``).

    Raises:
        ValueError: ``"<file>: <where.key> ...: <problem>"`` for an unknown or missing key, a value of
            the wrong type, a field's failed ``check`` or a problem of ``cls.problems()``.
    """
    prefix = f"{where}." if where else ""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(
            f"{file}: {prefix}{unknown[0]}: unknown key; the keys of {where or 'the config'} are {', '.join(fields)}."
        )
    values = {}
    for name, spec in fields.items():
        key = prefix + name
        if name not in raw:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                hint = spec.metadata.get("missing", "set it in the config")
                raise ValueError(f"{file}: {key}: missing; {hint}.")
            continue
        value = _convert_or_fail(hints[name], raw[name], key, file)
        check = spec.metadata.get("check")
        problem = check(value) if check is not None and value is not None else None
        if problem:
            raise ValueError(f"{file}: {key} = {raw[name]!r}: {problem}.")
        values[name] = value
    instance = cls(**values)
    for name, problem in instance.problems() if hasattr(instance, "problems") else ():
        raise ValueError(f"{file}: {prefix}{name} = {_value_at(instance, name)!r}: {problem}.")
    return instance


def _value_at(instance, key: str):
    """The value at dotted ``key`` (``a.b[2].c``) below ``instance``."""
    value = instance
    for part in key.split("."):
        name, _, index = part.partition("[")
        value = getattr(value, name)
        if index:
            value = value[int(index.rstrip("]"))]
    return value


def read_config(cls, path: str, overrides: dict | None = None):
    """Dataclass ``cls`` from the YAML file at ``path`` (``yaml.safe_load``), with top-level
    ``overrides`` (e.g. the command line's corpus) replacing the file's keys before the checks."""
    from longppl.commandline.running import read_yaml_file

    if not os.path.isfile(path):
        raise ValueError(f"No config file at {path!r}: give the path of a YAML config.")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config is a YAML mapping of keys to values, got {type(raw).__name__}.")
    raw = {**raw, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return read_dataclass(cls, raw, "", path)


# ------------------------------------------------------------------ reusable pieces


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style model's shape (``transformers`` config fields)."""

    hidden_size: int = checked(positive)
    intermediate_size: int = checked(positive)
    num_hidden_layers: int = checked(positive)
    num_attention_heads: int = checked(positive)
    max_position_embeddings: int = checked(positive)
    rope_theta: float = checked(positive, default=10000.0)
    architecture: Literal["llama", "mistral"] = "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def problems(self):
        if self.hidden_size % self.num_attention_heads:
            yield "hidden_size", f"must be a multiple of num_attention_heads ({self.num_attention_heads})"

    def model_fields(self) -> dict:
        """The fields ``family.model_config`` reads (``architecture`` plus the config's own)."""
        fields = dataclasses.asdict(self)
        fields["num_key_value_heads"] = self.num_attention_heads
        return fields


@dataclass(frozen=True)
class Training:
    """A plain training loop's settings (``family.train_variant``); ``steps`` may be 0 (no training)."""

    steps: int = checked(non_negative)
    seq_len: int = checked(positive)
    batch_tokens: int = checked(positive)
    lr: float = checked(positive)
    warmup_steps: int = checked(non_negative, default=0)
    min_lr_ratio: float = checked(share, default=0.1)
    weight_decay: float = checked(non_negative, default=0.0)
    micro_batch_tokens: int | None = checked(positive, default=None)
    compile: bool = False
    log_every: int = checked(positive, default=50)
    save_every: int | None = checked(positive, default=None)

    def problems(self):
        if self.batch_tokens < self.seq_len:
            yield "batch_tokens", f"must hold at least one sequence of seq_len {self.seq_len}"

    def settings(self, seed: int) -> dict:
        """The ``training`` dict of a ``family.Variant`` (with its seed)."""
        return {**dataclasses.asdict(self), "seed": seed}


@dataclass(frozen=True)
class Mix:
    """Shares of the training sequences by kind: book text, lines documents, needle documents,
    two-hop documents (``two_hop``: lines records whose asked lines name another line).

    ``asked_within``: a task document asks only about what lies within that many tokens of its
    question (``None``: anywhere), so that it keeps the task's format without teaching retrieval
    beyond it.
    """

    books: float = checked(share)
    lines: float = checked(share, default=0.0)
    needle: float = checked(share, default=0.0)
    two_hop: float = checked(share, default=0.0)
    asked_within: int | None = checked(positive, default=None)

    def problems(self):
        total = self.books + self.lines + self.needle + self.two_hop
        if abs(total - 1.0) > 1e-6:
            yield "books", f"the shares books + lines + needle + two_hop must sum to 1, got {total:g}"
        if self.two_hop > 0 and self.asked_within is not None:
            yield "two_hop", "two-hop documents ask anywhere in their record: use them without asked_within"

    def task_shares(self) -> dict[str, float]:
        """``{kind: share}`` of the task documents with a share above 0 (kinds in a fixed order, so
        that a mix without two-hop documents draws the batches it drew before they existed)."""
        return {kind: getattr(self, kind) for kind in ("lines", "needle", "two_hop") if getattr(self, kind) > 0}


@dataclass(frozen=True)
class Gate:
    """A check a model must pass before the experiment goes on: lines accuracy at ``length`` tokens
    (``cases`` cases, the asked line uniform over the record) at least ``min_accuracy``.

    ``lines``: the records' number of lines; by default as many as fit when the prompt, the
    reference answer and the greedy answer's ``evaluation.max_new_tokens`` count against
    ``length``. Give it where that count leaves a record the model never trained on (at 256 tokens
    it leaves one line, while every 256-token training record holds two); the prompt and the greedy
    answer must still fit ``length``."""

    length: int = checked(positive)
    cases: int = checked(positive)
    min_accuracy: float = checked(share)
    lines: int | None = checked(positive, default=None)


@dataclass(frozen=True)
class Pretrained:
    """A model trained from scratch (the base of the population, or an evaluator)."""

    name: str = checked(folder_name)
    seed: int = checked(non_negative)
    shape: ModelShape
    training: Training
    mix: Mix
    gate: Gate
    enabled: bool = True

    def problems(self):
        if self.training.seq_len > self.shape.max_position_embeddings:
            yield (
                "training",
                f"seq_len must not pass shape.max_position_embeddings {self.shape.max_position_embeddings}",
            )
        if self.gate.length > self.shape.max_position_embeddings:
            yield "gate", f"length must not pass shape.max_position_embeddings {self.shape.max_position_embeddings}"


#: The context-extension methods of a population: the library's (``longce.context_extension``, the one
#: list of them), each but ``none``, in its order.
EXTENSION_METHODS = tuple(m for m in context_extension.METHODS if m != "none")
#: What a config must give for each argument a method reads (the library's defaults are not taken: a
#: member's recipe is written out in full); YaRN's ``original_max_position_embeddings`` is the base's.
_EXTENSION_NEEDS = {
    "factor": "a factor >= 1 (new context / old)",
    "rope_theta": "rope_theta (the new RoPE base)",
    "eabf_base_length": "eabf_base_length (the context the base was trained at)",
}


@dataclass(frozen=True)
class Extension:
    """A context extension of the base model (``longce.apply_context_extension``).

    ``pi`` / ``yarn``: positions scaled by ``factor``; ``ntk``: NTK-aware scaling, an ABF whose
    base is ``theta * factor ** (d / (d - 2))`` (``d`` the head dimension); ``abf`` / ``eabf``: RoPE
    base ``rope_theta`` (``eabf`` also scales queries by ``log(p + 1) / log(eabf_base_length)``).
    """

    name: str = checked(folder_name)
    method: Literal[EXTENSION_METHODS]
    factor: float | None = checked(positive, default=None)
    rope_theta: float | None = checked(positive, default=None)
    eabf_base_length: int | None = checked(positive, default=None)
    # a control is trained, evaluated and reported, but left out of every analysis
    control: bool = False

    def problems(self):
        for parameter in context_extension.PARAMETERS[self.method]:
            if parameter not in _EXTENSION_NEEDS:
                continue
            value = getattr(self, parameter)
            if value is None or (parameter == "factor" and value < 1):
                yield parameter, f"{self.method} needs {_EXTENSION_NEEDS[parameter]}"

    def ntk_theta(self, theta: float, head_dim: int) -> float:
        """NTK-aware base: ``theta * factor ** (d / (d - 2))`` (``longce.context_extension.ntk_rope_theta``)."""
        return context_extension.ntk_rope_theta(theta, self.factor, head_dim)


@dataclass(frozen=True)
class FineTuning:
    """Each extension fine-tuned for each of ``steps`` (0: the extension alone), ``seeds`` times for
    every step count above 0 (a seed sets the initial data order; 0 steps is one member, as it has
    no training); member ``i`` (in order: extensions, then steps, then seeds) gets seed
    ``seed_base + i``."""

    steps: tuple[int, ...] = checked(each(non_negative))
    seed_base: int = checked(non_negative)
    training: Training
    mix: Mix
    seeds: int = checked(positive, default=1)


@dataclass(frozen=True)
class Data:
    """Tokenizer and documents.

    ``length``: the validation documents' tokens (and the members' context); ``validation_books``:
    when no validation corpus is given, the last books of the corpus held out (at least 1).
    """

    vocab_size: int = checked(positive)
    tokenizer_books: int = checked(positive)
    validation_documents: int = checked(positive)
    length: int = checked(positive)
    validation_books: int = checked(positive, default=2)
    max_books: int | None = checked(positive, default=None)
    skip_fraction: float = checked(share, default=0.1)
    per_book_cap: int = checked(positive, default=20)
    null_keep: int = checked(positive, default=256)
    task_documents: int = checked(positive, default=4096)
    lines_min: int = checked(positive, default=4)
    needles: int = checked(positive, default=4)

    def problems(self):
        if self.null_keep >= self.length:
            yield "null_keep", f"must be below length {self.length} (the null documents' kept tail)"


@dataclass(frozen=True)
class Evaluation:
    """Benchmarks: lines at ``lines_lengths`` with the asked line more than ``beyond`` tokens
    before the question, needle at ``needle_length``; greedy answers of ``max_new_tokens``."""

    lines_lengths: tuple[int, ...] = checked(each(positive))
    cases: int = checked(positive)
    beyond: int = checked(positive)
    needle_length: int = checked(positive)
    max_new_tokens: int = checked(positive, default=24)
    batch_size: int = checked(positive, default=16)
    max_tokens_per_batch: int = checked(positive, default=32768)
    # the two-hop benchmark (both hops beyond ``beyond``) at this length; None: not measured
    two_hop_length: int | None = checked(positive, default=None)
    two_hop_share: float = checked(share, default=0.25)  # of a record's lines that name another line


@dataclass(frozen=True)
class Window:
    """Short-context window of the key-token rule: K and d."""

    trunc_len: int = checked(positive)
    sliding_window: int = checked(positive)


@dataclass(frozen=True)
class Calibration:
    """alpha: the smallest of ``grid`` where null documents' key tokens are at most
    ``max_null_ratio`` of the real ones' (scored with ``window``, beta ``beta``)."""

    window: Window
    grid: tuple[float, ...]
    beta: float = -2.0
    max_null_ratio: float = checked(share, default=0.1)

    def problems(self):
        if not self.grid:
            yield "grid", "must list at least one alpha"


@dataclass(frozen=True)
class Scoring:
    """LongPPL of the members: ``primary`` and ``secondary`` windows at the calibrated alpha, and
    the sensitivity grid ``alphas`` (``calibrated`` or a number) x ``betas`` on the primary window."""

    primary: Window
    secondary: Window
    beta: float = -2.0
    sensitivity_alphas: tuple[float, ...] = (1.0, 2.0)
    sensitivity_betas: tuple[float, ...] = (-2.0, -1.0)
    gamma: float = checked(positive, default=5.0)


@dataclass(frozen=True)
class AnswerTokens:
    """Figure 5(b): ``cases`` lines cases per length with the asked line beyond K, classified at ``alphas``
    and at the calibrated alpha."""

    cases: int = checked(positive)
    length: int = checked(positive)
    alphas: tuple[float, ...] = (2.0,)


@dataclass(frozen=True)
class Analysis:
    """Exclusions and statistics of the report."""

    min_acc512_ratio: float = checked(share, default=0.5)
    max_no_number_share: float = checked(share, default=0.5)
    resamples: int = checked(positive, default=10000)
    seed: int = checked(non_negative, default=0)
    level: float = checked(share, default=0.95)
    floor: float = checked(share, default=0.05)
    ceiling: float = checked(share, default=0.95)
    inconclusive_share: float = checked(share, default=2 / 3)
    min_members: int = checked(positive, default=24)
    # what counts as success: LongPPL's Pearson r with the primary accuracy at most success_max_r,
    # its interval's upper end below success_max_high, and r(LongPPL) - r(PPL)'s interval below 0
    success_max_r: float = checked(correlation_bound, default=-0.7)
    success_max_high: float = checked(correlation_bound, default=-0.4)
    # The third attempt's plan (docs/reproduction.md) sets the fields below; their defaults are
    # the second attempt's rules.
    plan: Literal["second", "third"] = "second"
    # "acc512_and_format": the second attempt's two exclusion rules; "format": only the format rule
    exclusion: Literal["acc512_and_format", "format"] = "acc512_and_format"
    # what the cluster bootstrap resamples: extension methods (second attempt) or configurations
    # (an extension at one setting, e.g. yarn at s = 2, with all its members)
    cluster: Literal["method", "configuration"] = "method"
    # the third attempt's outcome: the mean of these benchmarks, each standardised over the
    # analysed members (a part without variance there is left out and named)
    composite: tuple[str, ...] = ("primary_accuracy", "needle", "two_hop")
    # the third attempt's decision (Spearman, cluster bootstrap over configurations)
    positive_max_high: float = checked(correlation_bound, default=-0.3)
    negative_min_low: float = checked(correlation_bound, default=-0.5)
    equivalence_margin: float = checked(share, default=0.15)
    mixed_model_resamples: int = checked(positive, default=2000)

    @property
    def bootstrap(self) -> dict:
        """The keyword arguments of every bootstrap in ``longppl_reproduce.common.statistics``."""
        return {"resamples": self.resamples, "seed": self.seed, "level": self.level}


def gate_lines_conflict(specs) -> tuple[Pretrained, Pretrained] | None:
    """Two of ``specs`` whose gates share a length but ask records of different ``lines``, or None.

    The gate cases of a length are one file (``data/cases/gate-<length>.jsonl``), read by every
    model gated at that length, so their gates must agree on its records."""
    first = {}
    for spec in specs:
        other = first.setdefault(spec.gate.length, spec)
        if other.gate.lines != spec.gate.lines:
            return other, spec
    return None


@dataclass(frozen=True)
class Population:
    """The LongPPL population experiment: a base B extended by several methods, each fine-tuned for
    several step counts; evaluators outside the population; see ``longppl_reproduce.population``."""

    corpus: str = field(metadata={"missing": "set it in the config or pass --corpus"})
    base: Pretrained
    evaluators: tuple[Pretrained, ...]
    extensions: tuple[Extension, ...]
    finetune: FineTuning
    data: Data
    evaluation: Evaluation
    calibration: Calibration
    scoring: Scoring
    answer_tokens: AnswerTokens
    analysis: Analysis = field(default_factory=Analysis)
    validation_corpus: str | None = None
    text_column: str = "text"
    seed: int = checked(non_negative, default=0)
    device: str = "auto"

    def problems(self):
        if not self.evaluators or not self.evaluators[0].enabled:
            yield "evaluators", "must list at least one evaluator, the first enabled (it calibrates alpha)"
        if not self.extensions:
            yield "extensions", "must list at least one extension"
        taken = {self.base.name, *(e.name for e in self.evaluators)}
        for index, extension in enumerate(self.extensions):
            if extension.name in taken:
                yield f"extensions[{index}].name", "is taken by the base, an evaluator or another extension"
            taken.add(extension.name)
        pretrained = [self.base, *self.evaluators]
        clash = gate_lines_conflict(pretrained)
        if clash:
            other, spec = clash
            key = "base" if spec is self.base else f"evaluators[{pretrained.index(spec) - 1}]"
            yield (
                f"{key}.gate.lines",
                (
                    f"is {spec.gate.lines}, and {other.name}'s gate of the same length {spec.gate.length} asks "
                    f"{other.gate.lines}: the two read one file of gate cases; give both the same lines"
                ),
            )
        length = self.data.length
        if self.finetune.training.seq_len > length:
            yield "finetune.training.seq_len", f"must not pass data.length {length}"
        # a greedy answer follows its prompt inside the members' positions: a number cut off by the
        # end of the positions would be scored wrong under LongChat's last-number rule
        room = length - self.evaluation.max_new_tokens
        if max(self.evaluation.lines_lengths) > room:
            yield (
                "evaluation.lines_lengths",
                f"must leave evaluation.max_new_tokens inside data.length {length} (<= {room})",
            )
        if self.evaluation.needle_length > room:
            yield (
                "evaluation.needle_length",
                f"must leave evaluation.max_new_tokens inside data.length {length} (<= {room})",
            )
        if (self.evaluation.two_hop_length or 0) > room:
            yield (
                "evaluation.two_hop_length",
                f"must leave evaluation.max_new_tokens inside data.length {length} (<= {room})",
            )
        for index, evaluator in enumerate(self.evaluators):
            if evaluator.shape.max_position_embeddings < length:
                yield f"evaluators[{index}].shape.max_position_embeddings", f"must be >= data.length {length}"
        for key in ("calibration.window", "scoring.primary", "scoring.secondary"):
            if _value_at(self, key).trunc_len >= length:
                yield f"{key}.trunc_len", f"must be below data.length {length}"

    def members(self) -> list[Member]:
        """The population: every extension with every step count (``finetune.seeds`` members for a
        step count above 0: ``<extension>-s<steps>``, then ``-r2``, ``-r3``, ...), seeds
        ``finetune.seed_base + index``."""
        found = []
        for extension in self.extensions:
            for steps in self.finetune.steps:
                for replicate in range(1 if steps == 0 else self.finetune.seeds):
                    name = f"{extension.name}-s{steps}" + (f"-r{replicate + 1}" if replicate else "")
                    found.append(Member(name, extension, steps, self.finetune.seed_base + len(found), replicate + 1))
        return found


@dataclass(frozen=True)
class Member:
    """One member of the population: ``extension`` of the base, fine-tuned ``steps`` steps with ``seed``."""

    name: str
    extension: Extension
    steps: int
    seed: int
    replicate: int = 1  # 1 for the first seed of its extension and step count, 2 for the second, ...

    @property
    def configuration(self) -> str:
        """The member's configuration (its extension's name): the third attempt's cluster."""
        return self.extension.name


def read_population(path: str, corpus: str | None = None, validation_corpus: str | None = None) -> Population:
    """The population config at ``path`` (the command line's corpora replace the file's)."""
    return read_config(Population, path, {"corpus": corpus, "validation_corpus": validation_corpus})
