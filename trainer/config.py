"""``LongCEConfig``: ``TrainingArguments`` plus the LongCE settings (paper Sec. 3.2, App. A.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .weighted_loss import DEFAULT_LOSS_CHUNK_BYTES


@dataclass
class LongCEConfig(TrainingArguments):
    """``TrainingArguments`` with the ``longce_*`` fields of ``LongCETrainer``.

    Usable from ``HfArgumentParser`` (command line) and YAML like any ``TrainingArguments``. The
    defaults are the paper's: ``K = 4096``, ``d = 1024``, ``gamma = 5``.
    """

    longce_trunc_len: int = field(
        default=4096,
        metadata={"help": "K: tokens of context of the short-context pass (the truncated context). Tokens with fewer "
                  "than K tokens before them in their own document get weight 1."},
    )
    longce_sliding_window: int = field(
        default=1024,
        metadata={"help": "d: stride of the short-context windows; each window scores d tokens, which then have "
                  "between K and K+d-1 tokens of short context (paper App. A.1)."},
    )
    longce_gamma: float = field(
        default=5.0,
        metadata={"help": "gamma: cap of the token weight min(exp(LSD), gamma); must be > 0."},
    )
    longce_max_tokens_per_batch: int = field(
        default=32768,
        metadata={"help": "Token budget of one short-context forward pass (windows of all documents of a batch are "
                  "packed under it). Results do not depend on it; memory and speed do."},
    )
    longce_plain_ce: bool = field(
        default=False,
        metadata={"help": "Train with plain cross-entropy (all weights 1, no short-context pass), through the same "
                  "memory-lean loss: the CE baseline of the paper's tables."},
    )
    longce_compile_windows: bool = field(
        default=False,
        metadata={"help": "torch.compile the model's transformer blocks for the short-context pass (regional, "
                  "dynamic shapes): fuses its element-wise kernels after a one-off compilation."},
    )
    longce_loss_kernel: str = field(
        default="auto",
        metadata={"help": "LM-head loss implementation: 'ours' (chunked autograd function, any device), 'liger' "
                  "(Liger-Kernel's fused linear cross-entropy, CUDA), or 'auto' (Liger when installed and "
                  "applicable, else ours). A LoRA-wrapped LM head always goes through its own forward.",
                  "choices": ["auto", "ours", "liger"]},
    )
    longce_loss_chunk_bytes: int = field(
        default=DEFAULT_LOSS_CHUNK_BYTES,
        metadata={"help": "Bytes of float32 logits computed at a time by the loss (the LM head never produces a "
                  "[tokens, vocabulary] tensor for the whole sequence)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_longce_settings(
            self.longce_trunc_len, self.longce_sliding_window, self.longce_gamma, self.longce_max_tokens_per_batch,
            self.longce_loss_kernel,
        )


LOSS_KERNELS = ("auto", "ours", "liger")


def validate_longce_settings(
    trunc_len: int, sliding_window: int, gamma: float, max_tokens_per_batch: int, loss_kernel: str = "auto"
) -> None:
    """Raise ``ValueError`` naming the bad LongCE setting and its valid range."""
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"longce_loss_kernel must be one of {LOSS_KERNELS}, got {loss_kernel!r}.")
    if loss_kernel == "liger":
        from .weighted_loss import liger_available

        if not liger_available():
            raise ValueError("longce_loss_kernel='liger' needs Liger-Kernel (pip install 'liger-kernel>=0.8.2') "
                             "and a CUDA build of PyTorch with Triton; or use 'auto' / 'ours'.")
    if not isinstance(trunc_len, int) or trunc_len < 1:
        raise ValueError(f"longce_trunc_len (K) must be an integer >= 1, got {trunc_len!r}.")
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"longce_sliding_window (d) must be an integer >= 1, got {sliding_window!r}.")
    if not gamma > 0:  # also catches NaN
        raise ValueError(f"longce_gamma must be > 0 (the cap of min(exp(LSD), gamma)), got {gamma!r}.")
    if not isinstance(max_tokens_per_batch, int) or max_tokens_per_batch < 1:
        raise ValueError(f"longce_max_tokens_per_batch must be an integer >= 1, got {max_tokens_per_batch!r}.")
