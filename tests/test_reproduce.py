"""The reproduction pipeline (longppl_reproduce.longppl_run, scripts/reproduce_longppl.py): the whole run on
the smoke config, resuming without redoing work, and the clear errors for bad configs and inputs."""

import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from helpers import DATA, byte_level_bpe, edited_config, govreport_texts, json_leaves
from longppl_reproduce import longppl_run as reproduce
from longppl_reproduce.family import TrainingBatches, cut_documents, learning_rate

SMOKE = os.path.join(REPO, "configs", "reproduce", "smoke_cpu.yaml")
H200 = os.path.join(REPO, "configs", "reproduce", "family_h200.yaml")


@pytest.mark.slow
def test_smoke_pipeline_writes_every_artefact_with_finite_values_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "repro"
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out)]
    results = reproduce.main(argv)

    for artefact in (
        "results.json",
        "report.md",
        "timings.json",
        "tokenizer/tokenizer.json",
        "data/train_tokens.npy",
        "data/validation.jsonl",
        "eval/benchmark_scores.csv",
        "eval/evaluator/results.json",
        "eval/answer_tokens.json",
        "figures/correlation_evaluator.png",
        "figures/correlation_self.png",
        "figures/correlation_evaluator_soft.png",
        "figures/correlation_self_soft.png",
        "eval/evaluator-soft/results.json",
        "figures/lsd_answer_tokens.png",
    ):
        assert (out / artefact).is_file(), artefact
    config = reproduce.load_config(SMOKE, corpus=DATA)
    names = [member["name"] for member in config["family"]]
    for name in names:
        assert (out / "models" / name / "training.json").is_file()
        assert (out / "models" / name / "model.safetensors").is_file()
    evaluator = results["evaluator"]
    assert evaluator in names
    cache = out / "caches" / f"evaluator-{evaluator}"
    assert (cache / "dataset_info.json").is_file()
    for length in config["evaluation"]["lines_lengths"]:
        assert (out / "data" / f"lines_{length}.jsonl").is_file()

    on_disk = json.loads((out / "results.json").read_text())
    assert [f["name"] for f in on_disk["family"]] == names
    assert set(on_disk["lines"]) == set(on_disk["with_evaluator"]) == set(on_disk["self_evaluated"]) == set(names)
    for name in names:
        for view in ("with_evaluator", "self_evaluated"):
            assert set(on_disk[view][name]) >= {"longppl", "soft_longppl", "ppl", "key_tokens", "tokens"}
    assert set(on_disk["correlations"]) == {"evaluator", "evaluator_soft", "self", "self_soft"}
    assert set(on_disk["timings"]["stages"]) >= {"tokenizer", "data", "train", "evaluate"}
    # Correlations are undefined only where the lines accuracy is the same for every model (a
    # constant has no correlation): the tiny models may well all score 0.
    accuracies = [on_disk["lines"][n]["mean_accuracy"] for n in names]
    constant = len(set(accuracies)) == 1
    for where, found in on_disk["correlations"].items():
        assert found["models"] == names, where
        for metric in ("longppl", "ppl"):
            for kind in ("pearson", "spearman"):
                value = found[metric][kind]
                assert (value is None) if constant else math.isfinite(value), (where, metric, kind, value)
    measured = ("tokenizer", "lines", "with_evaluator", "self_evaluated", "answer_tokens", "timings")
    leaves = list(json_leaves({key: on_disk[key] for key in measured}))
    assert len(leaves) > 50
    for where, value in leaves:
        assert value is not None and math.isfinite(value), where
    for row in on_disk["family"]:
        for key in ("parameters", "steps", "tokens", "seconds", "tokens_per_second", "final_loss"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key)
    answer = on_disk["answer_tokens"]
    for rule in reproduce.RULES:
        assert 0 <= answer["classification"][rule]["balanced_accuracy"] <= 1
        # the far subset keeps every other token and the answer tokens whose number is beyond K
        far = answer["classification_beyond_short"]
        assert far["n_other"] == answer["classification"]["n_other"]
        assert far["n_answer"] == answer["answer_tokens_beyond_short"] <= answer["answer_tokens"]
    report = (out / "report.md").read_text()
    for name in names:
        assert f"| {name} |" in report
    # a correlation that cannot be computed says why (here every model answers the same share)
    undefined = [label for label, found in results["correlations"].items() if math.isnan(found["longppl"]["pearson"])]
    if undefined:
        assert "take one value across all" in report and f"`{undefined[0]}`" in report.split("| n/a |")[-1]
    assert results["command"].startswith("longppl-reproduce ") or ".py" in results["command"].split()[0]

    # A second call finds everything done: no model is retrained, no stage redoes its work.
    stamps = {name: os.stat(out / "models" / name / "training.json").st_mtime_ns for name in names}
    cache_stamp = os.stat(cache / "dataset_info.json").st_mtime_ns
    again = reproduce.main(argv)
    assert {name: os.stat(out / "models" / name / "training.json").st_mtime_ns for name in names} == stamps
    assert os.stat(cache / "dataset_info.json").st_mtime_ns == cache_stamp
    assert again["with_evaluator"] == results["with_evaluator"]
    timings = json.loads((out / "timings.json").read_text())
    assert timings["train"]["calls"] == 2


