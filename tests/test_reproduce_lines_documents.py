"""LongEval lines: documents that keep their answers, cases asked beyond a distance, and the answer's
log-likelihood (longppl_reproduce.common.lines), measured here in tokens with plain references."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from helpers import byte_level_bpe, plain_greedy, tiny_model
from longppl_reproduce.common.lines import (
    answer_log_likelihood,
    case_text,
    fitted_lines_document,
    generate_lines_cases,
    greedy_answers,
    greedy_token_ids,
    lines_cases_beyond,
)

LINE = re.compile(r"line ([a-z]+-[a-z]+): REGISTER_CONTENT is <(\d+)>\n")
QA = re.compile(
    r"\nNow the record is over\. Tell me what is the <REGISTER_CONTENT> in line (\S+)\? I need the number\. "
    r"The <REGISTER_CONTENT> in line (\S+) is <(\d+)>\."
)


def token_at(offsets, char):
    return next(i for i, (a, b) in enumerate(offsets) if a <= char < b)


@pytest.mark.parametrize("seq_len, questions", [(700, "fill"), (1500, "fill"), (1500, 2), (3000, "fill")])
def test_fitted_documents_fit_and_end_with_complete_answers(seq_len, questions):
    tok = byte_level_bpe()
    rng = np.random.default_rng(seq_len)
    for _ in range(4):
        ids = fitted_lines_document(tok, rng, seq_len, min_lines=5, max_lines=120, questions=questions)
        assert len(ids) <= seq_len
        text = tok.decode(ids, skip_special_tokens=True)
        assert tok(text)["input_ids"] == ids  # the ids are the document's own tokenization
        record = dict(LINE.findall(text))
        asked = QA.findall(text)
        assert asked and text.endswith(f"is <{asked[-1][2]}>.")
        assert all(line == again and record[line] == number for line, again, number in asked)
        assert len({line for line, _, _ in asked}) == len(asked)  # distinct lines
        if questions != "fill":
            assert len(asked) <= questions
        # nothing was cut: the text is the record, then whole questions with answers
        rebuilt = text[: text.index("\nNow the record")] + "".join(
            f"\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {line}? I need the number. "
            f"The <REGISTER_CONTENT> in line {line} is <{number}>."
            for line, _, number in asked
        )
        assert rebuilt == text


def test_fill_adds_questions_while_they_fit():
    tok = byte_level_bpe()
    ids = fitted_lines_document(tok, np.random.default_rng(1), 3000, min_lines=5, max_lines=5)
    text = tok.decode(ids, skip_special_tokens=True)
    asked = QA.findall(text)
    assert len(LINE.findall(text)) == 5
    assert len(asked) == 5 or len(ids) > 3000 - 120  # all lines asked, or no room left for another


def test_asked_within_is_respected_in_tokens():
    tok = byte_level_bpe()
    rng = np.random.default_rng(3)
    K = 90
    for _ in range(4):
        ids = fitted_lines_document(tok, rng, 2500, min_lines=20, max_lines=80, questions="fill", asked_within=K)
        text = tok.decode(ids, skip_special_tokens=True)
        enc = tok(text, return_offsets_mapping=True)
        assert enc["input_ids"] == ids and len(ids) <= 2500
        offsets = enc["offset_mapping"]
        for match in QA.finditer(text):
            line, number = match.group(1), match.group(3)
            # the asked line's number: its last occurrence in the text before the question
            number_end = text.rindex(f"line {line}: REGISTER_CONTENT is <{number}>", 0, match.start())
            number_end += len(f"line {line}: REGISTER_CONTENT is <{number}")
            question_token = token_at(offsets, match.start())
            assert token_at(offsets, number_end - 1) >= question_token - K


def test_too_short_documents_and_distances_are_refused():
    tok = byte_level_bpe()
    with pytest.raises(
        ValueError, match=r"seq_len=300 tokens cannot hold the header, one line, a question and its answer \(\d+ tokens"
    ):
        fitted_lines_document(tok, np.random.default_rng(0), 300, min_lines=1, max_lines=4)
    with pytest.raises(ValueError, match="asked_within=1 tokens is too short"):
        fitted_lines_document(tok, np.random.default_rng(0), 1500, min_lines=3, max_lines=9, asked_within=1)
    with pytest.raises(ValueError, match="max_lines=2 is less than min_lines=3"):
        fitted_lines_document(tok, np.random.default_rng(0), 1500, min_lines=3, max_lines=2)


def test_cases_beyond_put_the_asked_number_out_of_the_last_tokens():
    tok = byte_level_bpe()
    length, beyond = 900, 300
    cases = lines_cases_beyond(tok, length, 6, beyond, seed=2)
    assert cases == lines_cases_beyond(tok, length, 6, beyond, seed=2)
    for case in cases:
        enc = tok(case.prompt, return_offsets_mapping=True)
        size = len(enc["input_ids"])
        assert size <= length
        record = dict(LINE.findall(case.prompt))
        assert record[case.target_line] == case.expected_number and len(record) == case.num_lines
        # as many lines as fit: one more line (of the longest id and number) would not
        longer = case.prompt.replace(
            "\n\nNow the record", "\nline silver-mountain: REGISTER_CONTENT is <49999>\n\nNow the record"
        )
        assert len(tok(longer)["input_ids"]) > length - 25
        line = f"line {case.target_line}: REGISTER_CONTENT is <{case.expected_number}"
        number_end = case.prompt.index(line) + len(line)
        assert token_at(enc["offset_mapping"], number_end - 1) < size - beyond
    with pytest.raises(ValueError, match="length=900 tokens leaves no line more than beyond=890 tokens"):
        lines_cases_beyond(tok, 900, 1, 890, seed=0)


def test_answer_log_likelihood_matches_one_full_forward_per_case():
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=3)
    cases = generate_lines_cases(2, 2, seed=1) + generate_lines_cases(5, 1, seed=2)  # different lengths
    expected = []
    for case in cases:
        text = case_text(case)
        enc = tok(text, return_offsets_mapping=True)
        start = text.rindex(case.expected_number)
        end = start + len(case.expected_number)
        with torch.no_grad():
            logp = model(torch.tensor([enc["input_ids"]])).logits[0].float().log_softmax(-1)
        total = 0.0
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if a >= start and b <= end and b > a:
                total += float(logp[i - 1, enc["input_ids"][i]])
        assert total != 0.0
        expected.append(total)
    for batch_size in (1, 2):
        got = answer_log_likelihood(model, tok, cases, batch_size=batch_size)
        assert all(math.isclose(g, e, rel_tol=1e-4, abs_tol=1e-4) for g, e in zip(got, expected)), (got, expected)
        assert len(got) == 3


def test_greedy_answers_match_a_plain_greedy_loop_in_order():
    """Batches encoded ahead on a thread come back in order, each prompt's answer the plain argmax
    loop's continuation (the prompts share a token length, so batching adds no padding)."""
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=5)
    prompts = [f"line {c}: REGISTER_CONTENT is <{c}>" for c in "abcdefg"]
    assert len({len(tok(p)["input_ids"]) for p in prompts}) == 1
    expected = []
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            for _ in range(4):
                ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
        expected.append(tok.decode(ids[-4:], skip_special_tokens=True))
    assert len(set(expected)) > 1  # answers that differ, so an order mixed up shows
    side = tok.padding_side
    for batch_size in (1, 3):  # 7 prompts: batches of 3, 3 and 1
        assert greedy_answers(model, tok, prompts, max_new_tokens=4, batch_size=batch_size) == expected
    assert tok.padding_side == side


