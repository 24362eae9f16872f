"""The LongEval lines benchmark (longppl_reproduce.common.lines) and the answer-token analysis
(longppl_reproduce.common.answer_tokens), against plain references written here."""

from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import ScriptedStub, byte_level_bpe, tiny_model
from longppl_reproduce.common.answer_tokens import answer_token_scores, classify_answer_tokens
from longppl_reproduce.common.lines import (
    LinesCase,
    case_text,
    generate_lines_cases,
    last_number,
    lines_accuracy,
    lines_for_token_length,
    longchat_correct,
    read_lines_cases,
    write_lines_cases,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from longppl.settings import WindowSettings

# LongChat's wording, written out here independently of the module.
HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and contains "
    "a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, memorize its "
    "corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the corresponding "
    "<REGISTER_CONTENT> of a certain line index. Now the record start:\n\n"
)
LINE = re.compile(r"line ([a-z]+-[a-z]+): REGISTER_CONTENT is <(\d+)>\n")
QUESTION = "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {}? I need the number."


def parse_record(text: str) -> list[tuple[str, str]]:
    """``(line id, number)`` of every record line of a prompt or training document."""
    assert text.startswith(HEADER)
    return LINE.findall(text)


def test_generated_cases_have_longchats_format_and_repeat_for_a_seed():
    cases = generate_lines_cases(7, 5, seed=3)
    assert cases == generate_lines_cases(7, 5, seed=3)
    assert cases != generate_lines_cases(7, 5, seed=4)
    for case in cases:
        record = parse_record(case.prompt)
        assert len(record) == 7 == case.num_lines
        ids = [line for line, _ in record]
        assert len(set(ids)) == 7
        assert all(10000 <= int(n) <= 50000 and len(n) == 5 for _, n in record)
        body = HEADER + "".join(f"line {line}: REGISTER_CONTENT is <{n}>\n" for line, n in record)
        assert case.prompt == body + QUESTION.format(case.target_line)
        assert dict(record)[case.target_line] == case.expected_number
        assert case.answer == f"The <REGISTER_CONTENT> in line {case.target_line} is <{case.expected_number}>."
        assert case_text(case) == case.prompt + " " + case.answer


def test_asked_line_is_uniform_over_the_record():
    cases = generate_lines_cases(4, 800, seed=0)
    positions = collections.Counter([line for line, _ in parse_record(c.prompt)].index(c.target_line) for c in cases)
    assert sorted(positions) == [0, 1, 2, 3]
    assert all(140 <= count <= 260 for count in positions.values()), positions  # 200 expected, ~5 sigma


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def test_longchat_file_round_trip(tmp_path):
    cases = generate_lines_cases(5, 3, seed=1)
    # LongChat writes expected_number as an int, beside fields this reader ignores.
    records = [
        {
            "random_idx": [c.target_line, 0],
            "expected_number": int(c.expected_number),
            "num_lines": 5,
            "prompt": c.prompt,
        }
        for c in cases
    ]
    records[1]["expected_number"] = str(records[1]["expected_number"])  # a string of digits works too
    path = write_jsonl(tmp_path / "lines.jsonl", records[:2] + ["  "] + records[2:])
    assert read_lines_cases(path) == cases
    written = str(tmp_path / "written.jsonl")
    write_lines_cases(written, cases)
    assert read_lines_cases(written) == cases
    with open(written, encoding="utf-8") as handle:
        first = json.loads(handle.readline())
    assert first["prompt"] == cases[0].prompt and first["expected_number"] == int(cases[0].expected_number)
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "What is it?", "expected_number": 7}])
    assert read_lines_cases(bare) == [LinesCase("What is it?", "7")]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "p"}', r"line 2 has no field 'expected_number'"),
        ('{"expected_number": 5}', r"line 2 has no field 'prompt'"),
        ('{"prompt": "p", "expected_number": 5', r"line 2 is not valid JSON"),
        ('["prompt", 5]', r"line 2 is a JSON list"),
        ('{"prompt": "p", "expected_number": "about 5"}', r"line 2, field 'expected_number' is 'about 5'"),
        ('{"prompt": "p", "expected_number": 5.5}', r"line 2, field 'expected_number' is a float"),
        ('{"prompt": "", "expected_number": 5}', r"line 2, field 'prompt'"),
    ],
)
def test_bad_lines_files_are_named(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "p", "expected_number": 1}', line])
    with pytest.raises(ValueError, match=re.escape(path) + ", " + message):
        read_lines_cases(path)


