r"""The LongEval "lines" benchmark (LongChat, 2023), the long-context retrieval task of the paper's
Sections 3 and 5: generate its test cases, read LongChat's own test-case files, score a model.

A case is a record of ``N`` lines ``line <adjective-noun>: REGISTER_CONTENT is <number>``, then a
question naming one line; the model must answer with that line's number. The prompt reproduces
LongChat's wording; line ids are distinct adjective-noun pairs from the word lists below (LongChat
draws them from ``wonderwords``; shipping the lists keeps the generator offline and reproducible),
numbers are uniform in ``[10000, 50000]`` (five digits; LongChat uses ``1 .. 50000``) and the asked
line is uniform over the record. A case's reference answer (``LinesCase.answer``) is the sentence
``The <REGISTER_CONTENT> in line swift-harbor is <42130>.``; the text a model reads when scored on
the answer is ``prompt + ANSWER_SEPARATOR + answer`` (:func:`case_text`).

Accuracy follows LongChat's LongEval: a case is right when the LAST run of digits in the greedy
continuation of the prompt, read as an integer, equals the expected number
(``int(re.findall(r"\d+", output)[-1]) == int(expected_number)``; :func:`last_number`,
:func:`longchat_correct`, :func:`lines_accuracy`). A continuation without digits is wrong.

Training documents that keep their answers (:func:`fitted_lines_document`) and test cases whose
asked line lies beyond a given distance from the question (:func:`lines_cases_beyond`) are for the
experiment on long-context ability; :func:`answer_log_likelihood` scores the reference answer's
number by teacher forcing.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from longppl.atomic_files import write_file_atomically
from longppl.core.progress import Progress, ProgressCallback
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


def draw_record(rng: np.random.Generator, num_lines: int) -> tuple[list[str], list[str]]:
    """``num_lines`` distinct adjective-noun ids and their numbers (text of five digits, uniform in
    :data:`NUMBER_RANGE`), in record order, drawn from ``rng``; also the keys of the needle task."""
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
    lines, numbers = draw_record(rng, num_lines)
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
    lines, numbers = draw_record(np.random.default_rng(seed), MAX_LINES)

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


def expected_number_text(value, where: str) -> str:
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
    from longppl.commandline.corpus import jsonl_records

    cases = []
    hint = "LongEval lines files need 'prompt' and 'expected_number' on every line."
    for where, record in jsonl_records(path, ("prompt", "expected_number"), hint):
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}, field 'prompt' is {prompt!r:.60}, not a non-empty string.")
        expected = expected_number_text(record["expected_number"], f"{where}, field 'expected_number'")
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


_DIGITS = re.compile(r"\d+")


def last_number(text: str) -> int | None:
    """The last run of digits in ``text`` as an int (LongChat LongEval's reading of an answer:
    ``re.findall(r"\\d+", output)[-1]``); ``None`` when the text holds no digit."""
    runs = _DIGITS.findall(text)
    return int(runs[-1]) if runs else None


def longchat_correct(output: str, expected_number) -> bool:
    """LongChat's rule: the last number of ``output`` (:func:`last_number`) equals
    ``int(expected_number)``; an output without digits is wrong. ``"24160"`` does not answer 2416."""
    found = last_number(output)
    return found is not None and found == int(expected_number)


def _pad_token_id(tokenizer) -> int:
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has neither a pad token nor an EOS token, so prompts of different lengths "
            "cannot be batched; set tokenizer.pad_token."
        )
    return pad_token_id


def greedy_answers(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    progress: bool | ProgressCallback | None = None,
    desc: str = "LongEval lines",
    prefill: str = "batch",
) -> list[str]:
    """The greedy continuation of every prompt, decoded without special tokens (one string per prompt).

    The prompt goes in as plain text with the tokenizer's special tokens (no chat template), in
    batches of ``batch_size`` left-padded prompts (the tokenizer's padding side is restored
    afterwards; a tokenizer without a pad token pads with its EOS token). The model runs in eval
    mode (restored afterwards) on its own device.

    Args:
        progress: ``True`` for a bar over the prompts, or a ``callback(desc, done, total)`` called
            after every batch; ``None``/``False`` for neither.
        prefill: ``"batch"``: ``model.generate`` on the padded batch (its prompts read under an
            attention mask); ``"rows"``: :func:`greedy_token_ids` (each prompt read alone, without
            padding or a mask, window layers in blocks, then the batch decoded together): the same
            greedy rule, up to rounding.
    """
    import torch

    require_int("max_new_tokens", max_new_tokens)
    require_int("batch_size", batch_size)
    if prefill not in ("batch", "rows"):
        raise ValueError(f"prefill={prefill!r}; use 'batch' or 'rows'.")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("No cases to score; pass at least one case.")
    pad_token_id = _pad_token_id(tokenizer)
    reporter = Progress(progress is True, progress if callable(progress) else None, desc=desc, unit="case")
    outputs: list[str] = []
    padding_side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    was_training = getattr(model, "training", False)
    try:
        tokenizer.padding_side = "left"  # generation continues every row from its last column
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.eval()
        with torch.inference_mode(), reporter.steps(len(prompts)) as advance, ThreadPoolExecutor(1) as encoder:
            # the next batch is tokenized on a thread while the model generates this one: a batch of
            # 32k-token prompts took about a sixth of a task's time to encode with the GPU idle, and
            # the fast tokenizer encodes without the GIL. Only that thread encodes.
            def encode(first: int):
                batch = prompts[first : first + batch_size]
                return tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=True)

            upcoming = encoder.submit(encode, 0)
            for start in range(0, len(prompts), batch_size):
                inputs = upcoming.result()
                if start + batch_size < len(prompts):
                    upcoming = encoder.submit(encode, start + batch_size)
                ids, mask = inputs["input_ids"], inputs["attention_mask"]
                if prefill == "rows":
                    rows = [row[keep.bool()] for row, keep in zip(ids, mask)]
                    new_tokens = greedy_token_ids(model, rows, max_new_tokens, pad_token_id).cpu()
                else:
                    new_tokens = padded_greedy_token_ids(model, ids, mask, max_new_tokens, pad_token_id).cpu()
                outputs.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
                advance(len(new_tokens))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = padding_side, pad_token
        model.train(was_training)
    return outputs


def padded_greedy_token_ids(model, input_ids, attention_mask, max_new_tokens: int, pad_token_id: int):
    """``model.generate``'s greedy new tokens of a left-padded batch (``input_ids``, ``attention_mask``:
    ``[batch, n]``, moved to the model's device): ``[batch, m]`` int64 on that device,
    ``m <= max_new_tokens``. What ``greedy_answers(prefill="batch")`` runs."""
    device = _generation_device(model)
    generated = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
    )
    return generated[:, input_ids.shape[1] :]


def _eos_token_ids(model) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # generate's stop rule
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def greedy_token_ids(model, rows, max_new_tokens: int, pad_token_id: int):
    """Greedy new tokens of a batch of prompts of different lengths, each prompt read alone.

    ``model.generate`` on left-padded prompts reads them under an attention mask, which keeps
    PyTorch's attention off its fastest (causal, maskless) kernel for the whole prompt, and runs a
    sliding-window layer (Gemma 3's) as full attention under that mask. Here each prompt is read alone
    (``rows[i]``: ``[n_i]`` token ids) under the library's windowed attention
    (``longppl.core.attention.windowed_attention``: a window layer computed in blocks, the full
    layers causal without a mask); its cache is then left-padded with zeros to the longest prompt
    and the batch decoded together, the padding masked out and every row at its own positions
    (``n_i + t``): what ``generate`` computes for each prompt alone, up to rounding. A window layer's
    cache (its last ``W - 1`` keys) goes into the batch's cache through the cache's own ``update``, so
    it keeps the window's bookkeeping.

    A row stops at an end-of-sequence token of the model's generation config (kept, then
    ``pad_token_id``), and decoding stops when every row has stopped, as ``generate`` does; the
    model's other generation settings (e.g. a repetition penalty) are not applied.

    Returns:
        ``[batch, m]`` int64 new tokens on the model's device, ``m <= max_new_tokens``.
    """
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    from longppl.core.attention import windowed_attention

    # transformers renamed ``past_key_values`` to ``cache`` (argument and output) after 5.17
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    device = _generation_device(model)
    lengths = [len(row) for row in rows]
    longest, count = max(lengths), len(rows)
    with windowed_attention(model):
        per_row, tokens = [], []
        for row in rows:
            out = model(input_ids=torch.as_tensor(row, device=device)[None], use_cache=True, logits_to_keep=1)
            # a window layer holds its last W - 1 keys: left-padded to the longest like a full layer,
            # the window's update keeps the same last ones and counts the padded length
            per_row.append([(layer.keys, layer.values) for layer in getattr(out, name).layers])
            tokens.append(out.logits[0, -1].argmax(-1))
            del out
        # per layer, its keys and then its values: every row's, left-padded on the positions axis
        data = [
            tuple(torch.cat([F.pad(t, (0, 0, longest - t.shape[-2], 0)) for t in part]) for part in zip(*layer))
            for layer in zip(*per_row)
        ]
        del per_row
        cache = DynamicCache(ddp_cache_data=data, config=model.config)
        del data
        eos = torch.tensor(_eos_token_ids(model), device=device, dtype=torch.long)
        mask = torch.zeros(count, longest + max_new_tokens, dtype=torch.long, device=device)
        for i, n in enumerate(lengths):
            mask[i, longest - n : longest] = 1
        positions = torch.tensor(lengths, device=device, dtype=torch.long)[:, None]
        token = torch.stack(tokens)[:, None]
        done = torch.isin(token, eos)
        found = [token]
        for step in range(1, max_new_tokens):
            if bool(done.all()):
                break
            mask[:, longest + step - 1] = 1
            out = model(
                input_ids=token,
                attention_mask=mask[:, : longest + step],
                position_ids=positions + step - 1,
                cache_position=torch.tensor([longest + step - 1], device=device),
                use_cache=True,
                logits_to_keep=1,
                **{name: cache},
            )
            token = torch.where(done, pad_token_id, out.logits[:, -1].argmax(-1, keepdim=True))
            done = done | torch.isin(token, eos)
            found.append(token)
    return torch.cat(found, dim=1)


def scored_answers(outputs: Sequence[str], expected_numbers: Sequence[str]) -> dict:
    """Score generated ``outputs`` against ``expected_numbers`` by :func:`longchat_correct`.

    Returns:
        ``{"accuracy": correct / total, "correct", "total", "outputs", "is_correct": [bool per case],
        "has_number": [bool per case: the output holds any digit]}``.
    """
    outputs = list(outputs)
    is_correct = [longchat_correct(output, expected) for output, expected in zip(outputs, expected_numbers)]
    correct = sum(is_correct)
    return {
        "accuracy": correct / len(outputs),
        "correct": correct,
        "total": len(outputs),
        "outputs": outputs,
        "is_correct": is_correct,
        "has_number": [last_number(output) is not None for output in outputs],
    }


def case_accuracy(
    model,
    tokenizer,
    cases: Sequence,
    *,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    progress: bool | ProgressCallback | None = None,
    desc: str = "LongEval lines",
    prefill: str = "batch",
) -> dict:
    """Greedy answers to cases of any task (objects with ``prompt`` and ``expected_number``, e.g.
    :class:`LinesCase`, ``needle.NeedleCase``; :func:`greedy_answers`), scored by LongChat's rule
    (:func:`longchat_correct`: the last number of the answer equals the expected number).

    Returns:
        ``{"accuracy": correct / total, "correct", "total", "outputs": [generated text per case],
        "is_correct": [bool per case], "has_number": [bool per case: the output holds a number]}``.
    """
    cases = list(cases)
    if not cases:
        raise ValueError("No cases to score; pass at least one case.")
    outputs = greedy_answers(
        model,
        tokenizer,
        [case.prompt for case in cases],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        desc=desc,
        prefill=prefill,
    )
    return scored_answers(outputs, [case.expected_number for case in cases])


def lines_accuracy(model, tokenizer, cases: Sequence[LinesCase], **options) -> dict:
    """LongEval lines accuracy: :func:`case_accuracy` of the cases (same options
    ``max_new_tokens=16``, ``batch_size=8``, ``progress``, ``prefill``, same result)."""
    return case_accuracy(model, tokenizer, cases, **{"desc": "LongEval lines", **options})


def answer_number_span(case: LinesCase, index: int = 0) -> tuple[int, int]:
    """``[start, end)`` characters of the expected number inside the answer of ``case_text(case)``
    (its last occurrence: the answer names the line before the number); ``index`` names the case
    in errors."""
    answer_start = len(case.prompt) + len(ANSWER_SEPARATOR)
    at = case.answer.rfind(case.expected_number)
    if at < 0:
        raise ValueError(
            f"cases[{index}]: the answer {case.answer!r} does not contain the expected number "
            f"{case.expected_number!r}; fix the case's answer or expected_number."
        )
    return answer_start + at, answer_start + at + len(case.expected_number)


def answer_log_likelihood(model, tokenizer, cases: Sequence[LinesCase], *, batch_size: int = 8) -> list[float]:
    """Per case, ``sum_i log P(x_i | x_<i)`` over the tokens ``x_i`` of ``case_text(case)`` (special
    tokens added) whose character span lies inside the expected number's span in the answer
    (:func:`answer_number_span`): the reference number's log-likelihood by teacher forcing.

    Needs a fast tokenizer (character offsets). Cases run in right-padded batches of
    ``batch_size``; the LM head runs at the scored positions only (``longppl.core.logprobs``).

    Raises:
        ValueError: a case without an answer, or whose number no token lies inside (e.g. a
            tokenizer that joins the number with the ``<`` before it).
    """
    import torch

    from longppl.core.logprobs import token_log_probs

    require_int("batch_size", batch_size)
    cases = list(cases)
    if not cases:
        raise ValueError("No cases to score; pass at least one LinesCase.")
    pad_token_id = _pad_token_id(tokenizer)
    encoded = []
    for index, case in enumerate(cases):
        text = case_text(case)
        start, end = answer_number_span(case, index)
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        inside = [a >= start and b <= end and b > a for a, b in enc["offset_mapping"]]
        if not any(inside):
            raise ValueError(
                f"cases[{index}]: no token of {type(tokenizer).__name__} lies inside the number "
                f"{case.expected_number!r} of the answer; use a tokenizer that splits numbers from '<' and '>'."
            )
        encoded.append((enc["input_ids"], inside))
    was_training = getattr(model, "training", False)
    totals: list[float] = []
    try:
        model.eval()
        with torch.inference_mode():
            for first in range(0, len(encoded), batch_size):
                batch = encoded[first : first + batch_size]
                width = max(len(ids) for ids, _ in batch)
                input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
                attention = torch.zeros((len(batch), width), dtype=torch.long)
                scored = torch.zeros((len(batch), width), dtype=torch.bool)
                for row, (ids, inside) in enumerate(batch):
                    input_ids[row, : len(ids)] = torch.tensor(ids)
                    attention[row, : len(ids)] = 1
                    scored[row, : len(ids)] = torch.tensor(inside)
                lp = token_log_probs(model, input_ids, attention, scored).cpu()
                totals.extend(float(lp[row][scored[row]].double().sum()) for row in range(len(batch)))
    finally:
        model.train(was_training)
    return totals


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def token_holding(offsets, char: int) -> int:
    """Index of the token whose character span holds ``char`` (the first such token)."""
    return next(i for i, (a, b) in enumerate(offsets) if a <= char < b)


def _number_end_chars(lines: Sequence[str], numbers: Sequence[str]) -> list[int]:
    """One past the character of the last digit of each line's number in ``_record(lines, numbers)``."""
    ends, at = [], len(PROMPT_HEADER)
    for line, number in zip(lines, numbers):
        text = LINE_TEMPLATE.format(line=line, number=number)
        ends.append(at + text.index(f"<{number}>") + len(number))
        at += len(text)
    return ends