def _config(tmp_path, **changes) -> str:
    return edited_config(SMOKE, tmp_path, **changes)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"evaluation.trunc_len": 512}, ["trunc_len (K) = 512", "evaluation.length = 512"]),
        ({"evaluation.length": 1024}, ["evaluation.length = 1024", "max_position_embeddings = 640", "'full'"]),
        ({"training.seq_len": 4096}, ["training.seq_len = 4096", "max_position_embeddings"]),
        ({"evaluation.lines_lengths": [256, 1024]}, ["lines_lengths [256, 1024]", "evaluation.length = 512"]),
        ({"evaluation.evaluator": "nobody"}, ["evaluation.evaluator = 'nobody'"]),
        ({"family": []}, ["'family' must be a non-empty list"]),
        ({"family": [{"name": "a"}, {"name": "a"}]}, ["unique", "['a']"]),
        ({"family": [{"name": "a/b"}]}, ["family[0]", "'a/b'"]),
        ({"family": [{"name": "a", "modle": {}}]}, ["unknown keys ['modle']"]),
        ({"training.lines_share": 1.5}, ["lines_share must be in [0, 1]", "1.5"]),
        ({"evaluation.sliding_window": 0}, ["sliding_window must be an integer >= 1"]),
    ],
)
def test_bad_configs_are_refused_naming_the_field_and_value(tmp_path, changes, words):
    path = _config(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        reproduce.load_config(path, corpus=DATA)
    assert path in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_the_corpus_is_required_and_relative_paths_follow_the_config(tmp_path):
    with pytest.raises(ValueError, match="no training corpus.*--corpus"):
        reproduce.load_config(_config(tmp_path))
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "train.jsonl").write_text('{"text": "a"}\n')
    config = reproduce.load_config(_config(tmp_path, corpus="books/train.jsonl"))
    assert config["corpus"] == str(tmp_path / "books" / "train.jsonl")
    # the command line wins over the config
    assert reproduce.load_config(_config(tmp_path, corpus="books/train.jsonl"), corpus=DATA)["corpus"] == DATA


def test_the_real_config_is_valid_and_a_family_of_at_least_eight():
    config = reproduce.load_config(H200, corpus="books.jsonl.gz")
    family = reproduce.variants(config)
    assert len(family) >= 8
    evaluation = config["evaluation"]
    assert evaluation["trunc_len"] < evaluation["length"] and len(evaluation["lines_lengths"]) >= 3


def test_empty_corpora_are_refused_by_name(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"{empty}.*no documents"):
        reproduce.read_books(str(empty))
    gz = tmp_path / "empty.jsonl.gz"
    with gzip.open(gz, "wt") as handle:
        handle.write("")
    with pytest.raises(ValueError, match=f"{gz}.*no documents"):
        reproduce.read_books(str(gz))
    with gzip.open(gz, "wt") as handle:
        handle.write('{"title": "x"}\n')
    with pytest.raises(ValueError, match=f"{gz}, line 1.*'text'"):
        reproduce.read_books(str(gz))


def test_gzipped_jsonl_reads_like_jsonl(tmp_path):
    gz = tmp_path / "books.jsonl.gz"
    with open(DATA, encoding="utf-8") as source, gzip.open(gz, "wt", encoding="utf-8") as target:
        target.write(source.read())
    assert reproduce.read_books(str(gz)) == list(govreport_texts())