def test_empty_lines_file_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(ValueError, match=re.escape(path) + " holds no test cases"):
        read_lines_cases(path)


def whitespace_tokenizer() -> PreTrainedTokenizerFast:
    """Every whitespace-separated word is one token: a case's length depends on N alone."""
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_lines_for_token_length_is_the_largest_fitting_n():
    tok = whitespace_tokenizer()

    def words(num_lines):
        return len(case_text(generate_lines_cases(num_lines, 1, seed=5)[0]).split())

    assert words(2) - words(1) == 5  # "line", "id:", "REGISTER_CONTENT", "is", "<number>"
    for target in (words(1), words(1) + 4, words(30), words(30) + 3, 2000):
        n = lines_for_token_length(tok, target, seed=9)
        assert words(n) <= target < words(n + 1)
    with pytest.raises(ValueError, match="shorter than a one-line case"):
        lines_for_token_length(tok, words(1) - 1)


def test_lines_for_token_length_grows_with_the_target_and_stays_within_it():
    tok = byte_level_bpe()
    targets = [400, 600, 900, 1500, 2500]
    lengths = [lines_for_token_length(tok, target) for target in targets]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    for target, n in zip(targets, lengths):
        case = generate_lines_cases(n, 1, seed=0)[0]
        # approximate per case: within a couple of lines' tokens of the target
        assert abs(len(tok(case_text(case))["input_ids"]) - target) < 60


def reference_greedy(model, tokenizer, prompt, max_new_tokens):
    """Greedy decoding by hand: one full forward per new token, stop at EOS."""
    ids = tokenizer(prompt)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(token)
            if token == model.config.eos_token_id:
                break
    return tokenizer.decode(new, skip_special_tokens=True)


def test_lines_accuracy_matches_a_plain_greedy_loop():
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=1).train()
    cases = generate_lines_cases(3, 2, seed=2) + generate_lines_cases(6, 2, seed=3)  # prompts of different lengths
    outputs = [reference_greedy(model, tok, case.prompt, 6) for case in cases]
    # LongChat's rule, written out: the last run of digits, as an integer, equals the expected number.
    outputs_digits = [re.findall(r"[0-9]+", output) for output in outputs]
    expected = [bool(runs) and int(runs[-1]) == int(case.expected_number) for case, runs in zip(cases, outputs_digits)]
    has_number = [bool(runs) for runs in outputs_digits]
    # A tokenizer without a pad token (falls back to EOS), sharing the trained one's vocabulary.
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    steps = []
    for tokenizer, batch_size in ((tok, 1), (tok, 3), (no_pad, 4)):
        result = lines_accuracy(
            model,
            tokenizer,
            cases,
            max_new_tokens=6,
            batch_size=batch_size,
            progress=lambda desc, done, total: steps.append((done, total)),
        )
        assert result["outputs"] == outputs
        assert result["is_correct"] == expected
        assert result["has_number"] == has_number
        assert (result["correct"], result["total"]) == (sum(expected), 4)
        assert math.isclose(result["accuracy"], sum(expected) / 4)
        assert tokenizer.padding_side == "right"  # restored
    assert no_pad.pad_token is None and model.training  # restored
    assert steps[-1] == (4, 4)


def test_lines_accuracy_needs_a_pad_or_eos_token():
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bare = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        lines_accuracy(tiny_model("llama", 8), bare, generate_lines_cases(2, 1, seed=0))


