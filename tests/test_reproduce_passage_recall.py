"""longppl_reproduce.common.passage_recall: the cases' geometry on plain integer books, the ambiguity guard,
the JSONL round trip, and the teacher-forced top-1 score against plain references (a model whose
top-1 token is a known function of the current token, and a per-case loop over full logits)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers import DATA, byte_level_bpe, tiny_gemma3, tiny_model, windows_in_blocks
from longppl_reproduce.common import lines, needle, stages
from longppl_reproduce.common.config import read_population
from longppl_reproduce.common.passage_recall import (
    RecallCase,
    passage_recall_accuracy,
    passage_recall_cases,
    read_passage_recall_cases,
    write_passage_recall_cases,
)
from longppl_reproduce.common.run_folder import RunFolder
from transformers import LlamaConfig, LlamaForCausalLM

SMOKE = os.path.join(REPO, "configs", "reproduce", "population_smoke_cpu.yaml")


def random_books(sizes, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).astype(np.uint16) for n in sizes]


def starts_of(ids, pattern):
    """Plain reference: every index where ``pattern`` begins in ``ids``."""
    ids, pattern = list(ids), list(pattern)
    return [i for i in range(len(ids) - len(pattern) + 1) if ids[i : i + len(pattern)] == pattern]


def assert_geometry(case, books, length, beyond, span=24, cue=8):
    ids = list(case.input_ids)
    assert len(ids) == length + span - cue and case.scored_end == len(ids)
    assert case.scored_start == length and case.cue_start == length - cue
    assert case.distance == case.cue_start - case.span_start > beyond
    assert 0 <= case.span_start and case.span_start + span <= case.cue_start  # the span lies in the haystack
    assert ids[: case.cue_start] == books[case.book][case.offset : case.offset + length - cue].tolist()
    assert ids[case.cue_start : case.scored_start] == ids[case.span_start : case.span_start + cue]  # the cue
    assert ids[case.scored_start :] == ids[case.span_start + cue : case.span_start + span]  # the scored tokens
    assert starts_of(ids, ids[case.cue_start : case.scored_start]) == [case.span_start, case.cue_start]


@pytest.mark.parametrize(
    "length, beyond",
    [(200, 100), (40, 5), (159, 150)],  # a long way back; beyond shorter than the span; one start allowed
)
def test_cases_hold_the_span_beyond_the_distance_and_end_with_its_cue_then_its_next_tokens(length, beyond):
    books = random_books([300, 50, 1000])
    cases = passage_recall_cases(books, length, beyond, 60, seed=0)
    assert len(cases) == 60
    for case in cases:
        assert_geometry(case, books, length, beyond)
    assert {case.book for case in cases} <= {0, 2} and 2 in {case.book for case in cases}  # book 1 is too short
    starts = {case.span_start for case in cases}
    assert max(starts) <= length - 8 - max(beyond + 1, 24)
    assert len(starts) > (1 if beyond < 150 else 0)
    if beyond == 150:
        assert starts == {0}


def test_other_spans_and_cues_keep_the_geometry():
    books = random_books([500])
    for case in passage_recall_cases(books, 300, 64, 20, seed=3, span=12, cue=4):
        assert_geometry(case, books, 300, 64, span=12, cue=4)


def test_the_same_seed_gives_the_same_cases():
    books = random_books([400, 700])
    cases = passage_recall_cases(books, 256, 100, 10, seed=7)
    assert cases == passage_recall_cases(books, 256, 100, 10, seed=7)
    assert cases != passage_recall_cases(books, 256, 100, 10, seed=8)


def test_a_cue_found_elsewhere_in_the_case_is_drawn_again_and_a_repetitive_corpus_is_refused():
    pattern = np.tile(np.arange(3, 13, dtype=np.uint16), 100)  # every 8 tokens recur every 10
    with pytest.raises(ValueError, match="64 draws in a row found no span whose first 8 tokens occur only there"):
        passage_recall_cases([pattern], 200, 50, 1, seed=0)
    books = [pattern, *random_books([600])]
    assert {case.book for case in passage_recall_cases(books, 200, 50, 30, seed=0)} == {1}

    # a random book with a passage copied: spans drawn from the copy's source would be ambiguous
    (book,) = random_books([384], seed=1)
    book[250:330] = book[40:120]
    cases = passage_recall_cases([book], 392, 100, 200, seed=0)  # one stretch: the whole book
    for case in cases:
        assert_geometry(case, [book], 392, 100)
    # a cue inside either copy occurs in the other
    assert not any(40 <= case.span_start <= 112 or 250 <= case.span_start <= 322 for case in cases)


def test_books_too_short_and_lengths_too_short_are_clear_errors():
    with pytest.raises(
        ValueError, match=r"No book holds the 992 tokens a case of length=1000 .* longest of 2 holds 900"
    ):
        passage_recall_cases(random_books([900, 10]), 1000, 256, 1, seed=0)
    with pytest.raises(ValueError, match="length=100 tokens leaves no span of 24 tokens starting more than beyond=92"):
        passage_recall_cases(random_books([900]), 100, 92, 1, seed=0)
    assert {c.distance for c in passage_recall_cases(random_books([900]), 100, 91, 5, seed=0)} == {92}
    with pytest.raises(ValueError, match="cue=24 must be shorter than span=24"):
        passage_recall_cases(random_books([900]), 100, 10, 1, seed=0, cue=24)
    with pytest.raises(ValueError, match="not a 1-D array of token ids"):
        passage_recall_cases([np.zeros((4, 300), dtype=np.int64)], 100, 10, 1, seed=0)


def test_cases_round_trip_through_jsonl_and_a_broken_case_is_named(tmp_path):
    books = random_books([500])
    cases = passage_recall_cases(books, 200, 64, 5, seed=0)
    path = str(tmp_path / "recall.jsonl")
    write_passage_recall_cases(path, cases)
    assert read_passage_recall_cases(path) == cases
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    records[3]["input_ids"][-1] += 1  # the last scored token no longer copies the span
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    with pytest.raises(ValueError, match=r"recall.jsonl, line 4 is not a passage-recall case"):
        read_passage_recall_cases(path)
    records[3]["input_ids"][-1] -= 1
    records[1]["span_start"] = -1
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    with pytest.raises(ValueError, match=r"line 2, field 'span_start' is -1, not a whole number"):
        read_passage_recall_cases(path)


# ------------------------------------------------------------------ the score

VOCAB = 64
SUCCESSOR = (np.arange(VOCAB) * 5 + 1) % VOCAB  # a permutation without a fixed point


def successor_model() -> LlamaForCausalLM:
    """A Llama whose top-1 next token is ``SUCCESSOR[x]`` of the current token ``x``, whatever came
    before: one layer with its attention and MLP outputs zeroed (the residual stream is the
    embedding), one-hot embeddings, and the LM head the permutation matrix."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=VOCAB,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        head = torch.zeros(VOCAB, VOCAB)
        head[SUCCESSOR, np.arange(VOCAB)] = 1.0
        model.lm_head.weight.copy_(head)
    return model