def test_a_lines_file_without_its_fields_is_refused_by_the_pipeline(tmp_path):
    config = reproduce.load_config(SMOKE, corpus=DATA)
    run = reproduce.Run(config, str(tmp_path))
    (tmp_path / "data").mkdir()
    for length in config["evaluation"]["lines_lengths"]:
        (tmp_path / "data" / f"lines_{length}.jsonl").write_text('{"prompt": "line a: REGISTER_CONTENT is <1>"}\n')
    with pytest.raises(ValueError, match="lines_384.jsonl, line 1 has no field 'expected_number'"):
        run.lines_cases()


def test_unknown_models_and_stages_are_refused(tmp_path, capsys):
    config = reproduce.load_config(SMOKE, corpus=DATA)
    with pytest.raises(ValueError, match=r"\['nope'\].*\['full', 'ctx256', 'swa64'\]"):
        reproduce.Run(config, str(tmp_path), ["full", "nope"])
    with pytest.raises(SystemExit):
        reproduce.main(["--config", SMOKE, "--output-dir", str(tmp_path), "--stages", "train,fly"])
    assert "unknown stages ['fly']" in capsys.readouterr().err
    assert reproduce.parse_stages("report,train") == ["train", "report"]
    assert reproduce.parse_stages("all") == list(reproduce.STAGES)


def test_stages_say_which_stage_to_run_first(tmp_path):
    run = reproduce.Run(reproduce.load_config(SMOKE, corpus=DATA), str(tmp_path))
    with pytest.raises(ValueError, match="run the 'tokenizer' stage first"):
        run.stage_data()


def test_validation_documents_are_exactly_the_evaluation_length():
    tokenizer = byte_level_bpe(600, add_bos=False)
    texts = list(govreport_texts()[:3])
    documents = cut_documents(tokenizer, texts, 200, 7)
    assert len(documents) == 7
    # the first chunk of every text first, then the second ones
    assert (
        documents[0] in texts[0] and documents[1] in texts[1] and documents[2] in texts[2] and documents[3] in texts[0]
    )
    for document in documents:
        assert len(tokenizer(document, add_special_tokens=False)["input_ids"]) == 200
    assert cut_documents(tokenizer, ["too short"], 200, 3) == []


def test_learning_rate_warms_up_then_follows_the_cosine():
    peak, steps, warmup, floor = 1e-3, 100, 10, 0.1
    assert learning_rate(0, steps, peak, warmup, floor) == pytest.approx(peak / 10)
    assert learning_rate(9, steps, peak, warmup, floor) == pytest.approx(peak)
    middle = learning_rate(55, steps, peak, warmup, floor)
    assert middle == pytest.approx(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert learning_rate(100, steps, peak, warmup, floor) == pytest.approx(peak * floor)


def test_training_batches_put_lines_documents_at_the_end_of_book_windows():
    books = np.arange(10, 1010, dtype=np.uint16)
    document = np.array([1, 2, 3, 4], dtype=np.uint16)
    every = TrainingBatches(books, [document], 16, 1.0, 0).sequences(5)
    assert every.shape == (5, 16) and every.dtype == np.int64
    assert (every[:, -4:] == document).all()
    # the rest of each row is a window of the books
    for row in every:
        start = int(np.flatnonzero(books == row[0])[0])
        assert (row[:12] == books[start : start + 12]).all()
    never = TrainingBatches(books, [], 16, 0.0, 0).sequences(3)
    assert not np.isin(never, document).any()
    with pytest.raises(ValueError, match="not enough for one sequence of 2000"):
        TrainingBatches(books, [], 2000, 0.0, 0)


def test_help_is_quick():
    code = "import runpy, sys; sys.argv=['reproduce_longppl.py', '--help']\ntry:\n runpy.run_path(sys.argv[0] and 'scripts/reproduce_longppl.py', run_name='__main__')\nexcept SystemExit: pass\nprint('HEAVY', [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])"
    # `import longppl` registers the metric with evaluate (which loads torch) when evaluate's copy is
    # stale; that one-off is register's business (test_script_help), not this script's imports.
    env = dict(os.environ, LONGPPL_AUTO_REGISTER="0")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--stages" in done.stdout and "--validation-corpus" in done.stdout
    assert "HEAVY []" in done.stdout
