"""What a run folder of the real-models studies has done, and what its phases do next: the records
file of each phase (one JSON line per finished unit), a phase's time budget, and the units still
pending, shared by claims among processes side by side on one run folder (``claims``)."""

from __future__ import annotations

import json
import os
import time


class Records:
    """A JSONL records file of one phase: rows appended whole (write, flush, fsync), each with a
    ``key`` that names its unit. A line cut short by a kill is dropped on the next open (its unit
    is done again), so the file never holds half a row."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
            if data and not data.endswith(b"\n"):
                with open(path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)

    def rows(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def keys(self) -> set[str]:
        return {row["key"] for row in self.rows()}

    def append(self, key: str, row: dict) -> None:
        """Append one row: a single ``write`` to a file opened with ``O_APPEND``, so that processes
        scoring members side by side (one per GPU) append whole rows to the same file."""
        data = (json.dumps({"key": key, **row}, allow_nan=True) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"wrote {written} of {len(data)} bytes of a row to {self.path}; is the disk full?")
            os.fsync(fd)
        finally:
            os.close(fd)


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def spent(self) -> bool:
        return time.monotonic() - self.start > self.seconds

    def left(self) -> float:
        """Seconds left (negative once spent)."""
        return self.seconds - (time.monotonic() - self.start)


def pending(run, phase: str, records: Records, budget: Budget, units, done=None, said: set | None = None):
    """Yield the ``(key, unit)`` pairs of ``units`` not done yet, until the budget is spent (then say
    so: the next call goes on). ``run``: a ``phases.Run`` (its ``root`` and ``log``).

    Processes side by side on one run folder (one per GPU) share the units: each unit is claimed
    (``claims.claim``) for as long as the caller works on it, i.e. until it asks for the next one, and a
    unit claimed by another process, or done since this one looked, is left. ``done``: a function
    returning the keys done (default: the keys ``records`` holds), asked again once a unit is claimed.
    ``said``: the log lines this process wrote before, for a caller that asks again and again (each
    line is written once, then added to it).
    """
    from .claims import claim

    finished = records.keys if done is None else done
    seen = finished()
    for key, unit in units:
        if key in seen:
            say_once(run, said, f"{phase}: {key} kept")
            continue
        if budget.spent():
            run.log(f"{phase}: budget spent; call again")
            return
        with claim(run.root, phase, key) as holder:
            if holder is not None:
                say_once(run, said, f"{phase}: {key} {holder}; left to it")
                continue
            if key in finished():
                run.log(f"{phase}: {key} done by another process")
                continue
            yield key, unit


def say_once(run, said: set | None, line: str, tail: str = "") -> None:
    """Log ``line`` + ``tail`` unless ``said`` (the lines this process logged before, for a caller
    that asks the same again and again) holds ``line``; then add it. ``said`` None: always log."""
    if said is None or line not in said:
        run.log(line + tail)
    if said is not None:
        said.add(line)
