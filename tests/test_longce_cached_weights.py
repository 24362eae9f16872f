"""LongCE weights from a key-token cache: the dataset column, the collator and the trainer's loss,
each against a plain reference written here."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import (
    SlowByteTokenizer,
    accelerate_launch_on_cpu,
    byte_level_bpe,
    govreport_texts,
    metaspace_bpe,
    one_step_args,
    one_torch_thread,
    run_guarded,
    tiny_model,
)
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, default_data_collator

from longce import LongCEConfig, LongCETrainer
from longce.cached_weights import LongCEWeightsCollator, add_key_token_weights, place_weights
from longppl.cache.key_token_cache import KeyTokenCache, KeyTokenSettings, key_token_rows
from longppl.core.scoring import EvaluatorScores, score_with_evaluator
from longppl.models.fingerprints import ModelIdentity
from longppl.rules.alignment import encode_with_offsets
from longppl.settings import DEFAULT_GAMMA, KeyTokenRule

GAMMA = 3.0
K, D = 40, 16  # the synthetic evaluator's window settings: tokens i < K have no short score


def excerpts(n=4, chars=(500, 900, 700, 300)):
    texts = govreport_texts()
    return [texts[i][200 : 200 + chars[i % len(chars)]] for i in range(n)]


def synthetic_scores(tokenizer, texts, seed=0):
    """Evaluator scores with large, varied LSDs (some above log gamma), NaN short scores for i < K."""
    rng = np.random.default_rng(seed)
    scores = []
    for text in texts:
        ids, offsets = encode_with_offsets(tokenizer, text, add_special_tokens=True)
        n = ids.shape[0]
        lp_long = (-rng.exponential(2.0, n)).astype(np.float32)
        lp_short = (lp_long - rng.normal(0.5, 1.5, n)).astype(np.float32)
        lp_long[0] = np.nan
        lp_short[:K] = np.nan
        scores.append(EvaluatorScores(ids, offsets, lp_long, lp_short))
    return scores


def make_cache(tokenizer, texts, fingerprint="weights:synthetic"):
    scores = synthetic_scores(tokenizer, texts)
    identity = ModelIdentity("synthetic-evaluator", "", "float32", fingerprint)
    cache = KeyTokenCache(key_token_rows(texts, scores, KeyTokenSettings(K, D), identity))
    return cache, scores


# --------------------------------------------------------------------------- plain references


def reference_soft_weights(score, gamma=GAMMA):
    """Per evaluator token: min(exp(lp_long - lp_short), gamma), 1 where there is no short score."""
    out = []
    for long, short in zip(score.lp_long.tolist(), score.lp_short.tolist()):
        out.append(1.0 if math.isnan(long) or math.isnan(short) else min(math.exp(long - short), gamma))
    return out


def reference_column(text, score, model_offsets, gamma=GAMMA):
    """Character-level average, one character at a time: each character takes the mean weight of the
    evaluator tokens covering it (byte tokens of one character all do), each model token the mean over
    its characters (1 without any)."""
    per_char = []
    for c in range(len(text)):
        covering = [w for (a, b), w in zip(score.offsets.tolist(), reference_soft_weights(score, gamma)) if a <= c < b]
        per_char.append(sum(covering) / len(covering) if covering else 1.0)
    return [sum(per_char[a:b]) / (b - a) if b > a else 1.0 for a, b in model_offsets.tolist()]


#: Emoji (a ZWJ sequence), Hebrew and Arabic (right to left), CJK and typographic dashes: byte-level
#: BPE splits each of these characters into tokens that share its span.
MIXED = "The report — in full 👩\u200d👩\u200d👧: שלום עולם, مرحبا بالعالم, 你好世界 and 東京 🙂 — ends."


def mixed_texts():
    """A plain report with one typographic dash, and excerpts with emoji, RTL and CJK characters."""
    report = govreport_texts()[1][:600].replace("—", "-") + " — and so on."
    return [report] + [MIXED + " " + text for text in excerpts(3)] + [MIXED * 3]


def test_same_tokenizer_column_is_the_evaluators_soft_weights():
    """The trained model's tokens are the evaluator's: every weight is exactly the evaluator's own
    min(exp(lp_long - lp_short), gamma), computed here from the cache row (float32, as stored)."""
    tokenizer = byte_level_bpe()
    texts = mixed_texts()
    assert texts[0].count("—") == 1 and texts[0].isascii() is False
    cache, scores = make_cache(tokenizer, texts)
    out = add_key_token_weights(Dataset.from_dict({"text": texts}), cache, tokenizer, gamma=GAMMA)
    assert out.column_names == ["text", "input_ids", "longce_weights"]
    split_tokens = 0
    for index, row in enumerate(out):
        cached = cache.scores(index)
        assert row["input_ids"] == cached.input_ids.tolist()  # same tokenizer, same special tokens
        long, short = cached.lp_long.astype(np.float32), cached.lp_short.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            expected = np.minimum(np.exp(long - short), np.float32(GAMMA))
        expected[np.isnan(long) | np.isnan(short)] = 1.0
        assert row["longce_weights"] == expected.tolist()
        starts, ends = cached.offsets[:, 0], cached.offsets[:, 1]
        split_tokens += int(((starts[1:] == starts[:-1]) & (ends[1:] == ends[:-1])).sum())
    assert split_tokens > 100  # many characters split into byte tokens of their own weights
    weights = np.concatenate(out["longce_weights"])
    assert weights.max() == pytest.approx(GAMMA) and (weights > 1).mean() > 0.2 and (weights < 1).any()


def test_same_tokenizer_without_the_evaluators_bos():
    """The evaluator's BOS aside, the tokens are the same: each keeps its evaluator weight."""
    evaluator_tokenizer, tokenizer = byte_level_bpe(), byte_level_bpe(add_bos=False)
    texts = mixed_texts()
    cache, scores = make_cache(evaluator_tokenizer, texts)
    out = add_key_token_weights(Dataset.from_dict({"text": texts}), cache, tokenizer, gamma=GAMMA)
    for row, score in zip(out, scores):
        assert row["input_ids"] == score.input_ids[1:].tolist()
        np.testing.assert_allclose(row["longce_weights"], reference_soft_weights(score)[1:], rtol=1e-6)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("model", [metaspace_bpe, SlowByteTokenizer], ids=["metaspace", "one-token-per-byte"])
