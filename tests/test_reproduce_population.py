"""The population pipeline (longppl_reproduce.population, its config and run folder): config errors
name the file and the dotted key, the CPU smoke run writes every stage's files and resumes without
redoing work, and the report's pure parts (exclusions, statistics, task mixes) against plain references."""

import json
import math
import os

import numpy as np
import pytest
from conftest import REPO
from helpers import DATA, edited_config
from longppl_reproduce import population
from longppl_reproduce.common import stages
from longppl_reproduce.common.config import Analysis, Population, read_population
from longppl_reproduce.common.family import TrainingBatches
from longppl_reproduce.common.report_text import closing_sections, fmt
from longppl_reproduce.common.run_folder import RunFolder, finite
from longppl_reproduce.population import analysis as population_analysis
from longppl_reproduce.population import models as population_models

SMOKE = os.path.join(REPO, "configs", "reproduce", "population_smoke_cpu.yaml")
H200 = os.path.join(REPO, "configs", "reproduce", "population_h200.yaml")


# ------------------------------------------------------------------ config


def test_the_shipped_configs_read_and_hold_the_plan():
    config = read_population(H200, corpus="books.jsonl")
    assert isinstance(config, Population)
    assert [m.name for m in config.members()][:4] == ["pi2-s0", "pi2-s100", "pi2-s300", "pi2-s1000"]
    assert len(config.members()) == 36
    seeds = [m.seed for m in config.members()]
    assert len(set(seeds)) == 36 and config.base.seed not in seeds
    assert config.base.shape.head_dim == 64 and config.base.gate.min_accuracy == 0.7
    ntk = next(e for e in config.extensions if e.name == "ntk2")
    assert ntk.ntk_theta(1e4, 64) == pytest.approx(1e4 * 2 ** (64 / 62))
    assert read_population(SMOKE, corpus=DATA).device == "cpu"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"base.training.lrr": 1.0}, r"base\.training\.lrr: unknown key"),
        ({"base.training.lr": "fast"}, r"base\.training\.lr = 'fast': must be a number"),
        ({"base.training.lr": -1.0}, r"base\.training\.lr = -1\.0: must be > 0"),
        (
            {"base.mix.lines": 0.9},
            r"base\.mix\.books = 0\.45: the shares books \+ lines \+ needle \+ two_hop must sum to 1",
        ),
        ({"base.shape.architecture": "gpt2"}, r"base\.shape\.architecture = 'gpt2': must be 'llama' or 'mistral'"),
        ({"finetune.steps": [0, -5]}, r"finetune\.steps = \[0, -5\]: item -5 must be >= 0"),
        (
            {"evaluation.lines_lengths": [640, 2048]},
            r"evaluation\.lines_lengths = \(640, 2048\): must leave evaluation\.max_new_tokens inside data\.length "
            r"1024 \(<= 992\)",
        ),
        (
            # a 1008-token prompt and its 32-token answer overflow 1024 positions
            {"evaluation.lines_lengths": [640, 1008]},
            r"evaluation\.lines_lengths = \(640, 1008\): must leave evaluation\.max_new_tokens inside data\.length",
        ),
        ({"calibration.window.trunc_len": 1024}, r"calibration\.window\.trunc_len = 1024: must be below data\.length"),
        ({"base.gate.enabled": True}, r"base\.gate\.enabled: unknown key"),
    ],
)
def test_a_bad_config_value_is_an_error_naming_the_file_and_the_dotted_key(tmp_path, changes, message):
    path = edited_config(H200, tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as error:
        read_population(path, corpus="books.jsonl")
    assert str(error.value).startswith(f"{path}: ")


def test_missing_keys_and_bad_extensions_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"corpus: missing; set it in the config or pass --corpus"):
        read_population(H200)
    extensions = [{"name": "pi2", "method": "pi"}]
    with pytest.raises(ValueError, match=r"extensions\[0\]\.factor = None: pi needs a factor >= 1"):
        read_population(edited_config(H200, tmp_path, extensions=extensions), corpus="x")
    extensions = [{"name": "B", "method": "abf", "rope_theta": 1e5}]
    with pytest.raises(ValueError, match=r"extensions\[0\]\.name = 'B': is taken by the base"):
        read_population(edited_config(H200, tmp_path, extensions=extensions), corpus="x")
    with pytest.raises(ValueError, match=r"extensions\[0\]\.method = 'rope': must be 'pi' or 'ntk'"):
        read_population(edited_config(H200, tmp_path, extensions=[{"name": "r", "method": "rope"}]), corpus="x")


