"""longce-train with ``--longce_weights cache --key_tokens <cache>``: every weight the trainer sees stays
with its token through tokenization, run_clm-style grouping, per-document packing and the evaluation
split (against plain references written here), and the bad combinations are clear errors."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import yaml
from datasets import Dataset
from helpers import byte_level_bpe, govreport_texts, one_torch_thread

from longce import LongCETrainer, cli
from longce.arguments import parse_args
from longce.cached_weights import add_key_token_weights
from longce.data import byte_level_tokenizer, load_datasets
from longppl.cache.key_token_cache import KeyTokenCache, KeyTokenSettings, key_token_rows
from longppl.core.scoring import EvaluatorScores
from longppl.models.fingerprints import ModelIdentity
from longppl.rules.alignment import encode_with_offsets
from longppl.settings import KeyTokenRule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
GAMMA = 3.0  # --longce_gamma: the synthetic LSDs exceed log(3) often
K, D = 40, 16  # the synthetic evaluator's settings: tokens before K have no short score (weight 1)
LENGTH = 64  # --max_seq_length


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def ascii_texts(n=6, chars=(700, 450, 900, 300, 650, 500)):
    """Excerpts of the reports without non-ASCII characters: one byte-level token per character."""
    texts = [text.encode("ascii", "ignore").decode() for text in govreport_texts()]
    return [texts[i][100 : 100 + chars[i % len(chars)]] for i in range(n)]


def synthetic_scores(tokenizer, texts, seed):
    """Evaluator scores with varied LSDs (many above log GAMMA), NaN short scores before K."""
    rng = np.random.default_rng(seed)
    scores = []
    for text in texts:
        ids, offsets = encode_with_offsets(tokenizer, text, add_special_tokens=True)
        lp_long = (-rng.exponential(2.0, ids.shape[0])).astype(np.float32)
        lp_short = (lp_long - rng.normal(0.5, 1.5, ids.shape[0])).astype(np.float32)
        lp_long[0] = np.nan
        lp_short[:K] = np.nan
        scores.append(EvaluatorScores(ids, offsets, lp_long, lp_short))
    return scores


def write_cache(path, tokenizer, texts, evaluators=(("evaluator-a", 0),)):
    """A key-token cache on disk with synthetic scores of ``texts`` from each (name, seed) evaluator."""
    cache, scores = KeyTokenCache(None), {}
    for name, seed in evaluators:
        scores[name] = synthetic_scores(tokenizer, texts, seed)
        identity = ModelIdentity(name, "", "float32", f"synthetic:{name}")
        cache.add(key_token_rows(texts, scores[name], KeyTokenSettings(K, D), identity))
    cache.save(str(path))
    return scores


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return str(path)


def reference_documents(scores, eos, gamma=GAMMA):
    """Per document: the byte-level ids with EOS and, token by token, min(exp(lp_long - lp_short), gamma)
    (1 without a short score, 1 for the EOS). Same tokenizer and one character per token, so token k of
    the trained model is the evaluator's token k."""
    documents = []
    for score in scores:
        weights = [
            1.0 if math.isnan(long) or math.isnan(short) else min(math.exp(long - short), gamma)
            for long, short in zip(score.lp_long.tolist(), score.lp_short.tolist())
        ]
        documents.append((score.input_ids.tolist() + [eos], weights + [1.0]))
    return documents


def reference_blocks(documents, batch_size=100):
    """run_clm grouping, written out: per map batch of documents, the concatenation cut into LENGTH blocks."""
    blocks = []
    for start in range(0, len(documents), batch_size):
        ids = [t for doc, _ in documents[start : start + batch_size] for t in doc]
        weights = [w for _, doc in documents[start : start + batch_size] for w in doc]
        blocks += [(ids[i : i + LENGTH], weights[i : i + LENGTH]) for i in range(0, len(ids) - LENGTH + 1, LENGTH)]
    return blocks


