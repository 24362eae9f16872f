"""The real-models study's members and phases, on tiny random models built here: a windowed Gemma
reads no further than its window (per layer, and through depth), a context-limited member reads at
most its context, RoPE scaling touches only the full layers, and the phases resume without
duplicating a row."""

import dataclasses
import json
import math
import os
import shutil
import types

import numpy as np
import pytest
import torch
from helpers import (
    byte_level_bpe,
    plain_greedy,
    run_real_models_stage,
    run_while_locked,
    tiny_gemma3,
    tiny_model,
    windows_in_blocks,
    write_books,
)
from longppl_reproduce.real_models import members, phases
from transformers import Gemma3ForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding


def twin(model):
    other = Gemma3ForCausalLM(model.config.__class__.from_dict(model.config.to_dict())).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_one_full_layer_limited_to_w_is_the_model_on_the_last_w_tokens():
    plain = tiny_gemma3(["full_attention"])
    windowed = members.limit_full_attention(twin(plain), 6)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        limited = windowed(ids).logits[0]
        full = plain(ids).logits[0]
        for t in range(24):
            first = max(0, t - 5)
            reference = plain(ids[:, first : t + 1], position_ids=torch.arange(first, t + 1)[None]).logits[0, -1]
            torch.testing.assert_close(limited[t], reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(limited[20], full[20], atol=1e-4)  # the plain model reads further


def test_a_windowed_stack_reads_no_token_beyond_its_reach():
    """Four layers (sliding 4, full limited to 5): position t depends on no token before t - 14
    (the sum of the layers' windows less one each), while the plain model's full layers read them."""
    plain = tiny_gemma3(["sliding_attention", "full_attention"] * 2)
    windowed = members.limit_full_attention(twin(plain), 5)
    reach = 2 * (4 - 1) + 2 * (5 - 1)
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, : 39 - reach] = (changed[0, : 39 - reach] + 7) % 61 + 3
    with torch.no_grad():
        torch.testing.assert_close(windowed(ids).logits[0, 39], windowed(changed).logits[0, 39], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(ids).logits[0, 39], plain(changed).logits[0, 39], atol=1e-4)
        # and the token just within reach does matter to the windowed model
        near = ids.clone()
        near[0, 39 - reach] = (near[0, 39 - reach] + 7) % 61 + 3
        assert not torch.allclose(windowed(ids).logits[0, 39], windowed(near).logits[0, 39], atol=1e-6)


def test_a_windowed_member_generates_as_its_full_forward_predicts():
    """Greedy generation (with its key-value cache) takes the windowed masks too."""
    windowed = members.limit_full_attention(tiny_gemma3(["sliding_attention", "full_attention"]), 5)
    ids = torch.randint(3, 64, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        generated = windowed.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 30:]
        expected, current = [], ids
        for _ in range(6):
            token = windowed(current).logits[0, -1].argmax()
            expected.append(int(token))
            current = torch.cat([current, token.view(1, 1)], dim=1)
    assert generated.tolist() == expected


def test_limits_refuse_what_they_cannot_apply():
    with pytest.raises(ValueError, match="needs a Gemma 3 text model"):
        members.limit_full_attention(tiny_model("llama", 64), 8)
    with pytest.raises(ValueError, match="window must be"):
        members.limit_full_attention(tiny_gemma3(["full_attention"]), 0)
    with pytest.raises(ValueError, match="'linear' or 'yarn'"):
        members.gemma_rope_scaled(tiny_gemma3(["full_attention"]).config, "ntk", 2.0)


def test_gemma_rope_scaling_touches_only_the_full_layers():
    config = tiny_gemma3(["sliding_attention", "full_attention"]).config
    before = Gemma3RotaryEmbedding(config)
    members.gemma_rope_scaled(config, "linear", 4.0)
    after = Gemma3RotaryEmbedding(config)
    torch.testing.assert_close(after.sliding_attention_inv_freq, before.sliding_attention_inv_freq)
    torch.testing.assert_close(after.full_attention_inv_freq, before.full_attention_inv_freq / 4.0)
    assert config.max_position_embeddings == 2048


def test_context_limited_log_probs_read_at_most_the_context():
    model = tiny_model("llama", 64, seed=4)
    ids = torch.randint(3, 64, (50,), generator=torch.Generator().manual_seed(4))
    context = 12
    (found,) = members.context_limited_log_probs(model, [ids], context)
    trunc_len, stride = context - context // 4, context // 4
    with torch.no_grad():
        for i in range(1, 50):
            start = 0 if i < trunc_len else (i - trunc_len) // stride * stride
            assert i - start <= context
            lp = torch.log_softmax(model(ids[start : i + 1][None]).logits[0, -2].double(), -1)[ids[i]]
            assert float(found[i]) == pytest.approx(float(lp), abs=1e-4)


