"""The multi-GPU recipe, accelerate configs and README commands, and scripts/bench/bench_multi_gpu.py's own checks.

The runs themselves need GPUs (docs/benchmarks.md, "Several GPUs"); here: the recipe holds what the docs say,
every file the documented commands name exists, the bench's cache comparison catches a difference,
and its scoring check runs end to end on 2 CPU processes.
"""

from __future__ import annotations

import json
import os
import re
import sys

import datasets
import numpy as np
import pytest
import yaml
from helpers import DATA, run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "scripts", "bench")
sys.path.insert(0, BENCH)

import bench_multi_gpu  # noqa: E402  (scripts/bench/ is not a package)

from longce.arguments import parse_args  # noqa: E402
from longce.data import build_train_dataset, load_text_dataset, load_tokenizer  # noqa: E402
from longppl.cache.key_token_cache import KeyTokenCache  # noqa: E402

RECIPE = os.path.join(REPO, "configs", "llama1b_shape_16k.yaml")


def test_recipe_is_the_llama_3_2_1b_shape_on_16k_blocks_that_fill_every_batch():
    model_args, data_args, args = parse_args(["--config", RECIPE, "--bf16", "false", "--data_files", DATA])
    shape = model_args.model_config
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (2048, 8192, 16)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (32, 8, 64)
    assert shape["vocab_size"] == 128256 and shape["tie_word_embeddings"] is True
    assert data_args.max_seq_length == 16384 and args.max_steps == 20
    assert (args.longce_trunc_len, args.longce_sliding_window, args.longce_gamma) == (4096, 1024, 5.0)
    assert args.gradient_checkpointing and yaml.safe_load(open(RECIPE))["bf16"] is True
    # 22 full blocks: global batches of 1 GPU x 2 and 2 GPUs x 1 hold the same sequences at every step
    # (an odd count would leave one sequence for the last batch, which accelerate pads on 2 GPUs).
    tokenizer = load_tokenizer(model_args)
    raw = load_text_dataset(data_args, None)
    blocks = build_train_dataset(raw, tokenizer, data_args)
    assert len(blocks) == 22 and {len(ids) for ids in blocks["input_ids"]} == {16384}


def test_every_file_the_documented_launch_commands_name_exists():
    docs = open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8").read()
    section = docs[docs.index("## Several GPUs") :]
    named = re.findall(r"--config(?:_file)? (\S+)", section) + re.findall(r"(scripts/\S+\.py)", section)
    assert {
        "configs/accelerate/ddp.yaml",
        "configs/accelerate/fsdp2.yaml",
        "configs/accelerate/zero3.yaml",
        "configs/llama1b_shape_16k.yaml",
        "scripts/bench/bench_multi_gpu.py",
    } <= set(named)
    for path in named:
        assert os.path.isfile(os.path.join(REPO, path)), path
    kinds = {
        name: yaml.safe_load(open(os.path.join(REPO, "configs", "accelerate", f"{name}.yaml")))
        for name in ("ddp", "fsdp2", "zero3")
    }
    assert kinds["ddp"]["distributed_type"] == "MULTI_GPU"
    assert kinds["fsdp2"]["distributed_type"] == "FSDP" and kinds["fsdp2"]["fsdp_config"]["fsdp_version"] == 2
    assert kinds["zero3"]["distributed_type"] == "DEEPSPEED" and kinds["zero3"]["deepspeed_config"]["zero_stage"] == 3
    # Batch size, accumulation and clipping must come from the training arguments, not the config.
    assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(kinds["zero3"]["deepspeed_config"])


def _rows(lp_long):
    return datasets.Dataset.from_dict({"text_fingerprint": ["b", "a"], "lp_long": lp_long})


def test_cache_comparison_finds_a_changed_value_and_accepts_reordered_rows():
    nan = float("nan")
    first = _rows([[nan, 1.0, 2.0], [nan, 3.0]])
    same = datasets.Dataset.from_dict({"text_fingerprint": ["a", "b"], "lp_long": [[nan, 3.0], [nan, 1.0, 2.0]]})
    assert bench_multi_gpu.rows_identical(first, same)[0]
    changed = _rows([[nan, 1.0, 2.0], [nan, 3.0 + 1e-6]])
    identical, detail = bench_multi_gpu.rows_identical(first, changed)
    assert not identical and "'lp_long' differs" in detail
    moved_nan = _rows([[1.0, nan, 2.0], [nan, 3.0]])
    assert not bench_multi_gpu.rows_identical(first, moved_nan)[0]


def test_corpus_cut_gives_documents_of_the_asked_byte_length():
    documents = bench_multi_gpu.crs_documents(DATA, 3, 5000)
    assert len(documents) == 3 and all(4990 <= len(text.encode("utf-8")) <= 5000 for text in documents)
    assert documents[0] != documents[1]
    with pytest.raises(ValueError, match="fewer than 1000 x 5,000"):
        bench_multi_gpu.crs_documents(DATA, 1000, 5000)


@pytest.mark.slow
def test_scoring_check_runs_on_two_cpu_processes(tmp_path):
    result_path = tmp_path / "score.json"
    command = [
        sys.executable,
        os.path.join(BENCH, "bench_multi_gpu.py"),
        "score",
        "--cpu",
        "--shape",
        "tiny",
        "--documents",
        "3",
        "--tokens",
        "300",
        "--trunc-len",
        "64",
        "--sliding-window",
        "32",
        "--data",
        DATA,
        "--workdir",
        str(tmp_path),
        "--json",
        str(result_path),
    ]
    done = run_guarded(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["identical"] is True and result["documents"] == 3
    assert len(result["script_seconds"]) == 2 and np.isfinite(result["ratio"])


@pytest.mark.slow
def test_training_check_with_cache_weights_scores_the_data_once_and_every_run_reads_it(tmp_path):
    # A short corpus (three reports cut to 1,500 characters) keeps the CPU scoring to seconds.
    data = tmp_path / "reports.jsonl"
    with open(data, "w", encoding="utf-8") as handle:
        for text in bench_multi_gpu.crs_documents(DATA, 3, 1500):
            handle.write(json.dumps({"text": text}) + "\n")
    result_path = tmp_path / "train.json"
    command = [sys.executable, os.path.join(BENCH, "bench_multi_gpu.py"), "train", "--cpu", "--weights"]
    command += ["cache", "--config", "configs/tiny_cpu.yaml", "--setups", "ddp", "--data", str(data)]
    command += ["--workdir", str(tmp_path), "--json", str(result_path), "--", "--max_steps", "2"]
    command += ["--logging_steps", "1", "--save_strategy", "no"]
    done = run_guarded(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    cache = KeyTokenCache.load(result["key_tokens"]).dataset
    assert result["weights"] == "cache" and len(cache) == 3 and set(cache["trunc_len"]) == {32}  # the recipe's K
    assert set(result["runs"]) == {"1 GPU", "ddp"}
    for run in result["runs"].values():
        assert run["steps"] == run["stats_steps"] == [1, 2]
        # the random evaluator's weights, not the trained model's (about 1 at the start)
        assert all(weight > 1.2 for weight in run["longce_mean_weight"])
    assert result["runs"]["ddp"]["max_abs_diff_vs_1gpu"] < 1e-3
    # Both runs trained on the cache: train_longce.py's summary names it once per run (rank 0).
    log = open(result["log"], encoding="utf-8").read()
    assert log.count(f"LongCE weights from {result['key_tokens']}") == 2
    assert "LongCE weights cache" in done.stdout and "FAILED" not in done.stdout
