"""Texts longer than a model's positions: refused before any forward pass where the model would crash
(learned absolute position embeddings, GPT-2 style), scored with a warning where it would not (RoPE)."""

import json
import math

import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, tiny_model

from longppl.core.scoring import score_with_evaluator, score_with_model
from longppl.settings import KeyTokenSettings

K, D = 16, 8


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def texts():
    return [govreport_texts()[0][:60], govreport_texts()[1][:900]]


def forward_calls(model):
    calls = []
    handle = model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def lengths(tokenizer, texts, add_special_tokens):
    return [len(tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"]) for t in texts]


def test_learned_positions_refuse_a_longer_text_before_any_forward_pass(tokenizer, texts):
    short, long = lengths(tokenizer, texts, add_special_tokens=True)
    assert short <= 64 < long
    model = tiny_model("gpt2", len(tokenizer), max_positions=64)
    calls, handle = forward_calls(model)
    try:
        with pytest.raises(
            ValueError,
            match=rf"^The evaluator 'GPT2LMHeadModel' has learned position embeddings for 64 positions, but "
            rf"predictions\[1\] is {long} of its tokens long \(1 text\(s\) are longer than 64\): it cannot score "
            r"past position 64\. Cut the texts with max_length \(the metric's argument; longppl-score --max-length",
        ):
            score_with_evaluator(model, tokenizer, texts, KeyTokenSettings(K, D), progress=False)
        with pytest.raises(ValueError, match=r"^The model 'GPT2LMHeadModel' has learned position embeddings for 64"):
            score_with_model(model, tokenizer, texts, progress=False)
    finally:
        handle.remove()
    assert calls == []


def test_a_text_of_exactly_the_positions_is_scored(tokenizer, texts):
    (long,) = lengths(tokenizer, texts[1:], add_special_tokens=False)
    fits = tiny_model("gpt2", len(tokenizer), max_positions=long)
    (scores,) = score_with_model(fits, tokenizer, texts[1:], progress=False)
    assert scores.lp.shape == (long,) and np.isfinite(scores.lp[1:]).all()
    one_short = tiny_model("gpt2", len(tokenizer), max_positions=long - 1)
    with pytest.raises(ValueError, match=rf"for {long - 1} positions, but predictions\[0\] is {long} of its tokens"):
        score_with_model(one_short, tokenizer, texts[1:], progress=False)


def test_rope_models_run_past_their_positions_with_a_warning(tokenizer, texts):
    (long,) = lengths(tokenizer, texts[1:], add_special_tokens=True)
    model = tiny_model("llama", len(tokenizer), max_positions=64)
    with pytest.warns(
        UserWarning,
        match=rf"The evaluator 'LlamaForCausalLM' was trained on 64 positions \(max_position_embeddings\), but 1 "
        rf"text\(s\) are longer, e.g. predictions\[1\] with {long} tokens",
    ):
        scores = score_with_evaluator(model, tokenizer, texts, KeyTokenSettings(K, D), progress=False)
    assert scores[1].lp_long.shape == (long,) and np.isfinite(scores[1].lp_long[1:]).all()


def score_arguments(tmp_path, texts, tokenizer, arch: str) -> list[str]:
    """``longppl score``'s arguments for ``texts`` (a JSONL corpus) scored by a tiny ``arch`` evaluator of
    64 positions, saved in ``tmp_path/arch``, into ``tmp_path/cache``."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    evaluator = tmp_path / arch
    tiny_model(arch, len(tokenizer), max_positions=64).save_pretrained(evaluator)
    tokenizer.save_pretrained(evaluator)
    args = ["--corpus", str(corpus), "--evaluator", str(evaluator), "--output", str(tmp_path / "cache")]
    return args + ["--trunc-len", str(K), "--sliding-window", str(D), "--device", "cpu"]


def test_longppl_score_names_the_document_and_max_length(tokenizer, texts, tmp_path):
    from accelerate import PartialState

    from longppl.tools import compute_key_tokens

    args = score_arguments(tmp_path, texts, tokenizer, "gpt2")
    try:
        with pytest.raises(
            ValueError,
            match=r"^The evaluator '.*gpt2' has learned position embeddings for 64 positions, but document 1 of "
            r"--corpus \(counted from 0\) is \d+ of its tokens long .*longppl-score --max-length",
        ):
            compute_key_tokens.main(args)
        assert not (tmp_path / "cache").exists()
        summary = compute_key_tokens.main([*args, "--max-length", "63"])  # + BOS: 64 positions
    finally:
        PartialState._reset_state()
    assert summary["scored"] == 2 and summary["tokens"] == lengths(tokenizer, texts[:1], True)[0] + 64
    assert math.isfinite(summary["key_share"])


def test_longppl_score_says_once_how_many_documents_pass_the_trained_length(tokenizer, tmp_path, capsys):
    import warnings

    from accelerate import PartialState

    from longppl.tools import compute_key_tokens

    texts = [t[:400] for t in govreport_texts()[:6]] + [govreport_texts()[6][:60]]
    n = lengths(tokenizer, texts, add_special_tokens=True)
    longer = sum(length > 64 for length in n)
    assert longer == 6 and n[-1] <= 64
    args = [*score_arguments(tmp_path, texts, tokenizer, "llama"), "--shard-documents", "2"]
    evaluator = tmp_path / "llama"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = compute_key_tokens.main(args)
    finally:
        PartialState._reset_state()
    assert summary["scored"] == 7
    assert [str(w.message) for w in caught if "positions" in str(w.message)] == []  # none per document
    said = [line for line in capsys.readouterr().err.splitlines() if "positions" in line]
    assert said == [
        f"compute_key_tokens.py: warning: {longer} of the 7 documents scored are longer than the 64 positions the "
        f"evaluator {str(evaluator)!r} was trained on (max_position_embeddings): its log-probs past position 64 "
        "measure extrapolation. Cut the documents with --max-length if that is not intended."
    ]
