"""LongCE beyond one setting (longppl_reproduce.longce_comparison with ``settings``): the whole
selection path on the smoke config (every setting, every method, the start models), the frozen
cache against the trainer's own self weights, ce-fresh's rows, the selection flags and resuming."""

import contextlib
import dataclasses
import io
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO
from datasets import Dataset
from helpers import DATA
from longppl_reproduce.common import fine_tuning, stages
from longppl_reproduce.common.config import read_population
from longppl_reproduce.common.run_folder import RunFolder, read_texts
from longppl_reproduce.longce_comparison import config as comparison
from longppl_reproduce.longce_comparison import pipeline as comparison_pipeline
from longppl_reproduce.longce_comparison import start as comparison_start
from longppl_reproduce.longce_comparison import training as comparison_training

SMOKE = os.path.join(REPO, "configs", "reproduce", "longce_settings_smoke_cpu.yaml")
H100X4 = os.path.join(REPO, "configs", "reproduce", "longce_settings_h100x4.yaml")
METHODS = ("ce", "self", "cache", "frozen", "ce-fresh")


def _main(argv) -> list[str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        comparison_pipeline.main(argv)
    return printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Seed 0 of the smoke config, start to report, over one folder."""
    out = tmp_path_factory.mktemp("settings") / "run"
    common = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out)]
    logged = _main([*common, "--seeds", "0", "--stages", "all"])
    config, pop = comparison.read_comparison(SMOKE, corpus=DATA)
    return {"out": out, "common": common, "config": config, "pop": pop, "logged": logged}


def _record(out, *parts):
    return json.loads(out.joinpath(*parts).read_text())


@pytest.mark.slow
def test_every_setting_and_method_is_trained_and_evaluated_with_the_plans_outcomes(smoke):
    out, config = smoke["out"], smoke["config"]
    for setting in config.settings:
        start = _record(out, "eval", "finetuned", f"{setting.name}-start.json")
        for method in METHODS:
            name = f"{setting.name}-{method}-s0"
            trained = _record(out, "models", "finetuned", name, "training.json")
            found = _record(out, "eval", "finetuned", f"{name}.json")
            per = config.finetune.training.batch_tokens // setting.seq_len
            assert trained["sequences_per_step"] == per and trained["setting"] == setting.name
            assert trained["model"]["base"] == setting.start
            # the void rule of the run: its accuracy at the start length at void.at_step against the start model's
            assert trained["void"]["at_step"] == config.void.at_step
            assert trained["void"]["start_acc_start"] == trained["curve"][0]["acc_start"]
            steps = round(config.finetune.fresh_factor * 2) if method == "ce-fresh" else 2
            assert trained["steps"] == steps
            for record in (start, found):
                assert set(record["lines"]) == {str(n) for n in setting.lines_lengths}
                assert 0 <= record["acc_start"]["accuracy"] <= 1 and 0 <= record["needle"]["accuracy"] <= 1
                assert record["recall"]["cases"] == config.recall_cases
                assert record["ppl"] > 1 and record["start_length"] == setting.start_length
                assert ("beyond_start" in record) == setting.beyond_start
            # LongPPL under the setting's outside evaluator, none for cache (that evaluator weighted it)
            if method == "cache":
                assert found["longppl"] is None and found["longppl_evaluator"] is None
            else:
                assert found["longppl"] > 1 and found["longppl_evaluator"] == setting.evaluator
        assert start["method"] == "start" and start["longppl_evaluator"] == setting.evaluator
    # the PPL at L: c's documents are 2048 tokens long
    texts = read_texts(str(out / "data" / "validation-2048.jsonl"))
    tokenizer = stages.load_tokenizer(RunFolder(str(out), log=lambda *_: None))
    assert {len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]} == {2048}
    results = _record(out, "results.json")
    assert set(results["settings"]) == {"a", "b", "c"}
    assert {r["method"] for r in results["settings"]["c"]["runs"]} == set(METHODS)
    # no temporary folder is left beside the outputs
    assert not [name for name in os.listdir(out) if name.startswith(".")]


@pytest.mark.slow
def test_the_frozen_weights_are_the_start_models_own_self_weights(smoke):
    """frozen's weights (the extended start model's key-token cache of the pool, scored once) equal the
    weights LongCETrainer computes with longce_weights='self' on the same model and text."""
    from longce import LongCEConfig, LongCETrainer
    from longce.weighted_loss import lsd_weights
    from longppl.core.logprobs import resolve_lm_head

    out, config, pop = smoke["out"], smoke["config"], smoke["pop"]
    run = RunFolder(str(out), log=lambda *_: None)
    setting = config.settings[0]
    model, tokenizer = stages.load_member(comparison.extended_folder(run, setting.name), "cpu")
    frozen = comparison_training.setting_dataset(config, pop, run, setting, "frozen", tokenizer)
    args = LongCEConfig(
        output_dir=str(out / ".self-weights"),
        use_cpu=True,
        report_to=[],
        longce_weights="self",
        longce_trunc_len=config.finetune.window.trunc_len,
        longce_sliding_window=config.finetune.window.sliding_window,
        longce_gamma=config.finetune.gamma,
    )
    trainer = LongCETrainer(model=model, args=args, train_dataset=frozen.remove_columns(["longce_weights"]))
    shutil.rmtree(out / ".self-weights", ignore_errors=True)
    compared = 0
    for row in frozen.select(range(2)):
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            short = trainer._short_context_pass(model, resolve_lm_head(model), {"input_ids": ids})[0]
            logits = model(input_ids=ids).logits[0].float()
        long = torch.full_like(short, float("nan"))
        long[1:] = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        expected = lsd_weights(long, short, config.finetune.gamma)  # per token, 1 where no short score
        expected[0] = 1.0  # the first token has no prediction
        scored = ~torch.isnan(short)
        assert scored.sum() > 500  # tokens beyond K: the weights are LSD's, not the unscored 1
        torch.testing.assert_close(torch.tensor(row["longce_weights"]), expected, rtol=2e-4, atol=2e-4)
        compared += 1
    assert compared == 2


@pytest.mark.slow
def test_ce_fresh_reads_ce_s_rows_in_order_then_fresh_ones_never_twice(smoke):
    out, config, pop = smoke["out"], smoke["config"], smoke["pop"]
    run = RunFolder(str(out), log=lambda *_: None)
    tokenizer = stages.load_tokenizer(run)
    for setting in config.settings:
        ce = comparison.Arm(setting.extension, "ce", 0, False, setting)
        fresh = comparison.Arm(setting.extension, "ce-fresh", 0, False, setting)
        other_seed = comparison.Arm(setting.extension, "ce", 1, False, setting)
        ce_rows, ce_steps, _ = comparison_training.ordered_rows(config, pop, run, ce, tokenizer)
        fresh_rows, steps, record = comparison_training.ordered_rows(config, pop, run, fresh, tokenizer)
        other_rows = comparison_training.ordered_rows(config, pop, run, other_seed, tokenizer)[0]
        per = config.finetune.training.batch_tokens // setting.seq_len
        first = [tuple(r) for r in fresh_rows["input_ids"]]
        assert first[: ce_steps * per] == [tuple(r) for r in ce_rows["input_ids"]]
        assert len(first) == steps * per and len(set(first)) == len(first)  # no sequence seen twice
        assert record == {"planned_steps": 4, "steps": 4, "fresh_rows": 4 // 2 * per, "stopped_early": False}
        # the rest is in no other arm's rows: the pool every method reads holds none of them
        pool = {
            tuple(r)
            for r in comparison_training.setting_dataset(config, pop, run, setting, "ce", tokenizer)["input_ids"]
        }
        assert not set(first[ce_steps * per :]) & pool
        # another seed reads the same rows in another order
        assert sorted(map(tuple, other_rows["input_ids"])) == sorted(map(tuple, ce_rows["input_ids"]))
    # the trainer reads them in that order: its data loader's first batch is the first rows
    trainer_type = fine_tuning.in_order_trainer()
    sampler = trainer_type._get_train_sampler(type("T", (), {"train_dataset": fresh_rows})())
    assert list(sampler) == list(range(len(fresh_rows)))


def test_ce_fresh_stops_at_the_last_fresh_step_when_the_books_run_short(monkeypatch, tmp_path):
    config, pop = comparison.read_comparison(SMOKE, corpus=DATA)
    setting = config.settings[0]
    per = config.finetune.training.batch_tokens // setting.seq_len  # 2 sequences a step
    pool = Dataset.from_dict({"input_ids": [[i, i] for i in range(2 * per)]})
    short = Dataset.from_dict({"input_ids": [[100 + i, 0] for i in range(per + 1)]})  # one whole step, and a row
    monkeypatch.setattr(comparison_training, "setting_dataset", lambda *args: (pool, short))
    config = dataclasses.replace(config, finetune=dataclasses.replace(config.finetune, fresh_factor=3.0))
    arm = comparison.Arm(setting.extension, "ce-fresh", 0, False, setting)
    rows, steps, record = comparison_training.ordered_rows(config, pop, RunFolder(str(tmp_path)), arm, None)
    assert steps == 3 and len(rows) == 3 * per
    assert record == {"planned_steps": 6, "steps": 3, "fresh_rows": per + 1, "stopped_early": True}
    assert len({tuple(r) for r in rows["input_ids"]}) == len(rows)


def test_the_pool_s_windows_and_documents_are_each_used_once():
    stream = np.arange(1000, dtype=np.int64)
    documents = [np.array([-1 - d, -1 - d]) for d in range(5)]
    rows, used = comparison_start.distinct_pool(stream, documents, 10, 0.0, 500, seed=0)
    assert rows.shape == (100, 10)  # the stream holds 100 windows of 10: no more rows than that
    assert sorted(rows[:, 0].tolist()) == list(range(0, 1000, 10)) and (used == -1).all()
    rows, used = comparison_start.distinct_pool(stream, documents, 10, 1.0, 50, seed=0)
    # every row takes a document: the pool stops when the 5 documents are used, each once
    assert rows.shape == (5, 10) and sorted(used.tolist()) == [0, 1, 2, 3, 4]
    assert sorted(rows[:, -1].tolist()) == [-5, -4, -3, -2, -1]


def test_selection_picks_settings_seeds_and_methods():
    config, _ = comparison.read_comparison(SMOKE, corpus=DATA)
    selection = comparison.Selection(seeds=(1,), settings=("b", "c"), methods=("frozen", "ce", "start"))
    names = [arm.name for arm in comparison.arms(config, selection=selection)]
    assert names == ["b-ce-s1", "b-frozen-s1", "c-ce-s1", "c-frozen-s1"]
    assert [arm.name for arm in comparison.start_arms(config, selection)] == ["b-start", "c-start"]
    assert comparison.start_arms(config, comparison.Selection(methods=("ce",))) == []
    assert len(comparison.arms(config)) == 3 * 2 * len(METHODS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--settings", "z"], "--settings names ['z']; choose from a, b, c."),
        (["--methods", "ce,ce-wallclock"], "--methods names ['ce-wallclock']; choose from"),
        (["--models", "E9"], "--models names ['E9']; choose from B, E1, B2, E2048."),
    ],
)
def test_a_bad_selection_is_one_error_line(flags, message, tmp_path):
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(tmp_path / "run"), "--stages", "report", *flags]
    with pytest.raises(SystemExit) as exit_:
        comparison_pipeline.cli(argv)
    text = str(exit_.value.code)
    assert message in text and ": error: " in text and "\n" not in text
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.slow
def test_a_finished_arm_is_skipped_and_a_cut_off_one_trained_again(smoke):
    out = smoke["out"]
    kept = out / "models" / "finetuned" / "a-ce-s0" / "training.json"
    cut = out / "models" / "finetuned" / "a-frozen-s0"
    stamp = os.path.getmtime(kept)
    (cut / "training.json").unlink()  # a run killed before its record: not done
    (out / "eval" / "finetuned" / "a-frozen-s0.json").unlink()
    logged = _main(
        [*smoke["common"], "--stages", "finetune,evaluate", "--settings", "a", "--seeds", "0", "--methods", "ce,frozen"]
    )
    assert "finetune: a-ce-s0 trained, kept" in logged
    assert any(line.startswith("finetune: a-frozen-s0 (2 steps") for line in logged)
    assert os.path.getmtime(kept) == stamp and (cut / "training.json").is_file()
    assert [line for line in logged if line.startswith("evaluate:")] == [
        next(line for line in logged if line.startswith("evaluate: a-frozen-s0"))
    ]


def test_the_h100x4_config_is_the_plan():
    config, pop = comparison.read_comparison(H100X4, corpus=DATA)
    tuning, training = config.finetune, config.finetune.training
    assert (training.steps, training.batch_tokens, training.lr) == (500, 12288, 2.0e-4)
    assert (training.warmup_steps, training.min_lr_ratio, training.weight_decay) == (20, 0.1, 0.0)
    assert tuning.methods == METHODS and tuning.seeds == (0, 1, 2, 3) and tuning.fresh_factor == 3.3
    assert (tuning.window.trunc_len, tuning.window.sliding_window, tuning.gamma) == (256, 64, 5.0)
    assert (tuning.mix.books, tuning.mix.lines, tuning.mix.asked_within) == (0.95, 0.05, 256)
    assert 125 in tuning.eval_steps and config.void.at_step == 125 and config.void.min_ratio == 0.5
    assert config.rerun.when == "never" and config.recall_cases == 300 and config.recall_margin == 32
    found = {
        s.name: (s.start, s.extension.method, s.extension.factor, s.seq_len, s.start_length, s.evaluator)
        for s in config.settings
    }
    assert found == {
        "a": ("B", "yarn", 2.0, 1024, 512, "E1"),
        "b": ("B256", "yarn", 4.0, 1024, 256, "E1"),
        "c": ("E1", "yarn", 2.0, 2048, 1024, "E2048"),
    }
    assert [s.lines_lengths for s in config.settings] == [(640, 768, 896, 992)] * 2 + [(1280, 1536, 1792, 1984)]
    assert [s.beyond_start for s in config.settings] == [False, False, True]
    assert [training.batch_tokens // s.seq_len for s in config.settings] == [12, 12, 6]
    specs = comparison.model_specs(config, pop)
    b256, e2048 = specs["B256"], specs["E2048"]
    assert b256.shape == dataclasses.replace(pop.base.shape, max_position_embeddings=256)
    # B's and E1's recipes at their lengths, pretrained 15,000 steps instead of 5,000 (the plan's
    # deviation: both failed their gates at 5,000)
    assert pop.base.training.steps == pop.evaluators[0].training.steps == 5000
    assert b256.training == dataclasses.replace(pop.base.training, seq_len=256, steps=15000)
    assert (b256.gate.length, b256.gate.min_accuracy, b256.gate.lines) == (256, 0.7, 2) and b256.mix == pop.base.mix
    assert (b256.seed, e2048.seed) == (pop.base.seed, pop.evaluators[0].seed)
    e1 = pop.evaluators[0]
    assert e2048.shape == dataclasses.replace(e1.shape, max_position_embeddings=2048)
    assert e2048.training == dataclasses.replace(e1.training, seq_len=2048, steps=15000)
    assert (e2048.gate.length, e2048.gate.min_accuracy, e2048.training.batch_tokens) == (2048, 0.7, 32768)


def _settings(**changes):
    """The smoke config's settings, the first one changed by ``changes``."""
    import yaml

    with open(SMOKE, encoding="utf-8") as handle:
        settings = yaml.safe_load(handle)["settings"]
    return [{**settings[0], **changes}, *settings[1:]]


