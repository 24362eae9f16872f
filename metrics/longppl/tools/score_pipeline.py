"""``longppl score`` as a datatrove pipeline step: the documents of any datatrove reader, scored by
an evaluator into a key-token cache, each with its curation columns on ``doc.metadata``.

    from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
    from datatrove.pipeline.filters import LambdaFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from longppl.settings import KeyTokenSettings
    from longppl.tools.score_pipeline import ScoreKeyTokens

    pipeline = [
        JsonlReader("/shared/pg19/"),  # task r reads only its own files (datatrove's sharding by rank)
        ScoreKeyTokens("Qwen/Qwen2-72B-Instruct", KeyTokenSettings(4096, 1024), cache="/shared/key_tokens/pg19"),
        LambdaFilter(lambda doc: doc.metadata["longppl_key_share"] > 0.02),  # keep long-context documents
        JsonlWriter("/shared/pg19-long/"),
    ]
    # one machine: 8 tasks, 8 at a time (a GPU each)
    LocalPipelineExecutor(pipeline, tasks=8, workers=8, logging_dir="/shared/logs/pg19").run()
    # a Slurm cluster: 64 tasks as one job array, a GPU each; only the executor changes
    SlurmPipelineExecutor(pipeline, tasks=64, time="24:00:00", partition="gpu", cpus_per_task=8,
                          sbatch_args={"gres": "gpu:1"}, job_name="longppl-score",
                          logging_dir="/shared/logs/pg19").run()

Each task scores the documents that flow into it, one block at a time (``shard_documents``
documents, or ``shard_minutes``), and commits each block's rows to the cache as one shard
(``key_token_cache.append_rows``) before passing the block's documents on: memory is that of one
block, whatever the corpus's size. A document whose row the cache held when the task started
(same text, evaluator and settings: the cache's key) is not scored again; its columns are read
from its row. So a task that is killed, preempted or loses its node resumes when the executor is
run again: datatrove reruns the tasks it did not record as completed (``logging_dir``), each
re-reads its own files and scores only what its committed shards lack. The cache folder and
``logging_dir`` must be on a file system all nodes share.

The columns put on ``doc.metadata`` (``METADATA_PREFIX`` + the names of
``longppl.cache.curation``, under ``rule``): ``longppl_text_fingerprint`` (the row's key),
``longppl_tokens``, ``longppl_scored_tokens``, ``longppl_key_tokens``, ``longppl_key_share``,
``longppl_lsd_mean``, ``longppl_lsd_p90``, ``longppl_longppl``, ``longppl_ppl``,
``longppl_benefit_near``, ``longppl_benefit_far`` (NaN where a value does not exist; JSON writers
write it as null). A document
without text is passed on without them (one warning line per task; drop such documents before the
step with a filter).

On a GPU machine a task uses GPU ``rank % device_count`` of its node (``device`` overrides it);
on Slurm, ask for one GPU per task. The same cache can be extended later by ``longppl score``, the
metric or another pipeline: the rows are keyed by document, evaluator and settings.

``ScoreKeyTokens(options)`` with ``longppl score``'s command-line options (the form before this
one, which read ``--corpus`` in every task) still works, with a ``FutureWarning``.
"""

from __future__ import annotations

import collections
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence

from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger

from longppl.settings import DEFAULT_MAX_TOKENS_PER_BATCH, KeyTokenRule, KeyTokenSettings, require_int
from longppl.tools.compute_key_tokens import (
    DEFAULT_SHARD_DOCUMENTS,
    DEFAULT_SHARD_MINUTES,
    PROG,
    ScoringJob,
    assign_to_processes,
    parse_args,
    past_positions_note,
)

#: What the step's ``doc.metadata`` keys start with (``longppl_key_share``...).
METADATA_PREFIX = "longppl_"
#: The curation columns put on ``doc.metadata`` (without the prefix), in order.
METADATA_COLUMNS = (
    "text_fingerprint",
    "tokens",
    "scored_tokens",
    "key_tokens",
    "key_share",
    "lsd_mean",
    "lsd_p90",
    "longppl",
    "ppl",
    "benefit_near",
    "benefit_far",
)
# Columns of documents seen lately in this task, so that a document repeated soon after (the same
# text in several files) is not scored twice; bounded, so a task's memory stays flat.
_RECENT_DOCUMENTS = 4096