def planted_case(rng, follows: bool, length=100, span_start=10) -> RecallCase:
    """A case on random tokens whose span follows ``SUCCESSOR`` throughout when ``follows``."""
    ids = rng.integers(VOCAB, size=length - 8)
    if follows:
        walk = [int(rng.integers(VOCAB))]
        for _ in range(23):
            walk.append(int(SUCCESSOR[walk[-1]]))
        ids[span_start : span_start + 24] = walk
    ids = [int(i) for i in ids]
    return RecallCase(tuple(ids + ids[span_start : span_start + 24]), span_start, length - 8, length, 0, 0)


def test_the_score_is_the_share_of_scored_tokens_the_model_ranks_first():
    """Against a known answer: the successor model is right at ``t`` exactly where
    ``SUCCESSOR[x[t - 1]] == x[t]``; scoring the logits at ``t`` or ``t - 2`` instead gives other shares."""
    rng = np.random.default_rng(0)
    cases = [planted_case(rng, follows) for follows in (True, False, True, False, False, True, False)]
    # half of one random span follows the rule too, so a share strictly between 0 and 1 is checked
    ids = list(cases[1].input_ids)
    for t in range(100, 108):
        ids[t] = int(SUCCESSOR[ids[t - 1]])
    cases[1] = RecallCase(tuple(ids), 10, 92, 100, 0, 0)
    expected = [np.mean([SUCCESSOR[c.input_ids[t - 1]] == c.input_ids[t] for t in range(100, 116)]) for c in cases]
    assert expected[1] >= 0.5 and expected[1] < 1.0
    model = successor_model().train()
    found = passage_recall_accuracy(model, cases, batch_size=3)
    assert model.training  # its mode is restored
    assert found["per_case"] == pytest.approx(expected, abs=0)
    assert found["accuracy"] == pytest.approx(np.mean(expected))
    assert found["exact"] == pytest.approx(3 / 7)
    assert found["cases"] == 7


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_score_matches_a_plain_per_case_loop_over_a_real_model_s_logits(arch, monkeypatch):
    """A random two-layer Llama, whose predictions depend on the whole context: the continuations
    are its own greedy tokens with every third one changed, so shares are neither 0 nor 1. A Gemma 3
    with window layers (W = 8) scores them with those layers in blocks, as its plain forward does."""
    blocks = windows_in_blocks(monkeypatch)
    if arch == "llama":
        model = tiny_model("llama", VOCAB, seed=3)
    else:
        model = tiny_gemma3(["sliding_attention", "full_attention"], sliding_window=8, seed=3, vocab_size=VOCAB)
        model.config._attn_implementation = "sdpa"
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(5):
        ids = [int(i) for i in rng.integers(VOCAB, size=60)]
        with torch.no_grad():
            for step in range(16):
                greedy = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(greedy if step % 3 else (greedy + 1) % VOCAB)
        cases.append(RecallCase(tuple(ids), 0, 52, 60, 0, 0))
    reference = []
    for case in cases:
        with torch.no_grad():
            logits = model(torch.tensor([case.input_ids])).logits[0]
        reference.append(np.mean([int(logits[t - 1].argmax()) == case.input_ids[t] for t in range(60, 76)]))
    assert 0 < min(reference) and max(reference) < 1
    assert not blocks
    found = passage_recall_accuracy(model, cases, batch_size=2)
    assert found["per_case"] == pytest.approx(reference, abs=0)
    assert found["accuracy"] == pytest.approx(np.mean(reference)) and found["exact"] == 0.0
    assert bool(blocks) == (arch == "gemma3")


