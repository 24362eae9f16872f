"""The LongPPL tasks: documents from a key-token cache, scored by the ``longppl`` model type, with
LongPPL and PPL per document and for the corpus, aggregated as ``longppl evaluate`` aggregates them.

A task is a :class:`LongPPLTask` (a ``ConfigurableTask``) named in a task YAML by ``class:``::

    task: longppl_govreport
    class: !function longppl.harness.LongPPLTask
    dataset_path: key_tokens/govreport-llama8b     # the cache: a folder or a Hub dataset id

Its settings are those of ``longppl evaluate``, under ``metadata:`` in the YAML or ``--metadata`` on
the command line (which applies to every task of the run): ``key_tokens`` (the cache, for a task
without ``dataset_path``, such as the bundled ``longppl``), ``split`` (of a Hub cache, default
``train``), ``evaluator``, ``trunc_len``, ``sliding_window`` (which of the cache's evaluator/settings
combinations), ``alpha``, ``beta``, ``use_lcl``, ``soft``, ``gamma`` (the key-token rule) and
``aggregation`` (``official``, the default, ``official-pre-2025-07`` or ``pooled``: ``longppl.settings.AGGREGATIONS``).
A key close to a setting without being one (``alhpa``) is refused, naming the setting it resembles;
another key the task does not know is named in a warning (lm_eval passes the model's arguments, and
settings meant for other tasks of the run, as metadata too: :func:`check_metadata`).

Per document (``--log_samples``), both metrics hold the document's result: ``longppl``, ``ppl``,
``n_key_tokens``, ``n_tokens``, ``key_nll``, ``nll``, ``n_predicted`` (``longppl.core.scoring.DocumentResult``).
The corpus values are ``longppl.summarize_results`` of those results: with ``official``, as the
official evaluation script computes them since July 2025, the exponential of the mean of per-document
log LongPPLs weighted by their key-token counts (documents without key tokens left out) and of
per-document log PPLs weighted by their token counts; never a plain mean of per-document values. Their
standard errors are bootstraps over documents (:func:`bootstrap_stderr`), each resample aggregated by
the same rule.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import datasets
import numpy as np
from lm_eval.api.task import ConfigurableTask

import longppl

from ._internal import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    DocumentResult,
    closest,
    corpus_values,
    document_columns,
    require_aggregation,
    require_int,
)
from .model import MODEL_TYPE, DocumentLogProbs, DocumentRequest, LongPPLLM

#: The metrics of a LongPPL task, both lower-is-better.
METRICS = ("longppl", "ppl")
#: Where a task reads its settings: ``metadata`` keys, as ``longppl evaluate`` names its options.
SETTINGS = (
    "key_tokens",
    "split",
    "evaluator",
    "trunc_len",
    "sliding_window",
    *(rule_field.name for rule_field in dataclasses.fields(longppl.KeyTokenRule)),  # alpha ... gamma
    "aggregation",
)
#: Keys lm_eval itself writes into a task's metadata: the task's version, the YAML it was read from, a
#: YAML ``metadata:`` that is not a mapping, a Python task's placeholder.
HARNESS_METADATA = ("version", "config_source", "_metadata", "config")
#: Seed of the bootstrap's resampling: the same run reports the same standard errors.
BOOTSTRAP_SEED = 1234
_BOOTSTRAP_CHUNK = 1000  # resamples drawn at once: [chunk, documents] counts in memory


def _corpus_values(counts: np.ndarray, items: list[dict], metric: str, aggregation: str) -> np.ndarray:
    """The corpus value of ``metric`` for each row of ``counts`` ``[r, n]`` (how often each of the ``n``
    documents is drawn), by the rule ``longppl.summarize_results`` applies (``scoring.corpus_values``)."""
    columns = document_columns([DocumentResult(**item) for item in items])
    return corpus_values(columns, aggregation, counts)[metric]


def model_arguments() -> frozenset[str]:
    """The named arguments of the ``longppl`` model type (its own and ``HFLM``'s, ``pretrained``, ``dtype``,
    ...). lm_eval's command line and ``simple_evaluate`` merge ``--model_args`` into every task's metadata,
    so a LongPPL task sees them there beside its settings."""
    names = set()
    for cls in LongPPLLM.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            parameters = inspect.signature(init).parameters.values()
            names.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return frozenset(names - {"self"})


def check_metadata(task: str, metadata: dict) -> None:
    """Refuse a metadata key of task ``task`` that reads as a misspelt setting; warn about other keys it ignores.

    A task's metadata holds, beside its settings (:data:`SETTINGS`), what lm_eval adds
    (:data:`HARNESS_METADATA`), the model's arguments (:func:`model_arguments`, and ``from_pretrained``
    keywords that no signature names, such as ``attn_implementation``) and ``--metadata`` meant for
    other tasks of the same run. So a key is refused when it is close to a setting without being one
    (``alhpa``, ``trunc-len``, ``Alpha``: difflib, on the key in lower case with ``-`` as ``_``), and any
    other key the task does not know is named in a warning with the settings.

    Raises:
        ValueError: a key close to a setting, named with the setting it resembles and every setting.
    """
    known = set(SETTINGS) | set(HARNESS_METADATA) | model_arguments()
    unknown = [key for key in metadata if key not in known]
    close = {key: closest(str(key).lower().replace("-", "_"), list(SETTINGS)) for key in unknown}
    settings = ", ".join(SETTINGS)
    misspelt = [key for key in unknown if close[key]]
    if misspelt:
        named = ", ".join(f"{key} (did you mean {close[key]}?)" for key in misspelt)
        raise ValueError(
            f"Task {task!r}: unknown setting(s) {named}. The settings of a LongPPL task (--metadata key=value, "
            f"or the task YAML's metadata:) are {settings}."
        )
    if unknown:
        warnings.warn(
            f"Task {task!r} ignores the metadata {', '.join(map(str, unknown))}: not a setting of a LongPPL task "
            f"({settings}). Expected for a model argument (lm_eval passes --model_args to the tasks as metadata) "
            "or a setting of another task of the run.",
            stacklevel=3,
        )


def canonical_order(item: dict) -> str:
    """Sort key of a per-document result that does not depend on the order the harness hands them in."""
    return json.dumps(item, sort_keys=True)


def bootstrap_stderr(items: list[dict], iters: int, metric: str, aggregation: str) -> float:
    """Standard error of a corpus value by the bootstrap over documents: the sample standard deviation
    (``n - 1``, as the harness's own bootstrap) of the corpus value over ``iters`` resamples of the
    documents with replacement (seeded, over the documents in :func:`canonical_order`: reruns, and runs
    that gather the documents in another order, agree). Resamples without a finite value (no key
    token drawn) are left out; ``nan`` when fewer than two remain.

    Args:
        items: per document, the dict a LongPPL task's ``process_results`` gives (``DocumentResult`` fields).
    """
    # The documents in one canonical order: under data parallelism the harness gathers them rank by
    # rank (0, 2, 4, ..., 1, 3, ...), and the seeded draws must pick the same documents either way.
    items = sorted(items, key=canonical_order)
    n = len(items)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    values = []
    for start in range(0, iters, _BOOTSTRAP_CHUNK):
        counts = rng.multinomial(n, np.full(n, 1.0 / n), size=min(_BOOTSTRAP_CHUNK, iters - start))
        values.append(_corpus_values(counts.astype(np.float64), items, metric, aggregation))
    drawn = np.concatenate(values) if values else np.empty(0)
    finite = drawn[np.isfinite(drawn)]
    return float(np.std(finite, ddof=1)) if finite.size > 1 else float("nan")


def corpus_aggregation(metric: str, aggregation: str):
    """The harness aggregation of ``metric`` (``longppl`` or ``ppl``): per-document results in, the
    corpus value out, by ``longppl.summarize_results`` (the code ``longppl evaluate`` runs). It
    carries its bootstrap as ``longppl_bootstrap(items, iters)``, which the harness's standard-error
    step calls once ``longppl.harness`` is imported (``longppl.harness.install_stderr``)."""

    def aggregate(items: list[dict]) -> float:
        results = [DocumentResult(**item) for item in items]
        if metric == "longppl" and results and not any(r.n_key_tokens > 0 for r in results):
            warnings.warn(  # as longppl evaluate warns
                f"No key tokens in any of the {len(results)} documents, so LongPPL is NaN: the key-token rule is "
                "too strict for this corpus and evaluator. Try a lower alpha or beta (--metadata alpha=... "
                "beta=...), or use_lcl=false.",
                stacklevel=2,
            )
        return float(longppl.summarize_results(results, aggregation)[metric])

    aggregate.__name__ = aggregate.__qualname__ = f"{metric}_{aggregation}".replace("-", "_")
    aggregate.longppl_bootstrap = lambda items, iters: bootstrap_stderr(items, iters, metric, aggregation)
    return aggregate


_AGGREGATIONS = {(metric, name): corpus_aggregation(metric, name) for metric in METRICS for name in AGGREGATIONS}


class LongPPLTask(ConfigurableTask):
    """A task whose documents are the texts of a key-token cache (module docstring for its settings).

    Args:
        config: the task's YAML as a dict (``task``, ``dataset_path``, ``metadata``, ...); the harness
            passes it. The request type, metrics and document fields are this class's.
    Raises:
        ValueError: no cache named, a cache without rows, settings that pick no (or several) of the
            cache's combinations, a bad key-token rule, K, d or aggregation, a misspelt setting
            (:func:`check_metadata`).
    """

    VERSION = 1

    def __init__(self, config: dict | None = None) -> None:
        config = dict(config or {})
        config.pop("class", None)
        name = config.get("task") or "longppl"
        metadata = dict(config.get("metadata") or {})
        check_metadata(name, metadata)
        settings = {key: metadata[key] for key in SETTINGS if metadata.get(key) is not None}
        source = config.get("dataset_path") or settings.get("key_tokens")
        if not source:
            raise ValueError(
                f"Task {name!r} has no key-token cache: pass --metadata key_tokens=<the folder longppl-score "
                "wrote, or a Hub dataset id>, or give the task's YAML a dataset_path line."
            )
        try:
            aggregation = require_aggregation("aggregation", settings.get("aggregation", DEFAULT_AGGREGATION))
        except ValueError as err:
            raise ValueError(f"Task {name!r}: {err}") from None
        # how messages name the cache: the task YAML's line, or the --metadata key
        self.cache_argument = "dataset_path" if config.get("dataset_path") else "key_tokens"
        self.cache_source = str(source)
        self.rule = longppl.KeyTokenRule.of(settings)
        self.cache_selection = {
            "evaluator": settings.get("evaluator"),
            **{
                key: require_int(key, settings[key]) if key in settings else None
                for key in ("trunc_len", "sliding_window")
            },
        }
        self.cache_split = settings.get("split", "train")
        self.aggregation_name = aggregation
        config.update(
            task=name,
            dataset_path=self.cache_source,
            output_type="loglikelihood_rolling",
            test_split="test",
            doc_to_text="",
            doc_to_target="text",
            num_fewshot=0,
            process_results=self.process_document,
            metric_list=[
                {"metric": metric, "aggregation": _AGGREGATIONS[metric, aggregation], "higher_is_better": False}
                for metric in METRICS
            ],
            metadata={**metadata, "version": self.VERSION},
        )
        super().__init__(config=config)

    def download(self, dataset_kwargs=None, **kwargs) -> None:
        """Open the cache, pick its one evaluator/settings combination (as ``longppl evaluate`` does)
        and make its texts the test documents: ``{"text": str, "row": int}`` (the cache row)."""
        name = self.config.task
        self.key_token_cache = longppl.open_cache(self.cache_source, self.cache_split, self.cache_argument)
        if len(self.key_token_cache) == 0:
            raise ValueError(
                f"The key-token cache {self.cache_source!r} of task {name!r} has no rows: score a corpus into it "
                f"first (longppl-score --corpus <texts> --evaluator <model> --output {self.cache_source})."
            )
        evaluator = self.cache_selection["evaluator"]
        settings, _, rows = self.key_token_cache.select(
            None if evaluator is None else str(evaluator),
            trunc_len=self.cache_selection["trunc_len"],
            sliding_window=self.cache_selection["sliding_window"],
        )
        self.key_token_settings = settings
        documents = datasets.Dataset.from_dict({"text": self.key_token_cache.texts(rows), "row": rows})
        self.dataset = datasets.DatasetDict({"test": documents})

    def construct_requests(self, doc: dict, ctx, **kwargs) -> DocumentRequest:
        """One :class:`DocumentRequest` per document: the whole text, scored by the ``longppl`` model type."""
        kwargs.pop("apply_chat_template", None)
        kwargs.pop("chat_template", None)
        return DocumentRequest(request_type="loglikelihood_rolling", doc=doc, arguments=(doc["text"],), idx=0, **kwargs)

    def process_document(self, doc: dict, results: list) -> dict:
        """LongPPL and PPL of one document from the model's per-token log-probs and the cache row's
        key tokens (``longppl.text_key_weights``, ``longppl.document_results``: ``longppl evaluate``'s
        code, across tokenizers too). Both metrics hold the same dict of ``DocumentResult`` fields."""
        (answer,) = results
        if not isinstance(answer, DocumentLogProbs):
            raise ValueError(
                f"Task {self.config.task!r} needs each document's per-token log-probs, which only the "
                f"{MODEL_TYPE!r} model type gives: run it with --model {MODEL_TYPE} (python -m longppl.harness "
                "run ..., or import longppl.harness before lm_eval.simple_evaluate); it takes every "
                "argument of --model hf."
            )
        evaluator_scores = self.key_token_cache.scores(doc["row"])
        weights = longppl.text_key_weights([doc["text"]], [evaluator_scores], [answer.scores], rule=self.rule)
        (result,) = longppl.document_results([answer.scores], weights)
        values = dataclasses.asdict(result)
        if not self.rule.soft:
            values["n_key_tokens"] = int(values["n_key_tokens"])
        return {metric: values for metric in METRICS}
