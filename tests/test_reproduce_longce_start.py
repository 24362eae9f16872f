"""The LongCE-from-a-real-start phases on tiny random models built here: the shuffled-weights
control keeps each document's weights and its unscored positions, and the phases start -> weights
-> train -> evaluate run end to end, resume without duplicating rows, and count the frozen arm's
one-off scoring in its compute."""

import gzip
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from helpers import REPO, byte_level_bpe, run_guarded, run_real_models_stage, run_while_locked, tiny_model, write_books
from longppl_reproduce.real_models.longce_start import frozen_weights, shuffled_weights


def _documents():
    rng = np.random.default_rng(3)
    found = []
    for n in (12, 30, 7):
        row = rng.uniform(0.2, 5.0, n).astype(np.float32)
        row[: min(4, n)] = np.nan  # the first positions have no short-context score
        found.append(row)
    return found


def test_shuffled_weights_keep_each_documents_weights_in_another_order():
    weights = _documents()
    shuffled = shuffled_weights(weights, seed=5)
    assert len(shuffled) == len(weights)
    moved = 0
    for before, after in zip(weights, shuffled):
        assert after.shape == before.shape
        scored = ~np.isnan(before)
        assert np.isnan(after[~scored]).all() and not np.isnan(after[scored]).any()  # unscored stay put
        np.testing.assert_array_equal(np.sort(after[scored]), np.sort(before[scored]))
        moved += int(not np.array_equal(after[scored], before[scored]))
    assert moved >= 2  # the long documents are permuted


def test_shuffled_weights_are_set_by_the_seed():
    weights = _documents()
    first, again, other = (shuffled_weights(weights, s) for s in (1, 1, 2))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, c, equal_nan=True) for a, c in zip(first, other))
    np.testing.assert_array_equal(weights[1][:4], np.full(4, np.nan))  # the input is not changed in place


def test_shuffled_weights_keep_positions_an_explicit_mask_calls_unscored():
    # the library's cached weights mark no score by the weight min(1, gamma) itself: the mask says which
    row = np.array([1.0, 1.0, 1.0, 0.5, 4.0, 2.0, 3.0, 1.0], dtype=np.float32)
    scored = np.array([False, False, False, True, True, True, True, True])
    (after,) = shuffled_weights([row], 0, [scored])
    np.testing.assert_array_equal(after[:3], row[:3])
    np.testing.assert_array_equal(np.sort(after[3:]), np.sort(row[3:]))
    with pytest.raises(ValueError, match="one flag per weight"):
        shuffled_weights([row], 0, [scored[:4]])


