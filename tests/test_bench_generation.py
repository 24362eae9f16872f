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


def test_real_prompts_are_read_as_the_studies_score_them_and_each_reader_is_scored(tmp_path):
    import re

    from helpers import byte_level_bpe, plain_greedy, tiny_model
    from longppl_reproduce.common.lines import ANSWER_SEPARATOR, generate_lines_cases, write_lines_cases

    tokenizer = byte_level_bpe()
    model = tiny_model("llama", len(tokenizer))
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # every prompt gets all tokens
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cases = generate_lines_cases(num_lines=5, num_cases=4, seed=0)
    write_lines_cases(str(tmp_path / "lines-beyond-100.jsonl"), cases)
    out = tmp_path / "generation.json"
    command = [sys.executable, os.path.join("scripts", "bench", "bench_generation.py"), "--model", str(folder)]
    command += ["--prompts", str(tmp_path / "lines-beyond-{}.jsonl"), "--lengths", "100", "--batches", "2"]
    command += ["--batch-size", "2", "--repeats", "1", "--new-tokens", "5", "--reference", "--json", str(out)]
    done = run_guarded(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["lengths"]["100"]

    # a lines prompt goes on with its answer up to the number, as the studies score it
    texts = [c.prompt + ANSWER_SEPARATOR + c.answer[: c.answer.rfind(c.expected_number)] for c in cases]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert row["prompt_tokens"] == [len(i) for i in ids]
    assert row["expected"] == [c.expected_number for c in cases]
    model.eval()
    for reader in ("generate", "rows", "float32"):
        assert row["answers"][reader] == [plain_greedy(model, i, 5, set()) for i in ids]
        said = [re.findall(r"\d+", tokenizer.decode(a, skip_special_tokens=True)) for a in row["answers"][reader]]
        right = [bool(n) and int(n[-1]) == int(c.expected_number) for n, c in zip(said, cases)]
        assert row[reader]["is_correct"] == right
        assert row[reader]["accuracy"] == sum(right) / len(right)


def test_the_generation_benchmark_refuses_a_recall_set(tmp_path):
    (tmp_path / "recall-100.jsonl").write_text("{}\n")
    command = [sys.executable, os.path.join("scripts", "bench", "bench_generation.py"), "--model", str(tmp_path)]
    command += ["--prompts", str(tmp_path / "recall-{}.jsonl"), "--lengths", "100"]
    done = run_guarded(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "teacher forced" in done.stderr
