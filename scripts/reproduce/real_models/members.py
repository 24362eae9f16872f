"""The population's members, built from the real models (docs/reproduction.md, "LongPPL on real
models — analysis plan", Population).

- **Windowed Gemma** (:func:`limit_full_attention`): Gemma 3 interleaves sliding-window layers
  (``config.sliding_window`` tokens, 512 in the 270M model) with full-attention layers
  (``config.layer_types``). A member of window ``w`` keeps every layer's RoPE and weights and
  limits the full-attention layers to the last ``w`` positions (and the sliding layers to
  ``min(sliding_window, w)``): at position ``t`` no layer reads a token before ``t - w + 1``, so
  nothing more than ``w - 1`` tokens back reaches the prediction. Changing ``layer_types`` to
  ``sliding_attention`` instead would also switch those layers to the local RoPE base (10^4 instead
  of 10^6): another model, not a windowed one.
  Through the depth of the network a token still reaches further: each layer reads ``w`` back
  from where the layer below had gathered, so the reach is at most ``sum over layers of (window
  - 1)``, about ``15 * 511 + 3 * (w - 1)`` tokens in Gemma 3 270M (15 sliding layers of 512, 3 full
  layers). The order of the members by ``w`` is still known (a wider window only adds paths).
- **Context-limited Gemma** (:func:`context_limited_log_probs`, :func:`truncated_case`): the strict
  form, which really cannot see beyond ``w``: every prediction reads at most the last ``w`` tokens
  (LongPPL and PPL from windows of ``w``, task prompts cut to their last ``w - max_new_tokens``).
- **RoPE-scaled Gemma** (:func:`gemma_rope_scaled`): the full-attention layers' RoPE scaled by PI
  (``linear``) or YaRN beyond the 32k it was trained at; the sliding layers (their own base) are
  left as they are, as Gemma 3's own long-context versions do.
- **Extended SmolLM2** (``longce.context_extension.apply_context_extension``): PI / NTK-aware / YaRN
  from its 8k to 16k or 32k, then fine-tuned (the ``finetune`` phase, not built yet) or not.
"""

from __future__ import annotations

import dataclasses
import math

# the config attribute that marks a windowed member (kept in its config.json, so a saved member
# reloads windowed once this module is imported)
FULL_WINDOW = "longppl_full_attention_window"

GEMMA = "gemma-3-270m"
SMOLLM2 = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class MemberSpec:
    """One member of the population.

    ``kind``: ``window`` (Gemma, every layer's attention limited to ``window`` tokens),
    ``context`` (Gemma, every prediction reading at most ``context`` tokens), ``rope`` (Gemma, RoPE
    of the full layers scaled by ``method`` x ``factor``, with ``window`` too) or ``extend``
    (SmolLM2 extended by ``method`` x ``factor``, fine-tuned ``steps`` steps at ``length`` tokens
    with data order ``seed``; ``trained`` once its fine-tuned folder, whose config holds the
    extension, is what loads). ``cluster``: its configuration cluster.
    """

    name: str
    base: str
    kind: str
    cluster: str
    window: int | None = None
    method: str | None = None
    factor: float | None = None
    steps: int = 0
    length: int | None = None
    seed: int = 0
    context: int | None = None

    @property
    def needs_training(self) -> bool:
        return self.steps > 0


WINDOWS = (1024, 2048, 4096, 8192, 16384, 32768)
FULL = 32768
SMOLLM2_EXTENSIONS = (("pi", 2.0), ("ntk", 2.0), ("yarn", 2.0), ("pi", 4.0), ("ntk", 4.0), ("yarn", 4.0))
SMOLLM2_STEPS = ((0, 0), (50, 0), (50, 1), (200, 0), (200, 1))


def _factor_name(factor: float) -> str:
    return f"{factor:g}".replace(".", "p")


