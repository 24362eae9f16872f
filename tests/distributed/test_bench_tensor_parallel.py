"""scripts/bench_tensor_parallel.py's own checks: the row comparison between layouts. The figures
themselves need GPUs (docs/benchmarks.md, "Evaluators larger than one GPU").
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_tensor_parallel  # noqa: E402  (scripts/ is not a package)

NAN = float("nan")


def _rows(path, lp_long, lp_short):
    np.savez(path, lp_long_0=np.array(lp_long, dtype=np.float32), lp_short_0=np.array(lp_short, dtype=np.float32))


def test_comparison_counts_key_tokens_and_the_top_lsd_tokens_both_layouts_share(tmp_path):
    # LSD = long - short: [nan, nan, 3, 0.5, 4]; LCL = long. The default rule (LSD > 2 and LCL > -2)
    # takes token 2 only (token 4's LCL is -5). The 95th percentile of [0.5, 3, 4] is 3.9, so the top
    # tokens by LSD are {4}, which the second layout moves below it (its LSD there is 3.5).
    for part in ("document", "corpus"):
        _rows(tmp_path / f"s-one-{part}.npz", [NAN, -1, -1, -1, -5], [NAN, NAN, -4, -1.5, -9])
        _rows(tmp_path / f"s-tp-{part}.npz", [NAN, -1, -1, -0.9, -5], [NAN, NAN, -4, -1.5, -8.5])
    found = bench_tensor_parallel.compare(str(tmp_path), "s", "tp", "one")
    for part in ("document", "corpus"):
        assert found[part]["max_abs_logprob_diff"] == pytest.approx(0.5)
        assert found[part]["default_rule_key_tokens"] == 1 and found[part]["default_rule_identical"] is True
        assert found[part]["top5pct_lsd_tokens"] == 1 and found[part]["top5pct_lsd_shared"] == 0
    assert bench_tensor_parallel.compare(str(tmp_path), "s", "device_map", "one") is None