def test_other_tokenizer_column_is_the_character_average(add_special_tokens, model):
    evaluator_tokenizer, model_tokenizer = byte_level_bpe(), model()
    texts = mixed_texts()
    cache, scores = make_cache(evaluator_tokenizer, texts)
    out = add_key_token_weights(
        Dataset.from_dict({"text": texts}),
        cache,
        model_tokenizer,
        gamma=GAMMA,
        add_special_tokens=add_special_tokens,
    )
    for text, row, score in zip(texts, out, scores):
        ids, offsets = encode_with_offsets(model_tokenizer, text, add_special_tokens)
        assert row["input_ids"] == ids.tolist() and ids.shape[0] != score.input_ids.shape[0]
        np.testing.assert_allclose(row["longce_weights"], reference_column(text, score, offsets), rtol=1e-5)


def test_max_length_and_eos_cut_tokens_and_weights_together():
    evaluator_tokenizer, model_tokenizer = byte_level_bpe(), metaspace_bpe()
    texts = excerpts()
    cache, _ = make_cache(evaluator_tokenizer, texts)
    dataset = Dataset.from_dict({"text": texts})
    whole = add_key_token_weights(dataset, cache, model_tokenizer, gamma=GAMMA, append_eos=True)
    cut = add_key_token_weights(dataset, cache, model_tokenizer, gamma=GAMMA, append_eos=True, max_length=60)
    eos = model_tokenizer.eos_token_id
    for full, short in zip(whole, cut):
        assert full["input_ids"][-1] == eos and full["longce_weights"][-1] == 1.0
        assert short["input_ids"] == full["input_ids"][:60] and short["longce_weights"] == full["longce_weights"][:60]


