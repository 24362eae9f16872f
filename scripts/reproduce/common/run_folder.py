"""The output folder of one experiment run: its paths, atomic JSON files, stage timings, and the
"done" checks that make every stage resumable (a stage skips what a finished file says is done).

Every JSON record a run reads back goes through :func:`read_record`: a file that is not JSON (cut
off, edited), not an object, or lacks a key the run reads is a ``ValueError`` naming the file and
saying what to do (delete it, and the stage that writes it computes it again), which the commands
report as one line."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager

from longppl.atomic_files import directory_lock, write_file_atomically
from longppl.models.sources import require_path

#: Sums of wall seconds per stage and per model, over every call that did work.
TIMINGS = "timings.json"
#: Nothing is computed from the timings: without the file, only earlier calls' wall times are lost.
TIMINGS_REMEDY = "delete it and run again (only the wall times of the calls before are lost)"


def jsonable(value):
    """``value`` with NaN / infinities as ``None`` (JSON has no NaN), tuples as lists and NumPy
    scalars and arrays as Python numbers and lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finite(value) -> bool:
    """Whether a number read back from a run's JSON files is defined: not ``None`` (what
    :func:`jsonable` writes for NaN and infinities), NaN or infinite."""
    return value is not None and math.isfinite(value)


#: What to do about a record that cannot be read: without it, the stage that wrote it runs again.
REDO = "delete it and run again, and the stage that writes it computes it again"


class Record(dict):
    """A JSON object read by :func:`read_record`: a key it lacks is a ``ValueError`` naming its file (a
    record edited by hand, or written by another version of the code), not a bare ``KeyError``."""

    def __init__(self, values=(), path: str = "", remedy: str = REDO):
        super().__init__(values)
        self.path, self.remedy = path, remedy

    def __missing__(self, key):
        raise ValueError(
            f"{self.path} has no {key!r} where the run reads one (its keys: {sorted(self)}): {self.remedy}."
        )


def read_record(path: str, check=None, remedy: str = REDO) -> Record:
    """The JSON object in the file ``path``, checked as it is read: every JSON file a run reads back
    (its stages' records, ``timings.json``, the models' training records) is read here.

    Args:
        path: the file (it exists: the callers check, to name the stage that writes it).
        check: ``check(record) -> problem or None``: its shape beyond being an object (``None``: none).
        remedy: what to do about a record that cannot be used, ending the error.
    Returns:
        the object, and every object nested in it, as a :class:`Record`.
    Raises:
        ValueError: ``<path> is not JSON (<problem>: line L, column C): <remedy>.`` for a file cut off
            or not text, ``<path> has the wrong shape: <problem>: <remedy>.`` for valid JSON that is
            not an object or fails ``check``.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle, object_hook=lambda found: Record(found, path, remedy))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err.msg}: line {err.lineno}, column {err.colno}): {remedy}.") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not JSON (not UTF-8 text at byte {err.start}): {remedy}.") from None
    problem = f"a JSON {type(value).__name__}, not an object" if not isinstance(value, dict) else None
    problem = problem or (check(value) if check is not None else None)
    if problem:
        raise ValueError(f"{path} has the wrong shape: {problem}: {remedy}.")
    return value


def _timings_problem(timings: dict) -> str | None:
    """What is wrong with ``timings.json``'s ``{group: {name: {"seconds": number, "calls": integer}}}``."""
    for group, entries in timings.items():
        if not isinstance(entries, dict):
            return f"{group!r} holds a {type(entries).__name__}, not {{name: {{seconds, calls}}}}"
        for name, entry in entries.items():
            seconds, calls = (entry.get(key) if isinstance(entry, dict) else None for key in ("seconds", "calls"))
            if not (isinstance(seconds, (int, float)) and isinstance(calls, int)):
                return f"{group}.{name} = {entry!r}, not {{seconds: number, calls: integer}}"
    return None