def test_rows_prefill_matches_a_plain_greedy_loop_on_prompts_of_different_lengths():
    """``prefill="rows"`` reads each prompt alone and decodes the batch together (the cache left-padded,
    every row at its own positions): each answer is the plain loop's on that prompt alone, in order,
    and equals ``generate`` on the padded batch (float32)."""
    tok = byte_level_bpe()
    # weights 2.5x the default scale: attention far enough from uniform that a row decoded at a
    # wrong position (RoPE) changes its answer, and near enough that reading the padding does too
    model = tiny_model("llama", len(tok), seed=5, initializer_range=0.05)
    model.generation_config.eos_token_id = None  # every prompt gets all its tokens here
    prompts = [f"line {c * k}: REGISTER_CONTENT is <{k}{c}>" for k, c in enumerate("abcdefg", 1)]
    sizes = [len(tok(p)["input_ids"]) for p in prompts]
    assert all(len(set(sizes[i : i + 3])) > 1 for i in (0, 3))  # padding in the batches of 3
    expected = [
        tok.decode(plain_greedy(model, tok(p)["input_ids"], 5, set()), skip_special_tokens=True) for p in prompts
    ]
    assert len(set(expected)) > 1
    for batch_size in (1, 3):
        assert greedy_answers(model, tok, prompts, max_new_tokens=5, batch_size=batch_size, prefill="rows") == expected
    assert greedy_answers(model, tok, prompts, max_new_tokens=5, batch_size=3) == expected
    with pytest.raises(ValueError, match="prefill="):
        greedy_answers(model, tok, prompts, prefill="padded")


def test_rows_decoder_stops_a_row_at_its_eos_and_pads_it():
    """A row whose greedy token is an end-of-sequence token of the generation config keeps it, then
    gets the pad token while the others go on; decoding ends once every row has stopped."""
    model = tiny_model("llama", 300, seed=7)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    rows = [torch.as_tensor(rng.integers(3, 300, n)) for n in (9, 14, 11)]
    free = [plain_greedy(model, row.tolist(), 6, set()) for row in rows]
    eos = free[0][1]  # row 0 stops at its second token
    assert eos not in free[1] and eos not in free[2][:5]
    model.generation_config.eos_token_id = [eos, 299]
    with torch.no_grad():
        got = greedy_token_ids(model, rows, 6, pad_token_id=2)
    for i, row in enumerate(rows):
        ref = plain_greedy(model, row.tolist(), 6, {eos, 299})
        assert got[i, : len(ref)].tolist() == ref
        assert got[i, len(ref) :].tolist() == [2] * (got.shape[1] - len(ref))
    assert got.shape[1] == max(len(plain_greedy(model, r.tolist(), 6, {eos, 299})) for r in rows)
    model.generation_config.eos_token_id = [t[0] for t in free]  # every row stops at its first token
    with torch.no_grad():
        assert greedy_token_ids(model, rows, 6, pad_token_id=2).tolist() == [[t[0]] for t in free]