def test_an_evaluator_model_scores_missing_texts_and_saves_them(tmp_path):
    tokenizer = byte_level_bpe()
    evaluator = tiny_model("llama", len(tokenizer))
    texts = [text[:250] for text in excerpts(3)]
    path = str(tmp_path / "cache")
    dataset = Dataset.from_dict({"text": texts})
    out = add_key_token_weights(
        dataset,
        path,
        tokenizer,
        gamma=GAMMA,
        evaluator_model=evaluator,
        evaluator_tokenizer=tokenizer,
        trunc_len=16,
        sliding_window=8,
    )
    live = score_with_evaluator(evaluator, tokenizer, texts, KeyTokenSettings(16, 8), progress=False, per_document=True)
    for row, score in zip(out, live):  # the evaluator's own tokens: its own weights
        np.testing.assert_allclose(row["longce_weights"], reference_soft_weights(score), rtol=1e-5)
    assert max(max(w) for w in out["longce_weights"]) > 1  # the random evaluator's LSDs are not all 0
    assert len(KeyTokenCache.load(path)) == 3  # saved: the next run needs no evaluator
    again = add_key_token_weights(dataset, path, tokenizer, gamma=GAMMA)
    assert again["longce_weights"] == out["longce_weights"]


@pytest.mark.parametrize(
    "given", [{}, {"trunc_len": 24}, {"sliding_window": 8}, {"trunc_len": 24, "sliding_window": 8}], ids=str
)
def test_window_settings_of_an_evaluator_model_are_taken_by_name(tmp_path, given):
    """trunc_len and sliding_window reach the scoring each in its own place, the other at its default."""
    tokenizer = byte_level_bpe()
    evaluator = tiny_model("llama", len(tokenizer))
    texts = [excerpts(1)[0][:200]]
    path = str(tmp_path / "cache")
    out = add_key_token_weights(
        Dataset.from_dict({"text": texts}),
        path,
        tokenizer,
        evaluator_model=evaluator,
        evaluator_tokenizer=tokenizer,
        **given,
    )
    row = KeyTokenCache.load(path).row(0)
    K, d = (
        given.get("trunc_len", KeyTokenSettings.trunc_len),
        given.get("sliding_window", KeyTokenSettings.sliding_window),
    )
    assert (row["trunc_len"], row["sliding_window"]) == (K, d)
    (live,) = score_with_evaluator(
        evaluator, tokenizer, texts, KeyTokenSettings(K, d), progress=False, per_document=True
    )
    np.testing.assert_allclose(out[0]["longce_weights"], reference_soft_weights(live, DEFAULT_GAMMA), rtol=1e-5)


# --------------------------------------------------------------------------- collator alignment


def rows_with_weights(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, 90, (n,), generator=generator).tolist(),
            "longce_weights": (torch.rand(n, generator=generator) * 4 + 0.5).tolist(),
        }
        for n in lengths
    ]


def test_flattening_keeps_weights_with_their_tokens():
    rows = rows_with_weights([7, 0, 12, 5])  # the empty row is dropped by the flattening collator
    batch = LongCEWeightsCollator(DataCollatorWithFlattening())(rows)
    plain = DataCollatorWithFlattening()([{"input_ids": r["input_ids"]} for r in rows])
    assert batch.keys() == set(plain) | {"longce_weights"}
    for key in plain:
        assert torch.equal(batch[key], plain[key])
    expected_ids, expected_weights = [], []
    for row in rows:
        expected_ids += row["input_ids"]
        expected_weights += row["longce_weights"]
    assert batch["input_ids"][0].tolist() == expected_ids
    assert batch["longce_weights"].shape == (1, 24)
    torch.testing.assert_close(batch["longce_weights"][0], torch.tensor(expected_weights))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_keeps_weights_with_their_tokens(side):
    tokenizer = copy.copy(metaspace_bpe())
    tokenizer.padding_side = side
    rows = rows_with_weights([7, 12, 5])
    inner = DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=8)
    batch = LongCEWeightsCollator(inner)(rows)
    assert batch["input_ids"].shape == batch["longce_weights"].shape == (3, 16)
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        for t in range(16):
            inside = t < n if side == "right" else t >= 16 - n
            k = t if side == "right" else t - (16 - n)
            if inside:
                assert batch["input_ids"][r, t] == row["input_ids"][k]
                assert batch["longce_weights"][r, t].item() == pytest.approx(row["longce_weights"][k])
            else:
                assert batch["longce_weights"][r, t] == 1.0 and batch["labels"][r, t] == -100
    assert "longce_weights" in rows[0]  # the caller's features are left whole


