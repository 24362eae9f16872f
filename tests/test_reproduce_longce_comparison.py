"""The LongCE-vs-CE comparison (longppl_reproduce.longce_comparison, scripts/reproduce_longce.py): the
whole run on the smoke config, resuming without redoing work, B and E1 taken from another run's
folders, the void rule and ce-wallclock's steps on constructed numbers, and the clear errors for bad
configs."""

import contextlib
import dataclasses
import io
import json
import os
import shutil

import pytest
from conftest import REPO
from helpers import DATA, edited_config
from longppl_reproduce.longce_comparison import config as comparison
from longppl_reproduce.longce_comparison import evaluation as comparison_evaluation
from longppl_reproduce.longce_comparison import pipeline as comparison_pipeline
from longppl_reproduce.longce_comparison import report as comparison_report
from longppl_reproduce.longce_comparison import start as comparison_start
from longppl_reproduce.longce_comparison import training as comparison_training

SMOKE = os.path.join(REPO, "configs", "reproduce", "longce_comparison_smoke_cpu.yaml")
H200 = os.path.join(REPO, "configs", "reproduce", "longce_comparison_h200.yaml")
SMOKE_POPULATION = os.path.join(REPO, "configs", "reproduce", "population_smoke_cpu.yaml")


def _config(tmp_path, **changes) -> str:
    """The smoke config with ``changes``, written to ``tmp_path`` (its population path made absolute)."""
    return edited_config(SMOKE, tmp_path, **{"population": SMOKE_POPULATION, **changes})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One whole run of the smoke config, then a second call of every stage over the same folder."""
    out = tmp_path_factory.mktemp("comparison") / "run"
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out)]
    printed = [io.StringIO(), io.StringIO()]  # the progress lines of each call
    with contextlib.redirect_stdout(printed[0]):
        first = comparison_pipeline.main(argv)
    stamps = {p: os.path.getmtime(p) for p in _model_records(out)}
    with contextlib.redirect_stdout(printed[1]):
        second = comparison_pipeline.main(argv)
    first_log, logged = (p.getvalue().splitlines() for p in printed)
    return {"out": out, "first": first, "second": second, "stamps": stamps, "first_log": first_log, "logged": logged}


def _model_records(out) -> list[str]:
    found = []
    for folder in ("finetuned", "extended"):
        root = os.path.join(out, "models", folder)
        found += [os.path.join(root, name, "training.json") for name in sorted(os.listdir(root))]
    return found


@pytest.mark.slow
def test_smoke_run_has_every_method_and_seed_with_curves_at_the_configured_points(smoke):
    out, results = smoke["out"], smoke["first"]
    config, pop = comparison.read_comparison(SMOKE, corpus=DATA)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["extensions"].keys() == {"yarn2"}
    found = on_disk["extensions"]["yarn2"]
    pairs = {(r["method"], r["seed"]) for r in found["runs"]}
    assert pairs == {(m, s) for m in ("ce", "self", "cache", "ce-wallclock") for s in (0, 1)}
    lengths = {str(n) for n in pop.evaluation.lines_lengths}
    for row in found["runs"]:
        assert set(row["accuracy"]) == lengths
        assert 0 <= row["primary_accuracy"] <= 1 and 0 <= row["acc512"] <= 1 and 0 <= row["needle"] <= 1
        assert row["ppl"] > 1 and row["log_likelihood"] < 0
        # the curve: the extended base at step 0, then every configured point the run reached, and its end
        expected = sorted({0, *(s for s in config.finetune.eval_steps if s <= row["steps"]), row["steps"]})
        assert [p["step"] for p in row["curve"]] == expected, row["run"]
        assert all(set(p["primary"]) == lengths for p in row["curve"])
        # LongPPL only from an evaluator that gave no training weights: E1 (no E2 here), not for cache
        if row["method"] == "cache":
            assert row["longppl"] is None and row["longppl_evaluator"] is None
        else:
            assert row["longppl"] > 1 and row["longppl_evaluator"] == "E1"
    assert found["runs"][0]["curve"][0] == found["extended_base"]["curve_point"]
    # alpha: calibrated -> the population's calibration of alpha on E1, run in this folder
    calibrated = json.loads((out / "eval" / "calibration.json").read_text())["alpha"]
    assert {row["alpha"] for row in found["runs"]} == {calibrated} == {on_disk["longppl"]["alpha"]}
    assert set(found["summary"]) == {"ce", "self", "cache", "ce-wallclock"}
    assert set(found["differences"]) == {"self - ce", "cache - ce", "ce-wallclock - ce", "self - ce-wallclock"}
    assert found["differences"]["self - ce"]["ppl"]["n"] == 2
    assert "skipped" in found["differences"]["cache - ce"]["longppl"]
    # rerun.when: always -> ce and self again at half the learning rate, every seed
    rerun = found["rerun"]["runs"]
    assert {(r["method"], r["seed"]) for r in rerun} == {(m, s) for m in ("ce", "self") for s in (0, 1)}
    assert all(r["lr"] == config.finetune.training.lr * 0.5 for r in rerun)
    assert set(found["void"]) >= {"void", "ce_acc512", "threshold", "at_step"}
    report = (out / "report.md").read_text()
    assert "yarn2-ce-wallclock-s1" in report and "self - ce" in report and "### Rerun" in report
    assert results["extensions"]["yarn2"]["verdict"] == found["verdict"]
    assert on_disk["figures"] and all((out / path).is_file() for path in on_disk["figures"])
    # the Trainer's scratch folders are gone, and no temporary folder is left beside the outputs
    assert not [name for name in os.listdir(out) if name.startswith(".")]


@pytest.mark.slow
def test_the_pool_is_tokenized_and_weighted_once_for_every_run(smoke):
    log = smoke["first_log"]
    made = [i for i, line in enumerate(log) if line.startswith(("finetune: the pool", "cache: the pool"))]
    assert sorted(log[i].split(" -> ")[0] for i in made) == [
        "cache: the pool with E1's LongCE weights",
        "finetune: the pool tokenized",
    ]
    # both in the cache stage, before any run: fine-tuning processes side by side only read them
    assert log.index("== stage cache") < min(made) and max(made) < log.index("== stage finetune")
    for name in ("finetune-tokens", "finetune-cache-weights"):
        assert (smoke["out"] / "data" / name / "key.json").is_file()


@pytest.mark.slow
def test_ce_wallclock_runs_for_self_s_measured_wall_time(smoke):
    out = smoke["out"]

    def record(name):
        return json.loads((out / "models" / "finetuned" / name / "training.json").read_text())

    for seed in (0, 1):
        ce, self_ = record(f"yarn2-ce-s{seed}"), record(f"yarn2-self-s{seed}")
        wallclock = record(f"yarn2-ce-wallclock-s{seed}")
        ratio = self_["step_seconds"]["median"] / ce["step_seconds"]["median"]
        assert wallclock["self_ce_step_ratio"] == pytest.approx(ratio)
        assert wallclock["steps"] == max(1, round(ce["steps"] * ratio))
        assert wallclock["settings"]["longce_weights"] == "none" and self_["settings"]["longce_weights"] == "self"


@pytest.mark.slow
def test_every_method_sees_a_seed_s_data_in_the_same_order(smoke):
    """The plain CE of the first batch, before any update (LongCE logs it as ``ce_loss``): the same
    for every method of a seed, since they start from one model on the same first batch."""
    out = smoke["out"]
    first_batch = {}
    for seed in (0, 1):
        for method in ("ce", "self", "cache", "ce-wallclock"):
            record = json.loads(
                (out / "models" / "finetuned" / f"yarn2-{method}-s{seed}" / "training.json").read_text()
            )
            step_one = next(entry for entry in record["log_history"] if entry.get("step") == 1 and "ce_loss" in entry)
            first_batch.setdefault(seed, set()).add(round(float(step_one["ce_loss"]), 5))
    assert all(len(losses) == 1 for losses in first_batch.values()), first_batch
    assert first_batch[0] != first_batch[1]  # another seed, another order


@pytest.mark.slow
def test_a_second_call_skips_finished_work(smoke):
    out, logged = smoke["out"], smoke["logged"]
    assert {p: os.path.getmtime(p) for p in _model_records(out)} == smoke["stamps"]
    kept = [line for line in logged if line.startswith("finetune: yarn2-") and line.endswith("trained, kept")]
    assert len(kept) == 8 + 4  # the runs, then the reruns
    assert not [line for line in logged if line.startswith("finetune: yarn2-") and "steps x" in line]
    assert not [line for line in logged if line.startswith("evaluate: ")]
    timings = json.loads((out / "timings.json").read_text())
    assert all(entry["calls"] == 1 for entry in timings["finetune"].values())
    assert smoke["second"]["extensions"]["yarn2"]["runs"] == smoke["first"]["extensions"]["yarn2"]["runs"]


@pytest.mark.slow
def test_base_and_evaluator_are_taken_from_another_run_s_folders(smoke, tmp_path):
    models = smoke["out"] / "models"
    out = tmp_path / "given"
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out), "--stages", "start"]
    comparison_pipeline.main([*argv, "--base-model", str(models / "B"), "--evaluator", str(models / "E1")])
    for name in ("B", "E1"):
        record = json.loads((out / "models" / name / "training.json").read_text())
        assert record["imported_from"] == str(models / name)
        assert (out / "models" / name / "model.safetensors").read_bytes() == (
            models / name / "model.safetensors"
        ).read_bytes()
    assert (out / "eval" / "gates" / "B.json").is_file()
    # the models of the output folder itself are taken where they are
    here = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(smoke["out"]), "--stages", "start"]
    comparison_pipeline.main([*here, "--base-model", str(models / "B"), "--evaluator", str(models / "E1")])
    assert "imported_from" not in json.loads((models / "B" / "training.json").read_text())
    # this folder's B came from there: another B is refused, not mixed in
    with pytest.raises(ValueError, match=r"holds B from .*models/B, not .*models/E1: .*another --output-dir"):
        comparison_pipeline.main([*argv, "--base-model", str(models / "E1"), "--evaluator", str(models / "E1")])


def test_void_rule_on_constructed_numbers():
    # CE keeps 0.25 on average at 512, the extended base 0.6: below half of it -> void
    assert comparison_training.void_rule([0.2, 0.3], 0.6, 0.5) == {
        "ce_acc512": 0.25,
        "extended_acc512": 0.6,
        "threshold": 0.3,
        "void": True,
    }
    assert comparison_training.void_rule([0.4, 0.3], 0.6, 0.5)["void"] is False
    assert comparison_training.void_rule([0.3, 0.3], 0.6, 0.5)["void"] is False  # at half exactly: kept
    assert comparison_training.void_rule([0.0], 0.0, 0.5)["void"] is False  # a base without the task: nothing to lose
    with pytest.raises(ValueError, match="at least one seed"):
        comparison_training.void_rule([], 0.6, 0.5)


def test_a_given_model_whose_training_record_is_cut_off_is_named_and_nothing_is_copied(tmp_path):
    from longppl_reproduce.common.run_folder import RunFolder

    source = tmp_path / "B"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "training.json").write_text('{"name": "B", "mod')
    run = RunFolder(str(tmp_path / "run"), log=lambda *_: None)
    with pytest.raises(ValueError) as error:
        comparison_start.import_model(run, str(source), "B")
    assert str(error.value) == (
        f"{source / 'training.json'} is not JSON (Unterminated string starting at: line 1, column 15): give another "
        "model folder (a population run's models/<name> or its export)."
    )
    assert os.listdir(tmp_path / "run" / "models") == ["B"]  # no half-made copy beside it
    assert os.listdir(tmp_path / "run" / "models" / "B") == []  # and nothing copied into it


@pytest.mark.slow
def test_a_void_comparison_is_reported_with_its_rerun_due_then_done(smoke, tmp_path):
    source = smoke["out"]
    for label, kept in (("due", False), ("done", True)):
        out = tmp_path / label

        def leave_out(folder, names, kept=kept):
            return [] if kept else [n for n in names if "-rerun-" in n]

        shutil.copytree(source, out, ignore=leave_out)
        # an extended base that answers 80% at 512: CE's 0 at the rule's step is below half of it
        extended = out / "eval" / "extended" / "yarn2.json"
        record = json.loads(extended.read_text())
        record["curve_point"]["acc512"] = 0.8
        extended.write_text(json.dumps(record))
        argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out), "--stages", "report"]
        found = comparison_pipeline.main(argv)["extensions"]["yarn2"]
        assert found["void"]["void"] is True and found["void"]["threshold"] == pytest.approx(0.4)
        report = (out / "report.md").read_text()
        if kept:
            assert found["rerun_due"] is False and found["rerun"]["verdict"] == "void"
            assert found["verdict"] == "void at the configured lr; at 0.5 x lr: void"
        else:
            assert found["rerun_due"] is True and found["rerun"] is None
            assert found["verdict"] == "void: the rerun at 0.5 x the learning rate is due (stage 'rerun')"
        assert found["verdict"] in report and "**void**" in report


@pytest.mark.slow
def test_a_report_over_the_seeds_that_finished_says_which(smoke, tmp_path):
    # a config of three seeds whose third never ran: the whole report cannot be made, one over
    # the two finished seeds can, and it names the seed it leaves out
    out = tmp_path / "run"
    shutil.copytree(smoke["out"], out)
    config = _config(tmp_path, **{"finetune.seeds": [0, 1, 2]})
    argv = ["--config", config, "--corpus", DATA, "--output-dir", str(out), "--stages", "report"]
    with pytest.raises(SystemExit, match=r"Seeds \[2\] have runs not evaluated .* with --seeds 0,1\."):
        comparison_pipeline.cli(argv)
    found = comparison_pipeline.main([*argv, "--seeds", "0,1"])
    assert found["seeds"]["finetune"] == [0, 1] and found["seeds"]["configured"] == [0, 1, 2]
    rows = found["extensions"]["yarn2"]["runs"]
    assert sorted({row["seed"] for row in rows}) == [0, 1] and len(rows) == 8
    assert found["extensions"]["yarn2"]["differences"]["self - ce"]["ppl"]["n"] == 2
    assert "Seeds reported: 2 of the 3 configured (0, 1; not reported: 2)." in (out / "report.md").read_text()
    assert "Seeds reported" not in (smoke["out"] / "report.md").read_text()  # every seed: no such line
    with pytest.raises(SystemExit, match=r"--seeds names \[1\]; name at least 2"):
        comparison_pipeline.cli([*argv, "--seeds", "1"])


def test_verdict_on_constructed_differences():
    not_void = {"void": False}
    above = {"self - ce": {"primary_accuracy": {"value": 0.08, "low": 0.02, "high": 0.14}}}
    across = {"self - ce": {"primary_accuracy": {"value": 0.08, "low": -0.01, "high": 0.17}}}
    assert comparison_report.verdict(not_void, above) == "reproduced"
    assert comparison_report.verdict(not_void, across) == "not reproduced"
    assert comparison_report.verdict({"void": True}, above) == "void"
    assert comparison_report.verdict(not_void, {"self - ce": {"primary_accuracy": {"skipped": "1 seed"}}}).startswith(
        "undecided"
    )


def test_rerun_follows_the_void_rule_unless_forced(tmp_path):
    config, _ = comparison.read_comparison(_config(tmp_path, **{"rerun.when": "void"}), corpus=DATA)
    assert comparison_evaluation.rerun_extensions(config, {"yarn2": True}) == list(config.extensions)
    assert comparison_evaluation.rerun_extensions(config, {"yarn2": False}) == []
    for when, expected in (("always", list(config.extensions)), ("never", [])):
        forced = dataclasses.replace(config, rerun=comparison.Rerun(when=when))
        assert comparison_evaluation.rerun_extensions(forced, {"yarn2": False}) == expected
    reruns = comparison.arms(config, rerun=True)
    assert [a.name for a in reruns] == [
        "yarn2-ce-rerun-s0",
        "yarn2-self-rerun-s0",
        "yarn2-ce-rerun-s1",
        "yarn2-self-rerun-s1",
    ]


def test_ce_wallclock_steps_from_a_measured_ratio():
    assert comparison_training.wallclock_steps(1000, 0.15, 0.1) == 1500
    assert comparison_training.wallclock_steps(1000, 0.1234, 0.1) == 1234
    assert comparison_training.wallclock_steps(1000, 0.05, 0.1) == 500  # a faster self gets fewer CE steps
    with pytest.raises(ValueError, match=r"self 0.0 s and ce 0.1 s must be > 0"):
        comparison_training.wallclock_steps(1000, 0.0, 0.1)


def test_runs_are_ordered_so_that_a_seed_s_ce_and_self_come_before_its_ce_wallclock(tmp_path):
    path = _config(tmp_path, **{"finetune.methods": ["ce-wallclock", "cache", "self", "ce"]})
    config, _ = comparison.read_comparison(path, corpus=DATA)
    names = [a.name for a in comparison.arms(config)]
    assert names[:4] == ["yarn2-ce-s0", "yarn2-self-s0", "yarn2-cache-s0", "yarn2-ce-wallclock-s0"]
    assert [a.name for a in comparison.arms(config, seeds=[1])][0] == "yarn2-ce-s1"


def test_the_h200_config_is_the_plan():
    config, pop = comparison.read_comparison(H200, corpus="books.jsonl.gz")
    tuning = config.finetune
    assert [(e.method, e.factor) for e in config.extensions] == [("yarn", 2.0)]
    assert tuning.methods == ("ce", "self", "cache", "ce-wallclock") and tuning.seeds == (0, 1, 2, 3, 4)
    assert (tuning.training.steps, tuning.training.batch_tokens, tuning.training.seq_len) == (1000, 16384, 1024)
    assert tuning.training.lr == 2e-4 and tuning.training.weight_decay == 0.0 and tuning.gamma == 5.0
    assert (tuning.window.trunc_len, tuning.window.sliding_window) == (256, 64)
    assert tuning.eval_steps == (250, 500, 1000) and tuning.mix.asked_within == 256
    assert (config.void.at_step, config.void.min_ratio, config.rerun.lr_factor) == (250, 0.5, 0.5)
    assert config.scoring.alpha == "calibrated" and config.scoring.beta == -2.0
    assert pop.evaluation.cases == 300 and pop.evaluation.beyond == 256


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"finetune.methods": ["ce", "longce"]}, r"finetune\.methods\[1\] = 'longce': must be 'ce' or 'self'"),
        ({"finetune.methods": ["ce", "ce"]}, r"finetune\.methods = \('ce', 'ce'\): must list each"),
        ({"finetune.methods": ["ce", "ce-wallclock"]}, r"ce-wallclock needs ce and self"),
        ({"finetune.seeds": [0]}, r"finetune\.seeds = \(0,\): must list at least 2 distinct seeds"),
        ({"finetune.eval_steps": [1, 5]}, r"finetune\.eval_steps = \(1, 5\): must not pass training\.steps 2"),
        ({"finetune.eval_steps": [2, 1]}, r"finetune\.eval_steps = \(2, 1\): must list increasing"),
        ({"finetune.gamma": 0}, r"finetune\.gamma = 0: must be > 0"),
        ({"finetune.training.steps": 0}, r"finetune\.training\.steps = 0: must be > 0"),
        (
            {"finetune.training.seq_len": 2048, "finetune.training.batch_tokens": 2048},
            r"seq_len = 2048: must not pass the population's data\.length 1024",
        ),
        (
            {"scoring.window.trunc_len": 1024},
            r"scoring\.window\.trunc_len = 1024: must be below the population's data\.length",
        ),
        ({"void.at_step": 3}, r"void\.at_step = 3: must be one of finetune\.eval_steps \[1, 2\]"),
        ({"rerun.when": "sometimes"}, r"rerun\.when = 'sometimes': must be 'void' or 'always' or 'never'"),
        ({"rerun.methods": ["cache"]}, r"rerun\.methods\[0\] = 'cache': must be 'ce' or 'self'"),
        ({"extensions": []}, r"extensions = \(\): must list at least one extension"),
        ({"extensions": [{"name": "y", "method": "yarn"}]}, r"extensions\[0\]\.factor = None: yarn needs a factor"),
        ({"base_model": "/nowhere/B"}, r"base_model \(--base-model\) = '/nowhere/B' is not a model folder"),
        ({"population": "/nowhere/population.yaml"}, r"population = '/nowhere/population\.yaml': no such file"),
        ({"surprise": 1}, r"surprise: unknown key"),
        ({"scoring.alpha": "tuned"}, r"scoring\.alpha = 'tuned': must be a number or 'calibrated'"),
    ],
)
def test_bad_configs_are_refused_naming_the_key_and_value(tmp_path, changes, message):
    path = _config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        comparison.read_comparison(path, corpus=DATA)


def test_the_command_reports_a_bad_config_in_one_line(tmp_path, capsys):
    path = _config(tmp_path, **{"finetune.seeds": [3, 3]})
    with pytest.raises(SystemExit) as exit_:
        comparison_pipeline.cli(["--config", path, "--corpus", DATA, "--output-dir", str(tmp_path / "out")])
    message = str(exit_.value.code)
    assert (
        message.count("\n") == 0
        and ": error: " in message
        and "finetune.seeds = (3, 3): must list at least 2 distinct seeds" in message
    )
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(SystemExit) as exit_:
        comparison_pipeline.cli(
            ["--config", _config(tmp_path), "--corpus", DATA, "--output-dir", str(tmp_path / "o"), "--seeds", "0,7"]
        )
    assert "--seeds names [7], which are not in the config's finetune.seeds [0, 1]" in str(exit_.value.code)


def test_a_config_that_does_not_parse_or_an_unusable_output_dir_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where an empty --output-dir would have written
    bad = tmp_path / "bad.yaml"
    bad.write_text("population: {name: [x\n")
    names_bad = _config(tmp_path, population=str(bad))  # the population config it names does not parse
    for config in (str(bad), names_bad):
        with pytest.raises(SystemExit) as exit_:
            comparison_pipeline.cli(["--config", config, "--corpus", DATA, "--output-dir", str(tmp_path / "out")])
        assert str(exit_.value.code).endswith(
            f"error: {bad} is not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1 "
            "(while parsing a flow sequence at line 1, column 20); fix the file there and run again."
        )
    (tmp_path / "f").write_text("a file")
    for output, message in (
        (str(tmp_path / "f" / "sub"), f"--output-dir {str(tmp_path / 'f' / 'sub')!r} lies below {tmp_path / 'f'}, "),
        ("", "--output-dir='' is empty: pass the run's folder, e.g. repro2/."),
    ):
        with pytest.raises(SystemExit) as exit_:
            comparison_pipeline.cli(
                ["--config", _config(tmp_path), "--corpus", DATA, "--output-dir", output, "--stages", "report"]
            )
        assert "error: " + message in str(exit_.value.code)
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml", "config.yaml", "f"]  # nothing written


def test_stages_run_in_pipeline_order_and_unknown_ones_are_named(capsys):
    parser = comparison_pipeline.build_parser("longppl-reproduce-longce")
    common = ["--config", SMOKE, "--output-dir", "out"]
    assert parser.parse_args([*common, "--stages", "report,start"]).stages == ["start", "report"]
    assert parser.parse_args([*common, "--stages", "all"]).stages == list(comparison_pipeline.STAGES)
    with pytest.raises(SystemExit):
        parser.parse_args([*common, "--stages", "start,train"])
    assert "unknown stages ['train']; choose from start, extend, cache, finetune, evaluate, rerun, report" in (
        capsys.readouterr().err
    )
