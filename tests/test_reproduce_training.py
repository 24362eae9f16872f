"""The reproduction's training loop and lines cases (longppl_reproduce.family, longppl_reproduce.longppl_run):
torch.compile gives the eager losses, a training cut off mid-model resumes from its checkpoint to
the weights of an uninterrupted run, and the lines prompts leave room for the generated answer
inside the models' positions."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers import DATA, byte_level_bpe, edited_config
from longppl_reproduce import lines
from longppl_reproduce import longppl_run as reproduce
from longppl_reproduce.family import CHECKPOINT, TRAINING_RECORD, TrainingBatches, Variant, train_variant
from safetensors.torch import load_file

SMOKE = os.path.join(REPO, "configs", "reproduce", "smoke_cpu.yaml")
H200 = os.path.join(REPO, "configs", "reproduce", "family_h200.yaml")

TINY_MODEL = {
    "architecture": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
}
TINY_TRAINING = {
    "seq_len": 64,
    "steps": 2,
    "batch_tokens": 256,
    "micro_batch_tokens": 128,
    "lr": 3e-3,
    "warmup_steps": 1,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.1,
    "lines_share": 0.0,
    "seed": 0,
    "log_every": 1,
}


class Interrupted(Exception):
    """Stands for the call limit killing a training run."""


def _tiny(tmp_path, name, log=None, **training):
    """Train the tiny model on random 'books' into tmp_path/name; returns (record, weights)."""
    tokenizer = byte_level_bpe(600, add_bos=False)
    books = np.random.default_rng(0).integers(3, len(tokenizer), 5000).astype(np.uint16)
    variant = Variant("tiny", dict(TINY_MODEL), {**TINY_TRAINING, **training})
    folder = str(tmp_path / name)
    record = train_variant(variant, tokenizer, TrainingBatches(books, [], 64, 0.0, 0), folder, "cpu", log or print)
    return record, load_file(os.path.join(folder, "model.safetensors"))


def _interrupt_at(step: int, seen: list):
    """A log that raises when the loop reports ``step`` (after that step's update, before its checkpoint)."""

    def log(message: str) -> None:
        seen.append(message)
        if f"step {step:>5}/" in message:
            raise Interrupted(message)

    return log


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses_and_weights(tmp_path):
    from torch._dynamo.utils import counters

    eager, eager_weights = _tiny(tmp_path, "eager")
    counters.clear()
    compiled, compiled_weights = _tiny(tmp_path, "compiled", compile=True)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo did capture the model's forward
    assert compiled["training"]["compile"] is True
    assert 0 < compiled["first_step_seconds"] <= compiled["seconds"]
    assert [row["step"] for row in compiled["losses"]] == [0, 1]
    for mine, reference in zip(compiled["losses"], eager["losses"]):
        assert np.isfinite(mine["loss"])
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    assert set(compiled_weights) == set(eager_weights)
    for name, tensor in compiled_weights.items():
        torch.testing.assert_close(tensor, eager_weights[name], rtol=1e-3, atol=1e-5)


def test_a_checkpoint_of_other_settings_is_not_resumed_but_a_new_log_interval_is(tmp_path):
    seen = []
    with pytest.raises(Interrupted):
        _tiny(tmp_path, "a", log=_interrupt_at(3, seen), steps=5, save_every=2)
    progress = json.loads((tmp_path / "a" / CHECKPOINT / "progress.json").read_text())
    assert progress["step"] == 2 and not (tmp_path / "a" / TRAINING_RECORD).exists()
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    seen.clear()
    record, _ = _tiny(tmp_path, "a", log=seen.append, steps=5, save_every=2, lr=1e-3)
    assert record["resumed_at"] == []
    assert any("training.lr changed" in line and "from scratch" in line for line in seen)
    assert not (tmp_path / "a" / CHECKPOINT).exists()  # the finished model replaced the folder

    seen.clear()
    record, _ = _tiny(tmp_path, "b", log=seen.append, steps=5, save_every=3, log_every=2)
    assert record["resumed_at"] == [2]
    assert [row["step"] for row in record["losses"]] == [0, 1, 2, 4]  # logged every step, then every 2


def _smoke_config(tmp_path, **changes) -> str:
    return edited_config(SMOKE, tmp_path, **changes)


@pytest.mark.slow
def test_the_train_stage_resumes_a_cut_off_model_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config_path = _smoke_config(
        tmp_path,
        **{
            "training.steps": 8,
            "training.save_every": 3,
            "training.log_every": 1,
            "training.warmup_steps": 2,
            "family": [{"name": "full"}],
        },
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = ["--config", config_path, "--corpus", DATA]
    reproduce.main([*common, "--output-dir", str(whole), "--stages", "tokenizer,data"])
    shutil.copytree(whole, cut)
    reproduce.main([*common, "--output-dir", str(whole), "--stages", "train"])

    # Cut off after step 4's update: the checkpoint of steps 0-2 is on disk, steps 3-4 are lost.
    config = reproduce.load_config(config_path, corpus=DATA)
    seen = []
    with pytest.raises(Interrupted):
        reproduce.Run(config, str(cut), log=_interrupt_at(4, seen)).stage_train()
    folder = cut / "models" / "full"
    assert json.loads((folder / CHECKPOINT / "progress.json").read_text())["step"] == 3
    assert not (folder / TRAINING_RECORD).exists()

    # The next call of the train stage resumes at step 3 and ends where the uninterrupted run did.
    reproduce.main([*common, "--output-dir", str(cut), "--stages", "train"])
    resumed = json.loads((folder / TRAINING_RECORD).read_text())
    reference = json.loads((whole / "models" / "full" / TRAINING_RECORD).read_text())
    assert resumed["resumed_at"] == [3] and reference["resumed_at"] == []
    assert resumed["losses"] == reference["losses"]
    assert [row["step"] for row in resumed["losses"]] == list(range(8))
    mine, theirs = load_file(str(folder / "model.safetensors")), load_file(str(whole / "models/full/model.safetensors"))
    assert set(mine) == set(theirs)
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    assert not (folder / CHECKPOINT).exists()


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def test_lines_cases_leave_room_for_the_answer_inside_the_positions(tmp_path):
    tokenizer = byte_level_bpe(600, add_bos=True)
    new = 128  # longer than a reference answer (~75 tokens of this small BPE), so the answer does not cover it

    def run(name: str, **changes):
        config = reproduce.load_config(_smoke_config(tmp_path, **{"evaluation.max_new_tokens": new, **changes}), DATA)
        return reproduce.Run(config, str(tmp_path / name))

    def positions_taken(case) -> int:
        return max(_tokens(tokenizer, case.prompt) + new, _tokens(tokenizer, lines.case_text(case)))

    roomy, tight = run("roomy"), run("tight", **{"model.max_position_embeddings": 512})
    assert roomy.positions == 640 and tight.positions == 512

    # 512-token cases with 128 new tokens fit 640 positions: the cases are what they always were ...
    wanted = lines.lines_for_token_length(tokenizer, 512, seed=0)
    cases, longest = roomy.lines_test_cases(tokenizer, 512)
    assert cases == lines.generate_lines_cases(wanted, len(cases), 512)
    assert longest == max(positions_taken(case) for case in cases)
    # ... but not 512 positions: a prompt and its generated answer run past them.
    assert longest > 512

    cases, longest = tight.lines_test_cases(tokenizer, 512)
    fitted = cases[0].num_lines
    assert fitted < wanted and cases == lines.generate_lines_cases(fitted, len(cases), 512)
    assert longest == max(positions_taken(case) for case in cases) <= 512
    # cut to fit, not further: one line more would not fit
    assert max(positions_taken(case) for case in lines.generate_lines_cases(fitted + 1, len(cases), 512)) > 512
    # Shorter records that fit are the same under both.
    assert tight.lines_test_cases(tokenizer, 384)[0] == roomy.lines_test_cases(tokenizer, 384)[0]


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"training.compile": "yes"}, ["training.compile must be", "'yes'"]),
        ({"training.save_every": 0}, ["training.save_every must be an integer >= 1", "no checkpoints"]),
        ({"evaluation.max_new_tokens": 320}, ["evaluation.max_new_tokens = 320", "max_position_embeddings = 640"]),
    ],
)
def test_bad_training_settings_are_refused_naming_the_field_and_value(tmp_path, changes, words):
    path = _smoke_config(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        reproduce.load_config(path, corpus=DATA)
    assert path in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_the_h200_config_plans_compiled_checkpointed_5000_step_runs():
    config = reproduce.load_config(H200, corpus="books.jsonl.gz")
    family = reproduce.variants(config)
    assert len(family) == 8
    steps = {v.name: v.training["steps"] for v in family}
    assert steps.pop("l80-short") == pytest.approx(5000 / 3, rel=0.05)
    assert set(steps.values()) == {5000}
    for variant in family:
        assert variant.training["compile"] is True and variant.training["save_every"] == 1000
    smoke = reproduce.load_config(SMOKE, corpus=DATA)
    assert smoke["training"]["compile"] is False and smoke["training"]["save_every"] is None
