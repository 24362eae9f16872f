"""Register the LongPPL metric in evaluate's module cache, so that ``evaluate.load("longppl")`` finds
it by its bare name, offline too::

    python -m longppl.register

How evaluate 0.4.6 resolves a bare name: it looks for ``./longppl/longppl.py``, then asks the Hub
for the Space ``evaluate-metric/longppl``, and when that fails (``HF_EVALUATE_OFFLINE=1``, no
network, or no such Space) loads the most recently written copy in its module cache,
``HF_MODULES_CACHE/evaluate_modules/metrics/evaluate-metric--longppl/<hash>/longppl.py``. This
writes that copy exactly as a download from the Hub would (``longppl.py``, the sibling modules it
imports, evaluate's ``longppl.json`` record; the metric card goes along for reference), under the
hash evaluate itself computes for the same code. The copy is a snapshot: run the command again
after upgrading the package.

``HF_MODULES_CACHE`` (or ``HF_HOME``) decides where evaluate's module cache is, for this command and
for ``evaluate.load`` alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import evaluate
from datasets.utils.filelock import FileLock
from evaluate.loading import files_to_hash, get_imports

METRIC_NAME = "longppl"
#: Folder holding longppl.py and its sibling modules (this package's folder).
METRIC_DIR = os.path.dirname(os.path.abspath(__file__))
#: evaluate's cache entry for the canonical metric name (the Space id ``evaluate-metric/longppl``).
CACHE_ENTRY = f"evaluate-metric--{METRIC_NAME}"


def module_files(folder: str = METRIC_DIR) -> list[str]:
    """``longppl.py`` and the sibling modules it imports, in the order evaluate copies and hashes them.

    Uses evaluate's own import parser, so the list is what ``evaluate.load`` would copy: the direct
    relative imports of ``longppl.py`` (evaluate does not follow imports recursively).
    """
    script = os.path.join(folder, f"{METRIC_NAME}.py")
    files = [script]
    for kind, name, _, _ in get_imports(script):
        if kind == "external":
            raise ValueError(f"{script} imports {name!r} from a URL; the metric must be self-contained.")
        if kind == "internal":
            files.append(os.path.join(folder, f"{name}.py"))
    return files


def default_modules_cache() -> str:
    """evaluate's module cache: ``HF_MODULES_CACHE``, else ``HF_HOME/modules`` (read when evaluate is imported)."""
    return str(evaluate.config.HF_MODULES_CACHE)


def _not_writable(path: str, reason: str) -> OSError:
    return OSError(
        f"Cannot register the LongPPL metric: evaluate's module cache {path} is not writable ({reason}). "
        "Set HF_MODULES_CACHE to a writable folder (evaluate.load reads the same variable) and run "
        "`python -m longppl.register` again."
    )


def _package_dirs(modules_cache: str) -> str:
    """Create the importable packages down to the cache entry (each with an ``__init__.py``); return the entry."""
    entry = os.path.join(modules_cache, evaluate.config.MODULE_NAME_FOR_DYNAMIC_MODULES, "metrics", CACHE_ENTRY)
    try:
        os.makedirs(entry, exist_ok=True)
        folder = entry
        while True:
            init = os.path.join(folder, "__init__.py")
            if not os.path.exists(init):
                open(init, "a").close()  # empty, so there is nothing to half-write
            if folder == modules_cache:
                break
            folder = os.path.dirname(folder)
    except OSError as err:
        raise _not_writable(modules_cache, err.strerror or str(err)) from err
    # Root may write anywhere, so this only catches a read-only cache for other users; their
    # failed writes below are caught too.
    if not os.access(entry, os.W_OK):
        raise _not_writable(modules_cache, f"no write permission on {entry}")
    return entry


def register_metric(modules_cache: str | None = None, folder: str = METRIC_DIR) -> str:
    """Copy the metric into evaluate's module cache as the newest ``evaluate-metric/longppl``.

    Args:
        modules_cache: evaluate's module cache (default: :func:`default_modules_cache`). A process
            that calls ``evaluate.load("longppl")`` must see the same ``HF_MODULES_CACHE``.
        folder: the metric folder to copy (default: this package's folder).

    Returns:
        The folder written, ``<modules_cache>/evaluate_modules/metrics/evaluate-metric--longppl/<hash>``.

    Raises:
        OSError: the module cache cannot be written; the message names the path.

    The copy is built in a temporary folder beside its destination and renamed into place, so a
    failure leaves no half-written module for evaluate to load.
    """
    modules_cache = os.path.abspath(modules_cache or default_modules_cache())
    files = module_files(folder)
    code_hash = files_to_hash(files)  # the name evaluate gives the same code
    entry = _package_dirs(modules_cache)
    destination = os.path.join(entry, code_hash)
    try:
        # evaluate takes this lock while it copies a module into the same entry.
        with FileLock(entry + ".lock"):
            _write_copy(files, folder, destination)
    except OSError as err:
        written = [p for p in (err.filename, err.filename2) if p and os.path.abspath(p).startswith(modules_cache)]
        if written:  # a write into the cache failed (not a missing source file)
            raise _not_writable(modules_cache, err.strerror or str(err)) from err
        raise
    return destination


def _write_copy(files: list[str], folder: str, destination: str) -> None:
    """Build the module folder beside ``destination``, then rename it into place."""
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(destination))  # evaluate skips it
    try:
        for path in files:
            shutil.copyfile(path, os.path.join(staging, os.path.basename(path)))
        card = os.path.join(folder, "README.md")
        if os.path.exists(card):
            shutil.copyfile(card, os.path.join(staging, "README.md"))
        open(os.path.join(staging, "__init__.py"), "a").close()
        record = {"original file path": files[0], "local file path": os.path.join(destination, f"{METRIC_NAME}.py")}
        with open(os.path.join(staging, f"{METRIC_NAME}.json"), "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is shared like evaluate's
        _replace_dir(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_dir(source: str, destination: str) -> None:
    """Rename ``source`` to ``destination``, replacing an older copy (the same code, registered before).

    The fresh copy must win even then: evaluate loads the hash whose ``longppl.py`` is newest.
    """
    if not os.path.exists(destination):
        os.rename(source, destination)
        return
    old = tempfile.mkdtemp(prefix=".replaced-", dir=os.path.dirname(destination))
    os.rename(destination, os.path.join(old, "copy"))
    try:
        os.rename(source, destination)
    except BaseException:
        os.rename(os.path.join(old, "copy"), destination)  # put the old copy back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m longppl.register`` (the cache is chosen by ``HF_MODULES_CACHE``/``HF_HOME``)."""
    argparse.ArgumentParser(
        prog="python -m longppl.register",
        description="Make evaluate.load('longppl') load this installed LongPPL metric, offline too. "
        "evaluate's module cache is $HF_MODULES_CACHE, else $HF_HOME/modules: evaluate.load must see the same.",
    ).parse_args(argv)
    try:
        destination = register_metric()
    except OSError as err:
        sys.exit(str(err))
    print(f"Registered the LongPPL metric at {destination}.")
    print('evaluate.load("longppl") now loads it (also with HF_EVALUATE_OFFLINE=1); run this again after upgrading.')


if __name__ == "__main__":
    main()