class RetrieverStub(torch.nn.Module):
    """A "model" that reads the record and answers the asked line's number (plus ``shift``)."""

    def __init__(self, tokenizer, shift: int = 0):
        super().__init__()
        self.tokenizer, self.shift = tokenizer, shift

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        assert kwargs["do_sample"] is False
        rows = []
        for row, mask in zip(input_ids, attention_mask):
            assert mask[-1] == 1  # left padding: every row ends at the last column
            prompt = self.tokenizer.decode(row[mask.bool()], skip_special_tokens=True)
            line = re.search(r"in line (\S+)\? I need the number\.$", prompt).group(1)
            number = int(dict(LINE.findall(prompt))[line]) + self.shift
            rows.append(self.tokenizer(f" It is <{number}>.", add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_lines_accuracy_counts_answers_that_contain_the_number():
    tok = byte_level_bpe()
    cases = generate_lines_cases(4, 5, seed=7)
    right = lines_accuracy(RetrieverStub(tok), tok, cases, batch_size=2)
    assert (right["accuracy"], right["correct"], right["total"]) == (1.0, 5, 5)
    assert all(case.expected_number in out for case, out in zip(cases, right["outputs"]))
    wrong = lines_accuracy(RetrieverStub(tok, shift=1), tok, cases, batch_size=2)
    assert (wrong["accuracy"], wrong["correct"]) == (0.0, 0)


def test_longchat_rule_reads_the_last_number():
    assert last_number("It is <2416> ... or <77>") == 77 and last_number("no digits") is None
    assert last_number("x007y") == 7
    assert not longchat_correct("24160", "2416")  # containment would count it
    assert not longchat_correct("<2416> ... <77>", "2416")  # the last number is 77
    assert longchat_correct("The <REGISTER_CONTENT> in line x is <2416>.", "2416")
    assert longchat_correct("is 02416", 2416)  # compared as integers
    assert not longchat_correct("I do not know.", "2416")


def test_lines_accuracy_scores_by_the_last_number():
    tok = byte_level_bpe()
    cases = [replace(case, expected_number="2416") for case in generate_lines_cases(2, 4, seed=1)]
    answers = [" It is 24160.", " <2416> or <77>", " It is <2416>.", " No idea."]
    result = lines_accuracy(ScriptedStub(tok, answers), tok, cases, batch_size=3)
    assert result["outputs"] == answers
    assert result["is_correct"] == [False, False, True, False]
    assert result["has_number"] == [True, True, True, False]
    assert (result["correct"], result["total"], result["accuracy"]) == (1, 4, 0.25)


def reference_answer_scores(model, tokenizer, case, K, d):
    """Per answer-side token of one case: (position, lsd, lcl, is_answer, source, beyond_short), by
    plain forwards; source is the token holding the first digit of the asked line's number."""
    text = case.prompt + " " + case.answer
    enc = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    number_start = text.rindex(case.expected_number)
    number_end = number_start + len(case.expected_number)
    line = f"line {case.target_line}: REGISTER_CONTENT is <"
    first_digit = text.index(line) + len(line)
    source = next(j for j, (a, b) in enumerate(offsets) if a <= first_digit < b)
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows = []
    for i, (a, b) in enumerate(offsets):
        if a < len(case.prompt) or b <= a:
            continue
        start = (i - K) // d * d  # the window whose scored tokens [start+K, start+K+d) hold i
        with torch.no_grad():
            short = model(torch.tensor([ids[start:i]])).logits[0, -1].float().log_softmax(-1)
        lp_long = float(full[i - 1, ids[i]])
        is_answer = a < number_end and b > number_start
        rows.append((i, lp_long - float(short[ids[i]]), lp_long, is_answer, source, source < start))
    return rows


@pytest.mark.parametrize("K, d, lines", [(24, 1, 2), (20, 7, 2), (40, 5, 6)])
def test_answer_token_scores_match_plain_forward_passes(K, d, lines):
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=2)
    cases = generate_lines_cases(lines, 2, seed=11)
    scores = answer_token_scores(model, tok, cases, window=WindowSettings(K, d), max_tokens_per_batch=256)
    rows = [
        (index, *row) for index, case in enumerate(cases) for row in reference_answer_scores(model, tok, case, K, d)
    ]
    assert scores["case"].tolist() == [r[0] for r in rows]
    assert scores["position"].tolist() == [r[1] for r in rows]
    np.testing.assert_allclose(scores["lsd"], [r[2] for r in rows], atol=2e-5)
    np.testing.assert_allclose(scores["lcl"], [r[3] for r in rows], atol=2e-5)
    assert scores["is_answer"].tolist() == [r[4] for r in rows]
    assert scores["source"].tolist() == [r[5] for r in rows]
    assert scores["beyond_short"].tolist() == [r[6] for r in rows]
    for index in range(len(cases)):  # each case's number is covered by its answer tokens
        assert scores["is_answer"][scores["case"] == index].sum() >= 1


def test_answer_tokens_are_those_overlapping_the_number():
    """A token that holds the number with other characters ("<42130>.") is an answer token."""
    tok = whitespace_tokenizer()
    model = tiny_model("llama", 8)
    cases = generate_lines_cases(3, 2, seed=4)
    scores = answer_token_scores(model, tok, cases, window=WindowSettings(16, 4))
    # The answer's words: "The", "<REGISTER_CONTENT>", "in", "line", "<id>", "is", "<number>."
    assert scores["case"].tolist() == [0] * 7 + [1] * 7
    assert scores["is_answer"].tolist() == ([False] * 6 + [True]) * 2
    assert np.isfinite(scores["lsd"]).all() and np.isfinite(scores["lcl"]).all()


def test_the_asked_number_is_beyond_the_short_context_only_where_it_is():
    """K below the distance to the record's number: beyond; K above it: within; no record line: -1."""
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=2)
    case = generate_lines_cases(1, 1, seed=3)[0]
    text = case_text(case)
    ids = tok(text)["input_ids"]
    answer_first = len(tok(case.prompt)["input_ids"])  # about where the answer side starts
    far = answer_token_scores(model, tok, [case], window=WindowSettings(8, 1))
    assert far["beyond_short"].all() and (far["source"] >= 0).all()
    near = answer_token_scores(model, tok, [case], window=WindowSettings(answer_first - 1, 1))
    assert not near["beyond_short"].any()  # the short context reaches back into the record's line
    assert len(ids) > answer_first
    reworded = replace(case, prompt=case.prompt.replace("REGISTER_CONTENT is", "holds"))
    unknown = answer_token_scores(model, tok, [reworded], window=WindowSettings(8, 1))
    assert (unknown["source"] == -1).all() and not unknown["beyond_short"].any()


