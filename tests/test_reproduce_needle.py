"""longppl_reproduce.common.needle: multi-key needle-in-a-haystack cases, measured here in tokens."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import ScriptedStub, byte_level_bpe, govreport_texts
from longppl_reproduce.common.lines import last_number
from longppl_reproduce.common.needle import (
    NeedleCase,
    make_needle_cases,
    needle_accuracy,
    needle_training_document,
    read_needle_cases,
    write_needle_cases,
)

NEEDLE = re.compile(r"The special magic number for ([a-z]+-[a-z]+) is: (\d{5})\. ")
QUESTION = "\nWhat is the special magic number for {0}? The special magic number for {0} is:"


def haystack(tok):
    return np.array(tok(govreport_texts()[0], add_special_tokens=False)["input_ids"])


def token_at(offsets, char):
    return next(i for i, (a, b) in enumerate(offsets) if a <= char < b)


def test_needle_cases_fit_hide_distinct_keys_and_ask_one_beyond_the_distance():
    tok = byte_level_bpe()
    hay = haystack(tok)
    length, beyond = 1200, 500
    cases = make_needle_cases(tok, hay, length, 6, needles=4, beyond=beyond, seed=1)
    assert cases == make_needle_cases(tok, hay, length, 6, needles=4, beyond=beyond, seed=1)
    assert cases != make_needle_cases(tok, hay, length, 6, needles=4, beyond=beyond, seed=2)
    for case in cases:
        enc = tok(case.prompt, return_offsets_mapping=True)
        size = len(enc["input_ids"])
        assert length - 40 <= size <= length  # the haystack fills the prompt
        found = NEEDLE.findall(case.prompt)
        assert [key for key, _ in found] == list(case.keys) and len(set(case.keys)) == 4
        assert dict(found)[case.key] == case.expected_number
        assert case.prompt.endswith(QUESTION.format(case.key))
        needle = f"The special magic number for {case.key} is: {case.expected_number}"
        last_digit = token_at(enc["offset_mapping"], case.prompt.index(needle) + len(needle) - 1)
        assert last_digit < size - beyond and case.distance == size - 1 - last_digit
        assert last_number(" " + case.answer) == int(case.expected_number)
    with pytest.raises(
        ValueError, match="length=400 tokens leaves no room for 4 needles with one more than beyond=390"
    ):
        make_needle_cases(tok, hay, 400, 1, needles=4, beyond=390, seed=0)


def test_needle_training_documents_fit_end_with_the_answer_and_keep_it_near():
    tok = byte_level_bpe()
    hay = haystack(tok)
    rng = np.random.default_rng(5)
    for asked_within in (None, 120):
        for _ in range(3):
            ids = needle_training_document(tok, hay, 900, rng, needles=3, asked_within=asked_within)
            assert len(ids) <= 900
            text = tok.decode(ids, skip_special_tokens=True)
            enc = tok(text, return_offsets_mapping=True)
            assert enc["input_ids"] == ids
            match = re.search(
                r"\nWhat is the special magic number for (\S+)\? The special magic number for \1 is: (\d+)\.$", text
            )
            assert match, text[-200:]
            key, number = match.groups()
            needles = dict(NEEDLE.findall(text))
            assert len(needles) == 3 and needles[key] == number
            assert last_number(text[match.start() :]) == int(number)
            if asked_within is not None:
                needle = f"The special magic number for {key} is: {number}"
                last_digit = token_at(enc["offset_mapping"], text.index(needle) + len(needle) - 1)
                assert last_digit >= token_at(enc["offset_mapping"], match.start()) - asked_within


def test_needle_files_round_trip_and_bad_records_are_named(tmp_path):
    tok = byte_level_bpe()
    cases = make_needle_cases(tok, haystack(tok), 800, 3, needles=2, beyond=300, seed=0)
    path = str(tmp_path / "needle.jsonl")
    write_needle_cases(path, cases)
    assert read_needle_cases(path) == cases
    bad = tmp_path / "bad.jsonl"
    record = {"prompt": "p", "expected_number": "12345", "key": "a-b", "keys": ["c-d"], "distance": 3}
    bad.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=re.escape(str(bad)) + r", line 1, field 'keys' is \['c-d'\], not a list of strings holding key 'a-b'",
    ):
        read_needle_cases(str(bad))
    bad.write_text(json.dumps({**record, "keys": ["a-b"], "distance": -1}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1, field 'distance' is -1"):
        read_needle_cases(str(bad))


def test_needle_accuracy_scores_greedy_answers_by_the_last_number():
    tok = byte_level_bpe()
    cases = [
        NeedleCase("Where is it?", "12345", "a-b", ("a-b",), 10),
        NeedleCase("And this?", "23456", "c-d", ("c-d",), 10),
        NeedleCase("And that?", "34567", "e-f", ("e-f",), 10),
    ]
    answers = [" 12345.", " 123456", " none"]
    result = needle_accuracy(ScriptedStub(tok, answers), tok, cases, batch_size=2)
    assert result["is_correct"] == [True, False, False] and result["has_number"] == [True, True, False]
    assert (result["correct"], result["total"]) == (1, 3)