def test_a_collator_that_cuts_tokens_is_refused():
    rows = rows_with_weights([7, 12])

    def cutting(features):
        return {"input_ids": torch.tensor([f["input_ids"][:5] for f in features])}

    with pytest.raises(ValueError, match="cut or reordered tokens"):
        LongCEWeightsCollator(cutting)(rows)
    with pytest.raises(ValueError, match="cut or reordered tokens"):
        place_weights(torch.tensor([[1, 2, 3]]), [torch.tensor([3, 2, 1])], [torch.ones(3)])


# --------------------------------------------------------------------------- the trainer's loss

VOCAB = 97


def make_args(**overrides):
    cached = dict(output_dir="/tmp/longce-cached-test", longce_weights="cache")
    return one_step_args(LongCEConfig, **(cached | dict(longce_trunc_len=8, longce_sliding_window=4) | overrides))


def reference_loss(model, rows, per_token=None):
    """Plain weighted CE: each row alone, full logits; position t predicts token t+1 with weight w[t+1]."""
    total, count = 0.0, 0
    weights, nlls = [], []
    for row in rows:
        ids = torch.tensor(row["input_ids"])
        logits = model(input_ids=ids[None]).logits[0].float()
        nll = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
        w = torch.tensor(row["longce_weights"])[1:]
        total = total + (w * nll).sum()
        count += len(ids) - 1
        weights.append(w)
        nlls.append(nll.detach())
    if per_token is not None:
        per_token.extend([torch.cat(weights), torch.cat(nlls)])
    return total / count


def grads_of(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def check_against_reference(model, rows, collator):
    trainer = LongCETrainer(model=model, args=make_args())
    model.zero_grad()
    loss = trainer.compute_loss(model, LongCEWeightsCollator(collator)(rows))
    loss.backward()
    ours = grads_of(model)
    model.zero_grad()
    reference = reference_loss(model, rows)
    reference.backward()
    torch.testing.assert_close(loss.detach(), reference.detach(), atol=1e-5, rtol=1e-5)
    expected = grads_of(model)
    assert ours.keys() == expected.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    return ours


def padding_collator(side):
    """Padding on ``side``; each row's first token gets label -100: with left padding, a pad position
    would otherwise "predict" it (stock causal-LM losses train on that pair, the reference does not)."""
    tokenizer = copy.copy(metaspace_bpe())
    tokenizer.padding_side = side
    inner = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def collate(features):
        batch = inner(features)
        batch["labels"][torch.arange(len(features)), batch["attention_mask"].argmax(-1)] = -100
        return batch

    return collate


@pytest.mark.parametrize(
    "collator",
    [DataCollatorWithFlattening(), padding_collator("right"), padding_collator("left")],
    ids=["packed", "right-padded", "left-padded"],
)
def test_cache_loss_and_gradients_equal_plain_weighted_ce(collator):
    model = tiny_model("llama", VOCAB).train()
    check_against_reference(model, rows_with_weights([30, 17, 26], seed=1), collator)


def test_no_short_context_pass_with_cached_weights(monkeypatch):
    model = tiny_model("llama", VOCAB).train()
    calls = []
    monkeypatch.setattr(LongCETrainer, "_short_context_pass", lambda *args: calls.append(args))
    trainer = LongCETrainer(model=model, args=make_args())
    trainer.compute_loss(model, LongCEWeightsCollator()(rows_with_weights([40, 33])))
    assert calls == []


def test_lora_model_with_cached_weights():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", VOCAB).train()
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )
    grads = check_against_reference(model, rows_with_weights([30, 21]), DataCollatorWithFlattening())
    assert grads and all("lora_" in name for name in grads) and any("lm_head" in name for name in grads)


def train_once(rows, **overrides):
    """One SGD step of LongCETrainer.train() on a dataset with a text column (dropped by
    remove_unused_columns) and the weights column (kept); returns its first log and the model."""
    model = tiny_model("llama", VOCAB)
    dataset = Dataset.from_dict(
        {
            "text": ["unused"] * len(rows),
            "input_ids": [r["input_ids"] for r in rows],
            "longce_weights": [r["longce_weights"] for r in rows],
            **({"labels": [r["input_ids"] for r in rows]} if overrides.pop("labels", False) else {}),
        }
    )
    collator = overrides.pop("data_collator", DataCollatorWithFlattening())
    if overrides.pop("iterable", False):
        dataset = dataset.to_iterable_dataset()
    trainer = LongCETrainer(model=model, args=make_args(**overrides), train_dataset=dataset, data_collator=collator)
    trainer.train()
    return trainer.state.log_history[0], model


