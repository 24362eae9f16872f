"""scripts/bench/bench_generation.py's CPU smoke run: both decoders give the same tokens in float32 (the
benchmark's agreement), and the results name every arm with its ratio against ``generate``."""

import json
import os
import sys

from helpers import run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_generation_benchmark_runs_both_decoders_to_the_same_tokens(tmp_path):
    out = tmp_path / "generation.json"
    command = [sys.executable, os.path.join("scripts", "bench", "bench_generation.py"), "--tiny"]
    command += ["--lengths", "90", "160", "--repeats", "1", "--new-tokens", "6", "--json", str(out)]
    done = run_guarded(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert sorted(results["lengths"]) == ["160", "90"]
    for row in results["lengths"].values():
        assert row["agreement"] == 1.0  # float32: the rows decoder is generate's greedy rule
        assert row["generate"]["vs_generate"] == 1.0
        for arm in ("rows", "prefill-batch", "prefill-rows"):
            assert row[arm]["seconds_a_prompt"] > 0 and row[arm]["vs_generate"] > 0
