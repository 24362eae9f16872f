"""``LongCEConfig``: ``TrainingArguments`` plus the LongCE settings (paper Sec. 3.2, App. A.2).

``LongCEConfig`` is the one declaration of the settings: its ``longce_*`` fields, their defaults and
their checks (in ``__post_init__``). ``LongCETrainer`` reads them from its ``args``; plain
``TrainingArguments`` are converted into a ``LongCEConfig`` once, when the trainer is built (TRL's
pattern), so they get the defaults.

Activation checkpointing has two names across transformers versions: ``gradient_checkpointing``
(and ``gradient_checkpointing_kwargs``) up to 5.23, ``activation_checkpointing`` (``..._kwargs``)
from 5.24 on, where the old names are deprecated aliases that warn. ``LongCEConfig`` accepts both
names on every version, without a warning, and sets both to the resolved value, so code reading
either name sees the same setting.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments

from longppl.settings import (
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    KeyTokenRule,
    WindowSettings,
    require_bool,
    require_gamma,
    require_int,
)

from .lm_head_loss import LOSS_KERNELS, check_loss_kernel
from .weighted_loss import DEFAULT_LOSS_CHUNK_BYTES

_PREFIX = "longce_"

#: Values of ``longce_weights``, the one setting of where the weights come from: "self" = the trained
#: model scores each batch (short-context pass); "cache" = the batch's ``longce_weights`` column (an
#: evaluator's, ``cached_weights.add_key_token_weights``); "none" = every weight 1 (plain CE; the
#: deprecated ``longce_plain_ce=True`` sets it). ``weight_sources.weight_source_for`` turns one into the trainer's ``WeightSource``.
WEIGHT_SOURCES = ("self", "cache", "none")

#: The dataset and batch column of the cached weights (``[B, T]`` float32 in a batch, one per token):
#: ``cached_weights`` writes it, ``weight_sources.CachedWeights`` reads it.
WEIGHTS_COLUMN = "longce_weights"


@dataclass
class LongCEConfig(TrainingArguments):
    """``TrainingArguments`` with the ``longce_*`` fields of ``LongCETrainer``.

    Usable from ``HfArgumentParser`` (command line) and YAML like any ``TrainingArguments``. The
    defaults are the paper's: ``K = 4096``, ``d = 1024``, ``gamma = 5``. ``eval_loss`` is the LongCE
    loss; ``metric_for_best_model="eval_ce_loss"`` or ``"eval_perplexity"`` selects checkpoints by plain
    cross-entropy (``greater_is_better`` then defaults to False for both).
    """

    longce_trunc_len: int = field(
        default=DEFAULT_TRUNC_LEN,
        metadata={
            "help": "K: tokens of context of the short-context pass (the truncated context). Tokens with fewer "
            "than K tokens before them in their own document get weight min(1, gamma)."
        },
    )
    longce_sliding_window: int = field(
        default=DEFAULT_SLIDING_WINDOW,
        metadata={
            "help": "d: stride of the short-context windows; each window scores d tokens, which then have "
            "between K and K+d-1 tokens of short context (paper App. A.1)."
        },
    )
    longce_gamma: float = field(
        default=DEFAULT_GAMMA,
        metadata={"help": "gamma: cap of the token weight min(exp(LSD), gamma); a finite number > 0."},
    )
    longce_max_tokens_per_batch: int = field(
        default=DEFAULT_MAX_TOKENS_PER_BATCH,
        metadata={
            "help": "Token budget of one short-context forward pass (windows of all documents of a batch are "
            "packed under it). Results do not depend on it; memory and speed do."
        },
    )
    longce_plain_ce: bool = field(
        default=False,
        metadata={
            "help": "Deprecated (removed in the next release): use longce_weights 'none' (plain cross-entropy, "
            "every weight 1), which this sets, with a warning."
        },
    )
    longce_weights: str = field(
        default="self",
        metadata={
            "help": "Where the token weights come from: 'self' (the model being trained scores each batch with "
            "a short-context pass: the paper's LongCE) or 'cache' (a 'longce_weights' column of the dataset, "
            "an evaluator's min(exp(LSD), gamma) from a key-token cache, built by "
            "longce.add_key_token_weights: no short-context pass, the cost of plain cross-entropy) or 'none' "
            "(every weight 1: plain cross-entropy, the CE baseline of the paper's tables).",
            "choices": list(WEIGHT_SOURCES),
        },
    )
    longce_compile_windows: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the model's transformer blocks for the short-context pass (regional, "
            "dynamic shapes): fuses its element-wise kernels after a one-off compilation."
        },
    )
    longce_loss_kernel: str = field(
        default="auto",
        metadata={
            "help": "LM-head loss implementation: 'ours' (chunked autograd function, any device), 'liger' "
            "(Liger-Kernel's fused linear cross-entropy, CUDA), or 'auto' (Liger when installed and "
            "applicable, else ours). A LoRA-wrapped LM head always goes through its own forward.",
            "choices": list(LOSS_KERNELS),
        },
    )
    longce_loss_chunk_bytes: int = field(
        default=DEFAULT_LOSS_CHUNK_BYTES,
        metadata={
            "help": "Bytes of float32 logits computed at a time by the loss (the LM head never produces a "
            "[tokens, vocabulary] tensor for the whole sequence)."
        },
    )

    # TrainingArguments' fields, with help that says what LongCETrainer's evaluation metrics mean.
    metric_for_best_model: str | None = field(
        default=None,
        metadata={
            "help": "Metric that compares checkpoints for load_best_model_at_end=True and save_strategy='best' "
            "(default: 'loss'). With LongCETrainer, eval_loss ('loss') is the LongCE-weighted loss being "
            "trained, not plain cross-entropy. To select by plain CE, name eval_ce_loss (cross-entropy averaged "
            "over every label token of the evaluation set) or eval_perplexity (exp of eval_ce_loss: what a "
            "stock Trainer with run_clm reports as exp(eval_loss) on equal-length blocks; with sequences of "
            "unequal lengths it stays the token-averaged value, where stock eval_loss averages per-batch means)."
        },
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={
            "help": "Whether higher values of metric_for_best_model are better. Default: False for a name that "
            "ends in 'loss' or 'perplexity' (eval_ce_loss, eval_perplexity), True otherwise."
        },
    )

    # Both names on every transformers version (see the module docstring); None = not given.
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Recompute activations in backward instead of keeping them (less memory, ~20%% slower). "
            "Same as gradient_checkpointing (its name before transformers 5.24); give one of them.",
            "nargs": "?",
            "const": True,
        },
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of the model's activation checkpointing, e.g. "
            "'{\"use_reentrant\": false}'. Same as gradient_checkpointing_kwargs."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Same as activation_checkpointing (the name before transformers 5.24); accepted on every "
            "version without a deprecation warning.",
            "nargs": "?",
            "const": True,
        },
    )
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Same as activation_checkpointing_kwargs."},
    )

    def __post_init__(self) -> None:
        native = _resolve_checkpointing_aliases(self)
        if self.greater_is_better is None and (self.metric_for_best_model or "").endswith("perplexity"):
            # TrainingArguments minimises only names ending in "loss"; a perplexity is minimised too.
            self.greater_is_better = False
        super().__post_init__()
        for names in CHECKPOINTING_ALIASES:  # mirror the resolved (and JSON-parsed) value under both names
            value = getattr(self, names[native])
            for name in names:
                setattr(self, name, value)
        _check_longce_fields(self)

    @property
    def longce_window(self) -> WindowSettings:
        """K and d (``longce_trunc_len``, ``longce_sliding_window``) as the scoring core takes them
        (``longppl.core.windows``)."""
        return WindowSettings(self.longce_trunc_len, self.longce_sliding_window)

    @property
    def longce_rule(self) -> KeyTokenRule:
        """The soft key-token rule of the LongCE weights, ``min(exp(LSD), longce_gamma)``, as the metric
        and the key-token cache take it (``longce.add_key_token_weights(rule=...)``)."""
        return KeyTokenRule(soft=True, gamma=self.longce_gamma)


#: The message of the deprecated ``longce_plain_ce`` (its replacement sets the same mode).
PLAIN_CE_DEPRECATION = (
    "longce_plain_ce is deprecated and will be removed in the next release: use longce_weights='none' "
    "(--longce_weights none), the same plain cross-entropy."
)


def _check_longce_fields(config: LongCEConfig) -> None:
    """Check the ``longce_*`` fields of ``config`` and put them in their types (in place).

    Raises ``ValueError`` naming the bad field and its valid range; the integer, boolean and gamma
    checks are the metric's own (``longppl.settings``), under the trainer's field names. The deprecated
    ``longce_plain_ce=True`` warns (``FutureWarning``) and sets ``longce_weights='none'``.
    """
    check_loss_kernel(config.longce_loss_kernel)
    if config.longce_weights not in WEIGHT_SOURCES:
        raise ValueError(
            f"longce_weights must be one of {WEIGHT_SOURCES} ('self': the trained model scores each batch; "
            f"'cache': the dataset's longce_weights column; 'none': every weight 1), got {config.longce_weights!r}."
        )
    checked = {
        "longce_trunc_len": require_int("longce_trunc_len (K)", config.longce_trunc_len),
        "longce_sliding_window": require_int("longce_sliding_window (d)", config.longce_sliding_window),
        "longce_max_tokens_per_batch": require_int("longce_max_tokens_per_batch", config.longce_max_tokens_per_batch),
        "longce_loss_chunk_bytes": require_int("longce_loss_chunk_bytes", config.longce_loss_chunk_bytes),
        "longce_plain_ce": require_bool("longce_plain_ce", config.longce_plain_ce),
        "longce_compile_windows": require_bool("longce_compile_windows", config.longce_compile_windows),
        "longce_gamma": require_gamma("longce_gamma", config.longce_gamma),
    }
    if checked["longce_plain_ce"]:
        if config.longce_weights == "cache":
            raise ValueError(
                "longce_plain_ce=True trains with all weights 1, but longce_weights='cache' asks for the dataset's "
                "weights: set only one of them (longce_plain_ce is deprecated: longce_weights='none' replaces it)."
            )
        warnings.warn(PLAIN_CE_DEPRECATION, FutureWarning, stacklevel=4)
        checked["longce_weights"] = "none"
    for name, value in checked.items():
        setattr(config, name, value)


def as_longce_config(args: TrainingArguments | None) -> LongCEConfig:
    """``args`` as a ``LongCEConfig``: itself if it is one; plain ``TrainingArguments`` converted once
    (their fields kept, the ``longce_*`` ones at their defaults), as TRL's trainers convert theirs;
    ``None``: ``Trainer``'s own default (``output_dir="tmp_trainer"``)."""
    if args is None:
        return LongCEConfig(output_dir="tmp_trainer")
    if isinstance(args, LongCEConfig):
        return args
    if not isinstance(args, TrainingArguments):
        raise ValueError(
            f"args must be a LongCEConfig (or TrainingArguments), got {type(args).__name__}; build one, e.g. "
            "LongCEConfig(output_dir=...)."
        )
    # The attributes themselves, not to_dict(), which hides tokens and turns some settings into JSON text.
    return LongCEConfig(**{spec.name: getattr(args, spec.name) for spec in fields(TrainingArguments) if spec.init})