def test_gradient_accumulation_equals_one_big_batch_and_logs_the_weights():
    rows = rows_with_weights([30, 12, 25, 19], seed=2)
    log_big, big = train_once(rows, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    log_acc, acc = train_once(rows, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    for (name, p), q in zip(big.named_parameters(), acc.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    per_token = []
    with torch.no_grad():
        expected = reference_loss(tiny_model("llama", VOCAB), rows, per_token).item()
    weights, nll = per_token
    for log in (log_big, log_acc):
        assert math.isclose(log["loss"], expected, rel_tol=1e-5)
        assert math.isclose(log["ce_loss"], nll.mean().item(), rel_tol=1e-5)
        assert math.isclose(log["longce_mean_weight"], weights.mean().item(), rel_tol=1e-5)
        assert math.isclose(log["longce_weight_gt1_share"], (weights > 1).float().mean().item(), rel_tol=1e-5)
        assert math.isclose(log["longce_max_weight"], weights.max().item(), rel_tol=1e-5)


def test_default_collator_is_wrapped_and_keeps_the_column():
    rows = rows_with_weights([20, 20, 20, 20], seed=3)  # equal lengths: default_data_collator stacks them
    log, _ = train_once(rows, data_collator=default_data_collator, per_device_train_batch_size=4, labels=True)
    with torch.no_grad():
        assert math.isclose(log["loss"], reference_loss(tiny_model("llama", VOCAB), rows).item(), rel_tol=1e-5)


def test_evaluation_with_cached_weights_logs_them():
    rows = rows_with_weights([30, 12, 25, 19], seed=4)
    model = tiny_model("llama", VOCAB)
    per_token = []
    with torch.no_grad():
        expected = reference_loss(model, rows, per_token).item()
    dataset = Dataset.from_dict({key: [r[key] for r in rows] for key in ("input_ids", "longce_weights")})
    trainer = LongCETrainer(
        model=model,
        args=make_args(per_device_eval_batch_size=4),
        eval_dataset=dataset,
        data_collator=DataCollatorWithFlattening(),
    )
    metrics = trainer.evaluate()
    assert math.isclose(metrics["eval_loss"], expected, rel_tol=1e-5)
    assert math.isclose(metrics["eval_longce_mean_weight"], per_token[0].mean().item(), rel_tol=1e-5)


# --------------------------------------------------------------------------- DDP (2 CPU processes)

DDP_STEPS, DDP_GLOBAL_BATCH = 2, 4


def ddp_train(data: str, output_dir: str, per_device_batch: int) -> LongCETrainer:
    """Train on the saved dataset (this file is also the worker that accelerate launches)."""
    from datasets import load_from_disk

    args = make_args(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=DDP_STEPS,
        learning_rate=1e-2,
        train_sampling_strategy="sequential",  # process r takes the r-th per-device batch of each global batch
        dataloader_drop_last=True,
        average_tokens_across_devices=True,  # normalise by the tokens of the whole global batch
        ddp_find_unused_parameters=True,
    )
    trainer = LongCETrainer(
        model=tiny_model("llama", VOCAB),
        args=args,
        train_dataset=load_from_disk(data),
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    trainer.save_model(output_dir)
    if trainer.args.process_index == 0:
        with open(os.path.join(output_dir, "log.json"), "w", encoding="utf-8") as handle:
            json.dump({"world_size": trainer.args.world_size, "log_history": trainer.state.log_history}, handle)
    return trainer


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path):
    from safetensors.torch import load_file

    rows = rows_with_weights([40, 31, 12, 18, 35, 22, 9, 27], seed=5)  # unequal token counts per process
    data = str(tmp_path / "data")
    Dataset.from_dict({key: [r[key] for r in rows] for key in ("input_ids", "longce_weights")}).save_to_disk(data)
    done = run_guarded(
        [*accelerate_launch_on_cpu(2), os.path.abspath(__file__), data, str(tmp_path / "ddp"), "2"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    with one_torch_thread():
        ddp_train(data, str(tmp_path / "single"), DDP_GLOBAL_BATCH)
    logs = {}
    for name in ("ddp", "single"):
        with open(tmp_path / name / "log.json", encoding="utf-8") as handle:
            logs[name] = json.load(handle)
    assert logs["ddp"]["world_size"] == 2 and logs["single"]["world_size"] == 1
    steps = {name: [e for e in log["log_history"] if "loss" in e] for name, log in logs.items()}
    assert len(steps["ddp"]) == len(steps["single"]) == DDP_STEPS
    for a, b in zip(steps["ddp"], steps["single"]):
        for key in (
            "loss",
            "grad_norm",
            "ce_loss",
            "longce_mean_weight",
            "longce_weight_gt1_share",
            "longce_max_weight",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])
    ddp, single = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("ddp", "single"))
    assert ddp.keys() == single.keys()
    for name in ddp:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-5, atol=1e-5, msg=name)


# --------------------------------------------------------------------------- bad input


def test_dataset_without_the_column():
    dataset = Dataset.from_dict({"input_ids": [[5, 6, 7, 8]]})
    with pytest.raises(ValueError, match="takes the token weights from the dataset's 'longce_weights' column"):
        LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(), train_dataset=dataset)
    with pytest.raises(ValueError, match="evaluation dataset has none"):
        LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(), eval_dataset=dataset)


