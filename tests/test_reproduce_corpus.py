"""The reproduction's corpus: longppl_reproduce.common.books (reading the books), corpus_chunks and calibration
on toy arrays, against plain loops written here."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
from helpers import DATA, govreport_texts
from longppl_reproduce.common.books import read_books
from longppl_reproduce.common.calibration import calibrate_alpha, key_token_count
from longppl_reproduce.common.corpus_chunks import body_chunks, null_documents


def toy_books(sizes):
    """Book b holds the ids b * 100000 + position, so every token tells its book and position."""
    return [np.arange(size) + 100000 * b for b, size in enumerate(sizes)]


def test_body_chunks_come_from_bodies_without_overlap_and_repeat_for_a_seed():
    books = toy_books([1000, 2300, 500, 90])
    chunks = body_chunks(books, 50, 40, skip_fraction=0.1, per_book_cap=20, seed=1)
    assert chunks.shape == (40, 50)
    np.testing.assert_array_equal(chunks, body_chunks(books, 50, 40, skip_fraction=0.1, per_book_cap=20, seed=1))
    assert not np.array_equal(chunks, body_chunks(books, 50, 40, skip_fraction=0.1, per_book_cap=20, seed=2))
    per_book = {}
    seen = set()
    for row in chunks:
        book, start = int(row[0]) // 100000, int(row[0]) % 100000
        assert (row == books[book][start : start + 50]).all()  # one contiguous piece of one book
        skipped = math.ceil(0.1 * len(books[book]))
        assert start >= skipped and (start - skipped) % 50 == 0  # on the body's grid: no overlaps
        seen.add((book, start))
        per_book[book] = per_book.get(book, 0) + 1
    assert len(seen) == 40 and all(count <= 20 for count in per_book.values())  # distinct, capped
    # offered: book 0 (1000-100)//50 = 18, book 1 46 capped to 20, book 2 (500-50)//50 = 9, book 3 (90-9)//50 = 1
    assert body_chunks(books, 50, 48, seed=0).shape == (48, 50)
    with pytest.raises(ValueError, match="offer 48 chunks"):
        body_chunks(books, 50, 49, seed=0)


def test_body_chunks_name_the_shortfall():
    books = toy_books([1000, 500])
    # offered: 18 + 9 = 27
    with pytest.raises(ValueError, match=r"The 2 books offer 27 chunks of 50 tokens .* fewer than count=28"):
        body_chunks(books, 50, 28)
    assert body_chunks(books, 50, 27).shape == (27, 50)


def test_null_documents_keep_the_tail_and_take_the_head_from_another_book():
    books = toy_books([400, 300, 350])
    documents = np.stack([books[0][100:160], books[1][50:110], books[0][200:260]])
    own = [0, 1, 0]
    nulls = null_documents(documents, books, keep=20, seed=3, book_of_row=own)
    assert nulls.shape == documents.shape
    np.testing.assert_array_equal(nulls[:, 40:], documents[:, 40:])
    for row in range(3):
        head = nulls[row, :40]
        donor = int(head[0]) // 100000
        assert donor != own[row]
        assert (np.diff(head) == 1).all() and (head // 100000 == donor).all()  # one contiguous donor piece
    np.testing.assert_array_equal(nulls, null_documents(documents, books, keep=20, seed=3, book_of_row=own))
    with pytest.raises(ValueError, match="keep=61 is more than the documents' 60 tokens"):
        null_documents(documents, books, keep=61, seed=0, book_of_row=own)
    with pytest.raises(ValueError, match=r"Row 0 \(book 0\) has no donor book other than its own"):
        null_documents(documents[:1], books[:1], keep=20, seed=0, book_of_row=[0])


def plain_count(lsd, lcl, alpha, beta, mask=None):
    return sum(
        1
        for i, (d, c) in enumerate(zip(lsd, lcl))
        if d > alpha and c > beta and not math.isnan(d) and (mask is None or mask[i])
    )


def test_key_token_count_and_calibration_match_plain_loops():
    rng = np.random.default_rng(0)
    real_lsd = rng.normal(1.0, 1.5, size=400).astype(np.float32)
    real_lcl = rng.normal(-1.0, 1.0, size=400).astype(np.float32)
    null_lsd = rng.normal(0.0, 1.0, size=300).astype(np.float32)
    null_lcl = rng.normal(-1.0, 1.0, size=300).astype(np.float32)
    real_lsd[5] = np.nan
    real_lsd[6], real_lcl[6] = 2.0, 0.0  # exactly on the threshold: not key (strict)
    mask = rng.random(400) < 0.5
    assert key_token_count(real_lsd, real_lcl, 2.0, -2.0) == plain_count(real_lsd, real_lcl, 2.0, -2.0)
    assert key_token_count(real_lsd, real_lcl, 2.0, -2.0, mask) == plain_count(real_lsd, real_lcl, 2.0, -2.0, mask)
    grid = [2.0, 0.0, 0.5, 1.0, 1.5, 2.5]
    result = calibrate_alpha(real_lsd, real_lcl, null_lsd, null_lcl, grid=grid, beta=-2.0, max_null_ratio=0.1)
    rows = []
    for alpha in sorted(grid):
        real, null = plain_count(real_lsd, real_lcl, alpha, -2.0), plain_count(null_lsd, null_lcl, alpha, -2.0)
        rows.append((alpha, real, null))
    assert [(r["alpha"], r["real"], r["null"]) for r in result["table"]] == rows
    assert all(math.isclose(r["ratio"], r["null"] / r["real"]) for r in result["table"])
    expected = next(alpha for alpha, real, null in rows if real > 0 and null <= 0.1 * real)
    assert result["alpha"] == expected and expected > 0.0
    with pytest.raises(
        ValueError, match=r"No alpha of grid \[0.0, 0.5\] keeps null key tokens within max_null_ratio=0.01"
    ):
        calibrate_alpha(real_lsd, real_lcl, null_lsd, null_lcl, grid=[0.5, 0.0], beta=-2.0, max_null_ratio=0.01)
    # a study records the failure instead: no alpha, the same table and sentence
    failed = calibrate_alpha(
        real_lsd, real_lcl, null_lsd, null_lcl, grid=[0.5, 0.0], beta=-2.0, max_null_ratio=0.01, refuse=False
    )
    assert failed["alpha"] is None and failed["failed"].startswith("No alpha of grid [0.0, 0.5]")
    assert [(r["alpha"], r["real"], r["null"]) for r in failed["table"]] == [row for row in rows if row[0] <= 0.5]
    with pytest.raises(ValueError, match="mask must be a bool array"):
        key_token_count(real_lsd, real_lcl, 2.0, -2.0, mask.astype(int))


def test_empty_corpora_are_refused_by_name(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"{empty}.*no documents"):
        read_books(str(empty))
    gz = tmp_path / "empty.jsonl.gz"
    with gzip.open(gz, "wt") as handle:
        handle.write("")
    with pytest.raises(ValueError, match=f"{gz}.*no documents"):
        read_books(str(gz))
    with gzip.open(gz, "wt") as handle:
        handle.write('{"title": "x"}\n')
    with pytest.raises(ValueError, match=f"{gz}, line 1.*'text'"):
        read_books(str(gz))
    with pytest.raises(ValueError, match="No gzipped JSONL file at '.*missing.jsonl.gz'"):
        read_books(str(tmp_path / "missing.jsonl.gz"))


def test_gzipped_jsonl_reads_like_jsonl(tmp_path):
    gz = tmp_path / "books.jsonl.gz"
    with open(DATA, encoding="utf-8") as source, gzip.open(gz, "wt", encoding="utf-8") as target:
        target.write(source.read())
    assert read_books(str(gz)) == list(govreport_texts()) == read_books(DATA)