# (name up to transformers 5.23, name from 5.24 on) of each activation-checkpointing setting.
CHECKPOINTING_ALIASES = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)


def _resolve_checkpointing_aliases(args: LongCEConfig) -> int:
    """Put the checkpointing settings under the names the installed ``TrainingArguments`` reads.

    Returns the index in each ``CHECKPOINTING_ALIASES`` pair of that name (0: ``gradient_*``, up to
    5.23; 1: ``activation_*``, 5.24 on); the other name is cleared so that transformers does not
    warn about it. Raises ``ValueError`` when both names are given different values.
    """
    base = TrainingArguments.__dataclass_fields__
    native = 1 if "activation_checkpointing" in base else 0
    for names in CHECKPOINTING_ALIASES:
        given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
        if len(set(map(repr, given.values()))) > 1:
            raise ValueError(
                f"{names[0]}={given[names[0]]!r} and {names[1]}={given[names[1]]!r} are two names of one setting "
                f"(renamed in transformers 5.24); give only one of them, or the same value."
            )
        value = next(iter(given.values()), None)
        setattr(args, names[native], value)
        setattr(args, names[1 - native], None)
    if args.gradient_checkpointing is None and args.activation_checkpointing is None:
        setattr(args, CHECKPOINTING_ALIASES[0][native], False)  # the flag is a bool once resolved
    return native


