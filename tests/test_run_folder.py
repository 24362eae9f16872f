"""The reproduction's run folder (longppl_reproduce.run_folder): stage timings that several processes
working on one folder (one per GPU, each on its own seeds) add to without losing an entry."""

from __future__ import annotations

import multiprocessing

import pytest
from longppl_reproduce.run_folder import RunFolder

ADDS = 150


def _add_many(root: str, name: str) -> None:
    run = RunFolder(root, log=lambda *_: None)
    for _ in range(ADDS):
        run.add_seconds("finetune", name, 0.5)
        run.add_seconds("stage", "finetune", 1.0)


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_processes_adding_timings_to_one_folder_lose_no_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add_many, args=(str(tmp_path), f"arm-{i}")) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    timings = RunFolder(str(tmp_path)).timings()
    # every process's own entry and the shared one hold every call: a read-add-write race loses some
    assert {name: e["calls"] for name, e in timings["finetune"].items()} == {f"arm-{i}": ADDS for i in range(3)}
    assert timings["stage"]["finetune"] == {"seconds": 3 * ADDS * 1.0, "calls": 3 * ADDS}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timings.json"]  # no lock file left behind