def test_frozen_weights_are_the_models_own_capped_long_short_ratio():
    """Against a plain reference: token i >= K + d is predicted short from the window start
    s = ((i - K) // d) * d, its weight min(exp(lp_long - lp_short), gamma); earlier tokens weigh 1."""
    model = tiny_model("llama", 64, seed=2).eval()
    rows = np.random.default_rng(0).integers(3, 64, size=(2, 40))
    k, d, gamma = 8, 4, 1.5
    weights, scored = frozen_weights(model, rows, (k, d), gamma)
    assert weights.shape == scored.shape == (2, 40)
    with torch.no_grad():
        for row, got, flags in zip(rows, weights, scored):
            ids = torch.as_tensor(row[None])
            long = model(ids).logits[0].log_softmax(-1)
            for i in range(40):
                if i < k + d:
                    assert not flags[i] and got[i] == 1.0
                    continue
                s = ((i - k) // d) * d
                short = model(ids[:, s:i]).logits[0, -1].log_softmax(-1)[row[i]]
                expected = min(float(torch.exp(long[i - 1, row[i]] - short)), gamma)
                assert flags[i] and got[i] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert (weights[scored] != 1.0).any()


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """A tiny Gemma-like evaluator (a Llama under the byte-level BPE stands in) and a tiny Llama as
    SmolLM2, trained to 512 positions; training and held-out books."""
    root = tmp_path_factory.mktemp("longce-start")
    tokenizer = byte_level_bpe()
    folders = {}
    for name, model in (
        ("gemma", tiny_model("llama", len(tokenizer), seed=5, max_positions=1024)),
        ("smollm2", tiny_model("llama", len(tokenizer), seed=6, max_positions=512)),
    ):
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    books = write_books(root / "books")
    records = root / "run" / "records"
    records.mkdir(parents=True)
    # the LongPPL study's calibrated alpha of the Gemma evaluator, which the LongPPL outcome reads
    (records / "calibration.jsonl").write_text(json.dumps({"key": "gemma", "evaluator": "gemma", "alpha": 0.0}) + "\n")
    return types.SimpleNamespace(root=root, folders=folders, books=books, records=records)


def _call(study, stage, *extra):
    return run_real_models_stage(study, stage, "--starts", "s2", *extra)


def _rows(study, name):
    return [json.loads(line) for line in open(study.records / f"{name}.jsonl")]


@pytest.mark.slow
def test_longce_phases_run_end_to_end_and_resume_without_duplicating_rows(tiny_study, capsys):
    assert _call(tiny_study, "longce-weights") == 2
    assert "run the 'longce-start' phase first" in capsys.readouterr().err
    for _ in range(2):
        assert _call(tiny_study, "longce-start") == 0
    start = _rows(tiny_study, "longce_start")
    assert [r["key"] for r in start] == ["s2", "pilot/s2"]
    assert start[0]["gate_set"] == "lines-within-512" and start[0]["primary"] in ("lines-beyond", "recall")
    assert start[1]["r"] > 0
    config = json.loads((tiny_study.root / "run" / "longce_models" / "s2" / "start" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 1024

    for _ in range(2):
        assert _call(tiny_study, "longce-weights") == 0
    (weights,) = _rows(tiny_study, "longce_weights")
    assert weights["scoring_seconds"] > 0 and weights["sequences"] == 2
    with np.load(tiny_study.root / "run" / "longce_weights" / "s2.npz") as data:
        assert data["weights"].shape == (2, 1024) and data["scored"][:, :192].sum() == 0  # K + d unscored

    for _ in range(2):
        assert _call(tiny_study, "longce-train") == 0
    trained = {r["key"]: r for r in _rows(tiny_study, "longce_train")}
    assert sorted(trained) == sorted(f"s2/{arm}-s0" for arm in ("ce", "self", "frozen", "shuffled", "ce-fresh"))
    assert len(_rows(tiny_study, "longce_train")) == 5
    for arm in ("frozen", "shuffled"):  # the one-off scoring is counted in these arms' compute
        row = trained[f"s2/{arm}-s0"]
        assert row["scoring_seconds"] == weights["scoring_seconds"]
        assert row["compute_seconds"] == pytest.approx(row["seconds"] + weights["scoring_seconds"])
    assert trained["s2/ce-s0"]["compute_seconds"] == trained["s2/ce-s0"]["seconds"]
    assert trained["s2/ce-fresh-s0"]["steps"] == max(2, round(start[1]["r"] * 2))
    assert [trained[f"s2/{a}-s0"]["longce_weights"] for a in ("ce", "self", "frozen")] == ["none", "self", "cache"]

    # a fresh machine: the records came back, the models and weights did not
    shutil.rmtree(tiny_study.root / "run" / "longce_models")
    (tiny_study.root / "run" / "longce_weights" / "s2.npz").unlink()
    assert _call(tiny_study, "longce-start") == 0 and _call(tiny_study, "longce-weights") == 0
    assert _call(tiny_study, "longce-train", "--arms", "ce,frozen") == 0
    assert "s2/frozen-s0 trained again" in capsys.readouterr().out
    assert len(_rows(tiny_study, "longce_start")) == 2 and len(_rows(tiny_study, "longce_weights")) == 1
    assert len(_rows(tiny_study, "longce_train")) == 5
    for _ in range(2):
        assert _call(tiny_study, "longce-evaluate", "--arms", "ce,frozen") == 0
    rows = _rows(tiny_study, "longce_evaluate")
    assert [r["key"] for r in rows] == ["s2/start", "s2/ce-s0/1", "s2/ce-s0/2", "s2/frozen-s0/1", "s2/frozen-s0/2"]
    assert set(rows[0]["tasks"]) == {
        "lines-beyond-1024",
        "needle-1024",
        "recall-1024",
        "lines-within-448",
        "lines-within-512",
    }
    assert rows[1]["books"]["ppl"] > 0 and "longppl" in rows[1]["books"]
    assert _call(tiny_study, "longce-train", "--arms", "ce,frozen") == 0  # evaluated: not trained again
    assert "trained again" not in capsys.readouterr().out
    assert _call(tiny_study, "longce-train", "--arms", "sideways") == 2
    assert "Unknown arms" in capsys.readouterr().err

    # the report stage reads what the phases wrote: each run's outcomes at its last checkpoint are
    # the evaluate records' task means, and the runs never trained or evaluated are listed as missing
    assert _call(tiny_study, "longce-report") == 0
    found = json.loads((tiny_study.root / "run" / "longce_results.json").read_text())
    s2 = found["starts"]["s2"]
    by_key = {r["key"]: r for r in rows}
    for run in s2["runs"]:
        tasks = by_key[f"{run['run']}/2"]["tasks"]
        within = [tasks[f"lines-within-{n}"]["accuracy"] for n in (448, 512)]
        assert run["lines_within"] == pytest.approx(sum(within) / 2)
        assert run["needle"] == pytest.approx(tasks["needle-1024"]["accuracy"])
        assert run["ppl"] == pytest.approx(by_key[f"{run['run']}/2"]["books"]["ppl"])
    assert sorted(r["run"] for r in s2["runs"]) == ["s2/ce-s0", "s2/frozen-s0"]
    assert any(m.startswith("s2/self-s0") for m in s2["missing"])
    assert found["starts"]["s1"]["skipped"].startswith("no gate record of s1")
    assert "# " in (tiny_study.root / "run" / "longce_report.md").read_text()


@pytest.mark.slow
def test_longce_chain_evaluates_each_unit_before_training_the_next(tiny_study, tmp_path, capsys):
    # books in capitals: the helpers' books are the CRS reports, which the evaluation must not read
    books = tmp_path / "books"
    books.mkdir()
    for name in ("validation", "train"):
        with gzip.open(os.path.join(tiny_study.books, f"{name}.jsonl.gz"), "rt", encoding="utf-8") as source:
            rows = [json.loads(line) for line in source]
        with gzip.open(books / f"{name}.jsonl.gz", "wt", encoding="utf-8") as target:
            target.writelines(json.dumps({"text": r["text"].upper()}) + "\n" for r in rows)
    study = types.SimpleNamespace(root=tmp_path, folders=tiny_study.folders, books=str(books))
    records = tmp_path / "run" / "records"
    records.mkdir(parents=True)
    shutil.copy(tiny_study.records / "calibration.jsonl", records)
    assert _call(study, "longce-start") == 0
    # every task set of the start is built before the first evaluation (side by side, not one by one there)
    from longppl_reproduce.real_models.longce_start import SMALL, task_sets

    start = next(s for s in SMALL.starts if s.name == "s2")
    written = sorted(p.name for p in (tmp_path / "run" / "tasks" / "longce-smollm2").iterdir())
    assert written == sorted(f"{name}.jsonl" for name, *_ in task_sets(SMALL, start))
    assert f"longce-start: {len(written)} task sets written" in capsys.readouterr().out
    assert _call(study, "longce-chain", "--arms", "ce,frozen") == 0
    done = [
        line.split(" ")[1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("longce-train: s2/", "longce-evaluate: s2/", "longce-weights: s2 ")) and " kept" not in line
    ]
    # the start evaluated first (saved here), then each unit trained and its checkpoints evaluated
    # before the next unit; the frozen unit's weights scored on the way (no 'longce-weights' phase ran)
    assert done == [
        "s2/start",
        "s2/ce-s0",
        "s2/ce-s0/1",
        "s2/ce-s0/2",
        "s2",
        "s2/frozen-s0",
        "s2/frozen-s0/1",
        "s2/frozen-s0/2",
    ]
    assert [r["key"] for r in json.loads("[" + ",".join(open(records / "longce_weights.jsonl")) + "]")] == ["s2"]
    # PPL and LongPPL were read on held-out books, not on the CRS reports
    texts = json.loads((tmp_path / "run" / "documents" / "books-longce-s2.json").read_text())
    assert len(texts) == 2 and all(len(t) > 1000 and t == t.upper() for t in texts)
    # a fresh machine: every unit evaluated, so nothing is trained or scored again
    shutil.rmtree(tmp_path / "run" / "longce_models")
    (tmp_path / "run" / "longce_weights" / "s2.npz").unlink()
    assert _call(study, "longce-start") == 0 and _call(study, "longce-chain", "--arms", "ce,frozen") == 0
    out = capsys.readouterr().out
    assert "trained again" not in out and "scored again" not in out
    assert len(open(records / "longce_train.jsonl").readlines()) == 2
    assert len(open(records / "longce_evaluate.jsonl").readlines()) == 5


def test_longce_chain_without_the_evaluators_calibration_stops_before_training(tiny_study, tmp_path, capsys):
    study = types.SimpleNamespace(root=tmp_path, folders=tiny_study.folders, books=tiny_study.books)
    (tmp_path / "run" / "records").mkdir(parents=True)
    assert _call(study, "longce-chain", "--arms", "ce") == 2
    assert "run the 'calibrate' phase first" in capsys.readouterr().err
    assert not (tmp_path / "run" / "longce_models").exists()
    assert not (tmp_path / "run" / "records" / "longce_train.jsonl").exists()


@pytest.mark.slow
def test_a_start_being_scored_by_another_process_is_waited_for_not_scored_again(tiny_study, tmp_path, monkeypatch):

    from longppl_reproduce.real_models import longce_start, phases

    study = types.SimpleNamespace(root=tmp_path, folders=tiny_study.folders, books=tiny_study.books)
    (tmp_path / "run" / "records").mkdir(parents=True)
    shutil.copy(tiny_study.records / "calibration.jsonl", tmp_path / "run" / "records")
    assert _call(study, "longce-start") == 0
    run = phases.Run(
        str(tmp_path / "run"),
        study.books,
        study.folders["gemma"],
        study.folders["smollm2"],
        "cpu",
        1e9,
        None,
        phases.SMALL,
    )
    choice = longce_start.Choice(longce_start.SMALL, longce_start.SMALL.starts[1:], ("frozen",), (0,))
    path = longce_start.weights_path(run, choice.starts[0])

    def scoring_model(*args):
        raise AssertionError("the start's weights were scored again")

    def fill():  # the other process's weights
        ids = np.zeros((2, 1024), dtype=np.int64)
        np.savez(path, weights=np.ones((2, 1024), np.float32), scored=np.ones((2, 1024), bool), input_ids=ids)

    monkeypatch.setattr(longce_start, "_scoring_model", scoring_model)
    run_while_locked(monkeypatch, path, lambda: longce_start.score_weights(run, choice), fill)
    assert "longce-weights: s2 scored by another process" in run.log_lines
    assert not (tmp_path / "run" / "records" / "longce_weights.jsonl").exists()  # the scorer records it


def _unit(choice):
    (start,), (arm,), (seed,) = choice.starts, choice.arms, choice.seeds
    return start.name, arm, seed


def test_a_corpus_name_that_names_no_source_is_refused(tmp_path):
    from longppl_reproduce.real_models import phases

    run = phases.Run(str(tmp_path), "", "", "", "cpu", 1.0, None, phases.PLAN)
    with pytest.raises(ValueError, match="start its name with 'books'"):
        phases.corpus_texts(run, "longce-books-s1", None, 1024, 2)
    assert not (tmp_path / "documents").exists()


WORKERS_SCRIPT = os.path.join(REPO, "scripts", "reproduce", "real_models", "run_longce_workers.sh")


def _workers(study, seconds, *options, **environ):
    """``run_longce_workers.sh`` on the tiny study, on the CPU at the smoke sizes, start s2."""
    env = dict(os.environ, DEVICES="cpu", PYTHON=sys.executable, **environ)
    paths = ["--run", str(study.root / "run"), "--books", study.books]
    paths += ["--gemma", study.folders["gemma"], "--smollm2", study.folders["smollm2"], "--small", "--starts", "s2"]
    return run_guarded(
        ["bash", WORKERS_SCRIPT, str(seconds), *paths, *options], env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_the_workers_script_runs_each_unit_once_across_its_processes(tiny_study, tmp_path):
    records = tmp_path / "run" / "records"
    records.mkdir(parents=True)
    shutil.copy(tiny_study.records / "calibration.jsonl", records)
    study = types.SimpleNamespace(root=tmp_path, folders=tiny_study.folders, books=tiny_study.books, records=records)
    done = _workers(study, 900, "--arms", "ce,self", WORKERS="2", PASSES="2")
    assert done.returncode == 0, done.stderr
    # two processes, each with its log: the first built the start, the second found it
    (folder,) = (tmp_path / "run" / "logs").glob("longce-workers-*")
    logs = {p.name: p.read_text() for p in folder.iterdir()}
    assert sorted(logs) == ["cpu-1.log", "cpu-2.log"], logs.keys()
    assert sum("longce-start: s2 kept" in text for text in logs.values()) == 1
    assert all("== longce-chain pass 2 on cpu" in text for text in logs.values())
    # every unit trained once and every evaluation made once, whichever process did it
    assert sorted(r["key"] for r in _rows(study, "longce_train")) == ["s2/ce-s0", "s2/self-s0"]
    evaluated = [r["key"] for r in _rows(study, "longce_evaluate")]
    assert sorted(evaluated) == sorted(["s2/start", "s2/ce-s0/1", "s2/ce-s0/2", "s2/self-s0/1", "s2/self-s0/2"])
    assert [r["key"] for r in _rows(study, "longce_start")] == ["s2", "pilot/s2"]


def test_the_workers_script_shows_each_process_its_gpu_alone(tmp_path):
    # a stand-in interpreter that records what each stage was given; the stages themselves are tested above
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$CUDA_VISIBLE_DEVICES $*" >> {seen}\n')
    fake.chmod(0o755)
    env = dict(os.environ, DEVICES="cuda:2 cuda:0", WORKERS="1", PASSES="1", PYTHON=str(fake))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = run_guarded(
        ["bash", WORKERS_SCRIPT, "120", "--run", str(tmp_path / "run")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(seen.read_text().splitlines())
    stages = [(line.split()[0], line.split()[3], line.split()[line.split().index("--device") + 1]) for line in lines]
    assert sorted(stages) == [("0", "longce-chain", "cuda:0"), ("0", "longce-start", "cuda:0"),
                              ("2", "longce-chain", "cuda:0"), ("2", "longce-start", "cuda:0")]  # fmt: skip
    (folder,) = (tmp_path / "run" / "logs").glob("longce-workers-*")
    assert sorted(p.name for p in folder.iterdir()) == ["cuda0-1.log", "cuda2-1.log"]
    assert "== longce-chain pass 1 on cuda:2" in (folder / "cuda2-1.log").read_text()


@pytest.mark.slow
def test_the_workers_script_refuses_a_bad_time_or_an_option_it_sets(tiny_study, tmp_path):
    study = types.SimpleNamespace(root=tmp_path, folders=tiny_study.folders, books=tiny_study.books)
    for seconds, options, said in (
        ("ten", (), "SECONDS, a whole number of seconds above 0"),
        ("0", (), "SECONDS, a whole number of seconds above 0"),
        ("60", ("--device", "cuda:1"), "--device is set here"),
        ("60", ("--budget-seconds=5",), "--budget-seconds=5 is set here"),
        ("60", ("--workers", "2"), "--workers is set here"),
    ):
        done = _workers(study, seconds, *options)
        assert done.returncode == 2 and said in done.stderr, (seconds, options, done.stderr)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
