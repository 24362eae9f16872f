"""The LongPPL Space: long texts in; LongPPL, PPL and the highlighted key tokens out.

evaluate's ``launch_gradio_widget`` passes only the feature columns (the texts) to ``compute``, so
it cannot take model ids or settings (and it fails on current gradio); this small Blocks UI is
ours. Nothing is loaded at start-up: the metric and both models load when "Compute" is clicked.

The Space runs the installed ``longppl`` package: its ``requirements.txt`` installs the package, and
its ``app.py`` is a thin shell that imports this module's ``demo``. The metric is loaded from the
package's metric file (``longppl.METRIC_PATH``), the same file ``evaluate.load`` takes from the Space.

Every failure reaches the page as a ``gr.Error`` that says what failed and what to try, in the
UI's words (the fields' labels, K and d, texts numbered from 1 as ``longppl visualize --document``
numbers them): bad input (an empty field, a K out of range), a request over the limits below, a
model that cannot be loaded (Hub unreachable, gated or missing model, out of memory) and anything
unexpected. "Compute" clears the previous results and closes the previous messages first (messages
stay until closed), so a message never stands over the results of another request.
Messages about a limit end with how to run the metric elsewhere, by this Space's id where
``SPACE_ID`` gives it (``run_it_yourself``). The Hub is asked once, with a short timeout
(``LONGPPL_SPACE_HUB_TIMEOUT_S``), whether a model is there before it is loaded, so an outage fails
in seconds rather than after a minute of retries.

The Space is a public server, so every request is bounded (all settable by the Space's owner as
environment variables / Space secrets; see ``SpaceSettings.from_env``):

* models: only the Hub ids of ``LONGPPL_SPACE_MODELS`` (comma-separated; default
  ``DEFAULT_MODELS``, small public models), or the short names of the real models that registry
  packages ship (``gemma-3-270m``, ``smollm2-135m``: the ``models`` extra; no Hub needed). Anything else (another id, a local path) is refused
  by comparing strings, before anything is loaded or the file system is looked at; remote code is
  never trusted. Loaded models stay in memory for the next requests (the two last used). For
  tests only, ``LONGPPL_SPACE_LOCAL_MODELS=1`` lets the list name absolute paths of model folders
  too (a visitor still picks only among the listed entries).
* size: at most ``LONGPPL_SPACE_MAX_CHARS`` characters per request (a longer paste is refused, not
  cut: the texts box has no maximum length of its own), ``LONGPPL_SPACE_MAX_TOKENS`` tokens (under
  each model's tokenizer), K <= ``LONGPPL_SPACE_MAX_K``, and at most
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
import gc
import html
import json
import math
import os
import re
import threading
import time
import warnings

import evaluate
import gradio as gr

from .. import settings as _settings
from ..metric import options as _options
from ..models import sources as _sources
from ..models.named import NAMED_MODELS, named_model
from ..models.named import resolve as resolve_named
from ..views import key_token_html as _views

HERE = os.path.dirname(os.path.abspath(__file__))


#: The metric file (``longppl.py``), the thin shell that the Space serves to ``evaluate.load``.
METRIC_FILE = os.path.join(os.path.dirname(HERE), "longppl.py")

#: A line holding only this separates documents in the texts box.
SEPARATOR = "---"
#: The example texts offered under the texts box (public-domain excerpts; see the file's "about").
EXAMPLES_FILE = os.path.join(HERE, "space_examples.json")
#: Small public models that run on a CPU Space (evaluated model first, evaluator last).
DEFAULT_MODELS = ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-360M", "Qwen/Qwen2.5-0.5B")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _is_owner_name(name: str) -> bool:
    """Whether ``name`` is a Hub id of the form ``owner/name`` (no ``..``, so never a path upwards)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


#: The fields' labels, as the page shows them and the messages name them.
K_LABEL, D_LABEL = "K (short-context length)", "d (sliding window)"
ALPHA_LABEL, BETA_LABEL = "alpha (LSD threshold)", "beta (LCL threshold)"