def reference_pieces(documents):
    """Packing, written out: each document cut into pieces of at most LENGTH tokens (at least 2)."""
    return [
        (ids[i : i + LENGTH], weights[i : i + LENGTH])
        for ids, weights in documents
        for i in range(0, len(ids), LENGTH)
        if len(ids) - i >= 2
    ]


def argv(tmp_path, data, cache, *extra):
    return [
        "--config",
        TINY,
        "--data_files",
        data,
        "--output_dir",
        str(tmp_path / "run"),
        "--cache_dir",
        str(tmp_path / "hf"),
        "--max_seq_length",
        str(LENGTH),
        "--longce_gamma",
        str(GAMMA),
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        *(("--longce_weights", "cache", "--key_tokens", str(cache)) if cache is not None else ()),
        *extra,
    ]


def spy_on_weights(monkeypatch):
    """Record (training?, input_ids, position_ids, weights) of every batch the trainer weighs."""
    seen = []
    original = LongCETrainer._batch_weights

    def spy(self, inputs, input_ids):
        weights = original(self, inputs, input_ids)
        positions = inputs.get("position_ids")
        seen.append((self.model.training, input_ids.cpu(), None if positions is None else positions.cpu(), weights))
        return weights

    monkeypatch.setattr(LongCETrainer, "_batch_weights", spy)
    return seen


def assert_rows_match(rows, reference):
    """Each (ids, weights) row is one reference row, weight for weight (found by its ids)."""
    by_ids = {tuple(ids): weights for ids, weights in reference}
    assert len(by_ids) == len(reference)  # ids tell the rows apart
    for ids, weights in rows:
        assert tuple(ids) in by_ids, "a row whose tokens are not a reference row's"
        np.testing.assert_allclose(weights, by_ids[tuple(ids)], rtol=1e-5)


# ------------------------------------------------------------------ the weights stay with their tokens


@pytest.mark.parametrize("batch_size", [100, 2])
def test_grouped_blocks_carry_each_tokens_weight(tmp_path, batch_size):
    tokenizer = byte_level_tokenizer()
    texts = ascii_texts()
    scores = write_cache(tmp_path / "keys", tokenizer, texts)["evaluator-a"]
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    extra = ("--preprocessing_batch_size", str(batch_size))
    _, data_args, training_args = parse_args(argv(tmp_path, data, tmp_path / "keys", *extra))
    train, _ = load_datasets(data_args, tokenizer, str(tmp_path / "hf"), training_args.longce_rule)
    expected = reference_blocks(reference_documents(scores, tokenizer.eos_token_id), batch_size)
    assert train.column_names == ["input_ids", "longce_weights", "labels"]
    assert train["input_ids"] == [ids for ids, _ in expected] == train["labels"]
    np.testing.assert_allclose(np.array(train["longce_weights"]), np.array([w for _, w in expected]), rtol=1e-5)
    weights = np.concatenate(train["longce_weights"])
    assert weights.max() == pytest.approx(GAMMA) and (weights > 1).mean() > 0.2 and (weights < 1).any()
    # The tokens are those of plain training (no cache): only the weights are added.
    _, plain_args, _ = parse_args(argv(tmp_path, data, None, *extra))
    assert load_datasets(plain_args, tokenizer, str(tmp_path / "hf"))[0]["input_ids"] == train["input_ids"]


