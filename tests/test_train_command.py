"""longce-train as a command: its --help (recipe fields, both spellings, the installed command and
`python -m`), its errors as one line like the longppl commands, and what it does with an output
folder that holds files, with its results and model card (the training itself: test_train_script.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers import DATA, REPO, TINY, one_torch_thread, read_recipe, run_guarded, tiny_argv

from longce import LongCEConfig, LongCETrainer, cli
from longce.arguments import DataArguments, ModelArguments, RecipeConfig, parse_args


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


# ------------------------------------------------------------------ (i) --help


def option_names(help_text: str) -> list[str]:
    """The first spelling of every option, in the order --help prints them."""
    return re.findall(r"^  (-{1,2}[\w-]+)", help_text, flags=re.MULTILINE)


def recipe_fields() -> list[str]:
    longce = [f.name for f in dataclasses.fields(LongCEConfig) if f.name.startswith("longce_")]
    own = ["overwrite_output_dir", "torch_threads"]  # the command's own fields (RecipeConfig), after LongCE's
    return [f.name for cls in (ModelArguments, DataArguments) for f in dataclasses.fields(cls)] + longce + own


def show_help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        parse_args(list(argv))
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_shows_the_recipe_fields_config_first(capsys):
    text = show_help(capsys, "--help")
    names = option_names(text)
    assert names[:3] == ["-h", "--config", "--help-all"]
    assert names[3:] == [f"--{name}" for name in recipe_fields()]  # and nothing else: no TrainingArguments field
    # short: no TrainingArguments field (the recipe fields with run_clm's / TRL's other names of four of
    # them, LongCE's and the command's own: about 220 lines)
    assert "--adam_beta1" not in text and len(text.splitlines()) < 230
    assert "`--help-all` lists them all" in text


def test_help_all_lists_every_field_and_help_shows_recipe_values(capsys):
    names = option_names(show_help(capsys, "--help-all"))
    assert names[:3] == ["-h", "--config", "--help-all"]
    every = {f.name for cls in (ModelArguments, DataArguments, RecipeConfig) for f in dataclasses.fields(cls) if f.init}
    # HfArgumentParser adds --no_X for boolean fields that default to True.
    assert {f"--{name}" for name in every} == {name.replace("--no_", "--") for name in names[3:]}
    text = show_help(capsys, "--config", TINY, "--help")
    assert re.search(r"--longce_trunc_len LONGCE_TRUNC_LEN.*\n(.*\n)*?.*\(default: 32\)", text)


def test_fields_take_both_spellings_and_the_recipe_stays_the_default(tmp_path):
    for flag in ("--output_dir", "--output-dir"):
        _, _, args = parse_args(tiny_argv(tmp_path, flag, str(tmp_path / "elsewhere"), "--learning-rate", "3e-4"))
        assert args.output_dir == str(tmp_path / "elsewhere") and args.learning_rate == 3e-4, flag
    model_args, data_args, args = parse_args(tiny_argv(tmp_path))
    recipe = read_recipe()
    assert args.learning_rate == recipe["learning_rate"] and data_args.max_seq_length == recipe["max_seq_length"]


def test_the_recipe_parser_uses_only_public_argparse_api():
    """HfArgumentParser's and argparse's private names change between releases: longce uses neither."""
    private = re.compile(r"_parse_dataclass_field|_add_dataclass_arguments|\._actions\b|_get_help_string")
    folder = os.path.join(REPO, "trainer", "longce")
    offenders = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                offenders += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(handle, 1) if private.search(line)]
    assert not offenders, "private parser internals used:\n" + "\n".join(offenders)


def test_every_recipe_field_has_help_text():
    specs = {f.name: f for cls in (ModelArguments, DataArguments, RecipeConfig) for f in dataclasses.fields(cls)}
    missing = [name for name in recipe_fields() if len(specs[name].metadata.get("help", "")) < 10]
    assert not missing, missing


def run_ok(argv: list[str]) -> subprocess.CompletedProcess:
    """Run a command from the repository on one thread; it must exit 0 (its stderr's end otherwise)."""
    done = run_guarded(argv, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.slow  # a fresh interpreter importing transformers: seconds
def test_help_as_a_command():
    done = run_ok([sys.executable, "scripts/train_longce.py", "--help"])
    assert option_names(done.stdout)[:2] == ["-h", "--config"] and "--longce_gamma" in done.stdout


@pytest.mark.slow  # a fresh interpreter importing transformers: seconds
def test_help_of_the_installed_command():
    """`pip install` puts `longce-train` next to the interpreter (setup.cfg's console_scripts)."""
    command = os.path.join(os.path.dirname(sys.executable), "longce-train")
    assert os.path.isfile(command), f"{command} missing: reinstall the project (pip install -e .) to get the command"
    done = run_ok([command, "--help"])
    assert done.stdout.startswith("usage: longce-train --config RECIPE.yaml")
    assert option_names(done.stdout)[:3] == ["-h", "--config", "--help-all"] and "--longce_gamma" in done.stdout
    assert "--adam_beta1" not in done.stdout  # the short help: TrainingArguments' fields are behind --help-all


@pytest.mark.slow  # a fresh interpreter importing transformers: seconds
def test_help_all_through_python_m():
    """`python -m longce.cli` (what `accelerate launch -m longce.cli` runs in every process)."""
    done = run_ok([sys.executable, "-m", "longce.cli", "--help-all"])
    assert "--adam_beta1" in done.stdout and "--longce_gamma" in done.stdout and "--model_config" in done.stdout


def test_import_longce_leaves_the_command_modules_out():
    """The training command's modules load only when used: `import longce` is the trainer alone."""
    code = (
        "import sys, longce; print([m for m in ('longce.arguments', 'longce.data', 'longce.cli') if m in sys.modules])"
    )
    done = run_guarded(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ (j) errors as one line, like the longppl-* commands


def command_error(monkeypatch, argv: list[str]) -> str:
    """What `longce-train argv` exits with (run_command's one line), started as the installed command."""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/longce-train", *argv])
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    return stop.value.code


def test_missing_config_is_one_line(tmp_path, monkeypatch):
    message = command_error(monkeypatch, ["--config", str(tmp_path / "nope.yaml")])
    assert message == (
        f"longce-train: error: Config file '{tmp_path / 'nope.yaml'}' not found (--config takes a YAML recipe, "
        "e.g. configs/tiny_cpu.yaml)."
    )


def test_a_recipe_that_does_not_parse_is_one_line_naming_the_file_line_and_column(tmp_path, monkeypatch):
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rate: 1.0e-4\nmodel: {name: [x\n")
    message = command_error(monkeypatch, ["--config", str(path)])
    assert message == (
        f"longce-train: error: {path} is not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, "
        "column 1 (while parsing a flow sequence at line 2, column 15); fix the file there and run again."
    )


def test_bad_value_is_one_line_naming_the_field_and_value(tmp_path, monkeypatch):
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--longce_gamma", "-1"))
    assert message == (
        "longce-train: error: longce_gamma must be > 0 (it caps the soft weights "
        "min(exp(LSD), longce_gamma)), got -1.0."
    )


def test_mistyped_option_names_the_closest_field(tmp_path, monkeypatch):
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--max_stesp", "5"))
    assert message == (
        "longce-train: error: unknown option(s) --max_stesp (did you mean --max_steps?); "
        "`longce-train --help-all` lists every field."
    )
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--learnig-rate=1e-4", "stray"))
    assert message.startswith("longce-train: error: unknown option(s) --learnig-rate (did you mean --learning-rate?)")
    with pytest.raises(ValueError, match=r"unexpected argument\(s\) stray: a value follows the --FIELD it sets"):
        parse_args(tiny_argv(tmp_path, "stray"))


def test_a_value_of_the_wrong_type_is_one_line_naming_the_flag_value_and_type(tmp_path, monkeypatch):
    message = command_error(monkeypatch, ["--learning_rate", "abc"])
    assert message == (
        "longce-train: error: argument --learning_rate/--learning-rate: invalid float value: 'abc'; "
        "`longce-train --help` lists the fields and their types."
    )
    message = command_error(monkeypatch, ["--config"])
    assert message.startswith("longce-train: error: argument --config: expected one argument")


def test_torch_threads_below_one_is_refused(tmp_path, monkeypatch):
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--torch_threads", "0"))
    assert (
        message
        == "longce-train: error: torch_threads must be >= 1 (CPU threads of torch's operations) or unset, got 0."
    )


def test_longppl_train_names_itself_as_started_in_its_messages(tmp_path, capsys):
    from longppl.tools.main import main as longppl

    def error(*argv: str) -> str:
        with pytest.raises(SystemExit) as stop:
            longppl(["train", *argv])
        return stop.value.code

    assert error(*tiny_argv(tmp_path, "--max_stesp", "5")) == (
        "longppl train: error: unknown option(s) --max_stesp (did you mean --max_steps?); "
        "`longppl train --help-all` lists every field."
    )
    assert error(*tiny_argv(tmp_path, "--learning_rate", "abc")) == (
        "longppl train: error: argument --learning_rate/--learning-rate: invalid float value: 'abc'; "
        "`longppl train --help` lists the fields and their types."
    )
    # a run that is finished already: the one line that says so, and nothing trained
    checkpoint = tmp_path / "run" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 0.5}))
    capsys.readouterr()
    assert longppl(["train", *tiny_argv(tmp_path, "--max_steps", "3")]) == 0
    assert capsys.readouterr().err.startswith(f"longppl train: the run in '{tmp_path / 'run'}' is finished (step 3 ")
    checkpoint.rename(tmp_path / "run" / "checkpoint-30")
    assert error(*tiny_argv(tmp_path, "--overwrite_output_dir")).endswith(
        "'last' would pick; longppl train deletes nothing it did not write. Move or delete them, or choose another "
        "output_dir."
    )


def test_recipe_names_read_before_torch_are_the_fields_of_the_argument_dataclasses():
    from longce.arguments import RecipeParser
    from longce.recipes import options_of_fields, source_fields

    classes = [ModelArguments, DataArguments, RecipeConfig]
    read = source_fields()
    assert read == {f.name: f.default is True for cls in classes for f in dataclasses.fields(cls) if f.init}
    assert options_of_fields(read) == RecipeParser(classes).field_options()
    # options of other names (HfArgumentParser's metadata "aliases") would need reading too: there are none
    assert not any(f.metadata.get("aliases") for cls in classes for f in dataclasses.fields(cls))


def test_settings_that_cached_weights_never_read_are_named_once(tmp_path, capsys):
    cache = ("--longce_weights", "cache", "--key_tokens", str(tmp_path))
    parse_args(tiny_argv(tmp_path, *cache))
    assert capsys.readouterr().err.splitlines() == [
        "longce-train: warning: longce_trunc_len, longce_sliding_window, longce_max_tokens_per_batch have no effect "
        "with longce_weights 'cache': the weights are the evaluator's, read from key_tokens, scored with the cache's "
        "own K and d (key_tokens_trunc_len and key_tokens_sliding_window choose among the cache's settings); drop "
        "them from the recipe and command line, or use longce_weights 'self'."
    ]
    recipe = tmp_path / "recipe.yaml"  # the tiny recipe without the short-context pass's settings
    shortened = {
        k: v for k, v in read_recipe().items() if not k.startswith(("longce_trunc", "longce_sliding", "longce_max"))
    }
    shortened["data_files"] = DATA
    recipe.write_text(yaml.safe_dump(shortened))
    parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "run"), *cache])
    assert capsys.readouterr().err == ""
    parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "run"), *cache, "--longce_trunc_len", "64"])
    assert capsys.readouterr().err.startswith(
        "longce-train: warning: longce_trunc_len has no effect with longce_weights 'cache': "
    )
    parse_args(tiny_argv(tmp_path))  # weights of the trained model's own short-context pass: all are read
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_the_installed_command_prints_one_line_and_the_traceback_on_request(tmp_path):
    command = os.path.join(os.path.dirname(sys.executable), "longce-train")
    argv = [command, "--config", str(tmp_path / "nope.yaml")]
    env = {k: v for k, v in os.environ.items() if k != "LONGPPL_DEBUG"}
    done = run_guarded(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"longce-train: error: Config file '{tmp_path / 'nope.yaml'}' not found (--config takes a YAML recipe, "
        "e.g. configs/tiny_cpu.yaml)."
    ]
    debug = run_guarded(argv, capture_output=True, text=True, env=dict(env, LONGPPL_DEBUG="1"))
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().endswith(
        f"FileNotFoundError: Config file '{tmp_path / 'nope.yaml'}' not found (--config takes a YAML recipe, e.g. configs/tiny_cpu.yaml)."
    )


