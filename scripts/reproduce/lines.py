"""The LongEval "lines" benchmark (LongChat, 2023), the long-context retrieval task of the paper's
Sections 3 and 5: generate its test cases, read LongChat's own test-case files, score a model.

A case is a record of ``N`` lines ``line <adjective-noun>: REGISTER_CONTENT is <number>``, then a
question naming one line; the model must answer with that line's number. The prompt reproduces
LongChat's wording; line ids are distinct adjective-noun pairs from the word lists below (LongChat
draws them from ``wonderwords``; shipping the lists keeps the generator offline and reproducible),
numbers are uniform in ``[10000, 50000]`` (five digits; LongChat uses ``1 .. 50000``) and the asked
line is uniform over the record. A case's reference answer (``LinesCase.answer``) is the sentence
``The <REGISTER_CONTENT> in line swift-harbor is <42130>.``; the text a model reads when scored on
the answer is ``prompt + ANSWER_SEPARATOR + answer`` (:func:`case_text`).

Accuracy follows LongChat: a case is right when the expected number appears in the greedy
continuation of the prompt (:func:`lines_accuracy`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longppl.atomic_files import write_file_atomically
from longppl.progress import Progress, ProgressCallback
from longppl.settings import require_int

PROMPT_HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
    "contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, "
    "memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the "
    "corresponding <REGISTER_CONTENT> of a certain line index. Now the record start:\n\n"
)
LINE_TEMPLATE = "line {line}: REGISTER_CONTENT is <{number}>\n"
QUESTION_TEMPLATE = (
    "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {line}? I need the number."
)
ANSWER_TEMPLATE = "The <REGISTER_CONTENT> in line {line} is <{number}>."
#: Between a prompt (which ends with the question) and its reference answer.
ANSWER_SEPARATOR = " "
#: The registers' numbers are drawn uniformly from this closed range (five digits).
NUMBER_RANGE = (10000, 50000)

ADJECTIVES = (
    "amber", "ancient", "bold", "brave", "bright", "calm", "clever", "cold", "crimson", "curly",
    "dark", "eager", "early", "fancy", "fierce", "gentle", "golden", "grand", "green", "happy",
    "hidden", "hollow", "humble", "icy", "jolly", "kind", "lazy", "little", "lively", "lucky",
    "misty", "noble", "odd", "pale", "proud", "quick", "quiet", "rapid", "rusty", "shiny",
    "silent", "silver", "sleepy", "smooth", "steady", "sunny", "swift", "tiny", "wild", "young",
)  # fmt: skip
NOUNS = (
    "anchor", "apple", "badge", "basket", "beacon", "bridge", "cabin", "candle", "canyon", "castle",
    "cloud", "comet", "desert", "dragon", "falcon", "feather", "forest", "garden", "glacier", "harbor",
    "island", "jungle", "kettle", "lantern", "meadow", "mirror", "mountain", "needle", "ocean", "orchard",
    "otter", "palace", "pebble", "piano", "planet", "pond", "rabbit", "river", "rocket", "saddle",
    "shadow", "spring", "summit", "temple", "thunder", "tiger", "tower", "valley", "violin", "willow",
)  # fmt: skip
#: How many distinct line ids the word lists give: the longest record :func:`make_lines_case` makes.
MAX_LINES = len(ADJECTIVES) * len(NOUNS)

# The question of a LongChat prompt, to recover the asked line from files that do not name it.
_QUESTION = re.compile(r"Tell me what is the <REGISTER_CONTENT> in line (\S+)\? I need the number\.\s*$")


@dataclass(frozen=True)
class LinesCase:
    """One test case.

    Attributes:
        prompt: the record and the question (the model's whole input).
        expected_number: the asked line's number, as text (e.g. ``"42130"``).
        answer: the reference answer (:data:`ANSWER_TEMPLATE`), ``None`` when unknown.
        num_lines: ``N``, lines in the record, ``None`` when unknown.
        target_line: the asked line's id (e.g. ``"swift-harbor"``), ``None`` when unknown.
    """

    prompt: str
    expected_number: str
    answer: str | None = None
    num_lines: int | None = None
    target_line: str | None = None


def case_text(case: LinesCase) -> str:
    """The prompt followed by its reference answer: ``prompt + ANSWER_SEPARATOR + answer``; the
    answer starts at character ``len(case.prompt)`` (the separator included)."""
    if case.answer is None:
        raise ValueError(
            "This LinesCase has no reference answer (answer=None); build cases with generate_lines_cases, or "
            "read files whose prompts end with LongChat's question, so that the answer can be written."
        )
    return case.prompt + ANSWER_SEPARATOR + case.answer


def _line_id(index: int) -> str:
    """Line id ``index`` in ``0 .. MAX_LINES-1``: an adjective-noun pair."""
    return f"{ADJECTIVES[index // len(NOUNS)]}-{NOUNS[index % len(NOUNS)]}"


def _draw_record(rng: np.random.Generator, num_lines: int) -> tuple[list[str], list[str]]:
    """``num_lines`` distinct line ids and their numbers (as text), in record order."""
    require_int("num_lines", num_lines)
    if num_lines > MAX_LINES:
        raise ValueError(
            f"num_lines={num_lines} is more than the {MAX_LINES} distinct adjective-noun line ids of the word "
            "lists; ask for fewer lines."
        )
    ids = rng.choice(MAX_LINES, size=num_lines, replace=False)
    numbers = rng.integers(NUMBER_RANGE[0], NUMBER_RANGE[1] + 1, size=num_lines)
    return [_line_id(int(i)) for i in ids], [str(int(n)) for n in numbers]


def _record(lines: Sequence[str], numbers: Sequence[str]) -> str:
    return PROMPT_HEADER + "".join(LINE_TEMPLATE.format(line=line, number=n) for line, n in zip(lines, numbers))


def _case(lines: Sequence[str], numbers: Sequence[str], target: int) -> LinesCase:
    line, number = lines[target], numbers[target]
    return LinesCase(
        prompt=_record(lines, numbers) + QUESTION_TEMPLATE.format(line=line),
        expected_number=number,
        answer=ANSWER_TEMPLATE.format(line=line, number=number),
        num_lines=len(lines),
        target_line=line,
    )


def make_lines_case(num_lines: int, rng: np.random.Generator) -> LinesCase:
    """One case of ``num_lines`` lines, drawn from ``rng`` (a ``numpy.random.Generator``).

    Line ids are distinct, numbers uniform in :data:`NUMBER_RANGE`, the asked line uniform over
    the record.
    """
    lines, numbers = _draw_record(rng, num_lines)
    return _case(lines, numbers, int(rng.integers(num_lines)))


def generate_lines_cases(num_lines: int, num_cases: int, seed: int) -> list[LinesCase]:
    """``num_cases`` cases of ``num_lines`` lines each; the same ``seed`` gives the same cases."""
    require_int("num_cases", num_cases)
    rng = np.random.default_rng(seed)
    return [make_lines_case(num_lines, rng) for _ in range(num_cases)]


def lines_for_token_length(tokenizer, target_tokens: int, seed: int = 0) -> int:
    """The largest ``N`` whose prompt and reference answer (:func:`case_text`, special tokens
    included) take at most ``target_tokens`` tokens of ``tokenizer``.

    Approximate per case: lengths are measured on one record drawn from ``seed`` (the cases with
    ``N`` lines grow by one line at a time, asking the first line, so the length grows with ``N``
    and the binary search is exact for that record). Other cases of ``N`` lines differ by the
    tokens of their own line ids and numbers (within about 1.5% of the length for 30 cases of the
    tests' byte-level BPE), so a case may run slightly past ``target_tokens``: leave a margin where
    a hard limit matters (a model's maximum length).

    Raises:
        ValueError: ``target_tokens`` is too small for a single line, or not an integer >= 1.
    """
    require_int("target_tokens", target_tokens)
    lines, numbers = _draw_record(np.random.default_rng(seed), MAX_LINES)

    def length(n: int) -> int:
        text = case_text(_case(lines[:n], numbers[:n], 0))
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    if length(1) > target_tokens:
        raise ValueError(
            f"target_tokens={target_tokens} is shorter than a one-line case ({length(1)} tokens with this "
            "tokenizer); ask for more tokens."
        )
    low, high = 1, MAX_LINES  # invariant: length(low) <= target_tokens
    if length(high) <= target_tokens:
        return high
    while high - low > 1:  # invariant also: length(high) > target_tokens
        middle = (low + high) // 2
        if length(middle) <= target_tokens:
            low = middle
        else:
            high = middle
    return low


def lines_training_document(rng: np.random.Generator, num_lines: int, num_questions: int = 1) -> str:
    """A training document in the test format: a record of ``num_lines`` lines, then
    ``num_questions`` questions about distinct lines, each followed by its reference answer
    (``question + ANSWER_SEPARATOR + answer``), for training small models on the task."""
    require_int("num_questions", num_questions)
    lines, numbers = _draw_record(rng, num_lines)
    if num_questions > num_lines:
        raise ValueError(f"num_questions={num_questions} is more than the {num_lines} lines to ask about.")
    asked = rng.choice(num_lines, size=num_questions, replace=False)
    return _record(lines, numbers) + "".join(
        QUESTION_TEMPLATE.format(line=lines[i])
        + ANSWER_SEPARATOR
        + ANSWER_TEMPLATE.format(line=lines[i], number=numbers[i])
        for i in (int(k) for k in asked)
    )


def _expected_number(value, where: str) -> str:
    """The ``expected_number`` field as text of digits (LongChat writes an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{where} is a {type(value).__name__} ({value!r}), not a number or a string of digits.")
    text = str(value).strip()
    if not text.isdigit():
        raise ValueError(f"{where} is {value!r}, not a non-negative whole number; write the expected number.")
    return text


def read_lines_cases(path: str) -> list[LinesCase]:
    """Test cases from a JSONL file with LongChat's LongEval fields: ``prompt`` (a string) and
    ``expected_number`` (a number, or a string of digits) on every line; ``num_lines`` is kept when
    it is an integer. Blank lines are skipped. Where the prompt ends with LongChat's question, the
    asked line and the reference answer are filled in (the answer-token analysis needs them).

    Raises:
        ValueError: naming the file and line of a record that is not a JSON object, lacks a field,
            or holds a bad value there; or an empty file.
    """
    from longppl.tools.corpus import jsonl_records

    cases = []
    hint = "LongEval lines files need 'prompt' and 'expected_number' on every line."
    for where, record in jsonl_records(path, ("prompt", "expected_number"), hint):
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}, field 'prompt' is {prompt!r:.60}, not a non-empty string.")
        expected = _expected_number(record["expected_number"], f"{where}, field 'expected_number'")
        num_lines = record.get("num_lines")
        num_lines = num_lines if isinstance(num_lines, int) and not isinstance(num_lines, bool) else None
        asked = _QUESTION.search(prompt)
        target = asked.group(1) if asked else None
        answer = None if target is None else ANSWER_TEMPLATE.format(line=target, number=expected)
        cases.append(LinesCase(prompt, expected, answer, num_lines, target))
    if not cases:
        raise ValueError(f"{path} holds no test cases (it is empty); write one JSON object per line.")
    return cases


def write_lines_cases(path: str, cases: Sequence[LinesCase]) -> None:
    """Write cases as a LongChat-format JSONL file (atomically): ``prompt``, ``expected_number``
    (an int, as LongChat writes it; a string where that would drop leading zeros), and ``num_lines`` / ``target_line`` where known. Reading it
    back with :func:`read_lines_cases` gives the same cases."""
    records = []
    for case in cases:
        number = case.expected_number
        record = {"prompt": case.prompt, "expected_number": int(number) if str(int(number)) == number else number}
        if case.num_lines is not None:
            record["num_lines"] = case.num_lines
        if case.target_line is not None:
            record["target_line"] = case.target_line
        records.append(json.dumps(record, ensure_ascii=False) + "\n")
    write_file_atomically(path, lambda handle: handle.writelines(records))


def _generation_device(model):
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return "cpu"


def lines_accuracy(
    model,
    tokenizer,
    cases: Sequence[LinesCase],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    progress: bool | ProgressCallback | None = None,
) -> dict:
    """Greedy answers to the cases and their accuracy (LongChat's rule: the expected number
    appears in the generated continuation).

    The prompt goes in as plain text with the tokenizer's special tokens (no chat template), in
    batches of ``batch_size`` left-padded prompts (the tokenizer's padding side is restored
    afterwards; a tokenizer without a pad token pads with its EOS token). The model runs in eval
    mode (restored afterwards) on its own device.

    Args:
        progress: ``True`` for a bar over the cases, or a ``callback(desc, done, total)`` called
            after every batch; ``None``/``False`` for neither.
    Returns:
        ``{"accuracy": correct / total, "correct", "total", "outputs": [generated text per case],
        "is_correct": [bool per case]}``.
    """
    import torch

    require_int("max_new_tokens", max_new_tokens)
    require_int("batch_size", batch_size)
    cases = list(cases)
    if not cases:
        raise ValueError("No cases to score; pass at least one LinesCase.")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has neither a pad token nor an EOS token, so prompts of different lengths "
            "cannot be batched; set tokenizer.pad_token."
        )
    reporter = Progress(progress is True, progress if callable(progress) else None, desc="LongEval lines", unit="case")
    device = _generation_device(model)
    outputs: list[str] = []
    padding_side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    was_training = getattr(model, "training", False)
    try:
        tokenizer.padding_side = "left"  # generation continues every row from its last column
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.eval()
        with torch.inference_mode(), reporter.steps(len(cases)) as advance:
            for start in range(0, len(cases), batch_size):
                prompts = [case.prompt for case in cases[start : start + batch_size]]
                inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True)
                generated = model.generate(
                    input_ids=inputs["input_ids"].to(device),
                    attention_mask=inputs["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_token_id,
                )
                new_tokens = generated[:, inputs["input_ids"].shape[1] :].cpu()
                outputs.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
                advance(len(prompts))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = padding_side, pad_token
        model.train(was_training)
    is_correct = [case.expected_number in output for case, output in zip(cases, outputs)]
    correct = sum(is_correct)
    return {
        "accuracy": correct / len(cases),
        "correct": correct,
        "total": len(cases),
        "outputs": outputs,
        "is_correct": is_correct,
    }