def test_training_and_evaluation_batches_carry_each_tokens_weight(tmp_path, monkeypatch, capsys):
    tokenizer = byte_level_tokenizer()
    texts = ascii_texts()
    scores = write_cache(tmp_path / "keys", tokenizer, texts)["evaluator-a"]
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    seen = spy_on_weights(monkeypatch)
    trainer = cli.train(
        argv(tmp_path, data, tmp_path / "keys", "--max_steps", "2", "--validation_split_percentage", "34")
    )
    assert trainer.state.global_step == 2
    documents = reference_documents(scores, tokenizer.eos_token_id)
    held_out = round(len(texts) * 0.34)  # the first documents evaluate, the rest train
    train_rows = [(ids, w) for training, ids, _, w in seen if training for ids, w in zip(ids.tolist(), w.tolist())]
    eval_rows = [(ids, w) for training, ids, _, w in seen if not training for ids, w in zip(ids.tolist(), w.tolist())]
    assert len(train_rows) == 2 * 4 and eval_rows  # two steps of 4 rows; one evaluation after training
    assert_rows_match(train_rows, reference_blocks(documents[held_out:]))
    eval_blocks = reference_blocks(documents[:held_out])
    assert_rows_match(eval_rows, eval_blocks)
    assert len(eval_rows) == len(eval_blocks)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert (
        max(entry["longce_max_weight"] for entry in trainer.state.log_history if "longce_max_weight" in entry) <= GAMMA
    )
    assert f"LongCE weights from {tmp_path / 'keys'}" in capsys.readouterr().out
    # the model card names the weights' source, not the recipe's K and d, which these weights never used
    card = (tmp_path / "run" / "README.md").read_text()
    assert "weights from 'cache' (longce_weights): an evaluator's key-token cache, keys, scored with its own K" in card
    assert "longce_trunc_len" not in card and "longce_sliding_window" not in card


def test_packed_pieces_of_another_tokenizers_cache_carry_each_tokens_weight(tmp_path, monkeypatch):
    """An evaluator with another tokenizer (BPE), per-document packing: each packed piece of the batch
    holds the weights of add_key_token_weights on its document, cut at the same places."""
    evaluator_tokenizer, tokenizer = byte_level_bpe(), byte_level_tokenizer()
    texts = [text[100:700] for text in govreport_texts()[:5]]  # non-ASCII characters included
    write_cache(tmp_path / "keys", evaluator_tokenizer, texts)
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    seen = spy_on_weights(monkeypatch)
    trainer = cli.train(argv(tmp_path, data, tmp_path / "keys", "--max_steps", "2", "--packing", "true"))
    assert trainer.state.global_step == 2
    whole = add_key_token_weights(
        Dataset.from_dict({"text": texts}), str(tmp_path / "keys"), tokenizer, gamma=GAMMA, append_eos=True
    )
    expected = reference_pieces(list(zip(whole["input_ids"], whole["longce_weights"])))
    pieces = []
    for _, ids, positions, weights in seen:
        assert ids.shape[0] == 1 and positions is not None  # one packed line; position ids restart per piece
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        pieces += [(ids[0, a:b].tolist(), weights[0, a:b].tolist()) for a, b in zip(starts, starts[1:])]
    assert len(pieces) == 2 * 4
    assert_rows_match(pieces, expected)


def test_key_tokens_evaluator_chooses_among_several(tmp_path):
    tokenizer = byte_level_tokenizer()
    texts = ascii_texts(3)
    scores = write_cache(tmp_path / "keys", tokenizer, texts, (("evaluator-a", 0), ("evaluator-b", 1)))
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    _, data_args, _ = parse_args(argv(tmp_path, data, tmp_path / "keys"))
    with pytest.raises(ValueError, match="2 evaluator/settings combinations.*key_tokens_evaluator"):
        load_datasets(data_args, tokenizer, str(tmp_path / "hf"), KeyTokenRule(soft=True, gamma=GAMMA))
    _, data_args, _ = parse_args(argv(tmp_path, data, tmp_path / "keys", "--key_tokens_evaluator", "evaluator-b"))
    train, _ = load_datasets(data_args, tokenizer, str(tmp_path / "hf"), KeyTokenRule(soft=True, gamma=GAMMA))
    expected = reference_blocks(reference_documents(scores["evaluator-b"], tokenizer.eos_token_id))
    np.testing.assert_allclose(np.array(train["longce_weights"]), np.array([w for _, w in expected]), rtol=1e-5)


