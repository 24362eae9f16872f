"""The reproduction's corpus: books read as a list of texts.

Both pipelines (``population``, and ``longce_comparison`` through it) train and evaluate on books
given as a ``.jsonl`` / ``.jsonl.gz`` file or anything ``longppl.tools.corpus.read_documents`` reads.
Gzipped JSONL, the form the GPU runs' books travel in, is read here, line by line: ``read_documents``
takes plain ``.jsonl`` only.
"""

from __future__ import annotations

import gzip
import json
import os


def read_books(source: str, text_column: str = "text") -> list[str]:
    """The texts of a corpus, in file order: a ``.jsonl.gz`` file (one JSON object per line, blank
    lines skipped), or what ``longppl.tools.corpus.read_documents`` reads (a ``.jsonl`` file, a
    datasets directory, a Hub dataset id).

    Args:
        source: the corpus's path or Hub id.
        text_column: the field of each record that holds its text.

    Returns:
        One string per book (non-empty for ``.jsonl.gz``; ``read_documents``' rules otherwise).

    Raises:
        ValueError: a missing ``.jsonl.gz`` file, a line that is not an object with a non-empty
            ``text_column`` (naming the file, the line and the fields it has), an empty corpus.
    """
    if source.endswith(".jsonl.gz"):
        if not os.path.isfile(source):
            raise ValueError(f"No gzipped JSONL file at {source!r}.")
        texts = []
        with gzip.open(source, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                text = record.get(text_column) if isinstance(record, dict) else None
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(
                        f"{source}, line {number}: no non-empty string field {text_column!r} "
                        f"(fields: {sorted(record) if isinstance(record, dict) else type(record).__name__})."
                    )
                texts.append(text)
    else:
        from longppl.tools.corpus import read_documents

        texts = read_documents(source, text_column)
    if not texts:
        raise ValueError(f"The corpus {source!r} holds no documents: give a corpus with texts in {text_column!r}.")
    return texts
