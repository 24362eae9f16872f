"""The keyword arguments of the metric's ``compute``, declared once.

:class:`LongPPLOptions` is the one list of them: its fields give each argument's name and default,
and their metadata its type and help. The metric builds one from ``compute``'s keywords (an unknown
keyword is refused there, naming the valid ones), its ``inputs_description`` and the metric card's
inputs table are rendered from it (``tests/test_metric_card.py`` keeps the card in step), and the
Space takes its defaults from it. The values are checked where they are turned into settings
(``settings``) by the metric, not here: this module only declares.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field, fields

from ..settings import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_EVALUATOR_PRECISION,
    DEFAULT_GAMMA,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
)

#: The help of ``predictions``, the metric's one feature (``evaluate`` passes it apart from the options).
PREDICTIONS_HELP = (
    "the texts to score (long documents; each needs more than `trunc_len` evaluator tokens to have key tokens). "
    "A bare string is refused (it would be scored character by character): pass one text as `[text]`."
)


def _option(default, kind: str, help: str, shown=None):
    """A field of :class:`LongPPLOptions`: ``kind`` is the type as the docs write it; ``shown`` the
    default the docs give where the field's own is ``None`` only to tell "not passed" apart."""
    return field(default=default, metadata={"type": kind, "help": help, "shown": shown})


