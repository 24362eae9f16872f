"""Worker of test_cache_reliability.py: one process writing rows into a key-token cache.

    python tests/distributed/cache_writer_worker.py CACHE WRITER ROWS ROUNDS BARRIER_DIR WRITERS [--die-in-save]

Per round: opens CACHE (``create=True``), waits until all WRITERS processes have opened it (a file
barrier in BARRIER_DIR, so that every writer reads the same old cache before any writes: the race
that lost rows), adds ROWS rows of synthetic scores (texts ``writer W round R row i``) and saves.
``--die-in-save`` kills the process (SIGKILL) inside its first save, after the new copy is
written and before it is swapped in. ``--append`` commits the rows as a shard
(``append_rows``) instead of adding and saving.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from longppl.cache.key_token_cache import KeyTokenCache, KeyTokenSettings, append_rows, key_token_rows
from longppl.core.scoring import EvaluatorScores
from longppl.models.fingerprints import ModelIdentity

IDENTITY = ModelIdentity("writer-test", "", "float32", "weights:" + "0" * 64)
SETTINGS = KeyTokenSettings(4, 2)


def synthetic_rows(
    texts: list[str], seed: int, identity: ModelIdentity = IDENTITY, settings: KeyTokenSettings = SETTINGS
):
    """Cache rows for ``texts`` with random (but valid-shaped) scores."""
    rng = np.random.default_rng(seed)
    scores = []
    for text in texts:
        n = len(text)
        offsets = np.stack([np.arange(n), np.arange(n) + 1], axis=1)
        lp_long = rng.normal(size=n).astype(np.float32)
        lp_short = rng.normal(size=n).astype(np.float32)
        lp_long[0], lp_short[: settings.trunc_len] = np.nan, np.nan
        scores.append(EvaluatorScores(rng.integers(0, 500, n), offsets, lp_long, lp_short))
    return key_token_rows(texts, scores, settings, identity)


def writer_texts(writer: int, round_: int, rows: int) -> list[str]:
    """The texts writer ``writer`` adds in round ``round_``."""
    return [f"writer {writer} round {round_} row {i}: " + "x" * (20 + i) for i in range(rows)]


def all_texts(writers: int, rounds: int, rows: int) -> set[str]:
    """Every text the writers add over all rounds."""
    return {text for w in range(writers) for r in range(rounds) for text in writer_texts(w, r, rows)}


def wait_for_all(barrier: str, name: str, writers: int, timeout: float = 3600.0) -> None:
    """Wait until ``writers`` processes have reached the barrier ``name``. ``timeout``: a hang guard only,
    far above any start of the writers (the tests' ``helpers.HANG_GUARD_S``), never a limit on speed."""
    open(os.path.join(barrier, f"{name}.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(entry.startswith(name + ".") for entry in os.listdir(barrier)) < writers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hang guard: barrier {name}: not all {writers} writers arrived within {timeout:g} s (a hang, not a "
                "wrong result)"
            )
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    path, writer, rows, rounds, barrier, writers = argv[:6]
    writer, rows, rounds, writers = int(writer), int(rows), int(rounds), int(writers)
    if "--die-in-save" in argv:
        import longppl.cache.storage as module

        def die(folder):
            os.kill(os.getpid(), signal.SIGKILL)

        module._write_checksums = die
    for round_ in range(rounds):
        cache = KeyTokenCache.load(path, create=True)
        wait_for_all(barrier, f"round{round_}", writers)
        texts = writer_texts(writer, round_, rows)
        if "--append" in argv:
            append_rows(path, synthetic_rows(texts, seed=1000 * writer + round_))
            continue
        cache.add(synthetic_rows(texts, seed=1000 * writer + round_))
        cache.save()


if __name__ == "__main__":
    main(sys.argv[1:])