def test_lines_prompts_end_with_the_answers_opening():
    from longppl_reproduce.common.lines import generate_lines_cases
    from longppl_reproduce.real_models import tasks

    (case,) = generate_lines_cases(3, 1, seed=0)
    opened = tasks.with_answer_opening(case)
    assert opened.prompt == case.prompt + " " + f"The <REGISTER_CONTENT> in line {case.target_line} is <"
    assert opened.expected_number == case.expected_number


def test_a_written_task_set_is_read_back_and_scored_as_its_kind(tmp_path):
    from longppl_reproduce.common.lines import generate_lines_cases, write_lines_cases
    from longppl_reproduce.real_models import tasks

    cases = generate_lines_cases(3, 2, seed=1)
    write_lines_cases(str(tmp_path / "lines-within-900.jsonl"), cases)
    read = tasks.read_task_set(str(tmp_path / "lines-within-900.jsonl"))
    assert read == cases
    opened = tasks.as_scored("lines-within", read)
    assert [c.prompt for c in opened] == [c.prompt + " " + c.answer[: c.answer.rfind(c.expected_number)] for c in cases]
    assert tasks.as_scored("needle", read) == cases  # only lines prompts get the answer's opening
    with pytest.raises(ValueError, match=r"Unknown task kind 'passages'.*lines-beyond-32768"):
        tasks.read_task_set(str(tmp_path / "passages-900.jsonl"))


def test_the_population_has_the_planned_size():
    found = members.population()
    assert len(found) == 54 and len({m.cluster for m in found}) == 12
    assert len({m.name for m in found}) == 54
    gemma_windows = {m.window for m in found if m.kind == "window"}
    assert gemma_windows == set(members.WINDOWS)


def test_records_drop_a_line_cut_short_and_keep_whole_rows(tmp_path):
    path = tmp_path / "records" / "x.jsonl"
    records = phases.Records(str(path))
    records.append("a", {"value": 1})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"key": "b", "val')  # a kill in the middle of a row
    records = phases.Records(str(path))
    assert [r["key"] for r in records.rows()] == ["a"]
    records.append("b", {"value": 2})
    assert records.keys() == {"a", "b"}


def bare_run(root) -> phases.Run:
    """A run folder for the phases' bookkeeping alone (no models, no books)."""
    return phases.Run(str(root), "", "", "", "cpu", 1e9, None, phases.SMALL)


def test_pending_leaves_a_unit_another_process_holds_and_holds_each_unit_while_it_runs(tmp_path):
    from longppl_reproduce.real_models.claims import claim

    run = bare_run(tmp_path / "run")
    records, budget = run.records("score"), phases.Budget(1e9)
    units = ((key, key.upper()) for key in ("a", "b", "c"))
    seen = []
    with claim(run.root, "score", "b") as mine:  # another worker's claim on b (a lock of its own)
        assert mine is None
        for key, unit in phases.pending(run, "score", records, budget, units):
            with claim(run.root, "score", key) as other:  # a second worker asking for the unit now
                assert other == f"held by process {os.getpid()}"
            seen.append((key, unit))
            records.append(key, {})
    assert seen == [("a", "A"), ("c", "C")]
    assert f"score: b held by process {os.getpid()}; left to it" in run.log_lines
    with claim(run.root, "score", "a") as free:  # released once the worker asked for the next unit
        assert free is None
    assert [key for key, _ in phases.pending(run, "score", records, budget, iter([("b", 0)]))] == ["b"]


def test_pending_skips_a_unit_done_by_another_process_after_it_looked(tmp_path):
    run = bare_run(tmp_path / "run")
    records, budget = run.records("score"), phases.Budget(1e9)

    def units():
        yield "a", 1
        records.append("b", {})  # another process finished b after this one read the records
        yield "b", 2

    assert [key for key, _ in phases.pending(run, "score", records, budget, units())] == ["a"]
    assert "score: b done by another process" in run.log_lines


