"""``longppl score`` as a datatrove pipeline step: one machine or a Slurm cluster, the same step.

    from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
    from longppl.tools.score_pipeline import ScoreKeyTokens

    step = ScoreKeyTokens(["--corpus", "pg19.jsonl", "--evaluator", "Qwen/Qwen2-72B-Instruct",
                           "--output", "/shared/key_tokens/pg19-qwen72b"])
    # one machine: 8 tasks, 8 at a time (a GPU each)
    LocalPipelineExecutor([step], tasks=8, workers=8, logging_dir="/shared/logs/pg19").run()
    # a Slurm cluster: 64 tasks as one job array, a GPU each; only the executor changes
    SlurmPipelineExecutor([step], tasks=64, time="24:00:00", partition="gpu", cpus_per_task=8,
                          sbatch_args={"gres": "gpu:1"}, job_name="longppl-score",
                          logging_dir="/shared/logs/pg19").run()

The step takes ``longppl score``'s own options (``compute_key_tokens.parse_args``, checked at once,
when the step is built). Task ``rank`` of ``world_size`` scores a share of the corpus that depends
on the corpus alone (:func:`task_share`: the distinct documents balanced by length), never on what
is cached, so a task that starts late, is preempted or is run again scores the same share. Within
its share it skips the documents the cache already holds and commits the others shard by shard
(``--shard-documents``, ``--shard-minutes``; ``key_token_cache.append_rows``). datatrove records a
task as completed when it returns (``logging_dir/completions``) and reruns only the others: run the
same executor again after a kill, a preemption or a lost node, and each unfinished task resumes from
its committed shards. The cache folder and ``logging_dir`` must be on a file system all nodes share.

On a GPU machine a task uses GPU ``rank % device_count`` of the node (``--device`` overrides it);
on Slurm, ask for one GPU per task. The same cache can be extended later by ``longppl score`` or by
another pipeline run: the rows are keyed by document, evaluator and settings.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from datatrove.pipeline.base import PipelineStep

from longppl.tools.compute_key_tokens import PROG, ScoringJob, assign_to_processes, parse_args, past_positions_note


def task_share(texts: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The documents task ``rank`` of ``world_size`` scores: the distinct ``texts`` split by length
    (``assign_to_processes``), in corpus order. Depends on the corpus only, not on the cache."""
    distinct = list(dict.fromkeys(texts))
    return [distinct[i] for i in assign_to_processes([len(t) for t in distinct], world_size)[rank]]


def score_task(args, rank: int, world_size: int) -> dict:
    """Score task ``rank``'s share into the cache ``args.output``; returns ``{"task", "documents",
    "scored"}`` (its share's size, and how many were not cached yet)."""
    import torch

    from longppl.tools.threads import choose_torch_threads

    device = args.device
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        choose_torch_threads(1)  # tasks run side by side: one thread each unless OMP_NUM_THREADS says otherwise
    job = ScoringJob(args, device)
    share = task_share(job.texts, rank, world_size)
    missing = job.missing(share)
    job.score(missing, name=f"task {rank}")
    if job.past_positions:  # one line per task, not one per document
        note = past_positions_note(args.evaluator, job.positions, job.past_positions, len(missing))
        print(f"{PROG} (task {rank}): warning: {note}", file=sys.stderr, flush=True)
    return dict(task=rank, documents=len(share), scored=len(missing))


class ScoreKeyTokens(PipelineStep):
    """A datatrove step that scores its task's share of a corpus into a key-token cache.

    Args:
        options: ``longppl score``'s command-line options (``--corpus``, ``--evaluator``,
            ``--output`` and any other), parsed and checked here; usage errors raise ``SystemExit``
            as on the command line.

    Documents flowing in from an earlier step are passed on unchanged: the corpus is read from
    ``--corpus``, so that every task sees the same corpus and its own share of it.
    """

    name = "LongPPL key tokens"
    type = "Scorer"

    def __init__(self, options: Sequence[str]):
        super().__init__()
        self.options = list(options)
        parse_args(self.options, prog=f"{PROG} (datatrove step)")  # bad options fail now, not in every task

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        """Score the share of task ``rank`` of ``world_size`` (datatrove's signature); yields ``data``."""
        with self.track_time("task"):
            result = score_task(parse_args(self.options, prog=PROG), rank, world_size)
        self.stat_update("documents", value=result["documents"], unit="task")
        self.stat_update("scored", value=result["scored"], unit="task")
        if data is not None:
            yield from data