def test_batch_without_weights_or_of_another_shape():
    model = tiny_model("llama", VOCAB)
    trainer = LongCETrainer(model=model, args=make_args())
    batch = DataCollatorWithFlattening()([{"input_ids": r["input_ids"]} for r in rows_with_weights([9, 8])])
    with pytest.raises(ValueError, match="but this batch has none"):
        trainer.compute_loss(model, batch)
    with pytest.raises(ValueError, match=r"longce_weights has shape \(1, 16\) but input_ids \(1, 17\)"):
        trainer.compute_loss(model, dict(batch, longce_weights=torch.ones(1, 16)))
    self_scored = LongCETrainer(model=model, args=make_args(longce_weights="self"))
    with pytest.raises(ValueError, match="longce_weights='self' scores the weights"):
        self_scored.compute_loss(model, dict(batch, longce_weights=torch.ones(1, 17)))


def test_column_of_other_length_or_bad_values():
    rows = rows_with_weights([7, 5])
    rows[1]["longce_weights"] = rows[1]["longce_weights"][:-1]
    with pytest.raises(ValueError, match=r"Example 1 has \(4,\) longce_weights for 5 input_ids"):
        LongCEWeightsCollator()(rows)
    rows = rows_with_weights([7, 5])
    rows[0]["longce_weights"][2] = float("nan")
    with pytest.raises(ValueError, match="Example 0 has longce_weights that are negative, NaN or infinite"):
        LongCEWeightsCollator()(rows)
    with pytest.raises(ValueError, match="Example 0 of the batch has no 'longce_weights'"):
        LongCEWeightsCollator()([{"input_ids": [1, 2, 3]}])


def bad_weights_message(found, mode="train"):
    return (
        rf"The batches' longce_weights \({mode}, since the last log\) hold {found} weight\(s\) at trained positions; "
        r"every weight must be a finite number >= 0\. Build the column with longce\.add_key_token_weights"
    )


BAD_WEIGHTS = [(float("nan"), "1 NaN"), (float("inf"), "1 infinite"), (-0.5, "1 negative")]


@pytest.mark.parametrize("value, found", BAD_WEIGHTS, ids=["nan", "inf", "negative"])
def test_bad_weights_given_to_compute_loss_fail_at_the_next_log(value, found):
    model = tiny_model("llama", VOCAB).train()
    trainer = LongCETrainer(model=model, args=make_args())
    batch = LongCEWeightsCollator()(rows_with_weights([9, 8]))
    batch["longce_weights"][0, 3] = value
    trainer.compute_loss(model, batch)  # no check in the step: it would cost a host sync per step
    with pytest.raises(ValueError, match=bad_weights_message(found)):
        trainer.log({"loss": 1.0})
    # Evaluation checks its own batches when it reports.
    model.eval()
    with torch.no_grad():
        trainer.compute_loss(model, dict(batch, longce_weights=batch["longce_weights"].clone().fill_(value)))
    with pytest.raises(ValueError, match=bad_weights_message("15 " + found.split()[1], "eval")):
        trainer._reduced_stats("eval", "eval_")


