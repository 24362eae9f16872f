"""Token log-probabilities of a causal LM without a full ``[sequence, vocabulary]`` logits tensor.

Index convention (shared by the whole package): for a sequence ``x_0 … x_{T-1}``,
``lp[i] = log P(x_i | x_0 … x_{i-1})`` for ``i >= 1``; ``lp[0]`` has no value (NaN).

The backbone runs once and returns final hidden states ``[B, T, H]``; only the positions that are
scored are projected through the LM head, a chunk of rows at a time, so the largest logits tensor
ever alive is ``[chunk, vocabulary]`` (about ``logits_chunk_bytes`` of float32).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import windowed_attention

# float32 bytes of one logits chunk; 1 GiB keeps a 128k-vocabulary chunk at ~2k rows, large enough
# for the LM-head matmul to run at full speed and small next to a model's weights.
DEFAULT_LOGITS_CHUNK_BYTES = 1 << 30


def rows_per_chunk(vocab_size: int, chunk_bytes: int) -> int:
    """Rows projected through the LM head at a time: about ``chunk_bytes`` of float32 logits, at least 1.

    Shared with LongCE's loss (``longce.weighted_loss``), which cuts its chunks the same way.
    """
    return max(1, chunk_bytes // (4 * vocab_size))


_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(raw * multiplier)``, ``softcap(z) = c * tanh(z / c)`` when ``softcap = c``.

    The post-processing some architectures apply to the head's raw output, in float32.
    """

    multiplier: float = 1.0
    softcap: float | None = None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        logits = raw.float()
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(frozen=True)
class CausalLMHead:
    """A causal LM split into backbone and LM head, with the logit post-processing of its architecture.

    ``logits = softcap(head(hidden) * logit_multiplier)`` where ``softcap(z) = c * tanh(z / c)``
    when ``final_logit_softcapping = c`` is set (Gemma 2/3), and ``logit_multiplier`` covers
    Cohere's ``logit_scale`` and Granite's ``1 / logits_scaling``.
    """

    model: nn.Module  # the unwrapped ``*ForCausalLM`` module
    backbone: nn.Module  # returns ``last_hidden_state`` (final norm applied)
    head: nn.Module  # maps hidden states to logits (may be a PEFT/LoRA-wrapped Linear)
    logit_multiplier: float
    final_logit_softcapping: float | None

    @property
    def input_device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def transform(self) -> LogitTransform:
        """The architecture's post-processing of the head's raw output."""
        return LogitTransform(self.logit_multiplier, self.final_logit_softcapping)

    def logits(
        self, hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``[N, H]`` hidden states -> ``[N, V]`` float32 logits exactly as the model defines them.

        ``project`` replaces the head module's call while the head is intercepted (``intercept_head``).
        """
        # Call the module, not F.linear(weight): a LoRA-wrapped head adds its delta in forward().
        return self.transform((self.head if project is None else project)(hidden))


def _is_engine_wrapper(model: nn.Module) -> bool:
    """DDP, DataParallel, or DeepSpeed's engine (checked by module name: deepspeed need not be installed)."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return True
    return type(model).__module__.startswith("deepspeed.") and isinstance(getattr(model, "module", None), nn.Module)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the transformers model under DDP / DeepSpeed / PEFT wrappers (LoRA-style adapters stay in place)."""
    while _is_engine_wrapper(model):
        model = model.module
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        active = getattr(model, "active_peft_config", None)
        if active is not None and getattr(active, "is_prompt_learning", False):
            raise ValueError(
                f"PEFT prompt-learning adapters ({type(active).__name__}) change the model's inputs and "
                "are not supported for token scoring; merge them or use a LoRA-style adapter."
            )
        # LoRA & co. are injected into the base model's modules, so the base model computes with them.
        model = model.get_base_model()
    return model


def resolve_lm_head(model: nn.Module) -> CausalLMHead:
    """Split ``model`` into backbone and LM head, or explain why it is not a causal LM.

    Raises:
        ValueError: ``model`` has no causal language-modeling head (e.g. a bare ``LlamaModel``,
            a masked LM, an encoder-decoder, or a classifier).
    """
    base = unwrap_model(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    backbone = getattr(base, "base_model", None)
    is_causal = name.endswith(_CAUSAL_LM_SUFFIXES) and not getattr(config, "is_encoder_decoder", False)
    if head is None or backbone is None or backbone is base or not is_causal:
        raise ValueError(
            f"{name} is not a causal language model with an LM head, so it cannot score tokens. "
            "Load it with transformers.AutoModelForCausalLM.from_pretrained(...) (a *ForCausalLM class)."
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    multiplier = 1.0
    scale = getattr(base, "logit_scale", None)  # Cohere keeps it as a model attribute
    if isinstance(scale, (int, float)):
        multiplier *= float(scale)
    divisor = getattr(text_config, "logits_scaling", None)  # Granite
    if isinstance(divisor, (int, float)) and divisor:
        multiplier /= float(divisor)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return CausalLMHead(base, backbone, head, multiplier, float(softcap) if softcap else None)


def head_log_probs(
    head: CausalLMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """``log softmax(logits(hidden[rows]))[targets]``, a chunk of rows at a time.

    Args:
        hidden: ``[M, H]`` final hidden states.
        targets: ``[N]`` token ids; ``targets[r]`` is predicted by hidden row ``rows[r]``.
        rows: ``[N]`` row indices into ``hidden``; ``None`` means ``arange(M)`` (then ``N == M``).
            Rows are gathered chunk by chunk, so no ``[N, H]`` copy is made.
        project: the head's own projection while it is intercepted (see ``intercept_head``).
        on_chunk: called as ``on_chunk(done, total)`` after each chunk (progress; may raise to stop).
    Returns:
        ``[N]`` float32 log-probabilities on ``targets.device``.
    """
    vocab = getattr(head.head, "out_features", None) or head.model.config.get_text_config().vocab_size
    step = rows_per_chunk(vocab, logits_chunk_bytes)
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=targets.device)
    n_chunks = -(-targets.shape[0] // step)
    for index, start in enumerate(range(0, targets.shape[0], step)):
        end = start + step
        chunk = hidden[start:end] if rows is None else hidden[rows[start:end].to(hidden.device)]
        logits = head.logits(chunk, project)
        tgt = targets[start:end].to(logits.device)
        out[start:end] = -F.cross_entropy(logits, tgt, reduction="none").to(out.device)
        del logits
        if on_chunk is not None:
            on_chunk(index + 1, n_chunks)
    return out


@contextlib.contextmanager
def intercept_head(
    head: CausalLMHead,
    consume: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor | None],
) -> Iterator[None]:
    """Run ``consume(hidden, project)`` in place of the LM head while the model's own forward runs.

    Sharded and wrapped models (FSDP, DeepSpeed ZeRO-3, DDP) only have their parameters in place,
    and their gradient hooks armed, inside their own ``forward``; calling the backbone and the head
    separately would bypass that. So the model is called as usual, and its LM head, when reached,
    hands the final hidden states ``[B, T, H]`` to ``consume`` together with ``project`` (the head's
    real projection, for ``CausalLMHead.logits``) and returns what ``consume`` returns in place of
    the ``[B, T, V]`` logits, or an empty ``[B, T, 0]`` tensor when that is ``None``. ``consume``
    keeps what it computes (log-probs, a loss) itself; a training loss should make its stand-in
    depend on the loss (``zeros + 0 * loss``), so that DDP's search for unused parameters, which
    walks back from the forward's outputs, reaches the head and the backbone.
    """
    module = head.head
    previous = module.__dict__.get("forward")  # an instance-level forward (e.g. accelerate's hooks)
    project = module.forward

    def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        stand_in = consume(hidden, project)
        return hidden.new_zeros(*hidden.shape[:-1], 0) if stand_in is None else stand_in

    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` 0/1 mask -> ``[B, T]`` positions counted over real tokens (left padding safe)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def verify_head(head: CausalLMHead, input_ids: torch.Tensor) -> None:
    """Check once per model that backbone + head reproduce the model's own logits.

    This guards against architectures whose logit post-processing we do not know: a short probe
    (at most 16 tokens of ``input_ids``) is scored both ways and compared.
    """
    if _VERIFIED.get(head.model):
        return
    probe = input_ids[:1, :16].to(head.input_device)
    with torch.no_grad():
        reference = head.model(input_ids=probe, use_cache=False).logits[0].float().log_softmax(-1)
        hidden = head.backbone(input_ids=probe, use_cache=False).last_hidden_state[0]
        ours = head.logits(hidden).log_softmax(-1)
    dtype = head.head.weight.dtype if hasattr(head.head, "weight") else torch.float32
    # In half precision the model post-processes bf16 logits while we do it in float32. In float32
    # the two passes agree to rounding, and rounding grows with the values' scale when the passes sum
    # in another order (another thread count on a busy CPU): Gemma 3 270M's log-probabilities reach
    # about 90, and its two passes were once 1.6e-3 apart (a thread count changed between them gave
    # 3e-4 here). A post-processing step (a softcap, a scale) moves them by far more.
    finite = reference[torch.isfinite(reference)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    atol = 1e-3 + 1e-4 * scale if dtype == torch.float32 else 0.25
    diff = (reference - ours.to(reference.device)).abs().max().item()
    if not math.isfinite(diff) or diff > atol:
        raise RuntimeError(
            f"Backbone + LM head of {type(head.model).__name__} do not reproduce its own logits "
            f"(max log-prob difference {diff:.3g}); its architecture post-processes logits in a way this "
            "library does not know. Please report it to the library's maintainers, naming the model."
        )
    _VERIFIED[head.model] = True


#: The attribute ``models.precision.to_precision`` sets on an evaluator run with
#: ``evaluator_precision="tf32"``: its forward passes here turn TF32 products on.
TF32_ATTRIBUTE = "longppl_tf32_matmuls"


@contextlib.contextmanager
def tf32_matmuls(model: nn.Module) -> Iterator[None]:
    """Run the ``with`` block with TF32 matrix products and convolutions (float32 accumulation) when
    ``model`` carries :data:`TF32_ATTRIBUTE`, and put PyTorch's two switches back afterwards: the
    setting is the evaluator's, not the process's."""
    if not getattr(model, TF32_ATTRIBUTE, False):
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def token_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
    logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
    via_forward: bool = False,
    on_head_chunk: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Per-token log-probabilities of a (possibly padded) batch, in float32.

    Args:
        model: a ``*ForCausalLM`` model, optionally PEFT- or DDP-wrapped.
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (left or right); ``None`` = no padding.
            Positions are counted over real tokens, so a padded row scores exactly like the unpadded one.
        score_mask: ``[B, T]`` bool, the target positions ``i`` to score; ``None`` scores every
            ``i >= 1`` whose token and predecessor are real. Unscored positions cost no LM-head work.
        via_forward: call ``model`` itself (its LM head intercepted, see ``intercept_head``) rather
            than its backbone and head separately: needed for FSDP / DeepSpeed-wrapped models. The
            once-per-model logits probe is skipped then (the caller owns the model's wrapping).
        on_head_chunk: passed to ``head_log_probs`` as ``on_chunk`` (progress of the LM head).
    Returns:
        ``[B, T]`` float32 on the model's input device: ``lp[b, i] = log P(x[b, i] | real x[b, <i])``;
        NaN at position 0, at padding and wherever ``score_mask`` is False.
    """
    base = unwrap_model(model)
    # Window layers attend in blocks instead of under a (T, T) mask (core.attention: the same scores),
    # and a tf32 evaluator's products run on TF32 tensor cores: both for this call's passes only.
    with windowed_attention(base), tf32_matmuls(base):
        return _token_log_probs(
            model, input_ids, attention_mask, score_mask, logits_chunk_bytes, via_forward, on_head_chunk
        )


def _token_log_probs(model, input_ids, attention_mask, score_mask, logits_chunk_bytes, via_forward, on_head_chunk):
    """:func:`token_log_probs` inside its attention and precision contexts."""
    head = resolve_lm_head(model)
    device = head.input_device
    input_ids = input_ids.to(device)
    if attention_mask is not None and bool(attention_mask.all()):  # on a CPU mask: no device sync
        attention_mask = None  # no padding: lets SDPA use its causal fast path
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    if not via_forward:
        verify_head(head, input_ids if attention_mask is None else input_ids[:1, attention_mask[0].bool()])

    batch, length = input_ids.shape
    scored = torch.zeros(batch, length, dtype=torch.bool, device=device)
    scored[:, 1:] = True
    if attention_mask is not None:
        real = attention_mask.bool()
        scored[:, 1:] &= real[:, 1:] & real[:, :-1]
    if score_mask is not None:
        scored &= score_mask.to(device)

    position_ids = None if attention_mask is None else position_ids_from_mask(attention_mask)
    rows, cols = scored.nonzero(as_tuple=True)  # one host sync per batch
    out = torch.full((batch, length), float("nan"), dtype=torch.float32, device=device)

    def consume(hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if rows.numel():
            flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
            predictor_rows = rows * length + cols - 1  # hidden state at i-1 predicts token i
            targets = input_ids[rows, cols]
            out[rows, cols] = head_log_probs(
                head, flat_hidden, targets, predictor_rows, logits_chunk_bytes, project, on_head_chunk
            )

    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    # Window layers attend in blocks instead of under a (T, T) mask (models.attention): same scores.
    if via_forward:
        with intercept_head(head, consume):
            model(**inputs)
    else:
        consume(head.backbone(**inputs).last_hidden_state)
    return out