def run_it_yourself(environ=None) -> str:
    """The sentence that ends a message about a limit of this Space: how to run the metric on one's own
    hardware. It loads this Space by its id where the Space knows it (Hugging Face sets ``SPACE_ID``,
    ``owner/name``, in a Space's environment), else by the bare name, as the README does."""
    environ = os.environ if environ is None else environ
    space_id = environ.get("SPACE_ID", "").strip()
    if _is_owner_name(space_id):
        load = f'evaluate.load("{space_id}")'
    else:
        load = 'import longppl, then evaluate.load("longppl")'
    return f"To go beyond, run the metric on your own hardware: pip install longppl-hf, then {load}."


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


def _env_bool(environ, name: str) -> bool:
    raw = environ.get(name, "").strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise ValueError(f"The Space setting {name}={raw!r} must be 1 or 0 (true or false); fix or remove it.")
    return raw in ("1", "true")


def _check_model_entry(model: str, local_models: bool) -> None:
    """Raise a ``ValueError`` unless ``model`` is a Hub id, or (``local_models``) an absolute path of a folder."""
    if named_model(model) is not None:  # a real model shipped by a registry package (the models extra)
        return
    if local_models and os.path.isabs(model):
        if not os.path.isdir(model):
            raise ValueError(f"LONGPPL_SPACE_MODELS lists {model!r}, which is not a folder: list model folders.")
        return
    if not _is_owner_name(model):
        raise ValueError(
            f"LONGPPL_SPACE_MODELS lists {model!r}, which is not a Hub model id: list ids such as "
            f"Qwen/Qwen2.5-0.5B, or short names ({', '.join(NAMED_MODELS)}), separated by commas (local paths are "
            "served only to tests, with "
            "LONGPPL_SPACE_LOCAL_MODELS=1, and only as absolute paths)."
        )


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
    # Seconds the Hub may take to answer whether a model is there, before it is loaded.
    hub_timeout_s: float = 10.0
    # Tests only: the models may also be absolute paths of local folders (never a visitor's choice).
    local_models: bool = False

    @classmethod
    def from_env(cls, environ=None) -> "SpaceSettings":
        """The settings from ``LONGPPL_SPACE_*`` environment variables, defaults for those unset.

        Raises:
            ValueError: a variable is not a valid value (named in the message), or
                ``LONGPPL_SPACE_MODELS`` lists something that is not a Hub id ``owner/name`` (nor,
                with ``LONGPPL_SPACE_LOCAL_MODELS=1``, an absolute path of a folder).
        """
        environ = os.environ if environ is None else environ
        local_models = _env_bool(environ, "LONGPPL_SPACE_LOCAL_MODELS")
        models = tuple(m.strip() for m in environ.get("LONGPPL_SPACE_MODELS", "").split(",") if m.strip())
        for model in models:
            _check_model_entry(model, local_models)
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
            hub_timeout_s=_env_float(environ, "LONGPPL_SPACE_HUB_TIMEOUT_S", defaults.hub_timeout_s),
            local_models=local_models,
        )


SETTINGS = SpaceSettings.from_env()


class TimeLimitExceeded(Exception):
    """Raised from the metric's progress callback once a request's deadline has passed."""


# One metric object per worker thread: an evaluate metric buffers its texts in its own state,
# so two concurrent requests must not share one.
_metrics = threading.local()


def load_metric():
    """The LongPPL metric from the package's ``longppl.py``, loaded once per thread, on first use."""
    if getattr(_metrics, "metric", None) is None:
        # The file itself, not the folder: evaluate loads a folder only if it is named longppl,
        # and a Space's folder is not.
        _metrics.metric = evaluate.load(METRIC_FILE)
    return _metrics.metric