class UncheckedCollator(LongCEWeightsCollator):
    """Places the weights as LongCEWeightsCollator does, without refusing bad values (a hand-made pipeline)."""

    def __call__(self, features):
        batch = dict(self.collator([{"input_ids": f["input_ids"]} for f in features]))
        rows = [torch.tensor(f["input_ids"]) for f in features]
        weights = [torch.tensor(f["longce_weights"], dtype=torch.float32) for f in features]
        batch["longce_weights"] = place_weights(torch.as_tensor(batch["input_ids"]), rows, weights)
        return batch


@pytest.mark.parametrize("value, found", BAD_WEIGHTS, ids=["nan", "inf", "negative"])
def test_bad_weights_stop_training_at_the_first_log(value, found):
    """An iterable dataset cannot be read ahead: its batches are checked at the next log."""
    rows = rows_with_weights([9, 8])
    rows[1]["longce_weights"][4] = value
    collator = UncheckedCollator(DataCollatorWithFlattening())
    with pytest.raises(ValueError, match=bad_weights_message(found)):
        train_once(rows, data_collator=collator, logging_steps=1, iterable=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5], ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("where", ["train", "eval"])
def test_bad_weights_of_a_dataset_are_refused_before_any_step(value, where):
    """The whole column is checked when the trainer is built, whatever the collator: no step runs, so
    no optimizer update applies a bad weight; the error names the dataset, the row and the token."""
    rows = rows_with_weights([9, 8, 7])
    rows[2]["longce_weights"][4] = value
    good = Dataset.from_dict(
        {key: [r[key] for r in rows_with_weights([9, 8])] for key in ("input_ids", "longce_weights")}
    )
    bad = Dataset.from_dict({key: [r[key] for r in rows] for key in ("input_ids", "longce_weights")})
    train, evaluation = (bad, good) if where == "train" else (good, {"books": bad})
    named = "training dataset" if where == "train" else "evaluation dataset books"
    model = tiny_model("llama", VOCAB)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError, match=rf"^Row 2 of the {named} has {value} in its 'longce_weights' column \(token 4\)"
    ):
        LongCETrainer(
            model=model,
            args=make_args(),
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=UncheckedCollator(DataCollatorWithFlattening()),
        ).train()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # rows chosen or reordered by select() are named by their place in the dataset given
    with pytest.raises(ValueError, match=r"^Row 0 of the training dataset"):
        LongCETrainer(model=model, args=make_args(), train_dataset=bad.select([2, 0]))


