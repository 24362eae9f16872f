"""Fixed-length documents cut from books, and null documents for calibration.

A book is a ``[length]`` numpy array of token ids. Chunks come from each book's body (its start,
front matter, credits and contents, is skipped), never overlap, and a few books cannot dominate the
sample (at most ``per_book_cap`` chunks each).
"""

from __future__ import annotations

import numpy as np

from longppl.settings import require_int


def body_chunks(
    books_ids: list[np.ndarray],
    length: int,
    count: int,
    *,
    skip_fraction: float = 0.1,
    per_book_cap: int = 20,
    seed: int = 0,
) -> np.ndarray:
    """``[count, length]`` token ids: non-overlapping chunks from the books' bodies.

    Book ``b`` (``n_b`` tokens) offers the chunks ``[s + k * length, s + (k+1) * length)`` for
    ``s = ceil(skip_fraction * n_b)`` and ``k = 0, 1, ...`` while they end within the book; of
    these, at most ``per_book_cap`` are drawn at random per book, then ``count`` of all those at
    random; rows are in (book, position) order. The same ``seed`` gives the same chunks.

    Raises:
        ValueError: fewer than ``count`` chunks on offer (naming both numbers).
    """
    require_int("length", length)
    require_int("count", count)
    require_int("per_book_cap", per_book_cap)
    if not 0 <= skip_fraction < 1:
        raise ValueError(f"skip_fraction={skip_fraction!r} must lie in [0, 1); it is the share of each book skipped.")
    rng = np.random.default_rng(seed)
    offered: list[tuple[int, int]] = []  # (book, start)
    for book, ids in enumerate(books_ids):
        size = len(ids)
        first = int(np.ceil(skip_fraction * size))
        starts = np.arange(first, size - length + 1, length)
        if starts.size > per_book_cap:
            starts = np.sort(rng.choice(starts, size=per_book_cap, replace=False))
        offered.extend((book, int(start)) for start in starts)
    if len(offered) < count:
        raise ValueError(
            f"The {len(books_ids)} books offer {len(offered)} chunks of {length} tokens (skipping the first "
            f"{skip_fraction:g} of each, at most {per_book_cap} per book), fewer than count={count}; add books, "
            "or ask for fewer or shorter chunks."
        )
    chosen = np.sort(rng.choice(len(offered), size=count, replace=False))
    return np.stack([np.asarray(books_ids[offered[i][0]][offered[i][1] : offered[i][1] + length]) for i in chosen])


def null_documents(
    documents: np.ndarray, donors: list[np.ndarray], keep: int, seed: int, book_of_row: list[int]
) -> np.ndarray:
    """``[n, L]`` documents that keep each row's last ``keep`` tokens and take its first ``L - keep``
    tokens from another book.

    Index convention: row ``r`` of the result is ``donor[s : s + L - keep]`` followed by
    ``documents[r, L - keep :]``, where the donor is ``donors[j]`` for a ``j != book_of_row[r]``
    drawn at random and ``s`` a random start. So for every kept token at position ``t >= L - keep``,
    everything more than ``t - (L - keep)`` tokens back, i.e. beyond its window of ``keep`` tokens,
    is unrelated text.

    Args:
        documents: ``[n, L]`` token ids.
        donors: the books (``[length]`` token ids each), indexed as ``book_of_row``.
        keep: tokens kept at the end of each row, ``1 <= keep <= L``.
        book_of_row: ``[n]`` the index into ``donors`` of each row's own book.
    Raises:
        ValueError: a bad ``keep``, no donor other than a row's own book that is long enough.
    """
    documents = np.asarray(documents)
    if documents.ndim != 2:
        raise ValueError(f"documents must be [n, L] token ids, got shape {documents.shape}.")
    n, width = documents.shape
    require_int("keep", keep)
    if keep > width:
        raise ValueError(f"keep={keep} is more than the documents' {width} tokens; keep at most {width}.")
    if len(book_of_row) != n:
        raise ValueError(f"book_of_row has {len(book_of_row)} entries for {n} rows; give each row's book.")
    need = width - keep
    rng = np.random.default_rng(seed)
    result = documents.copy()
    for row, own in enumerate(book_of_row):
        candidates = [j for j, donor in enumerate(donors) if j != own and len(donor) >= need]
        if not candidates:
            raise ValueError(
                f"Row {row} (book {own}) has no donor book other than its own with {need} tokens; add donors."
            )
        donor = donors[candidates[int(rng.integers(len(candidates)))]]
        start = int(rng.integers(len(donor) - need + 1))
        result[row, :need] = donor[start : start + need]
    return result