def _gemma_cluster(w: int) -> list[MemberSpec]:
    cluster = f"gemma-w{w // 1024}k"
    if w >= FULL:  # the model as released, and its RoPE scaled beyond its training
        return [
            MemberSpec(cluster, GEMMA, "window", cluster, w),
            MemberSpec(f"{cluster}-linear2", GEMMA, "rope", cluster, w, "linear", 2.0),
            MemberSpec(f"{cluster}-linear4", GEMMA, "rope", cluster, w, "linear", 4.0),
            MemberSpec(f"{cluster}-yarn4", GEMMA, "rope", cluster, w, "yarn", 4.0),
        ]
    return [
        MemberSpec(cluster, GEMMA, "window", cluster, w),
        MemberSpec(f"gemma-c{w // 1024}k", GEMMA, "context", cluster, context=w),
        MemberSpec(f"{cluster}-linear2", GEMMA, "rope", cluster, w, "linear", 2.0),
        MemberSpec(f"{cluster}-yarn4", GEMMA, "rope", cluster, w, "yarn", 4.0),
    ]


def population() -> list[MemberSpec]:
    """The plan's members: 24 Gemma members in 6 window clusters (per window below 32k: attention
    limited to it, context limited to it, and the attention-limited model with PI x2 and with YaRN x4
    on the full layers; at 32k the released model with PI x2, PI x4 and YaRN x4) and 30 SmolLM2
    members in 6 extension clusters (PI / NTK / YaRN at x2 and x4, each at 0, 50 and 200 fine-tuning
    steps, two data orders for the trained ones): 54 members in 12 clusters."""
    members = [m for w in WINDOWS for m in _gemma_cluster(w)]
    for method, factor in SMOLLM2_EXTENSIONS:
        cluster = f"smollm2-{method}{_factor_name(factor)}"
        length = int(8192 * factor)
        for steps, seed in SMOLLM2_STEPS:
            suffix = f"-s{steps}" + (f"-r{seed + 1}" if seed else "")
            members.append(
                MemberSpec(cluster + suffix, SMOLLM2, "extend", cluster, None, method, factor, steps, length, seed)
            )
    return members


# ------------------------------------------------------------------ windowed Gemma


def _install_window_masks() -> None:
    """Let a Gemma 3 text model whose config carries ``FULL_WINDOW`` limit its full-attention mask to
    that window. Gemma3TextModel.forward builds the full layers' mask with its module's
    ``create_causal_mask``; the wrapper adds the window as an ``and_mask_function``, so the mask keeps
    the full layers' own key-value length when a cache is used (generation), and every other config
    is left alone."""
    from transformers import masking_utils
    from transformers.models.gemma3 import modeling_gemma3

    if getattr(modeling_gemma3.create_causal_mask, "_longppl_windowed", False):
        return
    original = modeling_gemma3.create_causal_mask

    def create_causal_mask(config, *args, **kwargs):
        window = getattr(config, FULL_WINDOW, None)
        if window is not None:
            limit = masking_utils.sliding_window_overlay(int(window))
            given = kwargs.get("and_mask_function")
            kwargs["and_mask_function"] = limit if given is None else masking_utils.and_masks(given, limit)
        return original(config, *args, **kwargs)

    create_causal_mask._longppl_windowed = True
    modeling_gemma3.create_causal_mask = create_causal_mask


def limit_full_attention(model, window: int):
    """Limit ``model`` (a Gemma 3 causal LM, in place) to attention windows of ``window`` tokens:
    every full-attention layer reads positions ``t - window + 1 .. t`` only, and the sliding layers
    ``min(sliding_window, window)``. ``window`` at or above the model's positions leaves it as it
    was. Returns the model.

    Raises:
        ValueError: not a Gemma 3 text model, or ``window`` below 1.
    """
    config = model.config.get_text_config()
    if getattr(config, "model_type", "") != "gemma3_text" or not hasattr(config, "layer_types"):
        raise ValueError(
            f"limit_full_attention needs a Gemma 3 text model, got model_type {getattr(config, 'model_type', None)!r}."
        )
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a whole number of tokens >= 1, got {window!r}.")
    _install_window_masks()
    if window >= config.max_position_embeddings:
        setattr(config, FULL_WINDOW, None)
        return model
    setattr(config, FULL_WINDOW, window)
    config.sliding_window = min(config.sliding_window, window)
    for layer, kind in zip(model.model.layers, config.layer_types):
        # flash-attention reads the window from the module, not from the mask
        layer.self_attn.sliding_window = window if kind == "full_attention" else config.sliding_window
    return model