def test_weights_are_checked_at_log_time_only(monkeypatch):
    """Valid weights: no host sync in LongCE's code during compute_loss (no .item(), .tolist() or bool()
    of a tensor from the longce package: the model's own forward may have some), and the counts reach the
    host only when the statistics are logged."""
    import longce.trainer as trainer_module

    checks, syncs = [], []
    check = trainer_module._refuse_bad_weights
    monkeypatch.setattr(trainer_module, "_refuse_bad_weights", lambda *counts: (checks.append(counts), check(*counts)))
    model = tiny_model("llama", VOCAB).train()
    trainer = LongCETrainer(model=model, args=make_args())
    batch = LongCEWeightsCollator()(rows_with_weights([9, 8]))
    package = os.path.dirname(trainer_module.__file__)

    def counted(name, original):
        def call(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(package):
                syncs.append(name)
            return original(self, *args, **kwargs)

        return call

    with monkeypatch.context() as patched:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            patched.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        for _ in range(3):
            trainer.compute_loss(model, batch)
    assert syncs == [] and checks == []
    trainer.log({"loss": 1.0})
    assert checks == [("train", 0.0, 0.0, 0.0)]
    rows = rows_with_weights([9, 8, 7, 6, 5, 4])
    log = train_once(rows, max_steps=3, logging_steps=2)[0]
    assert log["longce_mean_weight"] > 1 and len(checks) == 3  # steps 2 and 3 (the last), not every step


def test_texts_missing_from_the_cache_are_named():
    tokenizer = byte_level_bpe()
    texts = excerpts()
    cache, _ = make_cache(tokenizer, texts[:2])
    dataset = Dataset.from_dict({"text": [texts[0], texts[2], texts[1], texts[3]]})
    with pytest.raises(ValueError, match=r"no rows for 2 of 4 texts of the dataset \(rows 1 \('.*'\), 3 \(") as err:
        add_key_token_weights(dataset, cache, tokenizer)
    assert "evaluator_model" in str(err.value) and "--max-length" in str(err.value)


def test_cache_of_another_tokenizer():
    texts = excerpts(2)
    cache, _ = make_cache(byte_level_bpe(), texts)
    dataset = Dataset.from_dict({"text": texts})
    with pytest.raises(ValueError, match="scored by an evaluator with another tokenizer"):
        add_key_token_weights(dataset, cache, byte_level_bpe(), evaluator_tokenizer=metaspace_bpe())
    # An evaluator model (weights + tokenizer fingerprint) never takes rows of another evaluator: its own
    # rows are scored instead; without it, two evaluators in one cache must be told apart.
    other, _ = make_cache(metaspace_bpe(), texts, fingerprint="weights:other")
    both = KeyTokenCache(cache.dataset)
    both.add(other.dataset)
    with pytest.raises(ValueError, match="2 evaluator/settings combinations"):
        add_key_token_weights(dataset, both, byte_level_bpe())
    chosen = add_key_token_weights(dataset, both, byte_level_bpe(), evaluator="weights:synth", gamma=GAMMA)
    assert (
        chosen["longce_weights"]
        == add_key_token_weights(dataset, cache, byte_level_bpe(), gamma=GAMMA)["longce_weights"]
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(longce_weights="evaluator"), "longce_weights must be one of"),
        (dict(longce_plain_ce=True), "set only one of them"),
    ],
)
def test_bad_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(**overrides)


def test_bad_arguments_of_the_dataset_step():
    tokenizer = byte_level_bpe()
    cache, _ = make_cache(tokenizer, excerpts(1))
    dataset = Dataset.from_dict({"text": excerpts(1)})
    with pytest.raises(ValueError, match="gamma must be > 0"):
        add_key_token_weights(dataset, cache, tokenizer, gamma=0)
    with pytest.raises(ValueError, match="max_length must be an integer >= 2"):
        add_key_token_weights(dataset, cache, tokenizer, max_length=1)
    with pytest.raises(ValueError, match="no text column 'body'"):
        add_key_token_weights(dataset, cache, tokenizer, text_column="body")


def test_the_dataset_step_takes_the_soft_rule_whole():
    """``rule=`` (e.g. ``LongCEConfig.longce_rule``) gives the weights ``gamma=`` gives; a hard rule, or a rule
    beside ``gamma``, is refused."""
    tokenizer = byte_level_bpe()
    texts = excerpts(2)
    cache, _ = make_cache(tokenizer, texts)
    dataset = Dataset.from_dict({"text": texts})
    by_gamma = add_key_token_weights(dataset, cache, tokenizer, gamma=1.5, append_eos=True)["longce_weights"]
    rule = make_args(longce_gamma=1.5).longce_rule
    assert rule == KeyTokenRule(soft=True, gamma=1.5)
    by_rule = add_key_token_weights(dataset, cache, tokenizer, rule=rule, append_eos=True)["longce_weights"]
    assert by_rule == by_gamma and max(max(row) for row in by_rule) <= 1.5
    assert by_rule != add_key_token_weights(dataset, cache, tokenizer, append_eos=True)["longce_weights"]  # gamma 5
    with pytest.raises(ValueError, match="is the hard rule; LongCE weights are the soft rule's"):
        add_key_token_weights(dataset, cache, tokenizer, rule=KeyTokenRule())
    with pytest.raises(ValueError, match="Got both a KeyTokenRule and gamma"):
        add_key_token_weights(dataset, cache, tokenizer, gamma=1.5, rule=rule)


if __name__ == "__main__":  # the DDP test's worker, under accelerate launch: DATA OUTPUT_DIR PER_DEVICE_BATCH
    from longce.cli import close_process_group

    ddp_train(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    close_process_group()