class ScoreKeyTokens(PipelineStep):
    """A datatrove step that scores the documents flowing in, commits their rows to a key-token
    cache block by block, and puts their curation columns on ``doc.metadata``.

    Args:
        evaluator: the evaluator: a Hub id or a local folder (loaded in each task, on its device), or
            a model object (used where it is; pass ``tokenizer`` too).
        settings: ``KeyTokenSettings`` (K, d, the evaluator's tokenization): part of each row's key.
        cache: the key-token cache's folder (created if missing; shared by all tasks), or ``None``
            to put the columns on the documents without keeping rows (nothing to resume from).
        tokenizer: the evaluator's tokenizer; default: loaded from ``evaluator`` (a name or folder).
        rule: the key-token rule of the columns (``KeyTokenRule``; the rows do not depend on it).
        max_length: keep each text's first ``max_length`` evaluator tokens (the cache stores the cut
            text, as ``longppl score --max-length``; the document passed on keeps its whole text).
        torch_dtype: the dtype a named evaluator is loaded in (default: bfloat16 on GPU, float32 on CPU).
        device: where a named evaluator runs (default: GPU ``rank % device_count``, else the CPU).
        max_tokens_per_batch: tokens of short windows per forward pass (speed and memory only).
        shard_documents, shard_minutes: a block (one shard) closes after this many documents, or
            after the first document that ends this many minutes after the block began.
        options: deprecated: ``longppl score``'s command-line options (also accepted as the first
            argument), the former form of this step, which read ``--corpus`` in every task.
    """

    name = "LongPPL key tokens"
    type = "Scorer"

    def __init__(
        self,
        evaluator=None,
        settings: KeyTokenSettings | None = None,
        cache: str | os.PathLike | None = None,
        *,
        tokenizer=None,
        rule: KeyTokenRule | None = None,
        max_length: int | None = None,
        torch_dtype=None,
        device: str | None = None,
        max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
        shard_documents: int = DEFAULT_SHARD_DOCUMENTS,
        shard_minutes: float = DEFAULT_SHARD_MINUTES,
        options: Sequence[str] | None = None,
    ):
        super().__init__()
        if options is None and _is_options(evaluator):
            options, evaluator = evaluator, None
        self.options = list(options) if options is not None else None
        if self.options is not None:
            warnings.warn(
                "ScoreKeyTokens(options) with longppl score's command-line options is deprecated: each task "
                "re-reads the whole --corpus. Put a datatrove reader before the step and pass the evaluator, "
                "KeyTokenSettings and cache: [JsonlReader(folder), ScoreKeyTokens(evaluator, settings, cache=...)].",
                FutureWarning,
                stacklevel=2,
            )
            parse_args(self.options, prog=f"{PROG} (datatrove step)")  # bad options fail now, not in every task
            return
        if evaluator is None or (isinstance(evaluator, str) and not evaluator.strip()):
            raise ValueError(
                "ScoreKeyTokens needs an evaluator: a Hub id or a model folder, or a model object with its "
                "tokenizer (tokenizer=...)."
            )
        if not isinstance(evaluator, (str, os.PathLike)) and tokenizer is None:
            raise ValueError(
                f"ScoreKeyTokens got a {type(evaluator).__name__} as the evaluator without its tokenizer: pass "
                "tokenizer=... (or the evaluator's Hub id or folder, from which both are loaded)."
            )
        self.settings = settings if settings is not None else KeyTokenSettings()
        if not isinstance(self.settings, KeyTokenSettings):
            raise ValueError(
                f"settings must be a KeyTokenSettings, got {self.settings!r}; build one, e.g. KeyTokenSettings(4096, 1024)."
            )
        self.rule = rule if rule is not None else KeyTokenRule()
        if not isinstance(self.rule, KeyTokenRule):
            raise ValueError(
                f"rule must be a KeyTokenRule, got {self.rule!r}; build one, e.g. KeyTokenRule(alpha=2.0)."
            )
        if cache is not None:
            from longppl.cache.key_token_cache import cache_directory

            cache = cache_directory(cache, argument="cache", create=True)  # a bad folder fails now, not in each task
        self.evaluator = os.fspath(evaluator) if isinstance(evaluator, os.PathLike) else evaluator
        if isinstance(self.evaluator, str):  # a wrong name or folder fails now, not in every task
            from longppl.models.sources import check_model_source

            check_model_source(self.evaluator, "evaluator", tokenizer=tokenizer is None)
        self.cache, self.tokenizer = cache, tokenizer
        self.max_length = None if max_length is None else require_int("max_length", max_length, minimum=2)
        self.torch_dtype, self.device = torch_dtype, device
        self.max_tokens_per_batch = require_int("max_tokens_per_batch", max_tokens_per_batch)
        self.shard_documents = require_int("shard_documents", shard_documents)
        if not shard_minutes > 0:
            raise ValueError(f"shard_minutes must be a positive number of minutes, got {shard_minutes}.")
        self.shard_minutes = float(shard_minutes)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        """Score the documents of ``data`` (task ``rank`` of ``world_size``), yielding each with its columns."""
        if self.options is not None:
            yield from self._run_options(data, rank, world_size)
            return
        if data is None:
            raise ValueError(
                "ScoreKeyTokens scores the documents of the steps before it, and got none: put a datatrove reader "
                "first, e.g. [JsonlReader('corpus/'), ScoreKeyTokens(evaluator, settings, cache=...)]."
            )
        task = _Task(self, rank)
        received = 0
        for block in task.blocks(data):
            received += len(block)
            yield from block
        if task.past_positions:  # one line per task, not one per document
            name = self.evaluator if isinstance(self.evaluator, str) else type(self.evaluator).__name__
            logger.warning(
                f"task {rank}: {past_positions_note(name, task.positions, task.past_positions, task.scored)}"
            )
        if received == 0:
            logger.warning(
                f"task {rank} of {world_size} received no documents: if it was given input files, check that they "
                "are in its reader's format (JsonlReader: .jsonl, ParquetReader: .parquet) and its text_key; the "
                "reader's warnings above name the files or lines it skipped."
            )

    def _run_options(self, data, rank: int, world_size: int):
        with self.track_time("task"):
            result = score_task(parse_args(self.options, prog=PROG), rank, world_size)
        self.stat_update("documents", value=result["documents"], unit="task")
        self.stat_update("scored", value=result["scored"], unit="task")
        if data is not None:
            yield from data


