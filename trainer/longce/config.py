"""``LongCEConfig``: ``TrainingArguments`` plus the LongCE settings (paper Sec. 3.2, App. A.2).

Activation checkpointing has two names across transformers versions: ``gradient_checkpointing``
(and ``gradient_checkpointing_kwargs``) up to 5.23, ``activation_checkpointing`` (``..._kwargs``)
from 5.24 on, where the old names are deprecated aliases that warn. ``LongCEConfig`` accepts both
names on every version, without a warning, and sets both to the resolved value, so code reading
either name sees the same setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from longppl.settings import (
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    require_int,
)

from .weighted_loss import DEFAULT_LOSS_CHUNK_BYTES


@dataclass
class LongCEConfig(TrainingArguments):
    """``TrainingArguments`` with the ``longce_*`` fields of ``LongCETrainer``.

    Usable from ``HfArgumentParser`` (command line) and YAML like any ``TrainingArguments``. The
    defaults are the paper's: ``K = 4096``, ``d = 1024``, ``gamma = 5``.
    """

    longce_trunc_len: int = field(
        default=DEFAULT_TRUNC_LEN,
        metadata={
            "help": "K: tokens of context of the short-context pass (the truncated context). Tokens with fewer "
            "than K tokens before them in their own document get weight 1."
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
        metadata={"help": "gamma: cap of the token weight min(exp(LSD), gamma); must be > 0."},
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
            "help": "Train with plain cross-entropy (all weights 1, no short-context pass), through the same "
            "memory-lean loss: the CE baseline of the paper's tables."
        },
    )
    longce_weights: str = field(
        default="self",
        metadata={
            "help": "Where the token weights come from: 'self' (the model being trained scores each batch with "
            "a short-context pass: the paper's LongCE) or 'cache' (a 'longce_weights' column of the dataset, "
            "an evaluator's min(exp(LSD), gamma) from a key-token cache, built by "
            "longce.add_key_token_weights: no short-context pass, the cost of plain cross-entropy).",
            "choices": ["self", "cache"],
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
            "choices": ["auto", "ours", "liger"],
        },
    )
    longce_loss_chunk_bytes: int = field(
        default=DEFAULT_LOSS_CHUNK_BYTES,
        metadata={
            "help": "Bytes of float32 logits computed at a time by the loss (the LM head never produces a "
            "[tokens, vocabulary] tensor for the whole sequence)."
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
        super().__post_init__()
        for names in CHECKPOINTING_ALIASES:  # mirror the resolved (and JSON-parsed) value under both names
            value = getattr(self, names[native])
            for name in names:
                setattr(self, name, value)
        validate_longce_settings(
            self.longce_trunc_len,
            self.longce_sliding_window,
            self.longce_gamma,
            self.longce_max_tokens_per_batch,
            self.longce_loss_kernel,
            self.longce_weights,
            self.longce_plain_ce,
        )


LOSS_KERNELS = ("auto", "ours", "liger")
WEIGHT_SOURCES = ("self", "cache")
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


def validate_longce_settings(
    trunc_len: int,
    sliding_window: int,
    gamma: float,
    max_tokens_per_batch: int,
    loss_kernel: str = "auto",
    weights: str = "self",
    plain_ce: bool = False,
) -> None:
    """Raise ``ValueError`` naming the bad LongCE setting and its valid range."""
    if weights not in WEIGHT_SOURCES:
        raise ValueError(
            f"longce_weights must be one of {WEIGHT_SOURCES} ('self': the trained model scores each batch; "
            f"'cache': the dataset's longce_weights column), got {weights!r}."
        )
    if weights == "cache" and plain_ce:
        raise ValueError(
            "longce_plain_ce=True trains with all weights 1, but longce_weights='cache' asks for the dataset's "
            "weights: set only one of them."
        )
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"longce_loss_kernel must be one of {LOSS_KERNELS}, got {loss_kernel!r}.")
    if loss_kernel == "liger":
        from .weighted_loss import liger_available

        if not liger_available():
            raise ValueError(
                "longce_loss_kernel='liger' needs Liger-Kernel (pip install 'liger-kernel>=0.8.2') "
                "and a CUDA build of PyTorch with Triton; or use 'auto' / 'ours'."
            )
    # The integer checks are the metric's own (longppl.settings), under the trainer's field names.
    require_int("longce_trunc_len (K)", trunc_len)
    require_int("longce_sliding_window (d)", sliding_window)
    require_int("longce_max_tokens_per_batch", max_tokens_per_batch)
    if not gamma > 0:  # also catches NaN
        raise ValueError(f"longce_gamma must be > 0 (the cap of min(exp(LSD), gamma)), got {gamma!r}.")