def test_answer_token_scores_refuse_what_they_cannot_score():
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok))
    cases = generate_lines_cases(2, 1, seed=0)
    length = len(tok(case_text(cases[0]))["input_ids"])
    with pytest.raises(ValueError, match=f"trunc_len={length}"):
        answer_token_scores(model, tok, cases, window=WindowSettings(length, 4))
    with pytest.raises(ValueError, match=r"cases\[0\] has no reference answer"):
        answer_token_scores(model, tok, [replace(cases[0], answer=None)], window=WindowSettings(16, 4))


def test_classify_answer_tokens_counts_by_hand():
    lsd = np.array([3.0, 0.1, 2.5, 5.0, -1.0, 2.1, 2.0, np.nan])
    lcl = np.array([-0.5, -0.1, -3.0, -1.0, -0.2, -2.5, 0.0, -1.0])
    is_answer = np.array([True, False, True, False, False, False, True, False])
    result = classify_answer_tokens(lsd, lcl, is_answer, alpha=2.0, beta=-2.0)
    assert (result["n_answer"], result["n_other"], result["alpha"], result["beta"]) == (3, 5, 2.0, -2.0)
    # LSD > 2 (strict; NaN is never above): tokens 0, 2, 3, 5.
    by_lsd = result["lsd"]
    assert [by_lsd[k] for k in ("true_positive", "false_positive", "true_negative", "false_negative")] == [2, 2, 3, 1]
    assert math.isclose(by_lsd["recall"], 2 / 3) and math.isclose(by_lsd["specificity"], 3 / 5)
    assert math.isclose(by_lsd["balanced_accuracy"], (2 / 3 + 3 / 5) / 2)
    assert math.isclose(by_lsd["accuracy"], 5 / 8) and math.isclose(by_lsd["precision"], 2 / 4)
    # and LCL > -2: tokens 0, 3.
    both = result["lsd+lcl"]
    assert [both[k] for k in ("true_positive", "false_positive", "true_negative", "false_negative")] == [1, 1, 4, 2]
    assert math.isclose(both["balanced_accuracy"], (1 / 3 + 4 / 5) / 2)
    assert math.isclose(both["accuracy"], 5 / 8) and math.isclose(both["precision"], 1 / 2)
    defaults = classify_answer_tokens(lsd, lcl, is_answer)  # the paper's alpha=2, beta=-2
    assert defaults == result
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        classify_answer_tokens(lsd, lcl, is_answer, alpha=float("nan"))
    with pytest.raises(ValueError, match="one length"):
        classify_answer_tokens(lsd[:3], lcl, is_answer)
    with pytest.raises(ValueError, match="bool array"):
        classify_answer_tokens(lsd, lcl, is_answer.astype(int))
