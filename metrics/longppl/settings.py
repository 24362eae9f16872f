"""The settings of LongPPL, their defaults and their validation, in one place.

Every entry point (the ``evaluate`` metric, the drop-in ``compute_longppl``, the key-token cache,
the scripts and the scoring core below them) builds these small frozen dataclasses from its
arguments, so a bad value gets the same clear message wherever it is given, before any model runs.

- :class:`WindowSettings`: ``K`` (``trunc_len``) and ``d`` (``sliding_window``) of the short
  windows, both counted in evaluator tokens (see ``windows``).
- :class:`KeyTokenSettings`: a :class:`WindowSettings` with the evaluator's tokenization (its
  special tokens, ``window_bos``): everything an evaluator's scores depend on, the key of a
  key-token cache row (see ``key_token_cache``).
- :class:`KeyTokenRule`: which evaluator tokens are key, from their long-short difference LSD and
  long-context likelihood LCL (see ``key_tokens``).

The functions below the public ones (``windows``, ``batching``, ``key_tokens``, ``scoring``'s inner
helpers) take these objects whole and trust them: a value is checked once, when its object is built
at the public edge (the metric, the drop-in, the commands, ``LongCEConfig``, ``add_key_token_weights``).
The scoring calls take the object alone (``score_with_evaluator(settings=...)``,
``short_context_log_probs(window=...)``: one signature each); ``text_key_weights`` still takes the
rule's numbers too (:func:`settings_object` refuses both at once).

This module imports nothing else from the package, so every other module may import it.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import numpy as np


def require_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum`` (``bool`` is not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def require_finite(name: str, value) -> float:
    """``value`` as a ``float`` if it is a finite real number (``bool`` is not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def require_gamma(name: str, value) -> float:
    """``value`` as a ``float`` if it is a finite number ``> 0``, else ``ValueError``: the one rule for the
    cap ``gamma`` of the soft weights ``min(exp(LSD), gamma)``, the metric's and LongCE's alike.

    Infinity is refused: it leaves the weights uncapped, so one token with a large LSD outweighs the
    rest (``exp(LSD)`` overflows float32 past LSD ≈ 88.7, an infinite weight and loss), which is not the
    paper's bounded weight ``[0, gamma]``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(
            f"{name} must be a finite number > 0 (it caps the soft weights min(exp(LSD), {name}); infinity would "
            f"leave them unbounded: use a large finite cap instead), got {value!r}."
        )
    if value <= 0:
        raise ValueError(f"{name} must be > 0 (it caps the soft weights min(exp(LSD), {name})), got {value!r}.")
    return float(value)


def require_bool(name: str, value) -> bool:
    """``value`` as a ``bool`` if it is ``True``/``False`` (NumPy's too), else ``ValueError``.

    A string such as ``"false"`` is truthy: taking it as ``True`` would silently flip the setting.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}.")


@dataclass(frozen=True)
class WindowSettings:
    """The short-context windows: for ``s = 0, d, 2d, …`` the evaluator reads ``x[s : s+K+d]`` alone
    and scores tokens ``[s+K, s+K+d)`` (``windows``). Both counted in evaluator tokens.

    Attributes:
        trunc_len: ``K >= 1``, the short-context length; tokens ``i < K`` get no short score.
        sliding_window: ``d >= 1``, how many consecutive tokens share one short context.
    """

    trunc_len: int = 4096
    sliding_window: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "trunc_len", require_int("trunc_len", self.trunc_len))
        object.__setattr__(self, "sliding_window", require_int("sliding_window", self.sliding_window))


@dataclass(frozen=True)
class KeyTokenSettings(WindowSettings):
    """The evaluator settings its scores depend on: the windows and how texts are tokenized for it.
    A key-token cache row was computed with these (all part of its key).

    Attributes:
        trunc_len, sliding_window: as in :class:`WindowSettings` (a ``KeyTokenSettings`` is one).
        add_special_tokens: tokenize with the evaluator's special tokens (its BOS), as the official code does.
        window_bos: opt-in: the evaluator's BOS at the head of every short window after the first.
    """

    add_special_tokens: bool = True
    window_bos: bool = False

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "add_special_tokens", require_bool("add_special_tokens", self.add_special_tokens))
        object.__setattr__(self, "window_bos", require_bool("window_bos", self.window_bos))

    @property
    def window(self) -> WindowSettings:
        """K and d alone."""
        return WindowSettings(self.trunc_len, self.sliding_window)

    def describe(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in asdict(self).items())