def _pretrained(**changes):
    """The smoke config's pretrained models, the first one changed by ``changes``."""
    import yaml

    with open(SMOKE, encoding="utf-8") as handle:
        pretrained = yaml.safe_load(handle)["pretrained"]
    return [{**pretrained[0], **changes}, *pretrained[1:]]


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"settings": _settings(start="B9")},
            r"settings\[0\]\.start = 'B9': no such model; choose from B, E1, B2, E2048",
        ),
        ({"settings": _settings(evaluator="B")}, r"settings\[0\]\.evaluator = 'B': must not be the start model"),
        ({"settings": _settings(evaluator="B2")}, r"settings\[0\]\.evaluator = 'B2': reads fewer than seq_len 1024"),
        (
            {"settings": _settings(lines_lengths=[640, 1020])},
            r"settings\[0\]\.lines_lengths = \[640, 1020\]: must leave",
        ),
        ({"settings": _settings(start_length=1024)}, r"settings\[0\]\.start_length = 1024: must be below seq_len"),
        ({"rerun.when": "void"}, r"rerun\.when = 'void': a config with settings has no reruns"),
        ({"extensions": [{"name": "y", "method": "yarn", "factor": 2}]}, r"extensions .*or settings, not both"),
        ({"finetune.fresh_factor": 0.5}, r"finetune\.fresh_factor = 0\.5: must be >= 1"),
        (
            {"pretrained": _pretrained(gate={"length": 512, "cases": 4, "min_accuracy": 0.0, "lines": 2})},
            r"pretrained\[0\]\.gate\.lines = 2: B's gate of the same length 512 asks None, and the two read one file",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_value(tmp_path, changes, message):
    from helpers import edited_config

    path = edited_config(
        SMOKE, tmp_path, **{"population": os.path.join(os.path.dirname(SMOKE), "population_smoke_cpu.yaml"), **changes}
    )
    with pytest.raises(ValueError, match=message):
        comparison.read_comparison(path, corpus=DATA)


def _gate_cases(tmp_path, **gate):
    """The gate cases ``write_gate_cases`` writes for the smoke base with its gate changed by ``gate``."""
    from helpers import byte_level_bpe
    from longppl_reproduce.common import lines

    pop = read_population(os.path.join(os.path.dirname(SMOKE), "population_smoke_cpu.yaml"), corpus=DATA)
    spec = dataclasses.replace(pop.base, gate=dataclasses.replace(pop.base.gate, **gate))
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    tokenizer = byte_level_bpe()
    logged = stages.write_gate_cases(pop, run, tokenizer, spec)
    cases = lines.read_lines_cases(str(tmp_path / "data" / "cases" / f"gate-{spec.gate.length}.jsonl"))
    return pop, tokenizer, logged, cases


def test_a_gate_s_lines_fix_its_records_and_must_leave_room_for_the_greedy_answer(tmp_path):
    pop, tokenizer, logged, cases = _gate_cases(tmp_path / "two", length=2048, cases=5, lines=2)
    assert {case.num_lines for case in cases} == {2} and len(cases) == 5 and "of 2 lines" in logged
    # by default as many lines as fit with the reference answer and the greedy answer's tokens
    _, _, logged, fitted = _gate_cases(tmp_path / "fit", length=2048, cases=5)
    most = max(case.num_lines for case in fitted)
    assert most > 2 and f"of {most} lines" in logged
    # a record too long for the gate's positions once the greedy answer's tokens are added
    prompt = len(tokenizer(cases[0].prompt, add_special_tokens=True)["input_ids"])
    with pytest.raises(
        ValueError,
        match=r"gate\.lines = 2 lines: the longest prompt takes \d+ tokens, .* more than gate\.length = \d+; ask fewer lines",
    ):
        _gate_cases(tmp_path / "short", length=prompt + pop.evaluation.max_new_tokens - 1, cases=5, lines=2)


def test_a_population_whose_gates_of_one_length_disagree_on_lines_is_refused(tmp_path):
    from helpers import edited_config

    source = os.path.join(os.path.dirname(SMOKE), "population_smoke_cpu.yaml")
    path = edited_config(
        source,
        tmp_path,
        **{
            "base.gate": {"length": 1024, "cases": 4, "min_accuracy": 0.0, "lines": 2},
            "base.shape.max_position_embeddings": 1024,
        },
    )
    with pytest.raises(ValueError, match=r"evaluators\[0\]\.gate\.lines.*B's gate of the same length 1024 asks 2"):
        read_population(path, corpus=DATA)


def test_a_failed_gate_stops_the_run_and_says_how_to_train_the_model_again(tmp_path):
    """A gate recorded as failed stops the run every time (the record is kept, not redone), and the
    message names the model folder and the record to move aside to train the model again."""
    pop = read_population(os.path.join(os.path.dirname(SMOKE), "population_smoke_cpu.yaml"), corpus=DATA)
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    spec = dataclasses.replace(pop.base, gate=dataclasses.replace(pop.base.gate, min_accuracy=0.8))
    failed = {"accuracy": 0.12, "correct": 3, "total": 25, "passed": False}
    run.write_json(failed, "eval", "gates", f"{spec.name}.json")
    for _ in range(2):  # the second call reads the same record: a failed gate is not measured again
        with pytest.raises(ValueError) as raised:
            stages.check_gate(pop, run, spec)
        message = str(raised.value)
        assert f"{spec.name} fails its gate: lines accuracy 0.120 at {spec.gate.length} tokens is below 0.8" in message
        assert stages.model_folder(run, spec.name) in message
        assert run.path("eval", "gates", f"{spec.name}.json") in message
    passed = dict(failed, accuracy=0.9, passed=True)
    run.write_json(passed, "eval", "gates", f"{spec.name}.json")
    assert stages.check_gate(pop, run, spec)["accuracy"] == 0.9
