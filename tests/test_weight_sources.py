"""LongCE weight sources: a new source is one class, plugged in with ``LongCETrainer(weight_source=...)``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import one_step_args, tiny_model
from transformers import DataCollatorWithFlattening

from longce import LongCEConfig, LongCETrainer
from longce.weight_sources import CachedWeights, NoWeights, SelfScoredWeights, WeightSource, weight_source_for

VOCAB = 97


def make_args(**overrides):
    # K + d well below the documents' lengths: self-scored weights would differ from 1 (and from 2).
    settings = dict(output_dir="/tmp/longce-weight-sources-test", longce_trunc_len=8, longce_sliding_window=5)
    return one_step_args(LongCEConfig, **(settings | overrides))


def documents(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def packed(docs, **columns):
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    return dict(batch, **columns)


def plain_ce(model, docs):
    """Cross-entropy of every document read alone with full logits, averaged over the predicted tokens."""
    total, count = 0.0, 0
    for ids in docs:
        logits = model(input_ids=ids[None]).logits[0].float()
        total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        count += len(ids) - 1
    return total / count


class UniformWeights(WeightSource):
    """Every token weighs 2: all a new source needs."""

    def token_weights(self, inputs, input_ids):
        return torch.full(input_ids.shape, 2.0, device=input_ids.device)


class ColumnWeights(WeightSource):
    """Weights read from a column of one's own, which the trainer keeps and does not pass to the model."""

    batch_columns = ("my_weights",)

    def token_weights(self, inputs, input_ids):
        return inputs["my_weights"].float()


def test_a_new_source_is_one_class(monkeypatch):
    monkeypatch.setattr(LongCETrainer, "_short_context_pass", lambda *args: pytest.fail("no short pass was asked"))
    model = tiny_model("llama", VOCAB).train()
    docs = documents([30, 17, 26])
    trainer = LongCETrainer(model=model, args=make_args(), weight_source=UniformWeights())
    loss = trainer.compute_loss(model, packed(docs))
    torch.testing.assert_close(loss, 2 * plain_ce(model, docs), atol=1e-5, rtol=1e-5)
    assert trainer._reduced_stats("train", "")["longce_mean_weight"] == 2.0


def test_a_source_reads_its_own_column_which_never_reaches_the_model():
    model = tiny_model("llama", VOCAB).train()
    docs = documents([30, 17], seed=1)
    trainer = LongCETrainer(model=model, args=make_args(), weight_source=ColumnWeights())
    trainer._set_signature_columns_if_needed()
    assert "my_weights" in trainer._signature_columns  # kept from remove_unused_columns
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    weights = torch.rand(1, 47, generator=torch.Generator().manual_seed(1)) * 3
    loss = trainer.compute_loss(model, packed(docs, my_weights=weights))
    assert seen and all("my_weights" not in keys for keys in seen)
    with torch.no_grad():  # position t of the packed row predicts token t + 1 with weight w[t + 1]
        logits = model(input_ids=docs[0][None]).logits[0].float(), model(input_ids=docs[1][None]).logits[0].float()
        nll = [F.cross_entropy(lg[:-1], d[1:], reduction="none") for lg, d in zip(logits, docs)]
        expected = ((weights[0, 1:30] * nll[0]).sum() + (weights[0, 31:] * nll[1]).sum()) / 45
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)


def test_a_source_that_allows_context_parallelism_gets_it():
    class ShardableUniform(UniformWeights):
        allows_context_parallel = True

    config = SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2, sp_size=1))
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(), weight_source=ShardableUniform())
    trainer.accelerator = config
    trainer._refuse_context_parallelism()  # no error
    trainer._given_weight_source = UniformWeights()
    with pytest.raises(ValueError, match=r"\(cp_size=2\) only with longce_weights='cache': a custom weight source"):
        trainer._refuse_context_parallelism()


def test_the_settings_choose_one_source():
    assert type(weight_source_for(make_args())) is SelfScoredWeights
    assert type(weight_source_for(make_args(longce_weights="cache"))) is CachedWeights
    assert type(weight_source_for(make_args(longce_weights="none"))) is NoWeights
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(longce_weights="none"))
    assert type(trainer.weight_source) is NoWeights


def test_the_weight_mode_is_one_field():
    from longce.config import WEIGHT_SOURCES
    from longce.weight_sources import SOURCE_OF_SETTING

    assert WEIGHT_SOURCES == tuple(SOURCE_OF_SETTING) == ("self", "cache", "none")
    with pytest.warns(FutureWarning, match="longce_plain_ce is deprecated"):
        alias = make_args(longce_plain_ce=True)  # the deprecated name sets the one field
    assert alias.longce_weights == "none" and type(weight_source_for(alias)) is NoWeights
    with pytest.raises(ValueError, match=r"longce_weights must be one of \('self', 'cache', 'none'\)"):
        make_args(longce_weights="plain")


def test_setting_the_weights_field_anew_changes_the_source():
    trainer = LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args())
    assert type(trainer.weight_source) is SelfScoredWeights
    trainer.args.longce_weights = "none"
    assert type(trainer.weight_source) is NoWeights


@pytest.mark.parametrize(
    "overrides, setting",
    [(dict(longce_weights="cache"), "longce_weights='cache'"), (dict(longce_weights="none"), "longce_weights='none'")],
)
def test_a_given_source_and_a_chosen_one_are_refused(overrides, setting):
    with pytest.raises(ValueError, match=rf"weight_source=UniformWeights\(\) and {setting}.* give only one of them"):
        LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(**overrides), weight_source=UniformWeights())


def test_a_weight_source_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="weight_source must be a longce.weight_sources.WeightSource, got str"):
        LongCETrainer(model=tiny_model("llama", VOCAB), args=make_args(), weight_source="uniform")


def test_plain_ce_refuses_a_weights_column_and_names_itself():
    model = tiny_model("llama", VOCAB).train()
    docs = documents([20, 15])
    trainer = LongCETrainer(model=model, args=make_args(longce_weights="none"))
    with pytest.raises(ValueError, match=r"holds 'longce_weights', but longce_weights='none' \(every weight 1\)"):
        trainer.compute_loss(model, packed(docs, longce_weights=torch.ones(1, 35)))
