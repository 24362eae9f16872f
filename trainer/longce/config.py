"""``LongCEConfig``: ``TrainingArguments`` plus the LongCE settings (paper Sec. 3.2, App. A.2).

``LongCESettings`` holds those settings without their ``longce_`` prefix, with their defaults and
their checks: ``LongCEConfig`` validates through it, and ``LongCETrainer`` reads it (built from
``LongCEConfig`` or, with the defaults, from plain ``TrainingArguments``).

Activation checkpointing has two names across transformers versions: ``gradient_checkpointing``
(and ``gradient_checkpointing_kwargs``) up to 5.23, ``activation_checkpointing`` (``..._kwargs``)
from 5.24 on, where the old names are deprecated aliases that warn. ``LongCEConfig`` accepts both
names on every version, without a warning, and sets both to the resolved value, so code reading
either name sees the same setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from transformers import TrainingArguments

from longppl.settings import (
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
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
#: evaluator's, ``cached_weights.add_key_token_weights``); "none" = every weight 1 (plain CE, as
#: ``longce_plain_ce=True``). ``weight_sources.weight_source_for`` turns one into the trainer's ``WeightSource``.
WEIGHT_SOURCES = ("self", "cache", "none")

#: The dataset and batch column of the cached weights (``[B, T]`` float32 in a batch, one per token):
#: ``cached_weights`` writes it, ``weight_sources.CachedWeights`` reads it.
WEIGHTS_COLUMN = "longce_weights"


@dataclass(frozen=True)
class LongCESettings:
    """The LongCE settings of ``LongCETrainer`` (``LongCEConfig``'s ``longce_*`` fields), checked when built.

    Attributes:
        trunc_len: ``K``, tokens of context of the short-context pass.
        sliding_window: ``d``, stride of the short-context windows.
        gamma: cap of the token weights ``min(exp(LSD), gamma)``, finite and > 0 (``longppl.settings.require_gamma``).
        max_tokens_per_batch: token budget of one short-context forward pass.
        plain_ce: the older name of ``weights="none"``, kept as an alias: ``True`` sets ``weights`` to
            ``"none"``; once built, ``plain_ce`` is ``weights == "none"``.
        weights: the ``longce_weights`` setting, the one field saying where the weights come from: one
            of ``WEIGHT_SOURCES`` ("cache": the batch's ``longce_weights`` column, no short-context
            pass; "none": all weights 1, no short-context pass, the CE baseline; ``weight_sources``).
        compile_windows: ``torch.compile`` the transformer blocks for the short-context pass.
        loss_kernel: one of ``LOSS_KERNELS`` (``lm_head_loss.select_lm_head_loss``).
        loss_chunk_bytes: float32 bytes of logits computed at a time by the loss.
    """

    trunc_len: int = DEFAULT_TRUNC_LEN
    sliding_window: int = DEFAULT_SLIDING_WINDOW
    gamma: float = DEFAULT_GAMMA
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH
    plain_ce: bool = False
    weights: str = "self"
    compile_windows: bool = False
    loss_kernel: str = "auto"
    loss_chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the bad setting (by its ``LongCEConfig`` field) and its valid range."""
        check_loss_kernel(self.loss_kernel)
        if self.weights not in WEIGHT_SOURCES:
            raise ValueError(
                f"longce_weights must be one of {WEIGHT_SOURCES} ('self': the trained model scores each batch; "
                f"'cache': the dataset's longce_weights column; 'none': every weight 1), got {self.weights!r}."
            )
        # The integer, boolean and gamma checks are the metric's own (longppl.settings), under the trainer's field names.
        checked = {
            "trunc_len": require_int("longce_trunc_len (K)", self.trunc_len),
            "sliding_window": require_int("longce_sliding_window (d)", self.sliding_window),
            "max_tokens_per_batch": require_int("longce_max_tokens_per_batch", self.max_tokens_per_batch),
            "loss_chunk_bytes": require_int("longce_loss_chunk_bytes", self.loss_chunk_bytes),
            "plain_ce": require_bool("longce_plain_ce", self.plain_ce),
            "compile_windows": require_bool("longce_compile_windows", self.compile_windows),
        }
        checked["gamma"] = require_gamma("longce_gamma", self.gamma)
        if self.weights == "cache" and checked["plain_ce"]:
            raise ValueError(
                "longce_plain_ce=True trains with all weights 1, but longce_weights='cache' asks for the dataset's "
                "weights: set only one of them."
            )
        if checked["plain_ce"]:  # the alias: the mode lives in `weights` alone
            object.__setattr__(self, "weights", "none")
        checked["plain_ce"] = self.weights == "none"
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @cached_property
    def window(self) -> WindowSettings:
        """K and d as the scoring core takes them (``longppl.core.windows``)."""
        return WindowSettings(self.trunc_len, self.sliding_window)

    @classmethod
    def from_args(cls, args: Any) -> LongCESettings:
        """The ``longce_*`` attributes of ``args``; those it lacks (plain ``TrainingArguments``) take the defaults."""
        given = {f.name: getattr(args, _PREFIX + f.name) for f in fields(cls) if hasattr(args, _PREFIX + f.name)}
        return cls(**given)


@dataclass
class LongCEConfig(TrainingArguments):
    """``TrainingArguments`` with the ``longce_*`` fields of ``LongCETrainer``.

    Usable from ``HfArgumentParser`` (command line) and YAML like any ``TrainingArguments``. The
    defaults are the paper's: ``K = 4096``, ``d = 1024``, ``gamma = 5``. ``eval_loss`` is the LongCE
    loss; ``metric_for_best_model="eval_ce_loss"`` or ``"eval_perplexity"`` selects checkpoints by plain
    cross-entropy (``greater_is_better`` then defaults to False for both).
    """

    longce_trunc_len: int = field(
        default=LongCESettings.trunc_len,
        metadata={
            "help": "K: tokens of context of the short-context pass (the truncated context). Tokens with fewer "
            "than K tokens before them in their own document get weight min(1, gamma)."
        },
    )
    longce_sliding_window: int = field(
        default=LongCESettings.sliding_window,
        metadata={
            "help": "d: stride of the short-context windows; each window scores d tokens, which then have "
            "between K and K+d-1 tokens of short context (paper App. A.1)."
        },
    )
    longce_gamma: float = field(
        default=LongCESettings.gamma,
        metadata={"help": "gamma: cap of the token weight min(exp(LSD), gamma); a finite number > 0."},
    )
    longce_max_tokens_per_batch: int = field(
        default=LongCESettings.max_tokens_per_batch,
        metadata={
            "help": "Token budget of one short-context forward pass (windows of all documents of a batch are "
            "packed under it). Results do not depend on it; memory and speed do."
        },
    )
    longce_plain_ce: bool = field(
        default=LongCESettings.plain_ce,
        metadata={
            "help": "Train with plain cross-entropy (all weights 1, no short-context pass), through the same "
            "memory-lean loss: the CE baseline of the paper's tables. The same as longce_weights='none'."
        },
    )
    longce_weights: str = field(
        default=LongCESettings.weights,
        metadata={
            "help": "Where the token weights come from: 'self' (the model being trained scores each batch with "
            "a short-context pass: the paper's LongCE) or 'cache' (a 'longce_weights' column of the dataset, "
            "an evaluator's min(exp(LSD), gamma) from a key-token cache, built by "
            "longce.add_key_token_weights: no short-context pass, the cost of plain cross-entropy) or 'none' "
            "(every weight 1: plain cross-entropy, as longce_plain_ce=True).",
            "choices": list(WEIGHT_SOURCES),
        },
    )
    longce_compile_windows: bool = field(
        default=LongCESettings.compile_windows,
        metadata={
            "help": "torch.compile the model's transformer blocks for the short-context pass (regional, "
            "dynamic shapes): fuses its element-wise kernels after a one-off compilation."
        },
    )
    longce_loss_kernel: str = field(
        default=LongCESettings.loss_kernel,
        metadata={
            "help": "LM-head loss implementation: 'ours' (chunked autograd function, any device), 'liger' "
            "(Liger-Kernel's fused linear cross-entropy, CUDA), or 'auto' (Liger when installed and "
            "applicable, else ours). A LoRA-wrapped LM head always goes through its own forward.",
            "choices": list(LOSS_KERNELS),
        },
    )
    longce_loss_chunk_bytes: int = field(
        default=LongCESettings.loss_chunk_bytes,
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
        LongCESettings.from_args(self)  # raises ValueError naming a bad longce_* setting


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
