"""The LongCE-vs-CE reproduction (longppl_reproduce.longce_run, scripts/reproduce_longce.py): the whole
run on the smoke config, resuming without redoing work, and the clear errors for bad configs."""

import json
import math
import os
import subprocess
import sys

import datasets
import pytest
from conftest import REPO
from helpers import DATA, edited_config, json_leaves
from longppl_reproduce import longce_run as reproduce_longce

SMOKE = os.path.join(REPO, "configs", "reproduce", "longce_smoke_cpu.yaml")
H200 = os.path.join(REPO, "configs", "reproduce", "longce_h200.yaml")


@pytest.mark.slow
def test_smoke_pipeline_writes_every_artefact_with_finite_values_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "repro"
    argv = ["--config", SMOKE, "--corpus", DATA, "--output-dir", str(out)]
    import longce

    weighed = []  # the calls of add_key_token_weights: once per run, not once per seed of "cache"
    add_weights = longce.add_key_token_weights
    monkeypatch.setattr(longce, "add_key_token_weights", lambda *a, **k: weighed.append(1) or add_weights(*a, **k))
    results = reproduce_longce.main(argv)

    config = reproduce_longce.load_config(SMOKE, corpus=DATA)
    methods, seeds = config["finetune"]["methods"], config["finetune"]["seeds"]
    assert methods == ["ce", "self", "cache"] and len(seeds) >= 1
    runs = [reproduce_longce.run_name(m, s) for m in methods for s in seeds]
    for artefact in (
        "results.json",
        "report.md",
        "timings.json",
        "tokenizer/tokenizer.json",
        "data/finetune.jsonl",
        "data/validation.jsonl",
        "models/base/training.json",
        "models/long/training.json",
        "models/extended/training.json",
        "models/extended/model.safetensors",
        "caches/validation-evaluator/dataset_info.json",
        "caches/finetune-evaluator/dataset_info.json",
        "eval/evaluator/results.json",
        "eval/evaluator-soft/results.json",
        "figures/accuracy_vs_steps.png",
        *(f"models/{name}/model.safetensors" for name in runs),
        *(f"eval/lines/{name}.json" for name in ["extended", *runs]),
    ):
        assert (out / artefact).is_file(), artefact
    assert not (out / "work").exists() or not any((out / "work").iterdir())  # the trainer's scratch is gone

    # The extension reached L; every run saw the same number of sequences and tokens.
    extended = json.loads((out / "models" / "extended" / "config.json").read_text())
    assert extended["max_position_embeddings"] == config["evaluation"]["length"]
    assert extended["rope_parameters"]["rope_type"] == "linear"
    on_disk = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in on_disk["runs"]] == ["extended", *runs]
    tuned = on_disk["runs"][1:]
    assert len({(r["steps"], r["tokens"]) for r in tuned}) == 1
    steps, every = config["finetune"]["steps"], config["finetune"]["eval_every"]
    for row in tuned:
        assert [p["step"] for p in row["curve"]] == sorted({0, *range(every, steps + 1, every), steps})
    record = json.loads((out / "models" / runs[0] / "training.json").read_text())
    assert len(record["step_seconds"]["all"]) == steps
    # the cache run trained on the evaluator's weights (the trainer logs their statistics)
    cache_log = json.loads((out / "models" / "cache-s0" / "training.json").read_text())["log_history"]
    assert any("longce_mean_weight" in entry for entry in cache_log)
    assert set(on_disk["summary"]) == set(methods)
    for method in methods:
        assert on_disk["summary"][method]["seeds"] == seeds
    assert len(seeds) >= 2 and weighed == [1]  # the second seed of "cache" loaded the first one's weights
    assert (out / "data" / "finetune-cache-weights" / "key.json").is_file()

    measured = {key: on_disk[key] for key in ("runs", "summary")}
    leaves = [(w, v) for w, v in json_leaves(measured) if not w.endswith(".seed")]
    assert len(leaves) > 50
    for where, value in leaves:
        if where.startswith("results.runs[0].") and where.endswith("step_seconds"):
            continue
        assert value is not None and math.isfinite(value), where
    for row in tuned:
        for key in ("ppl", "longppl", "soft_longppl", "step_seconds", "seconds", "tokens"):
            assert row[key] > 0, (row["name"], key)
    assert set(on_disk["timings"]["stages"]) >= set(reproduce_longce.STAGES) - {"report"}
    # No lines length fits the base's 256 positions (a one-line case takes 317 tokens here): no
    # base row. The test below scores a base that fits.
    assert on_disk["base_lines"] is None and not (out / "eval" / "lines" / "base.json").exists()
    report = (out / "report.md").read_text()
    assert "The base before the extension" not in report
    for name in runs:
        assert f"| {name} |" in report
    for method in methods:
        assert f"| {method} | {len(seeds)} |" in report

    # A second call finds everything done: nothing is retrained, rescored or re-evaluated.
    watched = [
        *(out / "models" / name / "training.json" for name in ["base", "long", "extended", *runs]),
        out / "caches" / "finetune-evaluator" / "dataset_info.json",
        out / "eval" / "evaluator" / "results.json",
        out / "data" / "finetune.jsonl",
    ]
    stamps = [os.stat(path).st_mtime_ns for path in watched]
    again = reproduce_longce.main(argv)
    assert [os.stat(path).st_mtime_ns for path in watched] == stamps
    assert again["runs"] == results["runs"]
    timings = json.loads((out / "timings.json").read_text())
    assert timings["finetune"]["calls"] == 2

    # The saved weights are those add_key_token_weights gives, and another gamma computes them again.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "models" / "extended")
    run = reproduce_longce.LongCERun(config, str(out))
    saved = run.finetune_dataset("cache", tokenizer)
    assert weighed == [1]
    fresh = add_weights(
        datasets.Dataset.from_dict({"text": run.finetune_texts()}),
        key_tokens=run.cache_dir("finetune"),
        tokenizer=tokenizer,
        gamma=float(config["finetune"]["gamma"]),
        max_length=run.length,
        evaluator=run.named_model(config["evaluator"]),
        add_special_tokens=False,
    )
    assert saved["input_ids"] == fresh["input_ids"] and saved["longce_weights"] == fresh["longce_weights"]
    config["finetune"]["gamma"] = 0.5  # below the weights of this barely trained evaluator (~1): they change
    regamma = reproduce_longce.LongCERun(config, str(out)).finetune_dataset("cache", tokenizer)
    assert weighed == [1, 1] and regamma["longce_weights"] != saved["longce_weights"]

    # Another extension in the same output directory is refused, naming both (its runs started from this one).
    yarn = reproduce_longce.LongCERun({**config, "extension": {"method": "yarn"}}, str(out))
    with pytest.raises(ValueError, match="'method': 'pi'.*'method': 'yarn'.*new --output-dir"):
        yarn.stage_extend()

    # A base whose positions hold some lines lengths is scored before the extension at those only,
    # and the report says so (here the 512-position evaluator stands in for such a base).
    long_base = reproduce_longce.LongCERun({**config, "base_model": str(out / "models" / "long")}, str(out))
    cases = long_base.lines_cases()
    long_base.base_lines({**cases, 4 * run.length: cases[run.length]})  # 2048 tokens: beyond 512 positions
    scored = json.loads((out / "eval" / "lines" / "base.json").read_text())
    assert scored["positions"] == run.length and list(scored["per_length"]) == [str(n) for n in cases]
    assert all(len(v["outputs"]) == v["total"] == len(cases[int(n)]) for n, v in scored["per_length"].items())
    summary = reproduce_longce._base_lines_summary(str(out / "eval" / "lines" / "base.json"))
    assert summary == {"positions": run.length, "accuracy": {n: v["accuracy"] for n, v in scored["per_length"].items()}}
    report = reproduce_longce.format_report({**on_disk, "base_lines": summary})
    assert f"The base before the extension ({run.length} positions), lines accuracy: " in report