class RunFolder:
    """Paths below ``root`` (created if missing; nothing in it is ever deleted), atomic JSON
    read/write, and wall-time records.

    Args:
        root: the run's output folder.
        log: where progress lines go (``print`` by default).
    """

    def __init__(self, root: str, log=print):
        self.root = os.path.abspath(require_path(root, "--output-dir", "the run's folder, e.g. repro2/"))
        self.log = log
        existing = self.root
        while not os.path.exists(existing):  # the folder, or the nearest one above it that exists
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            where = "is a file" if existing == self.root else f"lies below {existing}, which is a file"
            raise ValueError(f"--output-dir {root!r} {where}, not a folder: give a folder (created if missing).")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as err:
            raise ValueError(
                f"--output-dir {root!r} cannot be created ({err.strerror or err}): give a folder you can write."
            ) from None

    def path(self, *parts: str) -> str:
        """``root/parts...``, its parent folder created."""
        path = os.path.join(self.root, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def has(self, *parts: str) -> bool:
        """Whether the file ``root/parts...`` exists (files are written atomically: existing means complete)."""
        return os.path.isfile(os.path.join(self.root, *parts))

    def read_json(self, *parts: str, check=None, remedy: str = REDO) -> Record:
        """The JSON object in ``root/parts...`` (:func:`read_record`: one that is not JSON, not an
        object or fails ``check`` is an error naming it); a clear error naming the stage to run when
        it is missing."""
        path = os.path.join(self.root, *parts)
        if not os.path.isfile(path):
            raise ValueError(f"No {os.path.join(*parts)} in {self.root}: run the stage that writes it first.")
        return read_record(path, check, remedy)

    def write_json(self, value, *parts: str) -> str:
        """Write ``value`` (made JSON-safe by :func:`jsonable`) to ``root/parts...`` atomically."""
        path = self.path(*parts)
        write_file_atomically(path, lambda handle: json.dump(jsonable(value), handle, indent=1))
        return path

    def write_report(self, results: dict, markdown: str) -> dict:
        """Write ``results.json`` (``results``, made JSON-safe) and ``report.md`` (``markdown``, built
        from those results), each atomically; returns ``results``."""
        self.write_json(results, "results.json")
        write_file_atomically(self.path("report.md"), lambda handle: handle.write(markdown))
        self.log(f"report: {self.path('results.json')}, {self.path('report.md')}")
        return results

    def add_seconds(self, group: str, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``timings.json[group][name]`` (``seconds`` and ``calls`` summed over calls).

        Safe for several processes working on one folder (e.g. one per GPU, each on its own seeds):
        the read-add-write holds the file's exclusive lock (``longppl.atomic_files.directory_lock``,
        whose lock file goes with its last holder), so no process's entry is lost.
        """
        with directory_lock(self.path(TIMINGS)):
            timings = self.timings()
            entry = timings.setdefault(group, {}).setdefault(name, {"seconds": 0.0, "calls": 0})
            entry["seconds"] += seconds
            entry["calls"] += 1
            self.write_json(timings, TIMINGS)

    @contextmanager
    def timed(self, group: str, name: str):
        """Time the block and add it to ``timings.json[group][name]`` (only when it finishes)."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.add_seconds(group, name, seconds)
        self.log(f"[{group} {name}] {seconds:.1f}s")

    def run_stages(self, stages, run_stage):
        """Run ``run_stage(name)`` for each name of ``stages`` in order, each timed under
        ``timings.json["stage"]``; returns what the ``report`` stage returned (``None`` without one)."""
        results = None
        for stage in stages:
            self.log(f"== stage {stage}")
            with self.timed("stage", stage):
                value = run_stage(stage)
            results = value if stage == "report" else results
        return results

    def timings(self) -> dict:
        """``timings.json`` (``{}`` before the first timed call), its shape checked."""
        if not self.has(TIMINGS):
            return {}
        return self.read_json(TIMINGS, check=_timings_problem, remedy=TIMINGS_REMEDY)


def write_jsonl(path: str, records: list[dict]) -> None:
    """``records`` as a JSONL file at ``path``, one object a line, written atomically."""
    write_file_atomically(path, lambda handle: handle.writelines(json.dumps(r) + "\n" for r in records))


def read_texts(path: str) -> list[str]:
    """The texts of a JSONL file this run wrote (``write_jsonl``), a bad line named by its file and line."""
    from longppl.commandline.corpus import jsonl_records

    return [record["text"] for _, record in jsonl_records(path, ("text",), f"delete {path} and run again.")]