def _question_and_answer(line: str, number: str) -> str:
    return QUESTION_TEMPLATE.format(line=line) + ANSWER_SEPARATOR + ANSWER_TEMPLATE.format(line=line, number=number)


def fitted_lines_document(
    tokenizer,
    rng: np.random.Generator,
    seq_len: int,
    *,
    min_lines: int,
    max_lines: int,
    questions: str | int = "fill",
    asked_within: int | None = None,
) -> list[int]:
    """Token ids (special tokens included) of a training document of at most ``seq_len`` tokens that
    never loses an answer: a record of a number of lines uniform in ``[min_lines, max_lines]``
    (fewer where the record, one question and its answer would not fit), then questions about
    distinct lines, each with its reference answer (``question + ANSWER_SEPARATOR + answer``),
    while they fit: ``questions="fill"`` adds them until the next would not fit, an int ``q``
    adds at most ``q``. Nothing is cut: the document ends with a complete answer.

    ``asked_within=K`` (tokens): a line is asked only if the token holding the last digit of its
    number has index ``>= q - K``, where ``q`` is the index of the token holding the question's
    first character, in the document's own tokenization (its number lies within the ``K`` tokens
    before the question, so answering needs no context beyond ``K`` tokens back).

    Raises:
        ValueError: ``seq_len`` too short for the header, one line, a question and its answer
            (naming both sizes), or ``asked_within`` too short for any line to qualify.
    """
    require_int("seq_len", seq_len)
    require_int("min_lines", min_lines)
    require_int("max_lines", max_lines)
    if max_lines < min_lines:
        raise ValueError(f"max_lines={max_lines} is less than min_lines={min_lines}; give max_lines >= min_lines.")
    limit = None if questions == "fill" else require_int("questions", questions)
    if asked_within is not None:
        require_int("asked_within", asked_within)
    lines, numbers = draw_record(rng, max_lines)
    drawn = int(rng.integers(min_lines, max_lines + 1))

    def asked_candidates(prefix: str, record_lines: int, asked: set[int]) -> list[tuple[list[int], int]]:
        """(ids, line) of documents ``prefix + question/answer`` that fit, lines in random order."""
        ends = _number_end_chars(lines[:record_lines], numbers[:record_lines])
        near = None
        if asked_within is not None:
            # A cheap first cut on the prefix's own tokens (with a token of slack for the boundary),
            # so that only lines near the question are tokenized with it.
            offsets = tokenizer(prefix, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
            cut = len(offsets) - asked_within - 2
            near = {line for line in range(record_lines) if token_holding(offsets, ends[line] - 1) >= cut}
        found = []
        for line in (int(i) for i in rng.permutation(record_lines)):
            if line in asked or (near is not None and line not in near):
                continue
            text = prefix + _question_and_answer(lines[line], numbers[line])
            enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=asked_within is not None)
            if len(enc["input_ids"]) > seq_len:
                continue
            if asked_within is not None:
                offsets = enc["offset_mapping"]
                if token_holding(offsets, ends[line] - 1) < token_holding(offsets, len(prefix)) - asked_within:
                    continue
            found.append((enc["input_ids"], line))
            break  # one fitting question is enough: the lines were shuffled
        return found

    def fits(n: int) -> bool:  # the record of n lines and a question about its last line
        text = _record(lines[:n], numbers[:n]) + _question_and_answer(lines[n - 1], numbers[n - 1])
        return len(_tokens(tokenizer, text)) <= seq_len

    smallest = len(_tokens(tokenizer, _record(lines[:1], numbers[:1]) + _question_and_answer(lines[0], numbers[0])))
    if smallest > seq_len:
        raise ValueError(
            f"seq_len={seq_len} tokens cannot hold the header, one line, a question and its answer ({smallest} "
            "tokens with this tokenizer); ask for a longer seq_len."
        )
    low, high = 1, drawn  # the most lines that fit with a question, by bisection (fits(low) holds)
    if fits(high):
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    for num_lines in range(low, 0, -1):  # fewer lines where no line qualifies (asked_within) or fits
        record = _record(lines[:num_lines], numbers[:num_lines])
        found = asked_candidates(record, num_lines, set())
        if found:
            break
    else:
        raise ValueError(
            f"asked_within={asked_within} tokens is too short for any line's number to lie within it before the "
            "question; ask for a larger asked_within."
        )
    ids, line = found[0]
    asked = {line}
    text = record + _question_and_answer(lines[line], numbers[line])
    while limit is None or len(asked) < limit:
        found = asked_candidates(text, num_lines, asked)
        if not found:
            break
        ids, line = found[0]
        asked.add(line)
        text += _question_and_answer(lines[line], numbers[line])
    return ids