def _config(tmp_path, **changes) -> str:
    return edited_config(SMOKE, tmp_path, **changes)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"finetune.methods": ["ce", "longce"]}, ["finetune.methods", "unknown: ['longce']"]),
        ({"finetune.methods": ["ce", "ce"]}, ["finetune.methods", "once"]),
        ({"finetune.methods": []}, ["finetune.methods must be a non-empty list"]),
        ({"finetune.seeds": []}, ["finetune.seeds"]),
        ({"finetune.seeds": [0, 0]}, ["finetune.seeds", "distinct"]),
        ({"finetune.steps": 0}, ["finetune.steps"]),
        ({"finetune.batch_tokens": 256}, ["finetune.batch_tokens = 256", "evaluation.length"]),
        ({"finetune.lines_share": 2.0}, ["finetune.lines_share = 2.0"]),
        ({"evaluator": "nobody"}, ["evaluator = 'nobody'", "neither a family member", "config.json"]),
        ({"evaluator": None}, ["no evaluator"]),
        ({"evaluator": "base"}, ["evaluator 'base' reads 256 positions", "evaluation.length = 512"]),
        ({"base_model": None}, ["no base_model"]),
        ({"base_model": "/nowhere/model"}, ["base_model = '/nowhere/model'", "neither a family member"]),
        ({"extension.method": "rope"}, ["extension.method = 'rope'", "'pi'"]),
        ({"extension.method": "eabf"}, ["extension.method = 'eabf'"]),
        ({"extension.factor": 1.5}, ["extension.factor = 1.5", "384 positions", "above what the extension allows"]),
        ({"extension.factor": 0.5}, ["extension.factor must be >= 1"]),
        ({"evaluation.trunc_len": 512}, ["trunc_len (K) = 512", "evaluation.length = 512"]),
        ({"training.seq_len": 1024}, ["training.seq_len = 1024", "max_position_embeddings"]),
        ({"family": [{"name": "ce-s0"}], "base_model": "ce-s0", "evaluator": "ce-s0"}, ["['ce-s0']", "taken"]),
    ],
)
def test_bad_configs_are_refused_naming_the_field_and_value(tmp_path, changes, words):
    path = _config(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        reproduce_longce.load_config(path, corpus=DATA)
    assert path in str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_models_may_be_folders_and_the_family_may_then_be_empty(tmp_path):
    for name, positions in (("short", 256), ("long", 512)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    path = _config(tmp_path, family=[], base_model=str(tmp_path / "short"), evaluator=str(tmp_path / "long"))
    config = reproduce_longce.load_config(path, corpus=DATA)
    assert config["base_model"] == str(tmp_path / "short")
    run = reproduce_longce.LongCERun(config, str(tmp_path / "out"))
    assert run.named_model(config["evaluator"]) == str(tmp_path / "long")
    # the command line's flags win over the config's, and ABF sets no factor to check
    overridden = reproduce_longce.load_config(
        _config(tmp_path, family=[], base_model="x", evaluator="y", **{"extension.method": "abf"}),
        corpus=DATA,
        base_model=str(tmp_path / "short"),
        evaluator=str(tmp_path / "long"),
    )
    assert overridden["base_model"] == str(tmp_path / "short")
    # with no family, no extension factor can reach L from 256 positions by 1.5
    with pytest.raises(ValueError, match="above what the extension allows"):
        reproduce_longce.load_config(
            _config(
                tmp_path,
                family=[],
                base_model=str(tmp_path / "short"),
                evaluator=str(tmp_path / "long"),
                **{"extension.factor": 1.5},
            ),
            corpus=DATA,
        )


def test_the_gpu_config_is_valid_with_three_seeds_and_every_method():
    config = reproduce_longce.load_config(H200, corpus="books.jsonl.gz")
    tuning = config["finetune"]
    assert tuning["methods"] == ["ce", "self", "cache"] and len(tuning["seeds"]) == 3
    evaluation = config["evaluation"]
    assert evaluation["trunc_len"] < evaluation["length"] and len(evaluation["lines_lengths"]) >= 3
    family = {v.name: v for v in reproduce_longce.longppl_run.variants(config)}
    assert family[config["base_model"]].training["seq_len"] < evaluation["length"]


def test_stages_say_which_stage_to_run_first(tmp_path):
    run = reproduce_longce.LongCERun(reproduce_longce.load_config(SMOKE, corpus=DATA), str(tmp_path))
    with pytest.raises(ValueError, match="run the 'train' stage first"):
        run.stage_extend()
    with pytest.raises(ValueError, match="run the 'extend' stage first"):
        run.stage_finetune()
    with pytest.raises(ValueError, match="run the 'data' stage first"):
        run.stage_cache()


def test_stages_parse_in_pipeline_order(capsys):
    parser = reproduce_longce.build_parser()
    args = parser.parse_args(["--config", "c", "--output-dir", "o", "--stages", "report,finetune,extend"])
    assert args.stages == ["extend", "finetune", "report"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", "c", "--output-dir", "o", "--stages", "train,fly"])
    assert "unknown stages ['fly']" in capsys.readouterr().err


def test_spread_is_the_mean_and_sample_deviation_of_the_finite_values():
    found = reproduce_longce._spread([1.0, 2.0, 4.0, float("nan"), None])
    mean = (1 + 2 + 4) / 3
    assert found["n"] == 3 and found["mean"] == pytest.approx(mean)
    assert found["std"] == pytest.approx(math.sqrt(((1 - mean) ** 2 + (2 - mean) ** 2 + (4 - mean) ** 2) / 2))
    assert reproduce_longce._spread([3.0]) == {"mean": 3.0, "std": 0.0, "n": 1}
    assert reproduce_longce._spread([None])["n"] == 0


def test_help_is_quick():
    code = "import runpy, sys; sys.argv=['reproduce_longce.py', '--help']\ntry:\n runpy.run_path('scripts/reproduce_longce.py', run_name='__main__')\nexcept SystemExit: pass\nprint('HEAVY', [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])"
    env = dict(os.environ, LONGPPL_AUTO_REGISTER="0")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--stages" in done.stdout and "--base-model" in done.stdout and "--evaluator" in done.stdout
    assert "HEAVY []" in done.stdout


def test_runs_of_one_call_must_be_in_the_config(tmp_path):
    config = reproduce_longce.load_config(SMOKE, corpus=DATA)
    with pytest.raises(ValueError, match=r"--methods names \['longce'\]"):
        reproduce_longce.LongCERun(config, str(tmp_path), methods=["longce"])
    with pytest.raises(ValueError, match=r"--seeds names \[7\]"):
        reproduce_longce.LongCERun(config, str(tmp_path), seeds=[7])
    run = reproduce_longce.LongCERun(config, str(tmp_path), methods=["cache"], seeds=[1])
    assert run.selected_runs == [("cache", 1)] and len(run.runs) == 3 * len(config["finetune"]["seeds"])


def test_without_matplotlib_the_plot_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    runs = [{"method": "ce", "curve": [{"step": 0, "mean": 0.0}, {"step": 2, "mean": 0.5}]}]
    assert reproduce_longce.draw_curves(str(tmp_path / "plot.png"), runs) == []
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "plot.png").exists()