# ------------------------------------------------------------------ (l) an output_dir that holds files; results and card


def test_rerun_into_a_folder_with_checkpoints_resumes_from_the_last(tmp_path, monkeypatch, capsys):
    common = ("--max_steps", "4", "--save_steps", "2", "--logging_steps", "2")
    cli.train(tiny_argv(tmp_path, *common))
    capsys.readouterr()
    calls = []
    compute_loss = LongCETrainer.compute_loss
    monkeypatch.setattr(
        LongCETrainer, "compute_loss", lambda self, *a, **k: calls.append(1) or compute_loss(self, *a, **k)
    )
    again = cli.train(tiny_argv(tmp_path, "--max_steps", "6", "--save_steps", "2", "--logging_steps", "2"))
    assert len(calls) == 2 and again.state.global_step == 6  # steps 5 and 6 only: resumed at checkpoint-4
    err = capsys.readouterr().err
    assert (
        f"longce-train: output_dir '{tmp_path / 'run'}' holds checkpoints of an earlier run: resuming from checkpoint-4"
        in err
    )


def test_rerunning_a_finished_run_says_so_and_writes_nothing_unless_asked_for_more_steps(tmp_path, capsys):
    out = tmp_path / "run"

    def snapshot():
        return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}

    common = ("--save_steps", "2", "--logging_steps", "1")
    cli.train(tiny_argv(tmp_path, "--max_steps", "3", *common))
    capsys.readouterr()
    before = snapshot()
    assert cli.train(tiny_argv(tmp_path, "--max_steps", "3", *common)) is None
    assert capsys.readouterr().err.splitlines() == [
        f"longce-train: the run in '{out}' is finished (step 3 of max_steps 3, checkpoint-3/trainer_state.json): nothing to do, "
        "nothing written. Raise --max_steps (or --num_train_epochs) to continue it, or choose another output_dir "
        "to train afresh."
    ]
    assert snapshot() == before
    assert cli.train(tiny_argv(tmp_path, "--max_steps", "2", *common, "--resume_from_checkpoint", "last")) is None
    assert "finished (step 3 of max_steps 2" in capsys.readouterr().err and snapshot() == before
    more = cli.train(tiny_argv(tmp_path, "--max_steps", "4", *common))
    assert more.state.global_step == 4 and sorted(p.name for p in out.glob("checkpoint-*"))[-1] == "checkpoint-4"
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_non_empty_folder_without_checkpoint_is_refused_unless_overwrite(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("the user's file")
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--max_steps", "1"))
    assert message == (
        f"longce-train: error: output_dir '{out}' is not empty and holds no checkpoint-* folder to resume from. "
        "Choose a new or empty output_dir, or add --overwrite_output_dir to train afresh into it (files of the "
        "same names are replaced, others kept)."
    )
    trainer = cli.train(tiny_argv(tmp_path, "--max_steps", "1", "--save_strategy", "no", "--overwrite_output_dir"))
    assert trainer.state.global_step == 1 and (out / "model.safetensors").is_file()
    assert (out / "notes.txt").read_text() == "the user's file"  # kept


def test_overwrite_refuses_a_folder_with_an_earlier_runs_checkpoints_and_deletes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoint-30").mkdir(parents=True)
    (out / "checkpoint-30" / "trainer_state.json").write_text("{}")
    message = command_error(monkeypatch, tiny_argv(tmp_path, "--overwrite_output_dir", "true"))
    assert message == (
        f"longce-train: error: overwrite_output_dir trains afresh into output_dir '{out}', but it holds the "
        "checkpoint folders of an earlier run (the newest: checkpoint-30), which a later resume_from_checkpoint "
        "'last' would pick; longce-train deletes nothing it did not write. Move or delete them, or choose another "
        "output_dir."
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-30"]


def test_help_says_what_happens_to_a_folder_that_holds_files(capsys):
    text = " ".join(show_help(capsys, "--help").split())
    assert "--overwrite_output_dir" in text and "--torch_threads" in text
    assert "a folder with checkpoint-* folders resumes from its last checkpoint" in text
    assert "any other non-empty folder is refused" in text and "LONGPPL_DEBUG=1 shows its traceback" in text


def test_all_results_and_model_card(tmp_path):
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--validation_split_percentage",
            "20",
            "--max_eval_samples",
            "4",
        )
    )
    out = tmp_path / "run"
    results = json.loads((out / "all_results.json").read_text())
    history = trainer.state.log_history
    summary = next(entry for entry in history if "train_loss" in entry)  # the Trainer's end-of-training record
    assert results["train_loss"] == pytest.approx(summary["train_loss"])
    assert results["train_runtime"] == pytest.approx(summary["train_runtime"])
    assert results["train_samples"] == len(trainer.train_dataset)
    evaluation = [entry for entry in history if "eval_loss" in entry]
    assert len(evaluation) == 1 and evaluation[0]["step"] == 2  # one evaluation, of the final model
    for key in ("eval_loss", "eval_ce_loss", "eval_longce_mean_weight"):
        assert results[key] == pytest.approx(evaluation[0][key]), key
    assert results["eval_samples"] == len(trainer.eval_dataset) == 4

    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert "longce" in card.data.tags and card.data.library_name == "transformers"
    assert "learning_rate: 0.003" in card.text  # transformers' hyperparameters section
    assert "[](https://huggingface.co/)" not in card.text and "unknown dataset" not in card.text
    assert (
        "This model is a randomly initialised llama model (model_config) on the local files `govreport_crs.jsonl`, "
        "trained with LongCE (K = 32 (longce_trunc_len), d = 16 (longce_sliding_window), gamma = 5 (longce_gamma), "
        "weights from 'self' (longce_weights))." in card.text
    )
    bibtex = re.search(r"```bibtex\n(.*?)```", card.text, re.S).group(1)
    assert bibtex.startswith("@inproceedings{fang2025wrong,")
    assert "What is Wrong with Perplexity for Long-context Language Modeling?" in bibtex


def test_model_card_names_a_hub_base_model_and_dataset():
    from types import SimpleNamespace

    model = SimpleNamespace(model_name_or_path="Qwen/Qwen2-7B", model_config=None)
    data = SimpleNamespace(dataset_name="emozilla/pg19", dataset_split="train", data_files=None)
    assert cli.model_card_origin(model, data) == (
        "a fine-tuned version of [Qwen/Qwen2-7B](https://huggingface.co/Qwen/Qwen2-7B) on the "
        "[emozilla/pg19](https://huggingface.co/datasets/emozilla/pg19) dataset (split 'train')"
    )


def test_model_card_of_a_lora_run_keeps_peft_metadata(tmp_path):
    cli.train(tiny_argv(tmp_path, "--lora_r", "2", "--max_steps", "1", "--save_strategy", "no"))
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "run" / "README.md")
    assert card.data.library_name == "peft" and "longce" in card.data.tags
    assert "@inproceedings{fang2025wrong," in card.text