def _is_options(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


class _Task:
    """One task's evaluator, cache index and counters (built in the task, never pickled)."""

    def __init__(self, step: ScoreKeyTokens, rank: int):
        import torch

        from longppl.commandline.threads import choose_torch_threads
        from longppl.models.fingerprints import ModelIdentity
        from longppl.models.loading import load_tokenizer, resolve_dtype

        self.step, self.rank = step, rank
        device = step.device
        if device is None:
            device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        if isinstance(step.evaluator, str):
            if device == "cpu":
                choose_torch_threads(1)  # tasks run side by side: one thread each unless OMP_NUM_THREADS says otherwise
            self.tokenizer = step.tokenizer if step.tokenizer is not None else load_tokenizer(step.evaluator)
            # loaded when a document needs scoring: a task whose documents are all cached loads nothing
            self.model, self.device = None, device
            self.identity = ModelIdentity.of_checkpoint(step.evaluator, resolve_dtype(step.torch_dtype, device))
            if self.identity is None:  # a Hub id not resolved to a commit (offline): the loaded weights say
                self.identity = ModelIdentity.of_model(self._evaluator(), self.tokenizer)
        else:
            self.model, self.tokenizer = step.evaluator, step.tokenizer
            self.identity = ModelIdentity.of_model(self.model, self.tokenizer)
        self.index = _CacheIndex(step.cache, step.settings, self.identity.fingerprint) if step.cache else None
        self.recent: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.warned_no_text = False
        self.past_positions, self.positions, self.scored = 0, None, 0  # said once per task, at its end

    def _evaluator(self):
        """The evaluator, loaded on the task's device the first time it is needed."""
        if self.model is None:
            from longppl.models.loading import load_model

            self.model = load_model(self.step.evaluator, self.device, self.step.torch_dtype)
        return self.model

    def blocks(self, data) -> Iterator[list]:
        """The documents of ``data`` in blocks, each block's rows committed before it is yielded."""
        step = self.step
        began, block, pending = time.monotonic(), [], {}
        for doc in data:
            self._add(doc, block, pending)
            if len(block) >= step.shard_documents or time.monotonic() - began >= step.shard_minutes * 60:
                self._commit(block, pending)
                yield block
                began, block, pending = time.monotonic(), [], {}
        if block:
            self._commit(block, pending)
            yield block

    def _add(self, doc, block: list, pending: dict) -> None:
        """Put ``doc`` in the block, scoring it now unless its row is cached or already scored."""
        from longppl.cache.curation import curation_columns
        from longppl.core.scoring import PastPositionsWarning, position_limits, score_with_evaluator, truncate_texts
        from longppl.models.fingerprints import text_fingerprint

        step = self.step
        block.append(doc)
        if not isinstance(doc.text, str) or not doc.text:
            step.stat_update("no text")
            if not self.warned_no_text:
                self.warned_no_text = True
                where = doc.metadata.get("file_path", "its input")
                logger.warning(
                    f"document {doc.id!r} of {where} has no text ({doc.text!r}): passed on without the longppl_ "
                    "columns (and so is every other such document of this task; drop them before the step with "
                    "a filter, e.g. LambdaFilter(lambda doc: bool(doc.text)))."
                )
            return
        text = truncate_texts([doc.text], self.tokenizer, step.max_length)[0]
        fingerprint = text_fingerprint(text)
        values = self.recent.get(fingerprint)
        if values is None and fingerprint in pending:
            values = pending[fingerprint][1]
        if values is None and self.index is not None:
            scores = self.index.scores(fingerprint)
            if scores is not None:
                values = _values(curation_columns(scores.lp_long, scores.lp_short, step.settings.trunc_len, step.rule))
                step.stat_update("cached")
        if values is None:
            with warnings.catch_warnings():  # counted here and said once per task (past_positions_note)
                warnings.simplefilter("ignore", PastPositionsWarning)
                scores = score_with_evaluator(
                    self._evaluator(),
                    self.tokenizer,
                    [text],
                    step.settings,
                    max_tokens_per_batch=step.max_tokens_per_batch,
                    progress=False,
                    per_document=True,
                    text_names=[f"document {doc.id!r}"],
                )[0]
            if self.scored == 0:  # the evaluator's trained positions, read once
                self.positions = position_limits(self._evaluator())[0]
            self.scored += 1
            self.past_positions += self.positions is not None and len(scores.input_ids) > self.positions
            values = _values(curation_columns(scores.lp_long, scores.lp_short, step.settings.trunc_len, step.rule))
            pending[fingerprint] = (text, values, scores)
            step.stat_update("scored")
        self.recent[fingerprint] = values
        self.recent.move_to_end(fingerprint)
        while len(self.recent) > _RECENT_DOCUMENTS:
            self.recent.popitem(last=False)
        doc.metadata[METADATA_PREFIX + "text_fingerprint"] = fingerprint
        doc.metadata.update(zip((METADATA_PREFIX + c for c in METADATA_COLUMNS[1:]), values))

    def _commit(self, block: list, pending: dict) -> None:
        """Commit the rows scored for this block as one shard (nothing without a cache)."""
        from longppl.cache import key_token_cache

        if not pending or self.step.cache is None:
            return
        texts = [text for text, _, _ in pending.values()]
        scores = [scores for _, _, scores in pending.values()]
        rows = key_token_cache.key_token_rows(texts, scores, self.step.settings, self.identity)
        key_token_cache.append_rows(self.step.cache, rows)
        logger.info(f"task {self.rank}: committed {len(rows)} rows ({len(block)} documents in this block)")


def _values(columns: dict) -> tuple:
    """The numeric curation columns in ``METADATA_COLUMNS`` order (a tuple: small to keep)."""
    return tuple(columns[name] for name in METADATA_COLUMNS[1:])


class _CacheIndex:
    """The rows of one evaluator and settings that a cache holds when a task starts, found by text
    fingerprint in 16 bytes a row (a sorted array of the fingerprints' first 8 bytes and the rows),
    read column by column in batches: a task's memory grows with the rows cached, 16 bytes each,
    not with their texts."""

    def __init__(self, path: str, settings: KeyTokenSettings, evaluator_fingerprint: str):
        import numpy as np

        from longppl.cache.key_token_cache import KeyTokenCache

        self.cache = KeyTokenCache.load(path, create=True)
        data = self.cache.dataset
        prefixes, rows = [], []
        wanted = (settings.trunc_len, settings.sliding_window, settings.add_special_tokens, settings.window_bos)
        columns = ["text_fingerprint", "evaluator_fingerprint", "trunc_len", "sliding_window", "add_special_tokens", "window_bos"]  # fmt: skip
        start = 0
        for batch in data.select_columns(columns).with_format("arrow").iter(batch_size=65536):
            keep = [
                i
                for i, key in enumerate(zip(*(batch.column(c).to_pylist() for c in columns[1:])))
                if key[0] == evaluator_fingerprint and tuple(key[1:]) == wanted
            ]
            fingerprints = batch.column("text_fingerprint").to_pylist()
            prefixes.append(np.array([int(fingerprints[i][:16], 16) for i in keep], dtype=np.uint64))
            rows.append(np.array(keep, dtype=np.int64) + start)
            start += batch.num_rows
        prefixes = np.concatenate(prefixes) if prefixes else np.zeros(0, np.uint64)
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        order = np.argsort(prefixes, kind="stable")
        self.prefixes, self.rows = prefixes[order], rows[order]
        self.fingerprints = data.select_columns(["text_fingerprint"]).with_format("arrow")  # one view, reused

    def scores(self, fingerprint: str):
        """The cached ``EvaluatorScores`` of the text of ``fingerprint``, or ``None``."""
        import numpy as np

        prefix = np.uint64(int(fingerprint[:16], 16))
        at = int(np.searchsorted(self.prefixes, prefix))
        while at < len(self.prefixes) and self.prefixes[at] == prefix:
            row = int(self.rows[at])
            if self.fingerprints[row].column(0)[0].as_py() == fingerprint:  # the first 8 bytes matched: check all
                return self.cache.scores(row)
            at += 1
        return None


# ---- the former form: longppl score's options, the whole corpus read in every task ----


def task_share(texts: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The documents task ``rank`` of ``world_size`` scores in the former ``options`` form: the
    distinct ``texts`` split by length (``assign_to_processes``), in corpus order."""
    distinct = list(dict.fromkeys(texts))
    return [distinct[i] for i in assign_to_processes([len(t) for t in distinct], world_size)[rank]]


def score_task(args, rank: int, world_size: int) -> dict:
    """The former ``options`` form: score task ``rank``'s share into the cache ``args.output``;
    returns ``{"task", "documents", "scored"}``."""
    import torch

    from longppl.commandline.threads import choose_torch_threads

    device = args.device
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        choose_torch_threads(1)
    job = ScoringJob(args, device)
    share = task_share(job.texts, rank, world_size)
    missing = job.missing(share)
    job.score(missing, name=f"task {rank}")
    if job.past_positions:  # one line per task, not one per document
        note = past_positions_note(args.evaluator, job.positions, job.past_positions, len(missing))
        print(f"{PROG} (task {rank}): warning: {note}", file=sys.stderr, flush=True)
    return dict(task=rank, documents=len(share), scored=len(missing))