@dataclass(frozen=True)
class KeyTokenRule:
    """Which evaluator tokens are key (paper Sec. 2.2, 3.1, Table 2).

    Attributes:
        alpha: hard rule: key iff ``LSD > alpha`` (finite).
        beta: and, if ``use_lcl``, ``LCL > beta`` (finite).
        use_lcl: keep the LCL condition (``False``: the paper's ablation).
        soft: weight every token by ``min(exp(LSD), gamma)`` instead of the hard rule.
        gamma: cap of the soft weights, finite and ``> 0`` (:func:`require_gamma`).

    A NaN threshold would compare false for every token and so silently give "no key tokens":
    it is refused here instead.
    """

    alpha: float = 2.0
    beta: float = -2.0
    use_lcl: bool = True
    soft: bool = False
    gamma: float = 5.0

    def __post_init__(self):
        object.__setattr__(self, "alpha", require_finite("alpha", self.alpha))
        object.__setattr__(self, "beta", require_finite("beta", self.beta))
        object.__setattr__(self, "use_lcl", require_bool("use_lcl", self.use_lcl))
        object.__setattr__(self, "soft", require_bool("soft", self.soft))
        object.__setattr__(self, "gamma", require_gamma("gamma", self.gamma))

    @classmethod
    def of(cls, values) -> "KeyTokenRule":
        """The rule whose fields ``values`` holds by name: a mapping (a harness task's metadata, the
        metric's ``settings`` output) or an object with attributes (the metric's options, a command's
        parsed arguments). A field it lacks, or holds as ``None``, takes its default; other names are
        ignored. Every field of the class is read, so a field added to the rule reaches each surface
        that builds its rule here, not only ``alpha`` and ``beta``.

        Raises:
            ValueError: a value the field refuses (as when the rule is built directly).
        """
        get = values.get if isinstance(values, Mapping) else lambda name: getattr(values, name, None)
        return cls(**{f.name: get(f.name) for f in fields(cls) if get(f.name) is not None})

    def key_condition(self, greater: str = ">") -> str:
        """The hard rule in people's words: ``LSD > 2 and LCL > -2`` (``LSD > 2`` without the LCL
        condition). ``greater`` is how the comparison is written (``&gt;`` in HTML). With
        :meth:`describe`, the one wording of the rule for reports, warnings and pages."""
        return f"LSD {greater} {self.alpha:g}" + (f" and LCL {greater} {self.beta:g}" if self.use_lcl else "")

    def describe(self) -> str:
        """The whole rule in people's words: its :meth:`key_condition`, or, for the soft variant,
        ``weights min(exp(LSD), 5)``."""
        if self.soft:
            return f"weights min(exp(LSD), {self.gamma:g})"
        return self.key_condition()


def settings_object(cls, given, **values):
    """The ``cls`` settings object (``WindowSettings``, ``KeyTokenSettings``, ``KeyTokenRule``) of a
    public function that takes either the object (``given``) or, as it always has, its values one by
    one (``values``, ``None`` where not passed: the default).

    ``given`` was checked when it was built, so it is returned as it is; the values are checked by
    building the object. Both at once is a ``ValueError`` (they could disagree).
    """
    passed = {name: value for name, value in values.items() if value is not None}
    if given is None:
        return cls(**passed)
    if not isinstance(given, cls):
        raise ValueError(f"settings must be a {cls.__name__}, got {given!r}; build one, e.g. {cls.__name__}().")
    if passed:
        raise ValueError(
            f"Got both a {cls.__name__} and {', '.join(sorted(passed))}: pass the settings object alone "
            f"(dataclasses.replace({cls.__name__}(...), ...) changes one of its values)."
        )
    return given


DEFAULT_TRUNC_LEN = WindowSettings.trunc_len
DEFAULT_SLIDING_WINDOW = WindowSettings.sliding_window
DEFAULT_ALPHA = KeyTokenRule.alpha
DEFAULT_BETA = KeyTokenRule.beta
DEFAULT_GAMMA = KeyTokenRule.gamma
#: Token budget of one forward pass (``batching``): results never depend on it, only speed and memory.
DEFAULT_MAX_TOKENS_PER_BATCH = 32768
#: How per-text results make the corpus LongPPL and PPL (``scoring.corpus_values`` computes them), and
#: what each rule is, in the words help texts use. ``"official"`` is the official evaluation script as
#: it stands (PKU-ML/LongPPL since July 2025, package 0.3.0), whose numbers the paper's table prints;
#: ``"official-pre-2025-07"`` is that script before July 2025, which its authors replaced as a bug
#: (kept to reproduce numbers computed with it); ``"pooled"`` pools the tokens of all texts.
AGGREGATIONS = {
    "official": "the official evaluation script as it stands (since July 2025): "
    "exp(sum n_key * log LongPPL / sum n_key) over the texts with key tokens, "
    "exp(sum n_tokens * log PPL / sum n_tokens) over all texts",
    "official-pre-2025-07": "the official evaluation script before July 2025: "
    "sum n_key * LongPPL / sum n_key, sum n_tokens * PPL / sum n_tokens (means of the values themselves)",
    "pooled": "exp(total NLL / total count) over the tokens of all texts (LongPPL: the same as official)",
}
DEFAULT_AGGREGATION = "official"


