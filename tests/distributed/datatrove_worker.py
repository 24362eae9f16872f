"""Worker of test_score_pipeline.py: ``[JsonlReader, ScoreKeyTokens, JsonlWriter]`` under one of
datatrove's executors, as a user runs it.

    python tests/distributed/datatrove_worker.py CONFIG.json

CONFIG: ``{"executor": "local" | "ray" | "slurm", "input", "evaluator", "cache", "logs", "output",
"tasks", "workers", "trunc_len", "sliding_window", "shard_documents", "die": "RANK:POINT:N" or null,
"pause": {"rank": R, "seconds": S} or null}``.

``die``: task RANK kills its own process (SIGKILL) at its N-th shard commit, at POINT (``written``,
``renamed``, ``committed``: tests/distributed/score_worker.py), once (under the local executor the
whole process group, the executor's manager process included: start it in a session of its own): a marker file in ``logs``
keeps the task run again (Ray resubmits a lost worker's task) from dying again. ``pause``: task R
sleeps S seconds before each document, so that a test can act on it mid-task (scancel, a kill).
For ``slurm`` the command returns once the job array is submitted; its id is printed as
``JOB <id>``.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class _KillGroup:
    """``os`` whose ``kill`` kills the whole process group (start the worker in a session of its own)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def kill(pid, sig):
        os.killpg(os.getpgid(0), sig)


class _KillActor(_KillGroup):
    """``os`` whose ``kill`` kills this process's parent first: under Ray, the worker (actor) process
    that runs the task in a pool process of its own (datatrove's ``RankWorker``), as when Ray loses it."""

    @staticmethod
    def kill(pid, sig):
        os.kill(os.getppid(), sig)
        os.kill(os.getpid(), sig)


def arm(config: dict):
    """A pipeline step (datatrove takes plain callables) that, in the chosen task only, patches the
    commit path to die at ``config["die"]`` and sleeps ``config["pause"]`` before each document."""
    die, pause = config.get("die"), config.get("pause")
    marker = os.path.join(config["logs"], "died-once")

    def step(data, rank: int = 0, world_size: int = 1):
        import time  # here: Slurm's executor pickles this function by value, without the module's imports

        if die and int(die.split(":")[0]) == rank and not os.path.exists(marker):
            sys.path.insert(0, HERE)
            import score_worker

            open(marker, "w").close()  # armed once: the task run again after the kill does not die
            if config["executor"] == "local":  # the executor's manager process goes too, as with a lost node
                score_worker.os = _KillGroup()
            elif config["executor"] == "ray":  # the Ray worker (actor) whose pool process runs the task
                score_worker.os = _KillActor()
            _, point, n = die.split(":")
            score_worker.die_at(point, int(n))
        for doc in data:
            if pause and pause["rank"] == rank:
                time.sleep(pause["seconds"])
            yield doc

    return step


def pipeline(config: dict) -> list:
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from longppl.settings import KeyTokenSettings
    from longppl.tools.score_pipeline import ScoreKeyTokens

    return [
        JsonlReader(config["input"]),
        arm(config),
        ScoreKeyTokens(
            config["evaluator"],
            KeyTokenSettings(config["trunc_len"], config["sliding_window"]),
            cache=config["cache"],
            shard_documents=config["shard_documents"],
        ),
        JsonlWriter(config["output"], compression=None),
    ]


def main(path: str) -> None:
    with open(path, encoding="utf-8") as handle:
        main_config(json.load(handle))


def main_config(config: dict) -> None:
    """Run the pipeline of ``config`` (the module docstring) under its executor."""
    kind = config["executor"]
    if kind == "local":
        from datatrove.executor import LocalPipelineExecutor

        LocalPipelineExecutor(
            pipeline(config),
            tasks=config["tasks"],
            workers=config["workers"],
            logging_dir=config["logs"],
            start_method="fork",
        ).run()
    elif kind == "ray":
        import ray
        from datatrove.executor import RayPipelineExecutor

        # a local cluster of its own, CPU only: as many CPUs as workers, so that many tasks run at once
        ray.init(num_cpus=config["workers"], num_gpus=0, include_dashboard=False, log_to_driver=False)
        try:
            RayPipelineExecutor(
                pipeline(config),
                tasks=config["tasks"],
                workers=config["workers"],
                logging_dir=config["logs"],
                cpus_per_task=1,
                mem_per_cpu_gb=1,
            ).run()
        finally:
            ray.shutdown()
    elif kind == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        executor = SlurmPipelineExecutor(
            pipeline(config),
            tasks=config["tasks"],
            workers=config["workers"],
            time="00:30:00",
            partition=config.get("partition", "debug"),
            cpus_per_task=1,
            mem_per_cpu_gb=1,
            job_name=config.get("job_name", "longppl-test"),
            logging_dir=config["logs"],
            qos="",
            requeue=config.get("requeue", False),
            env_command=config.get("env_command"),
        )
        executor.run()
        print(f"JOB {executor.job_id}", flush=True)
    else:
        raise ValueError(f"unknown executor {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1])