def test_the_score_refuses_no_cases_and_mixed_lengths():
    rng = np.random.default_rng(0)
    model = successor_model()
    with pytest.raises(ValueError, match="No cases to score"):
        passage_recall_accuracy(model, [], batch_size=2)
    with pytest.raises(ValueError, match="score the cases of each length on their own"):
        passage_recall_accuracy(model, [planted_case(rng, True), planted_case(rng, True, length=120)], batch_size=2)


# ------------------------------------------------------------------ the stages' hook


def test_the_stages_write_read_and_score_passage_recall_only_when_its_cases_exist(tmp_path, monkeypatch):
    config = read_population(SMOKE, corpus=DATA)
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    tokenizer = byte_level_bpe()
    gate = config.base.gate.length
    for name in [f"lines-{n}.jsonl" for n in config.evaluation.lines_lengths] + [f"gate-{gate}.jsonl"]:
        lines.write_lines_cases(run.path("data", "cases", name), lines.generate_lines_cases(3, 2, 0))
    needle_case = needle.NeedleCase("haystack? The special magic number for a-b is:", "12345", "a-b", ("a-b",), 3)
    needle.write_needle_cases(run.path("data", "cases", "needle.jsonl"), [needle_case])
    before = stages.read_benchmark_cases(config, run)
    assert "passage_recall" not in before

    message = stages.write_passage_recall_cases(config, run, tokenizer, 300, beyond=200)
    assert message == "data: 4 passage-recall cases of 300 tokens, the span beyond 200"
    validation = stages.book_ids(tokenizer, stages.validation_books(config))
    cases = stages.read_benchmark_cases(config, run)
    assert cases["passage_recall"] == passage_recall_cases(validation, 300, 200, 4, config.seed + 3)
    for case in cases["passage_recall"]:
        assert_geometry(case, validation, 300, 200)
    assert "passage_recall" not in stages.read_benchmark_cases(config, run, with_needle=False)

    # the other benchmarks stand in here: this checks what is added, and that nothing is without cases
    monkeypatch.setattr(stages, "lines_result", lambda *args, **kwargs: {"accuracy": 0.0})
    monkeypatch.setattr(lines, "answer_log_likelihood", lambda *args, **kwargs: [0.0])
    model = tiny_model("llama", len(tokenizer), seed=0)
    found = stages.benchmark_results(model, tokenizer, cases, config)
    batch = config.evaluation.batch_size
    assert found["passage_recall"] == passage_recall_accuracy(model, cases["passage_recall"], batch_size=batch)
    assert "passage_recall" not in stages.benchmark_results(model, tokenizer, before, config)