def test_the_command_reports_a_bad_config_as_one_error_line(tmp_path):
    path = edited_config(SMOKE, tmp_path, **{"finetune.training.weight_decay": -0.1})
    with pytest.raises(SystemExit) as exit_:
        population.cli(["--config", path, "--corpus", DATA, "--output-dir", str(tmp_path / "out")])
    assert "error: " in str(exit_.value.code)
    assert "finetune.training.weight_decay = -0.1: must be >= 0" in str(exit_.value.code)
    assert not (tmp_path / "out").exists()  # nothing is written before the config is read
    with pytest.raises(SystemExit) as exit_:
        population.cli(
            ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(tmp_path / "o"), "--members", "pi9-s0"]
        )
    assert "--members names ['pi9-s0'], which are not members" in str(exit_.value.code)


def test_a_config_that_does_not_parse_or_an_unusable_output_dir_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where an empty --output-dir would have written
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nmodel: {name: [x\n")
    with pytest.raises(SystemExit) as exit_:
        population.cli(["--config", str(bad), "--corpus", DATA, "--output-dir", str(tmp_path / "out")])
    assert str(exit_.value.code).endswith(
        f"error: {bad} is not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, column 1 "
        "(while parsing a flow sequence at line 2, column 15); fix the file there and run again."
    )
    assert not (tmp_path / "out").exists()
    (tmp_path / "f").write_text("a file")
    for output, message in (
        (str(tmp_path / "f" / "sub"), f"--output-dir {str(tmp_path / 'f' / 'sub')!r} lies below {tmp_path / 'f'}, "),
        ("", "--output-dir='' is empty: pass the run's folder, e.g. repro2/."),
        ("  ", "--output-dir='  ' is empty"),
    ):
        with pytest.raises(SystemExit) as exit_:
            population.cli(["--config", SMOKE, "--corpus", DATA, "--output-dir", output, "--stages", "report"])
        assert "error: " + message in str(exit_.value.code)
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml", "f"]  # nothing written, here or in the current folder


# ------------------------------------------------------------------ pure parts


def test_task_pools_draw_the_old_batches_with_one_pool_and_their_shares_with_several():
    books = np.arange(5000) % 200 + 300
    lines = [np.full(20, 1), np.full(30, 2)]
    needle = [np.full(25, 3)]
    # the old behaviour, written out: one uniform draw per row decides, then the document's index
    rng = np.random.default_rng(7)
    starts = rng.integers(0, books.shape[0] - 64, size=50)
    expected = np.empty((50, 64), dtype=np.int64)
    for row, start in enumerate(starts):
        expected[row] = books[start : start + 64]
        if rng.random() < 0.4:
            document = lines[int(rng.integers(2))]
            expected[row, 64 - document.shape[0] :] = document
    assert (TrainingBatches(books, lines, 64, 0.4, 7).sequences(50) == expected).all()
    mixed = TrainingBatches(books, [], 64, 0.0, 1, tasks={"lines": (lines, 0.3), "needle": (needle, 0.5)})
    last = mixed.sequences(4000)[:, -1]
    assert abs(np.isin(last, (1, 2)).mean() - 0.3) < 0.03 and abs((last == 3).mean() - 0.5) < 0.03
    with pytest.raises(ValueError, match="needle share 0.5 > 0 needs needle documents"):
        TrainingBatches(books, [], 64, 0.0, 1, tasks={"needle": ([], 0.5)})


def _row(name, method, acc512, accuracy, longppl, ppl, no_number=0.0):
    return {
        "member": name,
        "method": method,
        "acc512": acc512,
        "primary_accuracy": accuracy,
        "longppl": longppl,
        "ppl": ppl,
        "no_number_share": no_number,
    }


def test_exclusion_rules_name_their_reason():
    rules = Analysis()
    assert population_analysis.exclusion(_row("a", "pi", 0.5, 0.2, 2, 3), 0.8, rules) is None
    reason = population_analysis.exclusion(_row("b", "pi", 0.3, 0.2, 2, 3), 0.8, rules)
    assert reason == "accuracy at 512 tokens 0.300 is below 0.5 of the base's 0.800"
    reason = population_analysis.exclusion(_row("c", "pi", 0.9, 0.2, 2, 3, no_number=0.75), 0.8, rules)
    assert reason == "75% of its lines outputs hold no number"


def test_statistics_match_plain_references():
    rng = np.random.default_rng(0)
    methods = ["pi", "pi", "ntk", "ntk", "yarn", "yarn", "abf", "abf"]
    accuracy = rng.uniform(0.1, 0.9, 8)
    longppl = 5 - 3 * accuracy + rng.normal(0, 0.1, 8)
    ppl = 20 + rng.normal(0, 1, 8)
    rows = [_row(f"m{i}", methods[i], 0.9, accuracy[i], longppl[i], ppl[i]) for i in range(8)]
    found = population_analysis.statistics_of(rows, Analysis(resamples=200, min_members=8))
    assert found["n"] == 8 and found["inconclusive"] is False
    assert population_analysis.statistics_of(rows, Analysis(resamples=20, min_members=9))["inconclusive"] is True
    assert found["pearson"]["longppl"]["value"] == pytest.approx(np.corrcoef(longppl, accuracy)[0, 1])
    assert found["pearson"]["ppl"]["value"] == pytest.approx(np.corrcoef(ppl, accuracy)[0, 1])
    difference = np.corrcoef(longppl, accuracy)[0, 1] - np.corrcoef(ppl, accuracy)[0, 1]
    assert found["pearson"]["difference"]["value"] == pytest.approx(difference)
    ranks = lambda v: np.argsort(np.argsort(v))  # noqa: E731 (no ties here)
    assert found["spearman"]["longppl"]["value"] == pytest.approx(np.corrcoef(ranks(longppl), ranks(accuracy))[0, 1])
    low, high = found["pearson"]["longppl_by_method"]["low"], found["pearson"]["longppl_by_method"]["high"]
    assert low <= found["pearson"]["longppl"]["value"] <= high
    assert found["williams_t"]["t"] is not None
    floor = [_row(f"m{i}", "pi", 0.9, 0.0 if i < 6 else 0.5, 2 + i, 3 + i) for i in range(8)]
    at_floor = population_analysis.statistics_of(floor, Analysis(resamples=50, min_members=3))
    assert at_floor["inconclusive"] is True and at_floor["williams_t"]["skipped"] == "|r(LongPPL, PPL)| = 1"
    assert "3 are needed" in population_analysis.statistics_of(rows[:2], Analysis())["skipped"]


def _member_record(lines: dict) -> dict:
    """A member's evaluation record as the evaluate stage writes it, with only what a row reads."""
    scored = {"ppl": 30.0, "longppl": 4.0, "key_tokens": 3, "documents": {"nll": [3.0, 4.0], "tokens": [2, 2]}}
    scored["documents"].update(key_nll=[1.0, 2.0], key_tokens=[1, 2])
    counts = {"total": 300, "no_number": 0}
    return {
        "lines": {
            n: {"accuracy": c / 300, "correct": c, **counts, "outputs": ["<12345>"] * 300} for n, c in lines.items()
        },
        "acc512": {"accuracy": 0.9},
        "needle": {"accuracy": 0.1},
        "log_likelihood": {"640": [-1.0, -2.0]},
        "longppl": {"primary": scored, "secondary": scored, "soft": scored},
        "seconds": 1.0,
    }


def test_members_with_equal_counts_get_exactly_equal_accuracies():
    # 258 + 71 + 144 + 71 correct of 4 x 300 in two orders of the lengths: a float sum of the
    # per-length accuracies differs in its last bit between them (0.4533...33 against ...37)
    member = read_population(SMOKE, corpus=DATA).members()[0]
    orders = [
        {"640": 258, "768": 71, "896": 144, "992": 71},
        {"992": 71, "896": 144, "768": 71, "640": 258},
        {"640": 200, "768": 129, "896": 144, "992": 71},
    ]
    values = [
        population_analysis.member_row(member, _member_record(o), Analysis(resamples=20))["primary_accuracy"]
        for o in orders
    ]
    assert values[0] == values[1] == values[2] == 544 / 1200


def test_inconclusive_rules_name_their_reasons_and_skip_the_floor_for_a_log_likelihood():
    rng = np.random.default_rng(1)
    accuracy = np.r_[np.zeros(7), rng.uniform(0.2, 0.8, 3)]  # 7 of 10 at the floor: more than 2/3
    rows = [_row(f"m{i}", "pi", 0.9, accuracy[i], 5 - accuracy[i] + i / 100, 20 + i % 3) for i in range(10)]
    found = population_analysis.statistics_of(rows, Analysis(resamples=20, min_members=12))
    assert found["inconclusive"] is True and found["at_floor_or_ceiling"] == 7
    assert found["inconclusive_reasons"] == [
        "10 members analysed, fewer than the 12 the plan needs",
        "7 of 10 members at <= 0.05 or >= 0.95, more than 67%",
    ]
    # a log-likelihood (negative, unbounded) is no share: only the member count can make it inconclusive
    likelihood = [{**r, "primary_accuracy": -3.0 - i} for i, r in enumerate(rows)]
    found = population_analysis.statistics_of(likelihood, Analysis(resamples=20, min_members=10), share=False)
    assert found["inconclusive"] is False and found["at_floor_or_ceiling"] is None
    assert population_analysis.statistics_of(likelihood, Analysis(resamples=20, min_members=10))["inconclusive"] is True


def test_sensitivity_correlates_every_grid_point_and_window_with_the_accuracy():
    rng = np.random.default_rng(2)
    accuracy = rng.uniform(0.1, 0.9, 6)
    rows = []
    for i in range(6):
        row = _row(f"m{i}", "pi", 0.9, accuracy[i], 4 - accuracy[i], 30 + rng.normal())
        grid = {"alpha=1,beta=-2": 5 - 2 * accuracy[i] + rng.normal(0, 0.3), "alpha=2,beta=-2": rng.normal()}
        rows.append({**row, "sensitivity": grid, "longppl_secondary": 3 + accuracy[i] ** 2, "soft_longppl": 8.0 + i})
    found = population_analysis.sensitivity_statistics(rows, Analysis(resamples=50))
    assert list(found) == [
        "LongPPL alpha=1,beta=-2",
        "LongPPL alpha=2,beta=-2",
        "LongPPL, secondary window",
        "soft LongPPL",
        "PPL",
    ]
    columns = {
        "LongPPL alpha=1,beta=-2": [r["sensitivity"]["alpha=1,beta=-2"] for r in rows],
        "LongPPL, secondary window": [r["longppl_secondary"] for r in rows],
        "PPL": [r["ppl"] for r in rows],
    }
    for name, values in columns.items():
        assert found[name]["pearson"]["value"] == pytest.approx(np.corrcoef(values, accuracy)[0, 1])
        assert found[name]["pearson"]["low"] <= found[name]["pearson"]["value"] <= found[name]["pearson"]["high"]
    rows[0]["soft_longppl"] = float("nan")  # a measure with a missing value is left out
    assert "soft LongPPL" not in population_analysis.sensitivity_statistics(rows, Analysis(resamples=50))


def _primary(r: float, high: float, difference_high: float, reasons=()) -> dict:
    return {
        "pearson": {"longppl": {"value": r, "high": high}, "difference": {"high": difference_high}},
        "inconclusive": bool(reasons),
        "inconclusive_reasons": list(reasons),
    }


@pytest.mark.parametrize(
    "r, high, difference_high, reasons, outcome, held",
    [
        (-0.8, -0.5, -0.01, (), "reproduced", [True, True, True]),
        (-0.8, -0.3, -0.01, (), "not reproduced", [True, False, True]),  # interval reaches past -0.4
        (-0.8, -0.5, 0.05, (), "not reproduced", [True, True, False]),  # not better than PPL
        (-0.6, -0.45, -0.2, (), "not reproduced", [False, True, True]),
        (-0.8, -0.5, -0.01, ("19 members analysed",), "inconclusive", [True, True, True]),
    ],
)
def test_verdict_applies_the_plans_success_conditions(r, high, difference_high, reasons, outcome, held):
    decided = population_analysis.verdict(_primary(r, high, difference_high, reasons), Analysis())
    assert decided["outcome"] == outcome
    assert [c["holds"] for c in decided["conditions"]] == held
    assert decided["reasons"] == list(reasons)
    assert population_analysis.verdict({"skipped": "2 members"}, Analysis())["outcome"] == "inconclusive"


# ------------------------------------------------------------------ the smoke run


@pytest.mark.slow
def test_smoke_run_writes_every_stage_and_a_second_call_skips_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, export = tmp_path / "run", tmp_path / "export"
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out)]
    results = population.main(argv)
    config = read_population(SMOKE, corpus=DATA)
    names = [m.name for m in config.members()]

    for artefact in ("results.json", "report.md", "timings.json", "eval/calibration.json", "eval/answer_tokens.json"):
        assert (out / artefact).is_file(), artefact
    for name in ("B", "E1"):
        assert (out / "eval" / "gates" / f"{name}.json").is_file()
    on_disk = json.loads((out / "results.json").read_text())
    assert [r["member"] for r in on_disk["members"]] == names
    for row in on_disk["members"]:
        assert row["excluded"] == (row["exclusion_reason"] is not None)
        assert set(row["accuracy"]) == {"640", "800"}
        assert math.isfinite(row["ppl"]) and math.isfinite(row["longppl"]) and row["key_tokens"] > 0
        assert row["seed"] == config.members()[names.index(row["member"])].seed
    assert {"analysed", "all"} == set(on_disk["statistics"])
    assert "pearson" in on_disk["statistics"]["all"] and "inconclusive" in on_disk["statistics"]["all"]
    assert on_disk["calibration"]["alpha"] in config.calibration.grid
    assert on_disk["verdict"]["outcome"] in {"reproduced", "not reproduced", "inconclusive"}
    assert "## Sensitivity (analysed members, primary accuracy)" in (out / "report.md").read_text()
    assert f"Outcome by the analysis plan: **{on_disk['verdict']['outcome']}**" in (out / "report.md").read_text()
    assert set(on_disk["answer_tokens"]["by_alpha"]) == {"2", "-100"}
    member = json.loads((out / "eval" / "members" / f"{names[0]}.json").read_text())
    documents = member["longppl"]["primary"]["documents"]
    assert len(documents["key_nll"]) == config.data.validation_documents
    assert {"secondary", "soft", "alpha=-100,beta=-2", "alpha=0.5,beta=-100"} <= set(member["longppl"])
    assert results["members"] == on_disk["members"]

    before = json.loads((out / "timings.json").read_text())
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "eval" / "members").iterdir()}
    population.main(argv + ["--stages", "all"])
    after = json.loads((out / "timings.json").read_text())
    assert after["train"] == before["train"]  # no model trained again
    assert after.get("cache") == before.get("cache")  # no evaluator pass again
    assert {p: p.stat().st_mtime_ns for p in (out / "eval" / "members").iterdir()} == mtimes
    assert after["stage"]["report"]["calls"] == 2

    population.main(argv + ["--stages", "export", "--export-dir", str(export)])
    for name in ("B", "E1"):
        files = os.listdir(export / name)
        assert "tokenizer.json" in files and "config.json" in files
        assert all(os.path.getsize(export / name / f) <= 16 * 2**20 for f in files)
        assert json.loads((export / name / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_a_member_whose_weights_were_deleted_is_trained_again_not_trusted_by_its_record(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(tmp_path), "--members", "pi2-s2"]
    population.main([*argv, "--stages", "tokenizer,data,base,members"])
    folder = tmp_path / "models" / "members" / "pi2-s2"
    trained = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()  # deleted after training: its training.json stays

    logged = []
    population_models.stage_members(
        read_population(SMOKE, corpus=DATA), RunFolder(str(tmp_path), log=logged.append), ["pi2-s2"]
    )
    assert not any("pi2-s2 trained, kept" in line for line in logged)
    assert any("has its training record but no model.safetensors: training it again" in line for line in logged)
    assert (folder / "model.safetensors").read_bytes() == trained  # the same member again, from its seed
    model, _ = stages.load_member(str(folder), "cpu")  # what the evaluate stage loads
    assert model.config.max_position_embeddings >= 1024


def test_document_interval_resamples_the_pooled_perplexity():
    nll, counts = [10.0, 30.0, 5.0], [5, 10, 5]
    found = population_analysis.document_interval(nll, counts, Analysis(resamples=500))
    assert found["value"] == pytest.approx(math.exp(45 / 20))
    per_document = [math.exp(n / c) for n, c in zip(nll, counts)]
    assert min(per_document) <= found["low"] <= found["value"] <= found["high"] <= max(per_document)
    none = population_analysis.document_interval([0.0, 0.0], [0, 0], Analysis(resamples=10))
    assert math.isnan(none["value"]) and math.isnan(none["low"])


def test_extensions_set_the_rope_each_method_names(tmp_path):
    from longppl_reproduce.common.family import Variant, model_config

    config = read_population(H200, corpus="x")
    base = Variant("B", config.base.shape.model_fields(), {})
    model_config(base, 8192).save_pretrained(tmp_path)
    found = {}
    for extension in config.extensions:
        extended, attention = stages.extended_config(config, str(tmp_path), extension)
        assert extended.max_position_embeddings >= 1024
        found[extension.name] = (dict(extended.rope_parameters), attention)
    assert found["pi4"][0] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    assert found["yarn2"][0]["rope_type"] == "yarn" and found["yarn2"][0]["original_max_position_embeddings"] == 512
    # NTK through the library's recipe: the base raised by the factor, B's positions widened to L only
    assert found["ntk4"] == ({"rope_type": "default", "rope_theta": pytest.approx(1e4 * 4 ** (64 / 62))}, "sdpa")
    ntk4 = next(e for e in config.extensions if e.name == "ntk4")
    assert stages.extended_config(config, str(tmp_path), ntk4)[0].max_position_embeddings == 1024
    assert found["abf1e6"] == ({"rope_type": "default", "rope_theta": 1e6}, "sdpa")
    assert found["eabf1e5"][0]["rope_theta"] == 1e5 and found["eabf1e5"][1] != "sdpa"


def test_reports_show_undefined_numbers_as_na_and_end_with_wall_times_and_figures():
    assert fmt(0.12345) == "0.123" and fmt(2.46, 1) == "2.5" and fmt(3) == "3.000"
    for undefined in (None, float("nan"), float("inf"), -float("inf")):
        assert not finite(undefined) and fmt(undefined) == "n/a"
    assert finite(0) and finite(-1.5)
    results = {
        "timings": {
            "stage": {"data": {"seconds": 1.26, "calls": 2}, "report": {"seconds": 0.04, "calls": 1}},
            "train": {"B": {"seconds": 90.0, "calls": 1}},
        },
        "figures": ["figures/longppl.png"],
    }
    assert closing_sections(results) == [
        "",
        "## Wall time (seconds, summed over calls)",
        "",
        "- stage: data 1.3, report 0.0",
        "- train: B 90.0",
        "![longppl.png](figures/longppl.png)",
    ]


def test_the_report_is_written_as_results_json_and_report_md(tmp_path):
    logged = []
    run = RunFolder(str(tmp_path / "run"), log=logged.append)
    results = {"longppl": float("nan"), "members": ("a", "b")}
    assert run.write_report(results, "# Report\n") is results
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == {"longppl": None, "members": ["a", "b"]}
    assert (tmp_path / "run" / "report.md").read_text() == "# Report\n"
    assert logged == [f"report: {tmp_path / 'run' / 'results.json'}, {tmp_path / 'run' / 'report.md'}"]
    assert sorted(os.listdir(tmp_path / "run")) == ["report.md", "results.json"]  # nothing half-written left
