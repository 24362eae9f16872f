"""Reading the texts of a corpus to score: a JSONL file, a local ``datasets`` directory, or a Hub dataset.

Every bad record is reported with where it is (file and line, or row) and what to do, before any
model is loaded.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import TYPE_CHECKING

from ..models.sources import Location, locate

if TYPE_CHECKING:  # datasets loads when a dataset is read: longppl-score checks its --corpus before that
    import datasets


def jsonl_records(path: str, fields: tuple[str, ...], hint: str):
    """Yield ``(where, record)`` for every JSON object of a JSONL file (gzip-compressed where its name
    ends in ``.gz``; blank lines are skipped), where ``where`` names the file and line for the
    caller's own messages.

    Raises:
        ValueError: naming the line that is not JSON, not an object, or lacks one of ``fields``
            (``hint`` ends that message: what the file needs, or which flag names the field).
    """
    # Bytes, decoded line by line: a byte that is not UTF-8 is then reported with its line.
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where} is not valid UTF-8 (byte {raw[err.start]:#04x} at byte {err.start + 1} of the line: "
                    f"{err.reason}); save the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where} is not valid JSON ({err.msg}); each line must be one JSON object.") from None
            if not isinstance(record, dict):
                named = " and ".join(repr(field) for field in fields)
                named = f"a {named} field" if len(fields) == 1 else f"the fields {named}"
                raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with {named}.")
            for field in fields:
                if field not in record:
                    raise ValueError(f"{where} has no field {field!r} (its fields: {sorted(record)}); {hint}")
            yield where, record


def read_jsonl_texts(path: str, column: str = "text") -> list[str]:
    """The ``column`` field of every JSON object in a JSONL file (``.jsonl``, or gzipped
    ``.jsonl.gz``; blank lines are skipped).

    Raises:
        ValueError: naming the line that is not JSON, not an object, lacks ``column``, or holds a
            non-string or empty text there.
    """
    return [
        _checked_text(record[column], f"{where}, field {column!r}")
        for where, record in jsonl_records(path, (column,), "name the text field with --text-column.")
    ]


def _checked_text(value, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} is a {type(value).__name__}, not a string; the text column must hold texts.")
    if not value.strip():
        raise ValueError(f"{where} is an empty text; remove it or fill it in.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        # JSON can spell half of a UTF-16 surrogate pair ("\\ud800") alone: valid JSON, but not text,
        # and no tokenizer or cache can hold it.
        raise ValueError(
            f"{where} holds a lone surrogate {value[err.start]!r} at character {err.start}, which is not "
            "text (a JSON escape such as \\ud800 without its other half); fix or remove it."
        ) from None
    return value


def dataset_texts(dataset: datasets.Dataset, column: str, where: str) -> list[str]:
    """The texts of ``column`` of a ``datasets.Dataset``, checked to be non-empty strings."""
    import datasets

    if column not in dataset.column_names:
        raise ValueError(
            f"{where} has no column {column!r} (its columns: {dataset.column_names}); name the text column "
            "with --text-column."
        )
    feature = dataset.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(f"{where}: column {column!r} holds {feature!r}, not strings; pass a column of texts.")
    texts = dataset[column]
    for row, text in enumerate(texts):
        _checked_text(text, f"{where}, row {row} of column {column!r}")
    return texts


CORPUS_HINT = "pass a .jsonl file, a directory written by datasets' save_to_disk, or a Hub dataset id."


def locate_corpus(source: str, argument: str = "corpus") -> Location:
    """Where the corpus ``source`` is, checked without reading it: an existing ``.jsonl`` file or
    directory here, or a Hub dataset id (``sources.locate``; offline or with the Hub unreachable an
    error at once).

    Raises:
        ValueError: naming ``argument`` and ``source``, and what to pass.
    """
    if source.endswith(".jsonl"):
        if not os.path.isfile(source):
            raise ValueError(f"No JSONL file at {source!r}.")
        return Location(source, True, source)
    location = locate(source, "dataset", argument, CORPUS_HINT)
    if location.local and not os.path.isdir(location.path):
        raise ValueError(f"{source!r} is neither a .jsonl file nor a datasets directory.")
    return location


def read_documents(source: str, text_column: str = "text", split: str = "train", argument: str = "corpus") -> list[str]:
    """Texts from a ``.jsonl`` file, a directory saved with ``save_to_disk``, or a Hub dataset id
    (see :func:`locate_corpus`).

    Args:
        split: the split to use when the source holds several (a ``DatasetDict`` or a Hub dataset).
        argument: the argument or flag that named ``source``, for messages (e.g. ``"--corpus"``).
    """
    import datasets

    location = locate_corpus(source, argument)
    if not location.local:
        return dataset_texts(datasets.load_dataset(source, split=split), text_column, f"Hub dataset {source!r}")
    if source.endswith(".jsonl"):
        return read_jsonl_texts(source, text_column)
    try:
        dataset = datasets.load_from_disk(location.path)
    except FileNotFoundError as err:
        raise ValueError(f"{source!r} is not a directory written by datasets' save_to_disk ({err}).") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{source!r} has splits {list(dataset)}, not {split!r}; choose one with --split.")
        dataset = dataset[split]
    return dataset_texts(dataset, text_column, repr(source))
