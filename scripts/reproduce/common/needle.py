"""A multi-key needle-in-a-haystack task (RULER's "multikey NIAH"): a long-context retrieval test on
natural text, beside LongEval's synthetic lines.

A case hides ``needles`` sentences ``The special magic number for <key> is: <number>.`` (keys are
distinct adjective-noun pairs and numbers five digits, drawn as LongEval lines' ids and numbers,
:func:`lines.draw_record`) at sentence boundaries of a haystack, a stretch of a held-out book
(its token ids decoded), then asks for one key's number::

    <HEADER><haystack with needles><QUESTION about key>

The reference answer is ``ANSWER_SEPARATOR + "<number>."``; a greedy answer is scored by
LongChat's rule, its last number (:func:`lines.longchat_correct`). The asked needle's depth is
uniform over the sentence boundaries allowed by the distance asked for (``beyond`` for test cases,
``asked_within`` for training documents); the other needles are uniform over all boundaries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longppl.atomic_files import write_file_atomically
from longppl.settings import require_int

from .lines import case_accuracy, draw_record, expected_number_text, token_holding

HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE_TEMPLATE = "The special magic number for {key} is: {number}. "
QUESTION_TEMPLATE = "\nWhat is the special magic number for {key}? The special magic number for {key} is:"
ANSWER_SEPARATOR = " "
ANSWER_TEMPLATE = "{number}."
# Where a needle may go: after the end of a sentence or a line of the haystack.
_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")
# How many times a case is redrawn before the requested distance is declared out of reach.
_ATTEMPTS = 64


@dataclass(frozen=True)
class NeedleCase:
    """One test case.

    Attributes:
        prompt: the haystack with its needles and the question (the model's whole input).
        expected_number: the asked needle's number, as text (e.g. ``"42130"``).
        key: the asked needle's key (e.g. ``"swift-harbor"``).
        keys: every needle's key, in the order they appear in the prompt.
        distance: tokens of the prompt after the token holding the asked number's last digit.
    """

    prompt: str
    expected_number: str
    key: str
    keys: tuple[str, ...]
    distance: int

    @property
    def answer(self) -> str:
        """The reference answer (without the separator)."""
        return ANSWER_TEMPLATE.format(number=self.expected_number)


def _boundaries(text: str) -> list[int]:
    """Characters where a needle may be inserted: the text's start and the end of every sentence break."""
    return [0, *(match.end() for match in _BOUNDARY.finditer(text))]


def _build(
    tokenizer,
    haystack_ids,
    limit: int,
    rng: np.random.Generator,
    needles: int,
    with_answer: bool,
    region: tuple[float, float],
    qualifies,
):
    """Draw a case of at most ``limit`` tokens whose asked needle lies in the fraction ``region`` of
    the haystack's characters and passes ``qualifies(offsets, number_end, question_start, size)``
    (exact, on the text's own tokenization). Returns ``(text, prompt, key, number, keys, offsets,
    number_end)``, or ``None`` when no draw qualified."""
    haystack_ids = np.asarray(haystack_ids)
    keys, numbers = draw_record(rng, needles)
    overhead = len(
        tokenizer(
            HEADER
            + "".join(NEEDLE_TEMPLATE.format(key=k, number=n) for k, n in zip(keys, numbers))
            + QUESTION_TEMPLATE.format(key=keys[0])
            + ANSWER_SEPARATOR
            + ANSWER_TEMPLATE.format(number=numbers[0]),
            add_special_tokens=True,
        )["input_ids"]
    )
    budget = min(limit - overhead, len(haystack_ids))
    for _ in range(_ATTEMPTS):
        if budget < 1:
            return None
        start = int(rng.integers(len(haystack_ids) - budget + 1))
        haystack = tokenizer.decode(haystack_ids[start : start + budget].tolist(), skip_special_tokens=True)
        boundaries = _boundaries(haystack)
        low, high = (int(f * len(haystack)) for f in region)
        allowed = [b for b in boundaries if low <= b <= high]
        if not allowed:
            continue
        asked = int(rng.integers(needles))
        places = [int(b) for b in rng.choice(boundaries, size=needles)]
        places[asked] = int(allowed[int(rng.integers(len(allowed)))])
        order = sorted(range(needles), key=lambda i: (places[i], i))
        pieces, at, cursor, number_end = [HEADER], len(HEADER), 0, 0
        for i in order:
            pieces.append(haystack[cursor : places[i]])
            at += places[i] - cursor
            cursor = places[i]
            needle = NEEDLE_TEMPLATE.format(key=keys[i], number=numbers[i])
            if i == asked:
                number_end = at + needle.index(f" {numbers[i]}.") + 1 + len(numbers[i])
            pieces.append(needle)
            at += len(needle)
        pieces.append(haystack[cursor:])
        prompt = "".join(pieces) + QUESTION_TEMPLATE.format(key=keys[asked])
        question_start = len(prompt) - len(QUESTION_TEMPLATE.format(key=keys[asked]))
        text = prompt + (ANSWER_SEPARATOR + ANSWER_TEMPLATE.format(number=numbers[asked]) if with_answer else "")
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        size = len(enc["input_ids"])
        if size > limit:
            budget -= size - limit  # decoding and re-encoding changed the count: shrink and draw again
            continue
        if qualifies(enc["offset_mapping"], number_end, question_start, size):
            ordered_keys = tuple(keys[i] for i in order)
            return text, prompt, keys[asked], numbers[asked], ordered_keys, enc, number_end
    return None


def make_needle_cases(
    tokenizer, haystack_ids, length: int, count: int, *, needles: int = 4, beyond: int, seed: int
) -> list[NeedleCase]:
    """``count`` cases whose prompt (special tokens included) takes at most ``length`` tokens (the
    haystack filled to about that), with ``needles`` needles of distinct keys, the asked one's
    number lying more than ``beyond`` tokens before the prompt's end (every token of it has index
    ``< P - beyond`` for a prompt of ``P`` tokens). The haystack is a random stretch of
    ``haystack_ids`` (token ids of a held-out book). The same ``seed`` gives the same cases.

    Raises:
        ValueError: ``length`` too short for the needles and question, or for any needle to lie
            ``beyond`` tokens back (naming both).
    """
    require_int("length", length)
    require_int("count", count)
    require_int("needles", needles)
    require_int("beyond", beyond)
    rng = np.random.default_rng(seed)
    # The asked needle goes in the haystack's first (length - beyond) / length, less room for the question.
    region = (0.0, max(0.0, (length - beyond - 40) / length))

    def qualifies(offsets, number_end, question_start, size):
        return token_holding(offsets, number_end - 1) < size - beyond

    cases = []
    for _ in range(count):
        built = _build(tokenizer, haystack_ids, length, rng, needles, False, region, qualifies)
        if built is None:
            raise ValueError(
                f"length={length} tokens leaves no room for {needles} needles with one more than beyond={beyond} "
                "tokens before the prompt's end; ask for a longer length, a shorter beyond or fewer needles."
            )
        _, prompt, key, number, keys, enc, number_end = built
        distance = len(enc["input_ids"]) - 1 - token_holding(enc["offset_mapping"], number_end - 1)
        cases.append(NeedleCase(prompt, number, key, keys, distance))
    return cases


def needle_training_document(
    tokenizer, haystack_ids, seq_len: int, rng: np.random.Generator, *, needles: int, asked_within: int | None = None
) -> list[int]:
    """Token ids (special tokens included) of a needle prompt followed by its reference answer,
    at most ``seq_len`` tokens, for training. ``asked_within=K`` (tokens): the token holding the
    asked number's last digit has index ``>= q - K``, ``q`` the index of the token holding the
    question's first character (answering needs no context beyond ``K`` tokens back).

    Raises:
        ValueError: ``seq_len`` too short, or ``asked_within`` never met (naming them).
    """
    require_int("seq_len", seq_len)
    require_int("needles", needles)
    region = (0.0, 1.0)
    if asked_within is not None:
        require_int("asked_within", asked_within)
        region = (max(0.0, 1.0 - 0.8 * asked_within / seq_len), 1.0)

    def qualifies(offsets, number_end, question_start, size):
        if asked_within is None:
            return True
        return token_holding(offsets, number_end - 1) >= token_holding(offsets, question_start) - asked_within

    built = _build(tokenizer, haystack_ids, seq_len, rng, needles, True, region, qualifies)
    if built is None:
        raise ValueError(
            f"seq_len={seq_len} tokens with asked_within={asked_within} gave no document with {needles} needles; "
            "ask for a longer seq_len, a larger asked_within or fewer needles."
        )
    return list(built[5]["input_ids"])


def needle_accuracy(model, tokenizer, cases: Sequence[NeedleCase], **options) -> dict:
    """Greedy answers scored by LongChat's rule (the last number of the answer equals the expected
    number): :func:`lines.case_accuracy` of the cases (options ``max_new_tokens``, ``batch_size``,
    ``progress``, ``prefill``), which returns what :func:`lines.lines_accuracy` returns."""
    return case_accuracy(model, tokenizer, cases, **{"desc": "Needle in a haystack", **options})


_FIELDS = ("prompt", "expected_number", "key", "keys", "distance")


def write_needle_cases(path: str, cases: Sequence[NeedleCase]) -> None:
    """Write cases as JSONL (atomically), one object per case with the fields of :class:`NeedleCase`;
    :func:`read_needle_cases` reads them back."""
    records = [
        json.dumps(
            {
                "prompt": c.prompt,
                "expected_number": c.expected_number,
                "key": c.key,
                "keys": list(c.keys),
                "distance": c.distance,
            },
            ensure_ascii=False,
        )
        + "\n"
        for c in cases
    ]
    write_file_atomically(path, lambda handle: handle.writelines(records))


def read_needle_cases(path: str) -> list[NeedleCase]:
    """Cases from a JSONL file written by :func:`write_needle_cases` (JSON only; blank lines skipped).

    Raises:
        ValueError: naming the file and line of a record that is not a JSON object, lacks a field or
            holds a bad value there; or an empty file.
    """
    from longppl.commandline.corpus import jsonl_records

    cases = []
    for where, record in jsonl_records(
        path, _FIELDS, f"needle files need {', '.join(map(repr, _FIELDS))} on every line."
    ):
        prompt, key, keys, distance = record["prompt"], record["key"], record["keys"], record["distance"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}, field 'prompt' is {prompt!r:.60}, not a non-empty string.")
        number = expected_number_text(record["expected_number"], f"{where}, field 'expected_number'")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or key not in keys:
            raise ValueError(f"{where}, field 'keys' is {keys!r:.80}, not a list of strings holding key {key!r}.")
        if isinstance(distance, bool) or not isinstance(distance, int) or distance < 0:
            raise ValueError(f"{where}, field 'distance' is {distance!r}, not a whole number of tokens.")
        cases.append(NeedleCase(prompt, number, key, tuple(keys), distance))
    if not cases:
        raise ValueError(f"{path} holds no test cases (it is empty); write one JSON object per line.")
    return cases