def require_aggregation(name: str, value) -> str:
    """``value`` if it names one of :data:`AGGREGATIONS`, else ``ValueError`` naming them all."""
    if isinstance(value, str) and value in AGGREGATIONS:
        return value
    choices = ", ".join(repr(rule) for rule in AGGREGATIONS)
    raise ValueError(f"{name} must be one of {choices} (default {DEFAULT_AGGREGATION!r}), got {value!r}.")


class EvaluatorPrecision(str, enum.Enum):
    """What the evaluator's Linear layers compute in (``evaluator_precision``, ``longppl score
    --evaluator-precision``; ``models.precision``): ``BF16`` (``"bf16"``), the evaluator as loaded in
    its dtype (bfloat16 on a GPU), the exact reference; ``TF32`` (``"tf32"``), the evaluator in float32
    with its matrix products on TF32 tensor cores (float32 accumulation) during its passes: the key
    tokens of a float32 evaluator (Jaccard 0.997 on Gemma 3 at 32k) at under twice bf16's time;
    ``FP8`` (``"fp8"``), the transformer blocks' Linear layers in float8 through torchao (approximate:
    other key tokens near the thresholds).

    The checked value: a surface (the metric, a command) turns the string it was given into one with
    :meth:`of`, once, and passes it inward; the functions below take it as it is (``of`` returns a
    member unchanged). A member is a ``str`` equal to its name (``EvaluatorPrecision.FP8 == "fp8"``)
    and prints as it (``f"{precision}"`` is ``fp8``), so messages and records keep their words.
    """

    BF16 = "bf16"
    TF32 = "tf32"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value, name: str = "evaluator_precision") -> "EvaluatorPrecision":
        """``value`` (a member, or its string ``"bf16"`` / ``"tf32"`` / ``"fp8"``) as a member, else ``ValueError``
        naming the choices; ``name`` is what the message calls the setting."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in EVALUATOR_PRECISIONS:
            return cls(value)
        names = [repr(p) for p in EVALUATOR_PRECISIONS]
        choices = ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{name} must be {choices} (bf16: the exact reference), got {value!r}.")


#: The precisions' names, as commands offer them (``choices``) and messages list them.
EVALUATOR_PRECISIONS = tuple(member.value for member in EvaluatorPrecision)
DEFAULT_EVALUATOR_PRECISION = EvaluatorPrecision.BF16.value


def require_precision(name: str, value) -> EvaluatorPrecision:
    """``value`` checked into an :class:`EvaluatorPrecision` (:meth:`EvaluatorPrecision.of`): a
    member, or one of :data:`EVALUATOR_PRECISIONS`, else ``ValueError`` naming them."""
    return EvaluatorPrecision.of(value, name)


def evaluator_compiles(torch_compile, precision: EvaluatorPrecision | str) -> bool:
    """Whether the evaluator's transformer blocks run compiled: ``torch_compile`` when given
    (``True``/``False``), else (``None``) only for an fp8 evaluator, whose dynamic float8 casts
    compiled into the blocks make it faster than bf16, and slower than bf16 when eager."""
    if torch_compile is None:
        return precision == EvaluatorPrecision.FP8  # a member, or its string
    return require_bool("torch_compile", torch_compile)


def check_token_ids(ids, vocab_size: int | None, role: str, where: str) -> None:
    """Raise ``ValueError`` if a token id of ``ids`` is outside ``[0, vocab_size)``.

    Run on the encoded texts before any forward pass: an id past the model's embedding table is a
    tokenizer that belongs to another model, and would otherwise surface as a bare ``IndexError``
    (or, on a GPU, a device-side assert) deep inside the model.

    Args:
        ids: ``[n]`` int token ids of one text.
        vocab_size: rows of the model's input embedding; ``None`` skips the check.
        role: ``"model"`` or ``"evaluator"``, for the message. where: e.g. ``"predictions[2]"``.
    """
    if vocab_size is None or len(ids) == 0:
        return
    largest, smallest = int(max(ids)), int(min(ids))
    if largest >= vocab_size or smallest < 0:
        bad = largest if largest >= vocab_size else smallest
        raise ValueError(
            f"The {role}'s tokenizer gives token id {bad} for {where}, but the {role} has only {vocab_size} "
            f"token embeddings (ids 0..{vocab_size - 1}): the tokenizer does not belong to this model. "
            f"Pass the tokenizer saved with the {role} (or resize the {role}'s embeddings to the tokenizer)."
        )
