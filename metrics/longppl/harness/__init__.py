"""LongPPL inside lm-evaluation-harness (``lm_eval`` 0.4.13 or a later 0.4 release): the ``longppl``
model type and the LongPPL tasks, whose results JSON holds the numbers ``longppl evaluate`` prints.

lm_eval 0.4.13 finds model types in its own registry only (it loads no plugins), so the ``longppl``
model type exists in a process once this package is imported. Two ways in:

- the command line, every ``lm_eval`` argument forwarded, this package's task folder added to
  ``--include_path``::

      python -m longppl.harness run --model longppl --model_args pretrained=Qwen/Qwen2-7B \\
          --tasks longppl --metadata key_tokens=key_tokens/govreport-llama8b --output_path results

  (``accelerate launch -m longppl.harness run ...`` for data parallelism);
- Python: ``import longppl.harness`` before ``lm_eval.simple_evaluate(model="longppl", ...,
  task_manager=longppl.harness.task_manager(metadata={"key_tokens": ...}))``.

A release of lm_eval that loads plugins needs neither: setup.cfg declares the model type
(``lm_eval.models``) and the task folder (``lm_eval.tasks``, :mod:`longppl.harness.tasks`) in its
entry-point groups, so the plain ``lm_eval --model longppl --tasks longppl ...`` imports this package.

Importing it also lets the harness report a standard error for LongPPL and PPL (:func:`install_stderr`).
``import longppl`` never imports this package: lm_eval is the optional ``harness`` extra.
"""

from __future__ import annotations

import os

try:
    import lm_eval  # noqa: F401
except ImportError as err:  # pragma: no cover - the extra is installed wherever the tests run
    raise ImportError(
        "longppl.harness needs lm-evaluation-harness: pip install 'longppl-hf[harness]' (lm-eval>=0.4.13,<0.5)."
    ) from err

from .model import MODEL_TYPE, DocumentLogProbs, DocumentRequest, LongPPLLM
from .task import LongPPLTask, bootstrap_stderr

#: The folder of the bundled task YAMLs (``longppl``); ``python -m longppl.harness`` includes it.
TASKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
#: A task YAML to copy for your own cache: change its ``dataset_path`` line (and its task name).
TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template.yaml")

__all__ = [
    "MODEL_TYPE",
    "TASKS_PATH",
    "TEMPLATE_PATH",
    "DocumentLogProbs",
    "DocumentRequest",
    "LongPPLLM",
    "LongPPLTask",
    "bootstrap_stderr",
    "include_paths",
    "install_stderr",
    "task_manager",
]


def include_paths(include_path=None) -> list[str]:
    """The harness's ``include_path`` with :data:`TASKS_PATH` first: ``None``, a folder or a list of them in,
    a list out (the user's folders after ours, so their tasks override ours on a name clash)."""
    given = (
        [] if include_path is None else [include_path] if isinstance(include_path, (str, os.PathLike)) else include_path
    )
    return [TASKS_PATH, *(os.fspath(path) for path in given if os.fspath(path) != TASKS_PATH)]


def task_manager(include_path=None, metadata: dict | None = None):
    """A ``lm_eval.tasks.TaskManager`` that knows the LongPPL tasks (:func:`include_paths`) and passes
    ``metadata`` (e.g. ``{"key_tokens": ...}``, the settings of ``longppl.harness.task``) to every task."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths(include_path), metadata=metadata)


def install_stderr() -> bool:
    """Let the harness's standard-error step bootstrap LongPPL and PPL over documents.

    The harness computes a standard error only for aggregations on its own list (``stderr_for_metric``
    in ``lm_eval.api.metrics``); LongPPL's corpus value is none of them, so its ``_stderr`` would read
    ``N/A``. This wraps the name ``lm_eval.evaluator_utils`` calls: an aggregation of a LongPPL task
    (one carrying ``longppl_bootstrap``) gets :func:`bootstrap_stderr` with the harness's
    ``bootstrap_iters``; every other aggregation gets the harness's own answer. Idempotent; returns
    whether the hook is in place (False if this lm_eval lacks the name: the errors then stay ``N/A``).
    """
    from lm_eval import evaluator_utils

    original = getattr(evaluator_utils, "stderr_for_metric", None)
    if original is None:
        return False
    if getattr(original, "longppl_hook", False):
        return True

    def stderr_for_metric(metric, bootstrap_iters):
        bootstrap = getattr(metric, "longppl_bootstrap", None)
        if bootstrap is None or bootstrap_iters <= 0:
            return original(metric, bootstrap_iters)
        return lambda items: bootstrap(items, bootstrap_iters)

    stderr_for_metric.longppl_hook = True
    evaluator_utils.stderr_for_metric = stderr_for_metric
    return True


install_stderr()
