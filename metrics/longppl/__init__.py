"""LongPPL: key-token perplexity for long-context language models (Fang et al., ICLR 2025).

What users call is in ``__all__`` (small on purpose): ``evaluate.load(longppl.METRIC_PATH)``, the
drop-in ``compute_longppl`` / ``find_key_token`` / ``load_key_token``, the key-token cache, the
settings and the few scoring functions other tools build on. Everything else is imported from its
module (``from longppl.rules.key_tokens import key_token_mask``), without being part of that promise.

The package by role, one room a bullet, from the bottom floor up. A room imports only rooms on
lower floors (tests/test_package_boundaries.py checks the arrows); this map, docs/design.md's
Packages table and the README's Layout name every module (tests/test_repository.py checks them):

- floor 0, modules of the package folder: ``settings`` (every default and the validation of K, d,
  alpha, beta, ...), ``atomic_files`` (crash-safe writes).
- floor 1, ``rules/``, the key-token rules: ``key_tokens`` (LSD/LCL), ``alignment`` (key tokens
  across tokenizers by character spans).
- floor 2, ``core/``, the scoring core: ``logprobs`` (token log-probs without a ``[sequence x
  vocabulary]`` logits tensor), ``attention`` (sliding-window layers in blocks, float32 attention in
  query blocks), ``batching`` (forward passes packed to a token budget), ``windows``
  (the short-context windows of K tokens, stride d), ``compilation`` (optional ``torch.compile`` of
  the blocks), ``progress`` (progress bars, callbacks, time limits), ``scoring`` (per-document and
  corpus LongPPL / PPL).
- floor 2, ``parallel/``: ``tensor_parallel`` (an evaluator split over several GPUs).
- floor 3, ``models/``, where models come from and which they are: ``sources`` (local path or Hub
  id), ``named`` (real models by short name, converted once from a registry package's GGUF), ``loading`` (a model and its tokenizer on a device), ``fingerprints`` (which evaluator and
  text a cache row belongs to), ``precision`` (an evaluator in bf16 or, through torchao, fp8).
- floor 3, ``views/``: ``key_token_html`` (the key-token page of ``longppl-visualize`` and the Space).
- floor 4, ``cache/``: ``key_token_cache`` (an evaluator's scores of a corpus as a
  ``datasets.Dataset``, to evaluate many models at the cost of one perplexity pass each: the rows
  looked up and used), ``schema`` (what a row is), ``storage`` (the directory on disk: read, written,
  swapped, appended to, under its lock), ``integrity`` (checksums, a damaged cache named), ``shards`` (its immutable shards and their manifest: rows committed as they are scored),
  ``curation`` (per-document columns to filter or rank a corpus by, from the cached log-probs).
- floor 5, ``metric/``, the ``evaluate`` metric's logic: ``options`` (its arguments, declared once),
  ``compute`` (what ``compute`` runs), ``official`` (the drop-in for the official package).
- floor 5, ``commandline/`` (package ``longppl.commandline``), what the commands share: ``running`` (how a
  tool runs as a command: ``ToolParser``, ``run_command``, one-line errors, YAML configs),
  ``interrupts`` (Ctrl-C: one line and status 130), ``threads``, ``corpus`` (corpus readers),
  ``cache_options`` (the cache-selection flags), ``reports``, ``correlation``, ``figures``,
  ``synthetic`` (the quickstart's toy task).
- floor 6, ``space/``: ``app`` (the Hub Space's page, with its limits as a public server).
- floor 6, ``tools/`` (package ``longppl.tools``), the commands and nothing else: ``main``
  (``longppl``), ``compute_key_tokens``, ``evaluate_models``, ``visualize_key_tokens``,
  ``quickstart``, ``cache_tool``, ``score_pipeline`` (``longppl score`` as a datatrove step).
- floor 6, a module of the package folder: ``register`` (``evaluate.load("longppl")`` by its bare name:
  after ``python -m longppl.register``, and by itself at ``import longppl`` when evaluate's module-cache
  copy is missing or stale; ``LONGPPL_AUTO_REGISTER=0`` turns that off). A command that this holds up
  ends on Ctrl-C as the command would (``commandline.interrupts``).
- floor 7, ``harness/`` (package ``longppl.harness``, the ``harness`` extra; ``import longppl`` never
  imports it): LongPPL in lm-evaluation-harness: ``model`` (the ``longppl`` model type), ``task``
  (``LongPPLTask`` and its aggregation), ``__main__`` (``python -m longppl.harness``), ``_internal``
  (what it takes from the package beyond ``__all__``).
- floor 7, the thin shells in the package folder: ``longppl`` (the ``evaluate`` metric file, which
  evaluate copies alone), ``app`` (the Hub Space's), ``__main__`` (``python -m longppl``).
"""

import importlib
import os

from . import register as _register

# The names of `__all__` -> the submodule defining them. They load on first use (PEP 562), so that
# `import longppl` and its light submodules (register, key_tokens, ...) do not import torch: a
# script's `--help` answers at once.
_EXPORTS = {
    "cache.key_token_cache": ("KeyTokenCache", "open_cache"),
    "core.logprobs": ("token_log_probs",),
    "metric.official": ("compute_longppl", "find_key_token", "load_key_token"),
    "settings": ("KeyTokenRule", "KeyTokenSettings", "WindowSettings"),
    "core.scoring": (
        "document_results",
        "score_with_evaluator",
        "score_with_model",
        "summarize_results",
        "text_key_weights",
    ),
    "core.windows": ("short_context_log_probs",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

#: Folder of the ``evaluate`` module: ``evaluate.load(longppl.METRIC_PATH)`` works from any directory.
METRIC_PATH = os.path.dirname(os.path.abspath(__file__))

# evaluate.load("longppl") by its bare name: keep evaluate's module-cache copy of the metric this
# package's code (a cheap check; a one-off copy when missing or stale), and quiet evaluate's
# "couldn't be found ... remotely" warning about that copy. See longppl.register.
_register.install_log_filter()
_register.ensure_registered()

# What users call; tests/test_public_api.py keeps this list small.
__all__ = [
    "METRIC_PATH",
    # the drop-in for the official package
    "compute_longppl",
    "find_key_token",
    "load_key_token",
    # settings
    "KeyTokenRule",
    "WindowSettings",
    # the key-token cache
    "KeyTokenCache",
    "KeyTokenSettings",
    "open_cache",
    # scoring, for tools built on the metric (e.g. the LongCE trainer)
    "score_with_evaluator",
    "score_with_model",
    "text_key_weights",
    "document_results",
    "summarize_results",
    "token_log_probs",
    "short_context_log_probs",
]