@dataclass(frozen=True)
class LongPPLOptions:
    """The metric's keyword arguments besides ``predictions``, as passed (not yet checked).

    A field left at ``None`` where the docs give a default (``trunc_len``, ``sliding_window``,
    ``max_tokens_per_batch``, ``add_special_tokens``) was not passed: the metric then applies the
    default of ``settings``, or, for K and d, a key-token cache's own. ``torch_compile`` left at
    ``None`` compiles only an fp8 evaluator (``settings.evaluator_compiles``).
    """

    model_id: object = _option(
        None,
        "`str`",
        "Hub id, local path, `*.gguf` file or short name (`smollm2-135m`, `gemma-3-270m`: real models from the package registry) of the evaluated causal LM. Or pass `model` and `tokenizer` objects (a PEFT-wrapped model works too). Checked before anything is loaded: a path must exist, and while offline (`HF_HUB_OFFLINE=1`) a Hub id must be in the local cache.",
    )
    evaluator_model_id: object = _option(
        None,
        "`str`",
        "Hub id, local path, `*.gguf` file or short name (`gemma-3-270m`) of the evaluator. Or pass `evaluator_model` and `evaluator_tokenizer`. Required unless `self_evaluation=True` or `key_tokens` holds every text.",
    )
    model: object = _option(
        None,
        "model object",
        "the evaluated causal LM as an object (a PEFT-wrapped one works too), with `tokenizer`; instead of `model_id`.",
    )
    tokenizer: object = _option(None, "tokenizer object", "the tokenizer of `model`.")
    evaluator_model: object = _option(
        None, "model object", "the evaluator as an object, with `evaluator_tokenizer`; instead of `evaluator_model_id`."
    )
    evaluator_tokenizer: object = _option(None, "tokenizer object", "the tokenizer of `evaluator_model`.")
    key_tokens: object = _option(
        None,
        "`str` or `datasets.Dataset`",
        "a key-token cache (directory written by `scripts/compute_key_tokens.py` or by this argument, or a `Dataset` of it, e.g. from the Hub). Texts found in it, for the same evaluator and `trunc_len`, `sliding_window`, `evaluator_add_special_tokens`, `window_bos`, are not scored again: when all are found the evaluator is neither loaded nor run, and alpha, beta, soft and gamma may differ from the run that built it. Missing texts are scored by the evaluator and added (a directory is created or updated atomically; a `Dataset` is only updated in memory); without an evaluator they are an error that lists them.",
    )
    self_evaluation: object = _option(
        False,
        "`bool`",
        "use the evaluated model as its own evaluator (the paper's ablation; uninformative as a benchmark).",
    )
    alpha: object = _option(
        DEFAULT_ALPHA,
        "`float`",
        "LSD threshold; key iff LSD > alpha.",
    )
    beta: object = _option(
        DEFAULT_BETA,
        "`float`",
        "LCL threshold; key iff LCL > beta.",
    )
    use_lcl: object = _option(
        True,
        "`bool`",
        "False drops the LCL condition (paper ablation).",
    )
    soft: object = _option(
        False,
        "`bool`",
        "weight every token by min(exp(LSD), gamma) instead of the hard rule (paper Table 2); `n_key_tokens` then holds the total weight.",
    )
    gamma: object = _option(
        DEFAULT_GAMMA,
        "`float`",
        "cap of the soft weights.",
    )
    trunc_len: object = _option(
        None,
        "`int`",
        "K, the short-context length. With `key_tokens` and K or d not passed, a cache whose rows hold one setting gives its own (see `settings` in the output).",
        shown=DEFAULT_TRUNC_LEN,
    )
    sliding_window: object = _option(
        None,
        "`int`",
        "d, how many tokens share one short context.",
        shown=DEFAULT_SLIDING_WINDOW,
    )
    max_length: object = _option(
        None,
        "`int`",
        "keep only the first `max_length` *evaluator* tokens of each text (special tokens not counted), as `scripts/compute_key_tokens.py --max-length` does. Counted in evaluator tokens because K, d and the key tokens are, and because the cut text is then the same whatever model is evaluated: models with different tokenizers are compared on the same text, and a key-token cache built with `--max-length N` serves `max_length=N`. It needs the evaluator's tokenizer: with `key_tokens` and no evaluator, pass `evaluator_model_id` too (the evaluator itself is loaded only for texts the cache lacks). The official script cuts by the evaluated model's tokens instead; to reproduce it exactly, cut the texts yourself.",
    )
    max_tokens_per_batch: object = _option(
        None,
        "`int`",
        "token budget of one forward pass; short windows and short documents are packed up to it. Results do not depend on it.",
        shown=DEFAULT_MAX_TOKENS_PER_BATCH,
    )
    batch_size: object = _option(
        None,
        "`int`",
        "the name `evaluate`'s `perplexity` metric uses (texts per forward pass). Forward passes are packed by tokens here, so it sets the token budget to `max_tokens_per_batch = batch_size * (trunc_len + sliding_window)`: `batch_size` full short windows per pass. Pass it or `max_tokens_per_batch`, not both.",
    )
    device: object = _option(
        None,
        "`str`",
        'where models given by id are loaded: "cuda", "cuda:1", "cpu", "mps", "auto" (shard over GPUs). Default: a GPU if available. A device that is not one, or that is not available here, is refused. Model objects stay where they are.',
    )
    torch_dtype: object = _option(
        None,
        "`str` or `torch.dtype`",
        "dtype of models given by id; default bfloat16 on GPU, float32 on CPU.",
    )
    dtype: object = _option(
        None,
        "`str` or `torch.dtype`",
        "transformers 5's name of `torch_dtype`; pass either (both, with different values, is an error).",
    )
    evaluator_precision: object = _option(
        DEFAULT_EVALUATOR_PRECISION,
        "`str`",
        '"bf16": the evaluator as loaded (`dtype`, bfloat16 on a GPU), the exact reference. "tf32": the evaluator loaded in float32 (unless `dtype` says float32 already) with its matrix products on TF32 tensor cores and float32 accumulation during its passes: the key tokens of a float32 evaluator (Jaccard 0.997 with float32 on Gemma 3 270M at 32k tokens; bf16: 0.87) at 1.4–1.8× the time of bf16; needs `evaluator_model_id` and a CUDA GPU. "fp8": the Linear layers of its transformer blocks in float8 (torchao\'s dynamic float8 with per-row scales; `pip install "longppl-hf[fp8]"`), compiled unless `torch_compile=False`: faster (0.69–0.75× the time of compiled bf16 on an H100) and approximate: on a trained evaluator about 1 key token in 10 differed from bf16 (tokens near a threshold flip; docs/benchmarks.md). Needs `evaluator_model_id` and a CUDA GPU of compute capability 8.9 or newer (L4, H100...); a key-token cache keeps fp8 rows apart from bf16 rows.',
    )
    aggregation: object = _option(
        DEFAULT_AGGREGATION,
        "`str`",
        "; ".join(f'"{name}" = {words}' for name, words in AGGREGATIONS.items()) + ".",
    )
    add_special_tokens: object = _option(
        None,
        "`bool`",
        "tokenize for the evaluated model with its special tokens (the official code does not).",
        shown=False,
    )
    add_start_token: object = _option(
        None,
        "`bool`",
        "`evaluate`'s `perplexity` name: True puts the evaluated model's BOS token (`tokenizer.bos_token_id`) before each text, tokenized without special tokens, exactly as the `perplexity` metric does, so that the first token of the text is scored too; this works for tokenizers that have a BOS but do not add it (GPT-2, Qwen). Note the defaults differ: the `perplexity` metric adds it, LongPPL does not (default False), because the official LongPPL code does not and the paper's values are computed so; the text's first token is then not scored, which changes PPL slightly and LongPPL not at all (a first token has no context, so it is never a key token). Not together with `add_special_tokens=True`.",
    )
    evaluator_add_special_tokens: object = _option(
        True,
        "`bool`",
        "tokenize for the evaluator with its special tokens (official behaviour).",
    )
    window_bos: object = _option(
        False,
        "`bool`",
        "opt-in: put the evaluator's BOS at the head of every short window (the official code does not).",
    )
    torch_compile: object = _option(
        None,
        "`bool`",
        "compile the models' transformer blocks while scoring (10-20% faster on GPU after a one-off compilation of 10-20 s; worth it for corpora). Unset: only an fp8 evaluator's (`evaluator_precision=\"fp8\"`); False turns that off too.",
    )
    progress: object = _option(
        True,
        "`bool`",
        "show progress bars (per text; inside a text of more than 32768 tokens also per batch of short windows, per decoder layer and per LM-head chunk).",
    )
    progress_callback: object = _option(
        None,
        "`callable`",
        "called as `progress_callback(desc, done, total)` after every step of scoring (texts, batches of windows, decoder layers, LM-head chunks), whether bars are shown or not. An exception it raises stops scoring and propagates out of `compute` (e.g. to enforce a time limit).",
    )
    return_key_spans: object = _option(
        False,
        "`bool`",
        "also return `key_spans`, to see which tokens are key (hard rule only).",
    )
    return_evaluator_scores: object = _option(
        False,
        "`bool`",
        "also return `evaluator_scores`, the evaluator's view of each text, to show its LSD and LCL token by token (the Space does).",
    )

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> LongPPLOptions:
        """The options of ``compute``'s keywords; ``ValueError`` naming an unknown one and the valid names."""
        names = option_names()
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(
                f"LongPPL got unknown argument(s) {', '.join(unknown)}; it takes predictions and {', '.join(names)}."
            )
        return cls(**kwargs)


