"""The task documents of the LongPPL study on real models, with a real tokenizer.

Per length ``L`` (4k-32k tokens) and short context ``K``, from the shared generators:

- ``lines-beyond-L``: LongEval lines cases whose asked number lies more than ``K`` tokens before
  the prompt's end (``lines.lines_cases_beyond``): only a model that reads beyond ``K`` answers.
- ``lines-within-L``: the same task at the same length with the asked number among the last ``K``
  tokens (:func:`lines_cases_within`): the covariate that measures everything but the reach.
- ``needle-L``: multi-key needles in a held-out book, the asked one beyond ``K``
  (``needle.make_needle_cases``).
- ``recall-L``: passage recall in held-out books, the span beyond ``K``
  (``passage_recall.passage_recall_cases``; teacher forced, no generation).

Each set is written once as JSONL under ``<run>/tasks/<tokenizer>/`` by the shared writers
(temporary file, then rename) and read back by every later call.
"""

from __future__ import annotations

import os

import numpy as np

from ..common import lines as lines_task
from ..common import needle as needle_task
from ..common import passage_recall


def lines_cases_within(tokenizer, length: int, count: int, within: int, seed: int) -> list:
    """``count`` lines cases whose prompt takes at most ``length`` tokens (as many lines as fit)
    and whose asked number lies among the prompt's last ``within`` tokens (its last token has index
    ``>= P - within`` for a prompt of ``P`` tokens): the lines task of ``lines_cases_beyond`` with
    the answer inside the short context. The same ``seed`` gives the same cases.

    Raises:
        ValueError: ``length`` too short for a one-line prompt.
    """
    from ..common.lines import _case, _number_end_chars, longest_record, token_holding

    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        record_lines, numbers, low, prompt = longest_record(tokenizer, length, rng)
        ends = _number_end_chars(record_lines[:low], numbers[:low])
        # the last lines are the ones within reach; try them from the end
        for target in range(low - 1, -1, -1):
            enc = tokenizer(prompt(low, target), add_special_tokens=True, return_offsets_mapping=True)
            size = len(enc["input_ids"])
            if token_holding(enc["offset_mapping"], ends[target] - 1) >= size - within:
                candidates = [
                    t
                    for t in range(target, -1, -1)
                    if token_holding(enc["offset_mapping"], ends[t] - 1) >= size - within
                ]
                cases.append(_case(record_lines[:low], numbers[:low], int(rng.choice(candidates))))
                break
        else:
            raise ValueError(f"no line of a {length}-token prompt lies within its last {within} tokens.")
    return cases


def with_answer_opening(case):
    """``case`` (a lines case) whose prompt goes on with the reference answer up to the number (``... I
    need the number. The <REGISTER_CONTENT> in line swift-harbor is <``), so that a model's
    greedy continuation is the number itself. Gemma 3 270M and SmolLM2-135M-Instruct, without a
    chat template, answer LongEval's bare question with more record text ("Now the record is
    over"), even with the line inside the short context; given the opening, they answer with
    numbers."""
    import dataclasses

    opening = case.answer[: case.answer.rfind(case.expected_number)]
    return dataclasses.replace(case, prompt=case.prompt + lines_task.ANSWER_SEPARATOR + opening)


def task_sets(lengths, count: int, short: int) -> list[tuple[str, str, int]]:
    """``(name, kind, length)`` of every task set: lines beyond and within ``short``, needle and
    recall, at each of ``lengths``."""
    found = []
    for length in lengths:
        found += [
            (f"lines-beyond-{length}", "lines-beyond", length),
            (f"lines-within-{length}", "lines-within", length),
        ]
        found += [(f"needle-{length}", "needle", length), (f"recall-{length}", "recall", length)]
    return found


def build_task_set(kind: str, tokenizer, length: int, count: int, short: int, books_ids: list, seed: int) -> list:
    """The cases of one set (see the module docstring); ``books_ids``: held-out books' token ids."""
    if kind == "lines-beyond":
        return lines_task.lines_cases_beyond(tokenizer, length, count, short, seed)
    if kind == "lines-within":
        return lines_cases_within(tokenizer, length, count, short, seed)
    if kind == "needle":
        haystack = max(books_ids, key=len)
        return needle_task.make_needle_cases(tokenizer, haystack, length, count, beyond=short, seed=seed)
    if kind == "recall":
        return passage_recall.passage_recall_cases(books_ids, length, short, count, seed)
    raise ValueError(f"Unknown task kind {kind!r}.")


_WRITERS = {
    "lines": (lines_task.write_lines_cases, lines_task.read_lines_cases),
    "needle": (needle_task.write_needle_cases, needle_task.read_needle_cases),
    "recall": (passage_recall.write_passage_recall_cases, passage_recall.read_passage_recall_cases),
}


def task_cases(folder: str, name: str, kind: str, build) -> list:
    """The cases of set ``name`` in ``folder``: read if written, else ``build()`` and written."""
    path = os.path.join(folder, f"{name}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        _WRITERS[_family(kind)][0](path, build())
    return read_task_set(path, kind)


def read_task_set(path: str, kind: str | None = None) -> list:
    """The cases of a written task set (``task_cases``' files, e.g. ``tasks/gemma/lines-beyond-32768.jsonl``);
    ``kind`` (``lines-beyond``, ``needle``, ``recall`` ...) defaults to the file name's (:func:`kind_of`)."""
    return _WRITERS[_family(kind or kind_of(path), path)][1](path)


def kind_of(path: str) -> str:
    """The task kind a set's file name gives: ``lines-beyond-32768.jsonl`` -> ``lines-beyond``."""
    return os.path.splitext(os.path.basename(path))[0].rsplit("-", 1)[0]


def as_scored(kind: str, cases: list) -> list:
    """``cases`` of a ``kind`` set as the studies score them: a lines prompt goes on with its answer's
    opening (:func:`with_answer_opening`); the other kinds are read as written."""
    return [with_answer_opening(c) for c in cases] if kind.startswith("lines") else list(cases)


def _family(kind: str, path: str | None = None) -> str:
    family = kind.split("-")[0]
    if family not in _WRITERS:
        where = f" (from {path!r})" if path else ""
        raise ValueError(
            f"Unknown task kind {kind!r}{where}; a task set is one of {sorted(_WRITERS)}, as in lines-beyond-32768.jsonl."
        )
    return family
