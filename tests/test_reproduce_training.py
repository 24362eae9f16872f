"""The reproduction's model family (longppl_reproduce.common.family): torch.compile gives the eager losses, a
training cut off mid-model resumes from its checkpoint to the weights of an uninterrupted run, and its
helpers (the learning-rate schedule, the packed batches)."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import byte_level_bpe
from longppl_reproduce.common.family import (
    CHECKPOINT,
    TRAINING_RECORD,
    TrainingBatches,
    Variant,
    is_trained,
    learning_rate,
    missing_model_files,
    train_variant,
)
from safetensors.torch import load_file

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


@pytest.mark.slow  # three training runs: seconds
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


def test_a_cut_off_checkpoint_record_is_named_with_what_to_do(tmp_path):
    progress = tmp_path / "m" / CHECKPOINT / "progress.json"
    progress.parent.mkdir(parents=True)
    progress.write_text('{"step": 2, "sec')
    with pytest.raises(ValueError) as error:
        _tiny(tmp_path, "m")
    assert str(error.value) == (
        f"{progress} is not JSON (Unterminated string starting at: line 1, column 13): delete it and run again, and "
        "the model is trained from its first step."
    )


def test_a_cut_off_training_resumes_from_its_checkpoint_to_the_uninterrupted_weights(tmp_path):
    settings = {"steps": 8, "save_every": 3, "log_every": 1, "warmup_steps": 2}
    reference, reference_weights = _tiny(tmp_path, "whole", **settings)

    # Cut off after step 4's update: the checkpoint of steps 0-2 is on disk, steps 3-4 are lost.
    seen = []
    with pytest.raises(Interrupted):
        _tiny(tmp_path, "cut", log=_interrupt_at(4, seen), **settings)
    folder = tmp_path / "cut"
    assert json.loads((folder / CHECKPOINT / "progress.json").read_text())["step"] == 3
    assert not (folder / TRAINING_RECORD).exists()

    # The next call resumes at step 3 and ends where the uninterrupted run did.
    resumed, weights = _tiny(tmp_path, "cut", **settings)
    assert resumed["resumed_at"] == [3] and reference["resumed_at"] == []
    assert resumed["losses"] == reference["losses"]
    assert [row["step"] for row in resumed["losses"]] == list(range(8))
    assert set(weights) == set(reference_weights)
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name
    assert not (folder / CHECKPOINT).exists()


def test_a_model_whose_weights_went_after_training_is_trained_again(tmp_path):
    record, _ = _tiny(tmp_path, "m")
    folder = tmp_path / "m"
    assert is_trained(str(folder)) and missing_model_files(str(folder)) is None
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(whole[:-100])  # cut off: its header promises more bytes
    assert not is_trained(str(folder)) and missing_model_files(str(folder)) == "a cut-off model.safetensors"
    (folder / "model.safetensors").unlink()
    assert (folder / TRAINING_RECORD).is_file() and not is_trained(str(folder))  # the record alone is not a model
    seen = []
    again, _ = _tiny(tmp_path, "m", log=seen.append)
    assert f"  [tiny] {folder} has its training record but no model.safetensors: training it again" in seen
    assert is_trained(str(folder)) and again["losses"] == record["losses"]
    assert (folder / "model.safetensors").read_bytes() == whole  # the same seed trains the same weights
    (folder / "tokenizer.json").unlink()
    assert missing_model_files(str(folder)) == "no tokenizer.json"


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
