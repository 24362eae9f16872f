"""The steady rate of scripts/bench/bench_pipeline_gpus.py (docs/benchmarks.md's scaling figure) from the
times its ``PassTimes`` step notes, against a count written out by hand."""

import json
import os
import runpy
import sys

import pytest
from test_cache_shards import require_datatrove

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "scripts", "bench")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)  # the script imports its common.py as a script run from its folder would
    try:
        yield runpy.run_path(os.path.join(BENCH, "bench_pipeline_gpus.py"))
    finally:
        sys.path.remove(BENCH)


def write_times(folder, rank, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{rank:05d}.jsonl"), "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def test_the_steady_window_runs_from_the_last_first_block_to_the_first_last_block(bench, tmp_path):
    folder = str(tmp_path / "times")
    # task 0: blocks of two documents leave at 110, 112, 114, 116; task 1 at 111, 113, 115 (launched at 100)
    write_times(folder, 0, [[110, 5], [110, 5], [112, 7], [112, 7], [114, 9], [114, 9], [116, 1], [116, 1]])
    write_times(folder, 1, [[111, 3], [111, 3], [113, 4], [113, 4], [115, 6], [115, 6]])
    found = bench["steady_rate"](folder, 100.0)
    # window (111, 115]: task 0's blocks at 112 and 114, task 1's at 113 and 115
    tokens = 7 + 7 + 9 + 9 + 4 + 4 + 6 + 6
    assert found["window_s"] == 4.0
    assert found["window_tokens"] == tokens
    assert found["tokens_per_s"] == tokens / 4
    assert found["task_start_s"] == [10.0, 11.0]


def test_a_task_of_one_block_leaves_no_window(bench, tmp_path):
    folder = str(tmp_path / "times")
    write_times(folder, 0, [[10, 5], [10, 5]])
    write_times(folder, 1, [[9, 2], [12, 2]])
    found = bench["steady_rate"](folder, 0.0)
    assert found["tokens_per_s"] is None and found["window_tokens"] == 0


def test_pass_times_notes_each_document_and_passes_it_on_unchanged(bench, tmp_path):
    require_datatrove()
    from datatrove.data import Document

    docs = [Document(text=f"t{i}", id=str(i), metadata={"longppl_tokens": 10 + i}) for i in range(3)]
    step = bench["PassTimes"](str(tmp_path / "times"))
    out = list(step.run(iter(docs), rank=3, world_size=4))
    assert out == docs
    with open(tmp_path / "times" / "00003.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert [n for _, n in rows] == [10, 11, 12]
    assert [t for t, _ in rows] == sorted(t for t, _ in rows)
