"""Worker of test_cache_shards.py: ``longppl score`` as a datatrove step under the local executor.

    python tests/distributed/pipeline_worker.py TASKS WORKERS LOGGING_DIR [--die RANK:N] SCORE-OPTIONS...

Runs ``ScoreKeyTokens(SCORE-OPTIONS)`` as TASKS tasks on WORKERS worker processes (datatrove's
``LocalPipelineExecutor``; forked, so that the hook below reaches them). ``--die RANK:N``: at task
RANK's N-th shard commit, the whole process group (the executor and every worker, mid-task) is killed
with SIGKILL, as when a node is lost; start the script in a session of its own.
"""

from __future__ import annotations

import os
import signal
import sys

from datatrove.executor import LocalPipelineExecutor

import longppl.cache.key_token_cache as cache_module
from longppl.tools import score_pipeline


def die_at(rank: int, n: int) -> None:
    task = {"rank": None, "commits": 0}
    score_task, append_rows = score_pipeline.score_task, cache_module.append_rows

    def tracking_task(args, this_rank, world_size):
        task.update(rank=this_rank, commits=0)
        return score_task(args, this_rank, world_size)

    def killing_append(path, rows):
        result = append_rows(path, rows)
        task["commits"] += 1
        if task["rank"] == rank and task["commits"] == n:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return result

    score_pipeline.score_task = tracking_task
    cache_module.append_rows = killing_append


def main(argv: list[str]) -> None:
    tasks, workers, logging_dir, options = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    if options[:1] == ["--die"]:
        rank, n = options[1].split(":")
        die_at(int(rank), int(n))
        options = options[2:]
    executor = LocalPipelineExecutor(
        [score_pipeline.ScoreKeyTokens(options)],
        tasks=tasks,
        workers=workers,
        logging_dir=logging_dir,
        start_method="fork",
    )
    executor.run()


if __name__ == "__main__":
    main(sys.argv[1:])