def option_names() -> tuple[str, ...]:
    """The names of the metric's keyword arguments besides ``predictions``, in the docs' order."""
    return tuple(f.name for f in fields(LongPPLOptions))


def default_of(name: str):
    """The default of option ``name`` as it applies: the field's own, or, where that is ``None`` only to
    tell "not passed" apart, the settings' default it stands for (K, d, the token budget). The Space's
    inputs start from these."""
    option = {f.name: f for f in fields(LongPPLOptions)}[name]
    shown = option.metadata["shown"]
    return option.default if shown is None else shown


def _shown_default(option) -> str | None:
    """The default as the docs write it, ``None`` for an optional argument without one."""
    value = default_of(option.name)
    if value is None:
        return None
    return f'"{value}"' if isinstance(value, str) else str(value)


def _rows():
    """``(name, type, default or None, help)`` of ``predictions`` and every option."""
    yield "predictions", "`list` of `str`", None, PREDICTIONS_HELP
    for option in fields(LongPPLOptions):
        yield option.name, option.metadata["type"], _shown_default(option), option.metadata["help"]


def options_description(indent: str = "    ", width: int = 100) -> str:
    """The ``Args:`` entries of the metric's ``inputs_description``: ``name (type, default X): help``."""
    lines = []
    for name, kind, default, help in _rows():
        kind = kind if name == "predictions" else f"{kind}, default {default}" if default else f"{kind}, optional"
        lines += textwrap.wrap(
            f"{name} ({kind}): {help}",
            width=width,
            initial_indent=indent,
            subsequent_indent=indent * 2,
            break_on_hyphens=False,
            break_long_words=False,
        )
    return "\n".join(lines)


def options_table() -> str:
    """The metric card's inputs table (Markdown): argument, type, default, meaning."""
    lines = ["| argument | type | default | meaning |", "|---|---|---|---|"]
    for name, kind, default, help in _rows():
        cells = [f"`{name}`", kind, f"`{default}`" if default else "", help]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)
