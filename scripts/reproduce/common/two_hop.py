"""A two-hop retrieval task in LongEval's lines format (the third attempt's new benchmark).

A record is LongEval's list of lines, but some lines hold no number: they name another line,
``line swift-harbor: REGISTER_CONTENT is in line quiet-lake``, and the question asks about such a
line (LongEval's own question). The answer is the number of the line it names:
``The <REGISTER_CONTENT> in line swift-harbor is in line quiet-lake: <42130>.`` A pointer names
only an earlier line that holds a number, so every prefix of a record is a valid record.

Cases are :class:`lines.LinesCase` objects (``expected_number`` is the named line's number), so
they are written, read and scored (LongChat's last-number rule) by ``lines``'s functions. Line
ids hold no digits, so the last number of a correct answer is the number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from longppl.settings import require_int

from .lines import (
    ANSWER_SEPARATOR,
    LINE_TEMPLATE,
    MAX_LINES,
    PROMPT_HEADER,
    QUESTION_TEMPLATE,
    LinesCase,
    draw_record,
    token_holding,
)

_ATTEMPTS = 64

POINTER_TEMPLATE = "line {line}: REGISTER_CONTENT is in line {target}\n"
ANSWER_TEMPLATE = "The <REGISTER_CONTENT> in line {line} is in line {target}: <{number}>."


def draw_pointers(rng: np.random.Generator, num_lines: int, share: float) -> list[int | None]:
    """For each of ``num_lines`` record lines, the index of the earlier number line it names, or
    ``None`` for a line holding a number. Line 0 holds a number; line ``i >= 1`` is a pointer with
    probability ``share`` (its target uniform over the earlier number lines); at least one line is
    a pointer when ``num_lines >= 2`` (the last, if the draw gave none)."""
    require_int("num_lines", num_lines)
    targets: list[int | None] = [None]
    numbers = [0]  # the number lines so far
    for index in range(1, num_lines):
        if rng.random() < share:
            targets.append(numbers[int(rng.integers(len(numbers)))])
        else:
            targets.append(None)
            numbers.append(index)
    targets = targets[:num_lines]
    if num_lines >= 2 and all(t is None for t in targets):
        targets[-1] = int(rng.integers(num_lines - 1))
    return targets


def record_text(lines: Sequence[str], numbers: Sequence[str], targets: Sequence[int | None]) -> tuple[str, list[int]]:
    """The record (LongEval's header and lines) and, per line, one past the character that closes
    what the line holds (the last digit of its number, or the last letter of the line it names)."""
    text, ends = PROMPT_HEADER, []
    for line, number, target in zip(lines, numbers, targets):
        if target is None:
            part = LINE_TEMPLATE.format(line=line, number=number)
            ends.append(len(text) + part.index(f"<{number}>") + 1 + len(number))
        else:
            part = POINTER_TEMPLATE.format(line=line, target=lines[target])
            ends.append(len(text) + len(part) - 1)
        text += part
    return text, ends


def two_hop_case(lines: Sequence[str], numbers: Sequence[str], targets: Sequence[int | None], asked: int) -> LinesCase:
    """The case asking about pointer line ``asked`` of the record."""
    target = targets[asked]
    if target is None:
        raise ValueError(f"line {asked} holds a number, not a pointer: a two-hop case asks about a pointer line.")
    record, _ = record_text(lines, numbers, targets)
    return LinesCase(
        prompt=record + QUESTION_TEMPLATE.format(line=lines[asked]),
        expected_number=numbers[target],
        answer=ANSWER_TEMPLATE.format(line=lines[asked], target=lines[target], number=numbers[target]),
        num_lines=len(lines),
        target_line=lines[asked],
    )


def _tokens(tokenizer, text: str, offsets: bool = False):
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=offsets)
    return (encoded["input_ids"], encoded["offset_mapping"]) if offsets else encoded["input_ids"]


def _most_lines(fits, most: int) -> int:
    """The largest ``n`` in ``[1, most]`` with ``fits(n)`` (monotone), by bisection; 0 when none."""
    if not fits(1):
        return 0
    low, high = 1, most
    if fits(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def two_hop_cases_beyond(
    tokenizer, length: int, count: int, beyond: int, seed: int, share: float = 0.25
) -> list[LinesCase]:
    """``count`` cases whose prompt (special tokens included) takes at most ``length`` tokens, with
    as many lines as fit, where BOTH hops lie more than ``beyond`` tokens before the prompt's end:
    the token closing the asked pointer line and the token holding the last digit of the named
    line's number have index ``< P - beyond`` for a prompt of ``P`` tokens. The asked line is
    uniform over the pointer lines that qualify. The same ``seed`` gives the same cases.

    Raises:
        ValueError: ``length`` too short for a two-line prompt, or for any pointer and its target
            to lie ``beyond`` tokens back.
    """
    for name, value in (("length", length), ("count", count), ("beyond", beyond)):
        require_int(name, value)
    rng = np.random.default_rng(seed)
    # a line takes more than 6 tokens ("line", its id, ":", the content, "<", five digits, ">"), so no
    # prompt of `length` tokens holds more lines: the bisection searches up to there, not MAX_LINES
    cap = min(MAX_LINES, length // 6 + 2)
    cases = []
    for _ in range(count):
        lines, numbers = draw_record(rng, cap)
        targets = draw_pointers(rng, cap, share)

        def prompt(n: int) -> str:
            return record_text(lines[:n], numbers[:n], targets[:n])[0] + QUESTION_TEMPLATE.format(line=lines[0])

        most = _most_lines(lambda n: len(_tokens(tokenizer, prompt(n))) <= length, cap)
        case = None
        for n in range(most, 1, -1):
            record, ends = record_text(lines[:n], numbers[:n], targets[:n])
            for asked in (int(i) for i in rng.permutation(n)):
                target = targets[asked]
                if target is None:
                    continue
                ids, offsets = _tokens(tokenizer, record + QUESTION_TEMPLATE.format(line=lines[asked]), offsets=True)
                size = len(ids)
                hops = (token_holding(offsets, ends[asked] - 1), token_holding(offsets, ends[target] - 1))
                if size <= length and max(hops) < size - beyond:
                    case = two_hop_case(lines[:n], numbers[:n], targets[:n], asked)
                    break
            if case is not None:
                break
        if case is None:
            raise ValueError(
                f"length={length} tokens leaves no pointer line and its target more than beyond={beyond} tokens "
                "before the prompt's end; ask for a longer length or a shorter beyond."
            )
        cases.append(case)
    return cases


def fitted_two_hop_document(
    tokenizer, rng: np.random.Generator, seq_len: int, *, min_lines: int, max_lines: int, share: float = 0.25
) -> list[int]:
    """Token ids (special tokens included) of a training document of at most ``seq_len`` tokens: a
    record of a number of lines uniform in ``[max(2, min_lines), max_lines]`` (fewer where it would
    not fit with a question), then questions about distinct pointer lines, each followed by
    ``ANSWER_SEPARATOR`` and its answer (:data:`ANSWER_TEMPLATE`), while they fit. Nothing is cut.

    Raises:
        ValueError: ``seq_len`` too short for two lines, a question and its answer.
    """
    require_int("seq_len", seq_len)
    low = max(2, require_int("min_lines", min_lines))
    if require_int("max_lines", max_lines) < low:
        raise ValueError(f"max_lines={max_lines} is below {low}; a two-hop record needs at least two lines.")
    lines, numbers = draw_record(rng, max_lines)
    drawn = int(rng.integers(low, max_lines + 1))

    def question(asked: int) -> str:
        target = targets[asked]
        answer = ANSWER_TEMPLATE.format(line=lines[asked], target=lines[target], number=numbers[target])
        return QUESTION_TEMPLATE.format(line=lines[asked]) + ANSWER_SEPARATOR + answer

    def with_last_pointer(n: int) -> str | None:
        pointers = [i for i in range(n) if targets[i] is not None]
        return record_text(lines[:n], numbers[:n], targets[:n])[0] + question(pointers[-1]) if pointers else None

    def fits(n: int) -> bool:
        text = with_last_pointer(n)
        return text is not None and len(_tokens(tokenizer, text)) <= seq_len

    # The record must reach its first pointer line and still fit with a question: pointers are
    # drawn again (at most _ATTEMPTS times) while the first comes too late for seq_len.
    for _ in range(_ATTEMPTS):
        targets = draw_pointers(rng, max_lines, share)
        first = next(i for i, t in enumerate(targets) if t is not None) + 1
        if fits(first):
            break
    else:
        first = 0
    limit = max(drawn, first)
    n = _most_lines(lambda m: fits(m + first - 1), limit - first + 1) + first - 1 if first else 0
    if n < 2:
        raise ValueError(
            f"seq_len={seq_len} tokens cannot hold two lines, a two-hop question and its answer with this "
            "tokenizer; ask for a longer seq_len."
        )
    text = record_text(lines[:n], numbers[:n], targets[:n])[0]
    ids = None
    for asked in (int(i) for i in rng.permutation(n)):
        if targets[asked] is None:
            continue
        longer = _tokens(tokenizer, text + question(asked))
        if len(longer) > seq_len:
            continue
        text, ids = text + question(asked), longer
    if ids is None:  # not reached: fits(n) holds for the last pointer line
        raise ValueError("No two-hop question fits the document.")
    return ids