def longest_record(tokenizer, length: int, rng) -> tuple[list[str], list[str], int, Callable[[int, int], str]]:
    """A record drawn with ``rng`` and how much of it a prompt of ``length`` tokens holds:
    ``(lines, numbers, n, prompt)``, where ``prompt(k, target)`` is the first ``k`` lines with the
    question about line ``target`` and ``n`` the most lines whose prompt fits (special tokens
    included; found by bisection).

    Raises:
        ValueError: ``length`` too short for a one-line prompt (naming both sizes).
    """
    lines, numbers = draw_record(rng, MAX_LINES)

    def prompt(n: int, target: int) -> str:
        return _record(lines[:n], numbers[:n]) + QUESTION_TEMPLATE.format(line=lines[target])

    def fits(n: int) -> bool:
        return len(_tokens(tokenizer, prompt(n, 0))) <= length

    if not fits(1):
        raise ValueError(
            f"length={length} tokens is shorter than a one-line prompt ({len(_tokens(tokenizer, prompt(1, 0)))} "
            "tokens with this tokenizer); ask for more tokens."
        )
    low, high = 1, MAX_LINES
    if fits(high):
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return lines, numbers, low, prompt


def lines_cases_beyond(tokenizer, length: int, count: int, beyond: int, seed: int) -> list[LinesCase]:
    """``count`` cases whose prompt (special tokens included) takes at most ``length`` tokens, with
    as many lines as fit, and whose asked line's number lies more than ``beyond`` tokens before the
    prompt's end: every token of the number has index ``< P - beyond`` for a prompt of ``P``
    tokens, so a model reading only the last ``beyond`` tokens cannot see it. The asked line is
    uniform over the lines that qualify. The same ``seed`` gives the same cases.

    Raises:
        ValueError: ``length`` too short for a one-line prompt, or for any line to lie ``beyond``
            tokens back (naming both).
    """
    require_int("length", length)
    require_int("count", count)
    require_int("beyond", beyond)
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        lines, numbers, low, prompt = longest_record(tokenizer, length, rng)
        case = None
        for n in range(low, 0, -1):
            ends = _number_end_chars(lines[:n], numbers[:n])
            for target in (int(i) for i in rng.permutation(n)):
                text = prompt(n, target)
                enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
                size = len(enc["input_ids"])
                if size <= length and token_holding(enc["offset_mapping"], ends[target] - 1) < size - beyond:
                    case = _case(lines[:n], numbers[:n], target)
                    break
            if case is not None:
                break
        if case is None:
            raise ValueError(
                f"length={length} tokens leaves no line more than beyond={beyond} tokens before the prompt's end; "
                "ask for a longer length or a shorter beyond."
            )
        cases.append(case)
    return cases
