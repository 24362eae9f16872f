"""The reproduction's corpus: books read as a list of texts.

Both pipelines (``population``, and ``longce_comparison`` through it) train and evaluate on books
given as a ``.jsonl`` / ``.jsonl.gz`` file or anything ``longppl.commandline.corpus.read_documents`` reads.
Gzipped JSONL, the form the GPU runs' books travel in, is read by ``read_jsonl_texts`` (with its
checks of every line); ``read_documents`` takes the forms a ``longppl-score --corpus`` names.
"""

from __future__ import annotations

import os

from longppl.commandline.corpus import read_documents, read_jsonl_texts


def read_books(source: str, text_column: str = "text") -> list[str]:
    """The texts of a corpus, in file order: a ``.jsonl.gz`` file (one JSON object per line, blank
    lines skipped), or what ``longppl.commandline.corpus.read_documents`` reads (a ``.jsonl`` file, a
    datasets directory, a Hub dataset id).

    Args:
        source: the corpus's path or Hub id.
        text_column: the field of each record that holds its text.

    Returns:
        One non-empty string per book.

    Raises:
        ValueError: a missing ``.jsonl.gz`` file, a line that is not an object with a non-empty
            ``text_column`` (naming the file, the line and the fields it has), an empty corpus.
    """
    if source.endswith(".jsonl.gz"):
        if not os.path.isfile(source):
            raise ValueError(f"No gzipped JSONL file at {source!r}.")
        texts = read_jsonl_texts(source, text_column)
    else:
        texts = read_documents(source, text_column)
    if not texts:
        raise ValueError(f"The corpus {source!r} holds no documents: give a corpus with texts in {text_column!r}.")
    return texts