def test_recipe_key_tokens_is_relative_to_the_recipe(tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    recipe = {
        "model_config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1},
        "tokenizer_name_or_path": "byte-level",
        "data_files": "../docs.jsonl",
        "max_seq_length": LENGTH,
        "longce_weights": "cache",
        "key_tokens": "../keys",
        "key_tokens_evaluator": "evaluator-a",
        "key_tokens_trunc_len": K,
        "output_dir": str(tmp_path / "run"),
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    _, data_args, training_args = parse_args(["--config", str(path)])
    assert data_args.key_tokens == str(tmp_path / "keys") and training_args.longce_weights == "cache"
    assert (data_args.key_tokens_evaluator, data_args.key_tokens_trunc_len) == ("evaluator-a", K)
    # The command line stays relative to the current directory.
    _, data_args, _ = parse_args(["--config", str(path), "--key_tokens", "here/keys"])
    assert data_args.key_tokens == "here/keys"


# ------------------------------------------------------------------ bad inputs


def test_cache_weights_without_key_tokens(tmp_path):
    args = argv(tmp_path, write_jsonl(tmp_path / "docs.jsonl", ascii_texts(2)), None, "--longce_weights", "cache")
    with pytest.raises(ValueError, match="longce_weights='cache'.*key_tokens is not set.*longppl-score"):
        cli.train(args)


def test_key_tokens_without_cache_weights(tmp_path):
    args = argv(tmp_path, write_jsonl(tmp_path / "docs.jsonl", ascii_texts(2)), None, "--key_tokens", "keys")
    with pytest.raises(ValueError, match="key_tokens='keys' is read only with longce_weights 'cache'.*'self'"):
        cli.train(args)


def test_key_tokens_choice_without_key_tokens(tmp_path):
    data = write_jsonl(tmp_path / "docs.jsonl", ascii_texts(2))
    with pytest.raises(ValueError, match="key_tokens_evaluator choose.*key_tokens is not set"):
        parse_args(argv(tmp_path, data, None, "--key_tokens_evaluator", "evaluator-a"))
    with pytest.raises(ValueError, match="key_tokens_sliding_window must be >= 1"):
        parse_args(argv(tmp_path, data, tmp_path / "keys", "--key_tokens_sliding_window", "0"))


def test_missing_cache_folder_names_it_and_the_command(tmp_path):
    missing = tmp_path / "no-such-cache"
    args = argv(tmp_path, write_jsonl(tmp_path / "docs.jsonl", ascii_texts(2)), missing)
    with pytest.raises(FileNotFoundError, match=f"no key-token cache folder at '{missing}'.*longppl-score.*{missing}"):
        cli.train(args)


def test_texts_missing_from_the_cache_are_named(tmp_path):
    tokenizer = byte_level_tokenizer()
    texts = ascii_texts(3)
    write_cache(tmp_path / "keys", tokenizer, texts[:2])
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    with pytest.raises(
        ValueError, match=r"training data .*docs.jsonl from key_tokens.*no rows for 1 of 3 texts.*rows 2"
    ):
        cli.train(argv(tmp_path, data, tmp_path / "keys"))


def test_texts_missing_from_the_cache_are_one_line_of_the_command(tmp_path, monkeypatch):
    """The command reports it as `longce-train: error: ...`, not as a chained traceback."""
    tokenizer = byte_level_tokenizer()
    texts = ascii_texts(3)
    write_cache(tmp_path / "keys", tokenizer, texts[:2])
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    monkeypatch.setattr("sys.argv", ["/venv/bin/longce-train"])
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv(tmp_path, data, tmp_path / "keys"))
    assert "\n" not in stop.value.code
    assert re.fullmatch(
        r"longce-train: error: LongCE weights of the training data .*docs.jsonl from key_tokens.*no rows for 1 of 3 texts.*rows 2.*",
        stop.value.code,
    )