def _error(message: str) -> gr.Error:
    """A ``gr.Error`` showing ``message`` as text (gradio renders it as HTML), until closed."""
    return gr.Error(html.escape(message, quote=False), duration=None)


def _chain(err: BaseException):
    """``err`` and the exceptions it was raised from or while handling (transformers wraps the Hub's)."""
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _is_out_of_memory(err: BaseException) -> bool:
    return any(
        isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())
        for e in _chain(err)
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


_NETWORK_ERRORS = frozenset({"ConnectionError", "TimeoutError", "TransportError", "TimeoutException", "NetworkError"})


def describe_load_failure(model_id: str, err: BaseException) -> str:
    """What the page says when ``model_id`` cannot be loaded because of ``err``: what failed, why, and
    what to try (a gated or missing model, an unreachable Hub, no memory left, anything else)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    chain = _chain(err)
    if any(isinstance(e, GatedRepoError) for e in chain):
        return (
            f"{model_id} is a gated model and this Space has no access to it; pick another model (the Space's "
            "owner can accept the model's licence on the Hub and give the Space a token as its HF_TOKEN secret)."
        )
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return (
            f"{model_id} was not found on the Hub (or is private); pick another model (the Space's owner should "
            "correct LONGPPL_SPACE_MODELS)."
        )
    if _is_out_of_memory(err):
        return f"Not enough memory to load {model_id} ({_first_line(err)}); try again later, or pick a smaller model."
    status = next(
        (e.response.status_code for e in chain if isinstance(e, HfHubHTTPError) and e.response is not None), None
    )
    unreachable = isinstance(status, int) and (status >= 500 or status in (408, 429))
    # The HTTP client's connection errors and timeouts (httpx's, or requests'), by their classes' names.
    unreachable |= any(c.__name__ in _NETWORK_ERRORS for e in chain for c in type(e).__mro__)
    unreachable |= "couldn't connect" in str(err)  # transformers' message when every retry failed
    if unreachable:
        return f"Could not reach the Hub for {model_id}: {_first_line(err)}; try again later."
    return f"Could not load {model_id}: {_first_line(err)}; try again later, or pick another model."


def _check_hub(model_id: str, timeout_s: float) -> None:
    """Ask the Hub once, with a short timeout, whether ``model_id`` is there: an outage then fails in
    seconds, where ``from_pretrained`` would retry each file for a minute. Nothing to ask offline."""
    from huggingface_hub import HfApi

    if _sources.hub_offline():  # the library's reading of HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
        return
    HfApi().model_info(model_id, timeout=timeout_s)


def _free_models() -> None:
    """Drop the models kept for the next requests (after running out of memory: a retry may fit)."""
    load_model.cache_clear()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@functools.lru_cache(maxsize=2)
def load_model(model_id: str, local: bool = False, hub_timeout_s: float = SpaceSettings.hub_timeout_s):
    """``(model, tokenizer)`` of an allow-listed Hub id, kept in memory for the next requests.

    Only ``score`` calls it, after checking ``model_id`` against ``SETTINGS.models``; remote code
    is never run, and an id that is also a folder beside the server is refused. ``local``: the
    settings allow local folders (tests; ``SpaceSettings.local_models``) and ``model_id`` is an
    absolute path, loaded without the Hub.

    Raises:
        gr.Error: the model cannot be loaded; the message says why and what to try
            (``describe_load_failure``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = local and os.path.isabs(model_id)
    named = named_model(model_id) is not None
    if (
        not local and not named and os.path.exists(model_id)
    ):  # an owner's id that would resolve to a local folder, not the Hub
        raise _error(f"The Space is misconfigured: the listed model {model_id!r} is not loaded from the Hub.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        source = model_id
        if named:  # converted from the package's GGUF on first use, then loaded from that folder
            source = resolve_named(model_id, "model")
        elif not local:
            _check_hub(model_id, hub_timeout_s)
        options = dict(trust_remote_code=False, local_files_only=local or named)
        tokenizer = AutoTokenizer.from_pretrained(source, **options)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **options)
        return model.to(device).eval(), tokenizer
    except Exception as err:
        if _is_out_of_memory(err):
            _free_models()
        raise _error(describe_load_failure(model_id, err)) from err


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


def key_token_view(texts: list[str], scores, rule: _settings.KeyTokenRule, trunc_len: int) -> str:
    """The key-token view: the legend, then each text (numbered from 1, as ``longppl visualize
    --document`` numbers them) with its evaluator tokens shaded by LSD, key tokens marked and LSD / LCL
    on hover, click, tap or focus, as ``longppl-visualize``'s HTML shows them (``key_token_html``), and
    the evaluator's counts (``TokenCounts``). ``scores``: the metric's ``evaluator_scores``, one per
    text; ``rule``: the key-token rule the metric applied (its ``settings`` output)."""
    lsd_cap = _views.check_lsd_cap(None, rule.alpha)
    parts = [_views.key_token_legend(trunc_len=trunc_len, lsd_cap=lsd_cap, rule=rule)]
    for index, (text, text_scores) in enumerate(zip(texts, scores), 1):
        counts, document = _views.key_token_document(text, text_scores, trunc_len=trunc_len, lsd_cap=lsd_cap, rule=rule)
        parts.append(f"<h3>Text {index}</h3>{counts}{document}")
    return f'<div class="longppl-keys">{"".join(parts)}</div>'


def _shown(value: float, digits: int) -> str:
    return "–" if math.isnan(value) else f"{value:.{digits}f}"  # a dash rather than "nan": no key tokens


#: The per-text table's columns: each count says whose tokens it counts.
SUMMARY_COLUMNS = (
    "text",
    "LongPPL",
    "PPL",
    "key tokens (evaluated model's)",
    "tokens (evaluated model's)",
    "key tokens (evaluator's)",
    "tokens (evaluator's)",
)
#: Under the corpus values: how the texts' values make them (the metric's default aggregation).
_CORPUS_NOTE = (
    f"all texts together, as the official evaluation script combines them (aggregation="
    f"{_settings.DEFAULT_AGGREGATION}): weighted by key tokens (LongPPL) and tokens (PPL), in the log domain"
)
_SUMMARY_NOTE = (
    "LongPPL and PPL average over the evaluated model's tokens. The evaluator picks the key tokens among "
    "its own tokens (those the view below shows and counts); they reach the evaluated model's tokens "
    "through the characters they cover, so the two counts differ when the two tokenizers cut the text "
    "differently, and agree when they cut it the same way."
)


def summary(result: dict, counts: list[_views.TokenCounts]) -> str:
    """A Markdown table (``SUMMARY_COLUMNS``) of each text (numbered from 1, as in the key-token view
    and the messages): LongPPL, PPL, its key tokens and tokens in the evaluated model's tokens (the
    metric's ``n_key_tokens``, ``n_tokens``) and in the evaluator's (``counts``, as the key-token view
    counts them), with a note on why they differ."""
    rows = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---:|" * len(SUMMARY_COLUMNS)]
    for index, values in enumerate(
        zip(result["longppls"], result["perplexities"], result["n_key_tokens"], result["n_tokens"], counts), 1
    ):
        longppl, ppl, n_key, n_tokens, own = values
        rows.append(
            f"| {index} | {_shown(longppl, 3)} | {_shown(ppl, 3)} | {n_key} | {n_tokens} | {own.key} | {own.tokens} |"
        )
    return "\n".join(rows) + "\n\n" + _SUMMARY_NOTE


#: The metric's argument names -> the UI's, in the metric's messages.
_UI_NAMES = {"trunc_len": "K", "sliding_window": "d"}


def _renumber(match: re.Match) -> str:
    numbers = [str(int(n) + 1) for n in re.findall(r"\d+", match.group(1))]
    verb = match.group(2) or ""
    if len(numbers) == 1:
        return f"Text {numbers[0]}" + (" has" if verb else "")
    return f"Texts {', '.join(numbers)}{verb}"


def in_ui_terms(message: str) -> str:
    """The metric's ``message`` in the UI's words: K and d for ``trunc_len`` and ``sliding_window``,
    texts numbered from 1 (the metric counts ``predictions[0]``, ``Texts [0, 2]`` from 0)."""
    message = re.sub(r"\b(trunc_len|sliding_window)\b", lambda m: _UI_NAMES[m.group(1)], message)
    message = re.sub(r"predictions\[(\d+)\]", lambda m: f"text {int(m.group(1)) + 1}", message)
    return re.sub(r"Texts \[([\d, ]*)\]( have)?", _renumber, message)


def _check_unicode(texts: list[str]) -> None:
    """Refuse a text that cannot be encoded as UTF-8 (a lone surrogate such as U+D800, which a broken
    copy-paste can leave): the tokenizers would fail on it with a bare TypeError."""
    for index, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise _error(
                f"Text {index} holds a character that is not valid Unicode (U+{ord(text[err.start]):04X}, a lone "
                f"surrogate, at character {err.start + 1}); remove it, or copy the text again from its source."
            ) from err


def _allowed_model(value, role: str, settings: SpaceSettings) -> str:
    """``value`` if it is one of the Space's models; refused otherwise (never looked up, never echoed)."""
    if isinstance(value, str) and value.strip() in settings.models:
        return value.strip()
    raise _error(
        f"The {role} must be one of the models this Space offers: {', '.join(settings.models)}. " + run_it_yourself()
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


def field_defaults(settings: SpaceSettings) -> dict[str, float]:
    """The values the page's fields start with, by label: the metric's defaults (K at most the Space's
    largest)."""
    return {
        K_LABEL: min(_options.default_of("trunc_len"), settings.max_trunc_len),
        D_LABEL: _options.default_of("sliding_window"),
        ALPHA_LABEL: _options.default_of("alpha"),
        BETA_LABEL: _options.default_of("beta"),
    }


def _check_fields(trunc_len, sliding_window, alpha, beta, settings: SpaceSettings) -> None:
    """Refuse an empty field, a K outside this Space's range or a d below 1, naming the field by its
    label and saying what to enter. (The fields set no minimum or maximum: gradio's own range check
    would answer first, with a message that names no field.)"""
    defaults = field_defaults(settings)
    wanted = {
        K_LABEL: f"an integer from 1 to {settings.max_trunc_len}",
        D_LABEL: "an integer >= 1",
        ALPHA_LABEL: "a number",
        BETA_LABEL: "a number",
    }
    for label, value in ((K_LABEL, trunc_len), (D_LABEL, sliding_window), (ALPHA_LABEL, alpha), (BETA_LABEL, beta)):
        if value is None:
            raise _error(f"The field {label} is empty; enter {wanted[label]} (default: {defaults[label]:g}).")
    if isinstance(trunc_len, (int, float)) and not 1 <= trunc_len <= settings.max_trunc_len:
        raise _error(
            f"{K_LABEL} is {trunc_len:g}, outside this Space's range of 1 to {settings.max_trunc_len}; enter "
            f"{wanted[K_LABEL]}." + (" " + run_it_yourself() if trunc_len > settings.max_trunc_len else "")
        )
    if isinstance(sliding_window, (int, float)) and sliding_window < 1:
        raise _error(f"{D_LABEL} is {sliding_window:g}; enter {wanted[D_LABEL]} (default: {defaults[D_LABEL]:g}).")


def _check_size(texts, trunc_len, sliding_window, tokenizers, settings: SpaceSettings) -> None:
    """Refuse a request over the Space's token or short-window limits."""
    for role, tokenizer, special in tokenizers:
        n_tokens = [len(tokenizer(text, add_special_tokens=special)["input_ids"]) for text in texts]
        if sum(n_tokens) > settings.max_tokens:
            raise _error(
                f"The texts have {sum(n_tokens)} tokens for the {role}, more than this Space scores per request "
                f"({settings.max_tokens}); score shorter texts. " + run_it_yourself()
            )
        if role == "evaluator model" and _is_count(trunc_len) and _is_count(sliding_window):
            windows = sum(short_window_tokens(n, trunc_len, sliding_window) for n in n_tokens)
            if windows > settings.max_window_tokens:
                raise _error(
                    f"With K = {trunc_len} and d = {sliding_window} the evaluator would read {windows} tokens in "
                    f"short windows, more than this Space allows ({settings.max_window_tokens}); use a larger d "
                    "(sliding window) or shorter texts. " + run_it_yourself()
                )


def score(raw_texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta, progress=gr.Progress()):
    """The "Compute" button: ``(LongPPL, PPL, key-token view (HTML), per-text table)``.

    Every failure is shown in the UI as a ``gr.Error`` that says what failed and what to try: bad
    input, a request over the Space's limits (``SETTINGS``), a model that cannot be loaded, the
    metric's own ``ValueError`` (in the UI's words: ``in_ui_terms``) and anything unexpected; the
    metric's warnings (e.g. a text too short to have key tokens) as ``gr.Warning``.
    ``progress``: gradio's progress bar.
    """
    try:
        return _score(raw_texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta, progress)
    except gr.Error:
        raise
    except Exception as err:  # gradio would show a bare "Error" badge with no message
        if _is_out_of_memory(err):
            _free_models()
            raise _error(
                f"The Space ran out of memory while scoring ({_first_line(err)}); score shorter texts, or try again "
                "later. " + run_it_yourself()
            ) from err
        raise _error(
            f"Scoring failed: {type(err).__name__}: {in_ui_terms(_first_line(err))}. Try again; if it fails again, "
            "try other texts or settings. " + run_it_yourself()
        ) from err


def _score(raw_texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta, progress):
    settings = SETTINGS
    deadline = time.monotonic() + settings.time_limit_s
    # The texts box cuts nothing (it has no maximum length): a longer paste is refused here, saying so.
    if len(raw_texts or "") > settings.max_chars:
        raise _error(
            f"The texts have {len(raw_texts)} characters, {len(raw_texts) - settings.max_chars} more than this "
            f"Space scores per request ({settings.max_chars}); nothing was scored or cut: shorten them, or score "
            "long texts and corpora on your own hardware (`longppl score`, then `longppl evaluate`). "
            + run_it_yourself()
        )
    texts = split_texts(raw_texts)
    if not texts:
        raise _error(f"Paste at least one long text (separate several with a line holding only {SEPARATOR}).")
    _check_unicode(texts)
    _check_fields(trunc_len, sliding_window, alpha, beta, settings)
    try:  # K and d as the metric checks them, here too (an integer: the fields round to one)
        _settings.WindowSettings(trunc_len, sliding_window)
    except ValueError as err:
        raise _error(in_ui_terms(str(err))) from None
    model_id = _allowed_model(model_id, "evaluated model", settings)
    evaluator_model_id = _allowed_model(evaluator_model_id, "evaluator model", settings)
    model, tokenizer = load_model(model_id, settings.local_models, settings.hub_timeout_s)
    evaluator, evaluator_tokenizer = load_model(evaluator_model_id, settings.local_models, settings.hub_timeout_s)
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
                return_evaluator_scores=True,
                progress=False,
                progress_callback=on_progress,
            )
        except ValueError as err:
            raise _error(in_ui_terms(str(err))) from err
        except TimeLimitExceeded as err:
            raise _error(
                f"This request took longer than this Space allows ({settings.time_limit_s:g} s) and was stopped "
                f"during: {err}. Score shorter texts, with a larger d or a smaller K. " + run_it_yourself()
            ) from err
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            gr.Warning(html.escape(in_ui_terms(str(warning.message)), quote=False))
    rule = _settings.KeyTokenRule.of(result["settings"])  # the rule the metric applied, whole
    return (
        _shown(result["longppl"], 4),
        _shown(result["ppl"], 4),
        key_token_view(texts, result["evaluator_scores"], rule, trunc_len),
        summary(result, [_views.TokenCounts.of(scores, rule) for scores in result["evaluator_scores"]]),
    )


def clear_results():
    """The outputs of ``score``, emptied: the first step of "Compute", so that a request that fails
    leaves its message alone on the page, not under the results of an earlier one."""
    return "", "", "", ""


#: Run in the page as "Compute" is clicked, before ``clear_results``: closes the messages of earlier
#: requests (gradio's pop-ups, shown until closed), so that none stands over this request's results.
#: It presses each pop-up's close button, as a visitor would; it returns ``clear_results``'s inputs (none).
CLOSE_MESSAGES = """() => {
    document.querySelectorAll('[data-testid="toast-close"]').forEach((button) => button.click());
    return [];
}"""


def load_examples(path: str = EXAMPLES_FILE) -> tuple[list[list], list[str]]:
    """``(rows, titles)`` for ``gr.Examples``: each row is ``[text, K, d]`` (the file's K and d: the
    excerpts are short, so K must be too) and its title labels it."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    rows = [[example["text"], data["K"], data["d"]] for example in data["examples"]]
    return rows, [example["title"] for example in data["examples"]]


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
        # No max_length: a browser would cut a longer paste silently; ``score`` refuses it, saying so.
        texts = gr.Textbox(
            label=f"Texts (separate documents with a line holding only {SEPARATOR})", lines=12, max_lines=30
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
        # No minimum or maximum: gradio's own range check names no field; ``score`` checks them
        # (``_check_fields``), naming the field and the range.
        defaults = field_defaults(settings)
        with gr.Row():
            trunc_len = gr.Number(
                label=K_LABEL, value=defaults[K_LABEL], precision=0, info=f"1 to {settings.max_trunc_len} in this Space"
            )
            sliding_window = gr.Number(label=D_LABEL, value=defaults[D_LABEL], precision=0)
            alpha = gr.Number(label=ALPHA_LABEL, value=defaults[ALPHA_LABEL])
            beta = gr.Number(label=BETA_LABEL, value=defaults[BETA_LABEL])
        examples, titles = load_examples()
        gr.Examples(
            examples,
            inputs=[texts, trunc_len, sliding_window],
            example_labels=titles,
            label="Examples (public-domain report excerpts, with a K and d short enough for them)",
        )
        button = gr.Button("Compute", variant="primary")
        with gr.Row():
            # Text boxes: empty until a request has been scored (a gr.Number would show 0).
            longppl = gr.Textbox(label="LongPPL", interactive=False)
            ppl = gr.Textbox(label="PPL", interactive=False)
        # under the boxes, not as their info: a box's accessible name stays its label alone
        gr.Markdown(f"LongPPL and PPL: {_CORPUS_NOTE}.")
        per_text = gr.Markdown(label="Per text")
        key_tokens = gr.HTML(
            label="Key tokens", css_template=_views.STYLE, show_label=True, container=True, padding=True
        )
        outputs = [longppl, ppl, key_tokens, per_text]
        # Clear first (the results and the messages), then score: a failure's message then never stands
        # over an earlier request's results, nor an earlier failure's message over this one's results.
        button.click(clear_results, outputs=outputs, queue=False, show_progress="hidden", js=CLOSE_MESSAGES).then(
            score,
            inputs=[texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta],
            outputs=outputs,
        )
    # One request at a time by default: a forward pass already uses every core of a CPU Space.
    demo.queue(default_concurrency_limit=settings.concurrency, max_size=settings.queue_size)
    return demo


demo = build_demo()

if __name__ == "__main__":
    demo.launch()