def test_a_killed_holder_leaves_its_unit_free(tmp_path):
    import subprocess
    import sys

    from helpers import wait_guarded

    run = bare_run(tmp_path / "run")
    records, budget = run.records("score"), phases.Budget(1e9)
    holder = (
        "import sys\n"
        "from longppl_reproduce.real_models.claims import claim\n"
        f"with claim({run.root!r}, 'score', 'a') as held:\n"
        "    print('free' if held is None else held, flush=True)\n"
        "    sys.stdin.read()\n"  # holds the claim until killed
    )
    process = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "free"
        assert [key for key, _ in phases.pending(run, "score", records, budget, iter([("a", 0)]))] == []
    finally:
        process.kill()
        wait_guarded(process)
    assert [key for key, _ in phases.pending(run, "score", records, budget, iter([("a", 0)]))] == ["a"]


def test_held_names_the_claims_live_processes_hold_and_not_a_killed_ones(tmp_path):
    import subprocess
    import sys

    from helpers import wait_guarded
    from longppl_reproduce.real_models.claims import claim, held

    root = str(tmp_path / "run")
    assert held(root, "longce-chain/cuda~0") == []  # never claimed
    holder = (
        "import sys\n"
        "from longppl_reproduce.real_models.claims import claim\n"
        f"with claim({root!r}, 'longce-chain/cuda~0', 'other') as mine:\n"
        "    print('free' if mine is None else mine, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "free"
        with claim(root, "longce-chain/cuda~0", "cuda:0 mine") as mine:
            assert mine is None
            with claim(root, "longce-chain/cuda~0", "gone"):
                pass  # claimed and let go: its file stays
            assert held(root, "longce-chain/cuda~0") == ["cuda~0~mine", "other"]
            # probing left every claim as it was
            with claim(root, "longce-chain/cuda~0", "other") as again:
                assert again is not None and again.startswith("held by process")
    finally:
        process.kill()
        wait_guarded(process)
    assert held(root, "longce-chain/cuda~0") == []


def test_pending_writes_each_line_once_to_a_caller_that_asks_again(tmp_path):
    from longppl_reproduce.real_models.claims import claim

    run = bare_run(tmp_path / "run")
    records, budget, said = run.records("score"), phases.Budget(1e9), set()
    records.append("a", {})
    with claim(run.root, "score", "b"):
        for _ in range(3):
            assert list(phases.pending(run, "score", records, budget, [("a", 0), ("b", 0)], said=said)) == []
    assert run.log_lines.count("score: a kept") == 1
    assert run.log_lines.count(f"score: b held by process {os.getpid()}; left to it") == 1
    list(phases.pending(run, "score", records, budget, [("a", 0)]))  # without: every time
    assert run.log_lines.count("score: a kept") == 2


def test_a_corpus_being_scored_is_waited_for_and_read_not_scored_again(tmp_path, monkeypatch):
    run = bare_run(tmp_path / "run")
    evaluator = phases.Evaluator("gemma", "unused", (4, 2), 8, 8)
    path = tmp_path / "run" / "scores" / "gemma-books.npz"

    def load_plain(*args):
        raise AssertionError("the corpus was scored again")

    def fill():  # the other process's scores
        path.parent.mkdir(parents=True, exist_ok=True)  # the lock made the folder
        ids = np.arange(5, dtype=np.int64)
        np.savez(
            path,
            lengths=np.array([2, 3]),
            input_ids=ids,
            offsets=np.stack([ids, ids + 1], axis=1),
            lp_long=-np.arange(5.0),
            lp_short=-np.arange(5.0) * 2,
        )

    monkeypatch.setattr(phases, "load_plain", load_plain)
    scores = run_while_locked(monkeypatch, path, lambda: phases.evaluator_scores(run, evaluator, "books", ["x"]), fill)
    assert [s.input_ids.tolist() for s in scores] == [[0, 1], [2, 3, 4]]
    assert scores[1].lp_short.tolist() == [-4.0, -6.0, -8.0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two tiny evaluators in model folders (a Gemma 3 and a Llama under a byte-level BPE) and
    held-out books."""
    root = tmp_path_factory.mktemp("real")
    tokenizer = byte_level_bpe()
    folders = {}
    for name, model in (
        ("gemma", tiny_gemma3(["sliding_attention", "full_attention"], 16, 5, len(tokenizer), 1024)),
        ("smollm2", tiny_model("llama", len(tokenizer), seed=6, max_positions=1024)),
    ):
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    books = write_books(root / "books")
    return types.SimpleNamespace(root=root, folders=folders, books=books)


@pytest.mark.slow
def test_phases_resume_without_duplicating_rows(tiny_run, capsys):
    run = tiny_run.root / "run" / "records"
    assert run_real_models_stage(tiny_run, "score") == 2
    assert "run the 'calibrate' phase first" in capsys.readouterr().err
    assert run_real_models_stage(tiny_run, "calibrate") == 0
    calibration = [json.loads(line) for line in open(run / "calibration.jsonl")]
    assert [r["evaluator"] for r in calibration] == ["gemma", "smollm2"]
    assert run_real_models_stage(tiny_run, "calibrate") == 0
    assert len(open(run / "calibration.jsonl").readlines()) == 2

    assert run_real_models_stage(tiny_run, "prepare", "--workers", "2") == 0
    sets = sorted(os.listdir(tiny_run.root / "run" / "tasks" / "gemma"))
    assert len(sets) == 8 and sets[0] == "lines-beyond-448.jsonl"
    assert run_real_models_stage(tiny_run, "prepare") == 0
    assert "every task set kept" in capsys.readouterr().out
    assert run_real_models_stage(tiny_run, "score", "--members", "gemma-w32k,gemma-c1k") == 0
    rows = [json.loads(line) for line in open(run / "members.jsonl")]
    assert [r["member"] for r in rows] == ["gemma-c1k", "gemma-w32k"]  # in the population's order
    assert set(rows[0]["tasks"]) == {
        f"{kind}-{length}" for kind in ("lines-beyond", "lines-within", "needle", "recall") for length in (448, 640)
    }
    assert set(rows[0]["longppl"]) == {"books-gemma", "govreport-gemma", "books-smollm2"}
    # beside the calibrated alpha (the smoke grid's 0 or 0.5), LongPPL at the paper's alpha = 2: fewer key tokens
    for found in rows[0]["longppl"].values():
        assert found["paper_alpha"]["alpha"] == 2.0 and 0 <= found["paper_alpha"]["key_tokens"] <= found["key_tokens"]
    lines = rows[0]["tasks"]["lines-beyond-448"]
    assert len(lines["outputs"]) == len(lines["per_case"]) == 2
    assert lines["accuracy"] == sum(lines["per_case"]) / 2
    assert (
        run_real_models_stage(tiny_run, "score", "--members", "gemma-w32k,gemma-c1k,smollm2-yarn2-s0,smollm2-yarn2-s50")
        == 0
    )
    rows = [json.loads(line)["member"] for line in open(run / "members.jsonl")]
    assert rows == ["gemma-c1k", "gemma-w32k", "smollm2-yarn2-s0"]  # s50 waits for the fine-tuning phase
    assert "smollm2-yarn2-s50 is not fine-tuned yet" in capsys.readouterr().out
    assert run_real_models_stage(tiny_run, "finetune", "--members", "smollm2-yarn2-s50") == 0
    trained = tiny_run.root / "run" / "members" / "smollm2-yarn2-s50"
    record = json.loads((trained / "training.json").read_text())
    assert (record["steps"], record["length"], len(record["losses"])) == (2, 256, 2)
    config = json.loads((trained / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"  # the extension travels with the member
    assert run_real_models_stage(tiny_run, "finetune", "--members", "smollm2-yarn2-s50") == 0
    assert len(open(run / "finetune.jsonl").readlines()) == 1
    assert run_real_models_stage(tiny_run, "score", "--members", "smollm2-yarn2-s50") == 0
    rows = [json.loads(line)["member"] for line in open(run / "members.jsonl")]
    assert rows[-1] == "smollm2-yarn2-s50" and len(rows) == 4
    shutil.rmtree(trained)  # a fresh machine: the member's folder is gone, its score row kept
    assert run_real_models_stage(tiny_run, "finetune", "--members", "smollm2-yarn2-s50") == 0
    assert len(open(run / "finetune.jsonl").readlines()) == 2  # no task-documents row yet: trained again
    assert run_real_models_stage(tiny_run, "documents", "--members", "smollm2-yarn2-s50,gemma-c1k") == 0
    documented = [json.loads(line) for line in open(run / "task_documents.jsonl")]
    assert [r["member"] for r in documented] == ["gemma-c1k", "smollm2-yarn2-s50"]
    # the lines documents beyond K whole: Gemma's at both task lengths, SmolLM2's within its 512 tokens
    assert set(documented[0]["longppl"]) == {"tasks-gemma", "tasks-smollm2"}
    assert len(documented[0]["longppl"]["tasks-gemma"]["documents"]["nll"]) == 2 * 2
    assert len(documented[0]["longppl"]["tasks-smollm2"]["documents"]["nll"]) == 2
    assert os.path.isfile(tiny_run.root / "run" / "scores" / "gemma-tasks-gemma.npz")  # scored once, kept
    shutil.rmtree(trained)
    assert run_real_models_stage(tiny_run, "finetune", "--members", "smollm2-yarn2-s50") == 0
    assert len(open(run / "finetune.jsonl").readlines()) == 2  # scored by both phases: not trained again
    assert run_real_models_stage(tiny_run, "documents", "--members", "smollm2-yarn2-s50") == 0
    assert len(open(run / "task_documents.jsonl").readlines()) == 2  # kept, not scored again
    assert run_real_models_stage(tiny_run, "score", "--members", "gemma-w99k") == 2
    assert "Unknown members" in capsys.readouterr().err

    # the report stage reads what the phases wrote: each member's accuracies are its records' means
    assert run_real_models_stage(tiny_run, "report-real", "--resamples", "50") == 0
    found = json.loads((tiny_run.root / "run" / "results.json").read_text())
    scored = {r["member"]: r for r in (json.loads(line) for line in open(run / "members.jsonl"))}
    assert [r["member"] for r in found["rows"]] == list(scored)
    for row in found["rows"]:
        tasks = scored[row["member"]]["tasks"]
        for part in ("lines-beyond", "needle", "recall"):
            expected = sum(tasks[f"{part}-{n}"]["accuracy"] for n in (448, 640)) / 2
            assert row[part.replace("-", "_")] == pytest.approx(expected)
        assert row["longppl"] == pytest.approx(scored[row["member"]]["longppl"]["books-gemma"]["longppl"])
    # the task documents' LongPPL joins the members that have it, as a secondary measure
    by_member = {r["member"]: r for r in found["rows"]}
    tasks_longppl = documented[0]["longppl"]["tasks-gemma"]["longppl"]
    assert by_member["gemma-c1k"]["longppl:tasks"] == pytest.approx(tasks_longppl)
    assert math.isnan(by_member["gemma-w32k"]["longppl:tasks"])
    assert found["decision"]["outcome"] == "inconclusive"  # 4 members, not the plan's 40
    assert (tiny_run.root / "run" / "report.md").read_text().startswith("# LongPPL on real models")


@pytest.mark.slow
def test_a_calibration_with_no_qualifying_alpha_is_recorded_and_kept(tiny_run, tmp_path):
    # a negative ratio: no alpha can keep null key tokens at or below it, whatever the scores
    sizes = dataclasses.replace(phases.SMALL, max_null_ratio=-1.0)
    folders = tiny_run.folders
    run = phases.Run(
        str(tmp_path / "run"), tiny_run.books, folders["gemma"], folders["smollm2"], "cpu", 1e9, None, sizes
    )
    phases.calibrate(run)  # no error: the failure is the study's outcome, and SmolLM2 is reached
    rows = run.records("calibration").rows()
    assert [(r["evaluator"], r["alpha"]) for r in rows] == [("gemma", None), ("smollm2", None)]
    assert rows[0]["failed"].startswith("No alpha of grid [0.0, 0.5]") and rows[0]["grid"] == [0.0, 0.5]
    assert [t["alpha"] for t in rows[0]["table"]] == [0.0, 0.5]
    phases.calibrate(run)  # a finished unit: kept, not done again
    assert run.records("calibration").rows() == rows
    assert phases.alphas(run) == {"gemma": 2.0, "smollm2": 2.0}  # the later phases score at the paper's alpha


@pytest.mark.slow
def test_instrument_writes_its_checks_once(tiny_run):
    run = tiny_run.root / "run" / "records"
    if not os.path.isfile(run / "calibration.jsonl"):
        assert run_real_models_stage(tiny_run, "calibrate") == 0
    assert run_real_models_stage(tiny_run, "instrument") == 0
    rows = [json.loads(line) for line in open(run / "instrument.jsonl")]
    checks = {r["check"] for r in rows}
    assert checks == {"key-share", "answer-share", "window-order"}
    assert len([r for r in rows if r["check"] == "window-order"]) == 11  # 6 attention limits, 5 context limits
    assert run_real_models_stage(tiny_run, "instrument") == 0
    assert len(open(run / "instrument.jsonl").readlines()) == len(rows)


@pytest.mark.slow
def test_chain_carries_each_member_through_its_phases_before_the_next(tiny_run, tmp_path):
    from longppl_reproduce.real_models.claims import claim

    folders = tiny_run.folders
    chosen = ("smollm2-yarn2-s50", "smollm2-pi2-s50", "gemma-c1k")
    run = phases.Run(
        str(tmp_path / "run"), tiny_run.books, folders["gemma"], folders["smollm2"], "cpu", 1e9, chosen, phases.SMALL
    )
    phases.calibrate(run)
    with claim(run.root, "finetune", "smollm2-pi2-s50") as mine:  # another process fine-tuning it
        assert mine is None
        phases.chain(run)
    finished = [
        line.split(" LongPPL")[0].split(" 2 steps")[0]
        for line in run.log_lines
        if " LongPPL " in line or " steps, last loss " in line
    ]
    # in the population's order, each member's phases before the next member's; the member held
    # elsewhere is left whole to its holder (not scored here without weights)
    assert finished == [
        "score: gemma-c1k",
        "documents: gemma-c1k",
        "finetune: smollm2-yarn2-s50",
        "score: smollm2-yarn2-s50",
        "documents: smollm2-yarn2-s50",
    ]
    assert f"finetune: smollm2-pi2-s50 held by process {os.getpid()}; left to it" in run.log_lines
    for name in ("members", "task_documents"):
        assert [r["key"] for r in run.records(name).rows()] == ["gemma-c1k", "smollm2-yarn2-s50"]
    phases.chain(dataclasses.replace(run, members=chosen[:1], log_lines=[]))  # done: nothing again
    assert [r["key"] for r in run.records("finetune").rows()] == ["smollm2-yarn2-s50"]
    assert len(run.records("members").rows()) == 2


def test_training_books_are_tokenized_once_a_run_folder(tmp_path, monkeypatch):
    from longppl_reproduce.common.books import read_books

    run = dataclasses.replace(bare_run(tmp_path / "run"), books=write_books(tmp_path / "books"))
    tokenizer = byte_level_bpe()
    monkeypatch.setattr(phases, "_TRAINING_IDS", {})
    first = phases.training_books(run, tokenizer)
    plain = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in read_books(f"{run.books}/train.jsonl.gz")]
    assert [row.tolist() for row in first] == plain and all(row.dtype == np.int64 for row in first)
    assert len(os.listdir(tmp_path / "run" / "tokens")) == 1

    def untokenizing(*args, **kwargs):  # the same tokenizer must not be asked to tokenize again
        raise AssertionError("the training books were tokenized again")

    with monkeypatch.context() as patched:
        patched.setattr(type(tokenizer), "__call__", untokenizing)
        patched.setattr(phases, "_TRAINING_IDS", {})  # another process: read from the run folder
        again = phases.training_books(run, tokenizer)
    assert [row.tolist() for row in again] == plain
    other = byte_level_bpe(vocab_size=400)  # another vocabulary: its own file, its own ids
    assert [row.tolist() for row in phases.training_books(run, other)] != plain
    assert len(os.listdir(tmp_path / "run" / "tokens")) == 2


@pytest.mark.parametrize("window", [None, 6])
def test_rows_decoder_on_gemma_window_layers_is_the_plain_greedy_loop(window, monkeypatch):
    """Gemma 3's window layers (W = 4), and a member whose full layers are limited to 6 tokens: each
    prompt read alone under the windowed attention (its window layers in blocks), the caches
    merged (a window layer's last W - 1 keys through the cache's update) and decoded together, gives
    each prompt's plain greedy tokens; prompts shorter and longer than the windows share a batch."""
    from longppl_reproduce.common.lines import greedy_token_ids

    model = tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], seed=3)
    model.config._attn_implementation = "sdpa"
    if window is not None:
        members.limit_full_attention(model, window)
    model.generation_config.eos_token_id = None
    blocks = windows_in_blocks(monkeypatch)
    rng = np.random.default_rng(4)
    rows = [torch.as_tensor(rng.integers(3, 64, n)) for n in (3, 17, 11, 26)]
    expected = [plain_greedy(model, row.tolist(), 7, set()) for row in rows]
    assert not blocks  # the plain loop runs transformers' attention
    assert len({tuple(e) for e in expected}) > 1
    with torch.no_grad():
        got = greedy_token_ids(model, rows, 7, pad_token_id=2)
    assert got.tolist() == expected
    assert blocks and set(blocks) <= {4, 6}  # the prompts' window layers ran in blocks
    assert model.config._attn_implementation == "sdpa"