def gemma_rope_scaled(config, method: str, factor: float):
    """``config`` (a Gemma 3 text config, edited in place) with its full-attention layers' RoPE
    scaled by ``method`` (``linear``: position interpolation; ``yarn``) and ``factor``; the sliding
    layers keep theirs. ``max_position_embeddings`` grows by ``factor``. Returns the config."""
    if method not in ("linear", "yarn"):
        raise ValueError(f"method must be 'linear' or 'yarn' for Gemma's RoPE, got {method!r}.")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
        raise ValueError(f"factor must be a number above 1, got {factor!r}.")
    full = dict(config.rope_parameters["full_attention"])
    full.update(rope_type=method, factor=float(factor))
    if method == "yarn":
        full["original_max_position_embeddings"] = int(config.max_position_embeddings)
    config.rope_parameters = {**config.rope_parameters, "full_attention": full}
    config.max_position_embeddings = int(config.max_position_embeddings * factor)
    return config


# ------------------------------------------------------------------ loading a member


def member_config(spec: MemberSpec, folder: str):
    """The config ``spec`` loads its base folder with (the extension applied), and the attention
    implementation to load with."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    attention = None
    if spec.kind == "rope":
        gemma_rope_scaled(config.get_text_config(), spec.method, spec.factor)
    elif spec.kind == "extend":
        from longce.context_extension import apply_context_extension

        text = config.get_text_config()
        if spec.method == "ntk":  # NTK-aware: an ABF whose base grows with the factor
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            theta = text.rope_parameters.get("rope_theta", 10000.0) * spec.factor ** (head_dim / (head_dim - 2))
            attention = apply_context_extension(config, "abf", rope_theta=theta)
            text.max_position_embeddings = int(text.max_position_embeddings * spec.factor)
        else:
            attention = apply_context_extension(config, spec.method, factor=spec.factor)
    return config, attention or "sdpa"


def load_member(spec: MemberSpec, folder: str, device: str = "cpu", dtype=None):
    """``spec``'s model: the base in ``folder`` (a converted named model, or a fine-tuned member's
    own folder) with its extension and window applied, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    config, attention = member_config(spec, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation=attention, dtype=dtype)
    if spec.window is not None and spec.window < FULL:  # the released model's 32k needs no limit
        limit_full_attention(model, spec.window)
    return model.to(device).eval()


# ------------------------------------------------------------------ context-limited members


def context_limited_log_probs(model, sequences, context: int, max_tokens_per_batch: int = 65536) -> list:
    """Per sequence ``[n]`` log-probs where token ``i`` is predicted from at most ``context`` tokens:
    ``log P(x_i | x_j .. x_{i-1})`` with ``i - j <= context``; NaN at 0.

    Tokens ``i < K`` (``K = context - context // 4``) read their whole prefix (``i < context``
    tokens); the others come from the metric's short windows (``windows``: K and stride ``d =
    context // 4``), which give every token between ``K`` and ``K + d - 1 = context - 1`` tokens of
    context. Args: ``sequences``: ``[n_k]`` int64 token ids each.
    """
    import torch

    from longppl.core.batching import long_context_log_probs
    from longppl.core.windows import short_context_log_probs
    from longppl.settings import WindowSettings

    stride = max(1, context // 4)
    window = WindowSettings(context - stride, stride)
    with torch.inference_mode():
        full = long_context_log_probs(model, sequences, max_tokens_per_batch)
        short = short_context_log_probs(model, sequences, window, max_tokens_per_batch=max_tokens_per_batch)
        return [torch.where(torch.isnan(s), f, s).float() for f, s in zip(full, short)]


def truncated_case(case, tokenizer, keep: int):
    """A lines or needle case whose prompt is cut to its last ``keep`` tokens (decoded back to
    text), so that a greedy answer of ``context - keep`` tokens reads at most ``context`` tokens."""
    ids = tokenizer(case.prompt, add_special_tokens=False)["input_ids"]
    if len(ids) <= keep:
        return case
    return dataclasses.replace(case, prompt=tokenizer.decode(ids[-keep:]))


def truncated_recall_case(case, context: int):
    """A passage-recall case cut on the left so that the last scored token is predicted from at
    most ``context`` tokens (the inputs stop before the last scored token)."""
    cut = max(0, len(case.input_ids) - 1 - context)
    if cut == 0:
        return case
    return dataclasses.replace(
        case,
        input_ids=tuple(case.input_ids[cut:]),
        span_start=max(0, case.span_start - cut),
        cue_start=case.cue_start - cut,
        scored_start=case.scored_start - cut,
    )