# ------------------------------------------------------------------ deprecated

#: What replaces the deprecated ``LongCESettings`` (one release more, then removed).
SETTINGS_DEPRECATION = (
    "longce.LongCESettings is deprecated and will be removed in the next release: LongCETrainer reads the "
    "longce_* fields of its LongCEConfig directly; use LongCEConfig(longce_gamma=..., ...) (or read those "
    "fields of the config you have)."
)


class _LongCESettings:
    """Deprecated: the ``longce_*`` fields of a ``LongCEConfig`` under their old names, without the prefix.

    ``LongCESettings(gamma=2.0)`` builds ``LongCEConfig(longce_gamma=2.0)`` (checked there) and reads its
    fields: ``.gamma`` is its ``longce_gamma``, ``.window`` its ``longce_window``, ``.plain_ce`` whether its
    ``longce_weights`` is ``'none'``; ``.config`` is the ``LongCEConfig``, and a ``longce_*`` name reads
    it too, so functions taking a config take this. ``from_args(args)`` reads an object's ``longce_*``
    attributes, as it did. Each warns (``FutureWarning``) with ``SETTINGS_DEPRECATION``.
    """

    def __init__(self, **settings: Any) -> None:
        warnings.warn(SETTINGS_DEPRECATION, FutureWarning, stacklevel=2)
        names = {spec.name for spec in fields(LongCEConfig) if spec.name.startswith(_PREFIX)}
        unknown = sorted(set(settings) - {name[len(_PREFIX) :] for name in names})
        if unknown:
            raise TypeError(f"LongCESettings has no setting(s) {unknown}. {SETTINGS_DEPRECATION}")
        given = {_PREFIX + name: value for name, value in settings.items()}
        object.__setattr__(self, "config", LongCEConfig(output_dir="tmp_trainer", **given))

    @classmethod
    def from_args(cls, args: Any) -> _LongCESettings:
        """The ``longce_*`` attributes of ``args``; those it lacks (plain ``TrainingArguments``) take the defaults."""
        names = [spec.name for spec in fields(LongCEConfig) if spec.name.startswith(_PREFIX)]
        return cls(**{name[len(_PREFIX) :]: getattr(args, name) for name in names if hasattr(args, name)})

    def __getattr__(self, name: str) -> Any:
        config = object.__getattribute__(self, "config")
        if name == "plain_ce":
            return config.longce_weights == "none"
        return getattr(config, name if name.startswith(_PREFIX) else _PREFIX + name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"LongCESettings is frozen. {SETTINGS_DEPRECATION}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _LongCESettings):
            return NotImplemented
        return _longce_fields(self.config) == _longce_fields(other.config)

    def __hash__(self) -> int:
        return hash(tuple(_longce_fields(self.config).items()))

    def __repr__(self) -> str:
        return (
            f"LongCESettings({', '.join(f'{k[len(_PREFIX) :]}={v!r}' for k, v in _longce_fields(self.config).items())})"
        )


_LongCESettings.__name__ = _LongCESettings.__qualname__ = "LongCESettings"


def _longce_fields(config: LongCEConfig) -> dict[str, Any]:
    # longce_plain_ce left out: once checked, longce_weights holds the mode it sets
    names = [spec.name for spec in fields(config) if spec.name.startswith(_PREFIX) and spec.name != "longce_plain_ce"]
    return {name: getattr(config, name) for name in names}


def __getattr__(name: str) -> Any:
    # PEP 562: `from longce.config import LongCESettings` still works, one release more, with a warning.
    if name == "LongCESettings":
        warnings.warn(SETTINGS_DEPRECATION, FutureWarning, stacklevel=2)
        return _LongCESettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
