"""The LongPPL Space: long texts in; LongPPL, PPL and the highlighted key tokens out.

evaluate's ``launch_gradio_widget`` passes only the feature columns (the texts) to ``compute``, so
it cannot take model ids or settings (and it fails on current gradio); this small Blocks UI is
ours. Nothing is loaded at start-up: the metric and both models load when "Compute" is clicked.

The Space is this folder as it is (``app.py`` beside ``longppl.py``, nothing pip-installed but
``requirements.txt``), so the metric is loaded from the file next to this one, and the UI's
defaults (K, d, alpha, beta) are read from ``settings.py`` next to it, not imported from an
installed package.

The Space is a public server, so every request is bounded (all settable by the Space's owner as
environment variables / Space secrets; see ``SpaceSettings.from_env``):

* models: only the Hub ids of ``LONGPPL_SPACE_MODELS`` (comma-separated; default
  ``DEFAULT_MODELS``, small public models). Anything else (another id, a local path) is refused
  by comparing strings, before anything is loaded or the file system is looked at; remote code is
  never trusted. Loaded models stay in memory for the next requests (the two last used).
* size: at most ``LONGPPL_SPACE_MAX_CHARS`` characters per request, ``LONGPPL_SPACE_MAX_TOKENS``
  tokens (under each model's tokenizer), K <= ``LONGPPL_SPACE_MAX_K``, and at most
  ``LONGPPL_SPACE_MAX_WINDOW_TOKENS`` tokens read by the evaluator in short windows (a small d
  multiplies the work by about ``(K + d) / d``).
* time: a request is stopped once ``LONGPPL_SPACE_TIME_LIMIT_S`` seconds have passed. The metric
  calls ``progress_callback`` after every decoder layer of every forward pass, every LM-head chunk
  and every batch of windows; the callback raises past the deadline, which ends scoring at once.
  So a request overruns by at most one such step (one layer of a pass of at most
  ``LONGPPL_SPACE_MAX_TOKENS`` tokens), plus loading a model not yet in memory.
* load: a queue running ``LONGPPL_SPACE_CONCURRENCY`` requests at a time (default 1: one request
  already uses every CPU core) and holding at most ``LONGPPL_SPACE_QUEUE_SIZE`` waiting ones.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import re
import sys
import threading
import time
import warnings

import evaluate
import gradio as gr

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_settings():
    """The metric's ``settings`` module, for its defaults: ``longppl.settings`` when this file is
    imported from the package, else ``settings.py`` beside it (the Space runs this folder as it is,
    with nothing installed; ``settings`` imports no other module of the folder)."""
    if __package__:
        return importlib.import_module(".settings", __package__)
    spec = importlib.util.spec_from_file_location("longppl_space_settings", os.path.join(HERE, "settings.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the classes
    spec.loader.exec_module(module)
    return module


_settings = _load_settings()

#: A line holding only this separates documents in the texts box.
SEPARATOR = "---"
KEY_LABEL = "key"
#: Small public models that run on a CPU Space (evaluated model first, evaluator last).
DEFAULT_MODELS = ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-360M", "Qwen/Qwen2.5-0.5B")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_RUN_IT_YOURSELF = 'To go beyond, run the metric on your own hardware: evaluate.load("<this Space\'s id>").'


def _env_int(environ, name: str, default: int, minimum: int = 1) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"The Space setting {name}={raw!r} must be an integer >= {minimum}; fix or remove it.")
    return value


def _env_float(environ, name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"The Space setting {name}={raw!r} must be a number of seconds > 0; fix or remove it.")
    return value


@dataclasses.dataclass(frozen=True)
class SpaceSettings:
    """What a request may ask of this Space (see the module docstring)."""

    # Sized for a free CPU Space (see longppl/progress.py): an 8k-token pass of a 135M model takes
    # about a minute on one core, a 0.5B evaluator's several.
    models: tuple[str, ...] = DEFAULT_MODELS
    max_chars: int = 50_000
    max_tokens: int = 8192
    max_trunc_len: int = 4096
    max_window_tokens: int = 65_536
    time_limit_s: float = 300.0
    concurrency: int = 1
    queue_size: int = 16

    @classmethod
    def from_env(cls, environ=None) -> "SpaceSettings":
        """The settings from ``LONGPPL_SPACE_*`` environment variables, defaults for those unset.

        Raises:
            ValueError: a variable is not a valid value (named in the message), or
                ``LONGPPL_SPACE_MODELS`` lists something that is not a Hub id ``owner/name``.
        """
        environ = os.environ if environ is None else environ
        models = tuple(m.strip() for m in environ.get("LONGPPL_SPACE_MODELS", "").split(",") if m.strip())
        for model in models:
            if not _HUB_ID.match(model) or ".." in model:
                raise ValueError(
                    f"LONGPPL_SPACE_MODELS lists {model!r}, which is not a Hub model id: list ids such as "
                    "Qwen/Qwen2.5-0.5B separated by commas (local paths are never served)."
                )
        defaults = cls()
        return cls(
            models=models or DEFAULT_MODELS,
            max_chars=_env_int(environ, "LONGPPL_SPACE_MAX_CHARS", defaults.max_chars),
            max_tokens=_env_int(environ, "LONGPPL_SPACE_MAX_TOKENS", defaults.max_tokens, minimum=2),
            max_trunc_len=_env_int(environ, "LONGPPL_SPACE_MAX_K", defaults.max_trunc_len),
            max_window_tokens=_env_int(environ, "LONGPPL_SPACE_MAX_WINDOW_TOKENS", defaults.max_window_tokens),
            time_limit_s=_env_float(environ, "LONGPPL_SPACE_TIME_LIMIT_S", defaults.time_limit_s),
            concurrency=_env_int(environ, "LONGPPL_SPACE_CONCURRENCY", defaults.concurrency),
            queue_size=_env_int(environ, "LONGPPL_SPACE_QUEUE_SIZE", defaults.queue_size),
        )


SETTINGS = SpaceSettings.from_env()


class TimeLimitExceeded(Exception):
    """Raised from the metric's progress callback once a request's deadline has passed."""


# One metric object per worker thread: an evaluate metric buffers its texts in its own state,
# so two concurrent requests must not share one.
_metrics = threading.local()


def load_metric():
    """The LongPPL metric from ``longppl.py`` beside this file, loaded once per thread, on first use."""
    if getattr(_metrics, "metric", None) is None:
        # The file itself, not the folder: evaluate loads a folder only if it is named longppl,
        # and a Space's folder is not.
        _metrics.metric = evaluate.load(os.path.join(HERE, "longppl.py"))
    return _metrics.metric


@functools.lru_cache(maxsize=2)
def load_model(model_id: str):
    """``(model, tokenizer)`` of an allow-listed Hub id, kept in memory for the next requests.

    Only ``score`` calls it, after checking ``model_id`` against ``SETTINGS.models``; remote code
    is never run, and an id that is also a folder beside the server is refused.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(model_id):  # an owner's id that would resolve to a local folder, not the Hub
        raise gr.Error(f"The Space is misconfigured: the listed model {model_id!r} is not loaded from the Hub.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, trust_remote_code=False)
    return model.to(device).eval(), tokenizer


def split_texts(raw: str | None) -> list[str]:
    """Documents of the texts box: separated by lines holding only ``---``; blank ones dropped."""
    documents, current = [], []
    for line in (raw or "").splitlines(keepends=True):
        if line.strip() == SEPARATOR:
            documents.append("".join(current))
            current = []
        else:
            current.append(line)
    documents.append("".join(current))
    return [doc.strip("\n") for doc in documents if doc.strip()]


def highlight(texts: list[str], key_spans: list[list[list[int]]]) -> list[tuple[str, str | None]]:
    """``HighlightedText`` segments: each text cut at its key spans, key pieces labelled ``"key"``."""
    segments: list[tuple[str, str | None]] = []
    for index, (text, spans) in enumerate(zip(texts, key_spans)):
        if index:
            segments.append((f"\n\n{SEPARATOR}\n\n", None))
        position = 0
        for start, end in spans:
            if start > position:
                segments.append((text[position:start], None))
            segments.append((text[start:end], KEY_LABEL))
            position = end
        if position < len(text):
            segments.append((text[position:], None))
    return segments


def _number(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)  # an empty box rather than "NaN"


def summary(result: dict) -> str:
    """A Markdown table: LongPPL, PPL, key tokens and tokens of each text."""
    rows = ["| text | LongPPL | PPL | key tokens | tokens |", "|---:|---:|---:|---:|---:|"]
    for index, values in enumerate(
        zip(result["longppls"], result["perplexities"], result["n_key_tokens"], result["n_tokens"]), 1
    ):
        longppl, ppl, n_key, n_tokens = values
        rows.append(f"| {index} | {longppl:.3f} | {ppl:.3f} | {n_key} | {n_tokens} |")
    return "\n".join(rows)


def _allowed_model(value, role: str, settings: SpaceSettings) -> str:
    """``value`` if it is one of the Space's models; refused otherwise (never looked up, never echoed)."""
    if isinstance(value, str) and value.strip() in settings.models:
        return value.strip()
    raise gr.Error(
        f"The {role} must be one of the models this Space offers: {', '.join(settings.models)}. " + _RUN_IT_YOURSELF
    )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def short_window_tokens(n_tokens: int, trunc_len: int, sliding_window: int) -> int:
    """Tokens the evaluator reads in the short windows of an ``n_tokens`` document (the first window,
    taken from the long pass, not counted): windows ``[s, min(s+K+d, n))`` for ``s = d, 2d, ...``
    while ``s + K < n`` (see ``windows.py``)."""
    return sum(
        min(s + trunc_len + sliding_window, n_tokens) - s
        for s in range(sliding_window, max(n_tokens - trunc_len, 0), sliding_window)
    )


def _check_size(texts, trunc_len, sliding_window, tokenizers, settings: SpaceSettings) -> None:
    """Refuse a request over the Space's character, token, K or short-window limits."""
    if isinstance(trunc_len, (int, float)) and trunc_len > settings.max_trunc_len:
        raise gr.Error(
            f"K = {trunc_len:g} is more than this Space allows ({settings.max_trunc_len}); "
            f"use K <= {settings.max_trunc_len}. " + _RUN_IT_YOURSELF
        )
    for role, tokenizer, special in tokenizers:
        n_tokens = [len(tokenizer(text, add_special_tokens=special)["input_ids"]) for text in texts]
        if sum(n_tokens) > settings.max_tokens:
            raise gr.Error(
                f"The texts have {sum(n_tokens)} tokens for the {role}, more than this Space scores per request "
                f"({settings.max_tokens}); score shorter texts. " + _RUN_IT_YOURSELF
            )
        if role == "evaluator model" and _is_count(trunc_len) and _is_count(sliding_window):
            windows = sum(short_window_tokens(n, trunc_len, sliding_window) for n in n_tokens)
            if windows > settings.max_window_tokens:
                raise gr.Error(
                    f"With K = {trunc_len} and d = {sliding_window} the evaluator would read {windows} tokens in "
                    f"short windows, more than this Space allows ({settings.max_window_tokens}); use a larger d "
                    "(sliding window) or shorter texts. " + _RUN_IT_YOURSELF
                )


def score(raw_texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta, progress=gr.Progress()):
    """The "Compute" button: ``(LongPPL, PPL, highlighted key tokens, per-text table)``.

    Bad input, a request over the Space's limits (``SETTINGS``) and the metric's own
    ``ValueError`` are shown in the UI as a ``gr.Error``; the metric's warnings (e.g. a text too
    short to have key tokens) as ``gr.Warning``. ``progress``: gradio's progress bar.
    """
    settings = SETTINGS
    deadline = time.monotonic() + settings.time_limit_s
    if len(raw_texts or "") > settings.max_chars:
        raise gr.Error(
            f"The texts have {len(raw_texts)} characters, more than this Space scores per request "
            f"({settings.max_chars}); score shorter texts. " + _RUN_IT_YOURSELF
        )
    texts = split_texts(raw_texts)
    if not texts:
        raise gr.Error(f"Paste at least one long text (separate several with a line holding only {SEPARATOR}).")
    model_id = _allowed_model(model_id, "evaluated model", settings)
    evaluator_model_id = _allowed_model(evaluator_model_id, "evaluator model", settings)
    model, tokenizer = load_model(model_id)
    evaluator, evaluator_tokenizer = load_model(evaluator_model_id)
    tokenizers = [("evaluator model", evaluator_tokenizer, True), ("evaluated model", tokenizer, False)]
    _check_size(texts, trunc_len, sliding_window, tokenizers, settings)

    def on_progress(desc: str, done: int, total: int) -> None:
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(desc)
        progress((done, total), desc=desc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = load_metric().compute(
                predictions=texts,
                model=model,
                tokenizer=tokenizer,
                evaluator_model=evaluator,
                evaluator_tokenizer=evaluator_tokenizer,
                trunc_len=trunc_len,
                sliding_window=sliding_window,
                alpha=alpha,
                beta=beta,
                return_key_spans=True,
                progress=False,
                progress_callback=on_progress,
            )
        except ValueError as err:
            raise gr.Error(str(err)) from err
        except TimeLimitExceeded as err:
            raise gr.Error(
                f"This request took longer than this Space allows ({settings.time_limit_s:g} s) and was stopped "
                f"during: {err}. Score shorter texts, with a larger d or a smaller K. " + _RUN_IT_YOURSELF
            ) from err
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            gr.Warning(str(warning.message))
    return (
        _number(result["longppl"]),
        _number(result["ppl"]),
        highlight(texts, result["key_spans"]),
        summary(result),
    )


def build_demo(settings: SpaceSettings | None = None) -> gr.Blocks:
    """The Space's UI with its request queue (builds components only: no model or metric is loaded)."""
    settings = settings or SETTINGS
    with gr.Blocks(title="LongPPL") as demo:
        gr.Markdown(
            "# LongPPL\n"
            "Perplexity over the **key tokens** of long texts: the tokens an evaluator model predicts much "
            "better with the full context than with only the last K tokens (Fang et al., ICLR 2025). "
            "Texts need more than K evaluator tokens.\n\n"
            f"This Space runs small models only, on at most {settings.max_chars} characters and "
            f"{settings.max_tokens} tokens per request, K <= {settings.max_trunc_len}, for at most "
            f"{settings.time_limit_s:g} s. For 7-8B models (the paper's evaluator is Llama-3.1-8B) and "
            "long documents, run the metric on a GPU of your own."
        )
        texts = gr.Textbox(
            label=f"Texts (separate documents with a line holding only {SEPARATOR})",
            lines=12,
            max_lines=30,
            max_length=settings.max_chars,
        )
        with gr.Row():
            model_id = gr.Dropdown(
                label="Evaluated model (Hub id)",
                choices=list(settings.models),
                value=settings.models[0],
                allow_custom_value=False,
            )
            evaluator_model_id = gr.Dropdown(
                label="Evaluator model (Hub id)",
                choices=list(settings.models),
                value=settings.models[-1],
                allow_custom_value=False,
            )
        with gr.Row():
            trunc_len = gr.Number(
                label="K (short-context length)",
                value=min(_settings.DEFAULT_TRUNC_LEN, settings.max_trunc_len),
                precision=0,
                minimum=1,
                maximum=settings.max_trunc_len,
            )
            sliding_window = gr.Number(
                label="d (sliding window)", value=_settings.DEFAULT_SLIDING_WINDOW, precision=0, minimum=1
            )
            alpha = gr.Number(label="alpha (LSD threshold)", value=_settings.DEFAULT_ALPHA)
            beta = gr.Number(label="beta (LCL threshold)", value=_settings.DEFAULT_BETA)
        button = gr.Button("Compute", variant="primary")
        with gr.Row():
            longppl = gr.Number(label="LongPPL")
            ppl = gr.Number(label="PPL")
        key_tokens = gr.HighlightedText(label="Key tokens", color_map={KEY_LABEL: "#f97316"}, combine_adjacent=True)
        per_text = gr.Markdown()
        button.click(
            score,
            inputs=[texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta],
            outputs=[longppl, ppl, key_tokens, per_text],
        )
    # One request at a time by default: a forward pass already uses every core of a CPU Space.
    demo.queue(default_concurrency_limit=settings.concurrency, max_size=settings.queue_size)
    return demo


demo = build_demo()

if __name__ == "__main__":
    demo.launch()
