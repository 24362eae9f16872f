"""Claims on the units of a phase, so that processes run side by side on one run folder (one per GPU)
share its units instead of each taking a fixed list.

A claim is an exclusive ``fcntl.flock`` on ``<run>/claims/<phase>/<unit>.lock``, held while the unit
runs. The operating system drops it when its holder ends in any way, a kill included, so a claim never
outlives its process and nothing has to be cleaned up. The lock files stay (a few bytes each) and are
not part of the records a call packs. POSIX only, like the cache's locks; on a network file system
``flock`` needs the server's support.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re


def claim_path(root: str, phase: str, key: str) -> str:
    """``<root>/claims/<phase>/<key>.lock``, ``key``'s characters other than letters, digits, ``.``,
    ``_`` and ``-`` written as ``~`` (a key like ``window-order/gemma-w4k`` names one file)."""
    return os.path.join(root, "claims", phase, re.sub(r"[^\w.-]", "~", key) + ".lock")


@contextlib.contextmanager
def claim(root: str, phase: str, key: str):
    """Hold the claim on ``phase``'s unit ``key`` for the ``with`` block, if no other process holds it.

    Yields:
        ``None`` when the claim is held by this block, else a line naming the holder (its process id
        as it wrote it), for the log.
    """
    path = claim_path(root, phase, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip() or "another process"
            yield f"held by {holder}"
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()}".encode("ascii"), 0)
        try:
            yield None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def held(root: str, phase: str) -> list[str]:
    """The keys (as :func:`claim_path` writes them in file names) of ``phase``'s claims that live
    processes hold now, this process's own included; ``[]`` for a phase never claimed.

    Each lock file is tried with a shared lock that is let go at once, so a process that claims the
    unit at that very instant finds it held, as if by another process, and passes it over once."""
    folder = os.path.join(root, "claims", phase)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".lock"):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(name[: -len(".lock")])
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return found
