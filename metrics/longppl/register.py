"""Register the LongPPL metric in evaluate's module cache, so that ``evaluate.load("longppl")`` finds
it by its bare name, offline too::

    python -m longppl.register

How evaluate 0.4.6 resolves a bare name: it looks for ``./longppl/longppl.py``, then asks the Hub
for the Space ``evaluate-metric/longppl``, and when that fails (``HF_EVALUATE_OFFLINE=1``, no
network, or no such Space) loads the most recently written copy in its module cache,
``HF_MODULES_CACHE/evaluate_modules/metrics/evaluate-metric--longppl/<hash>/longppl.py``. This
writes that copy exactly as a download from the Hub would (``longppl.py``, the sibling modules it
imports, evaluate's ``longppl.json`` record; the metric card goes along for reference), under the
hash evaluate itself computes for the same code. ``longppl.py`` is a thin shell that imports no
sibling (the code it runs comes from the installed package), so the copy is that one file, and it
goes stale only when the shell itself changes.

``HF_MODULES_CACHE`` (or ``HF_HOME``) decides where evaluate's module cache is, for this command and
for ``evaluate.load`` alike.

``import longppl`` does the same when needed (:func:`ensure_registered`): it checks cheaply (no
evaluate import, a few file reads) whether the copy evaluate would load is this package's code, and
registers it when it is missing or stale (a one-off that imports evaluate). A cache it cannot write
gives a warning that says what to do, never a failed import; ``LONGPPL_AUTO_REGISTER=0`` turns it
off. It also installs a filter on evaluate's loader log (:class:`CachedCopyNotice`): evaluate's
"Using the latest cached version ... couldn't be found locally ..., or remotely on the Hugging Face
Hub" warning, which reads like a failure, is dropped when the copy is this package's code and
rewritten into a "run ``python -m longppl.register``" warning when it is an older copy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings

# The commands' Ctrl-C handling (standard library only): a command that this import holds up with a
# registration ends on Ctrl-C as the command itself would.
from .commandline.interrupts import exit_if_command_interrupted, is_project_command, keep_interrupts_from_finalizers

# evaluate (which imports torch) is imported inside the functions that need it: the check that runs
# at `import longppl` must stay cheap.

METRIC_NAME = "longppl"
#: Folder holding the metric file longppl.py (this package's folder).
METRIC_DIR = os.path.dirname(os.path.abspath(__file__))
#: evaluate's cache entry for the canonical metric name (the Space id ``evaluate-metric/longppl``).
CACHE_ENTRY = f"evaluate-metric--{METRIC_NAME}"
#: evaluate's folder for dynamic modules inside its module cache (``evaluate.config.MODULE_NAME_FOR_DYNAMIC_MODULES``).
DYNAMIC_MODULES = "evaluate_modules"
#: Set to 0 (or false/no/off) to stop ``import longppl`` from registering the metric.
AUTO_REGISTER_VARIABLE = "LONGPPL_AUTO_REGISTER"


def module_files(folder: str = METRIC_DIR) -> list[str]:
    """``longppl.py`` and the sibling modules it imports, in the order evaluate copies and hashes them.

    Uses evaluate's own import parser, so the list is what ``evaluate.load`` would copy: the direct
    relative imports of ``longppl.py`` (evaluate does not follow imports recursively).
    """
    from evaluate.loading import get_imports

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
    import evaluate

    return str(evaluate.config.HF_MODULES_CACHE)


def modules_cache_location(environ: dict[str, str] | None = None) -> str:
    """Where ``evaluate.load`` will look: :func:`default_modules_cache` without importing evaluate.

    Once evaluate is imported its value wins (it read the environment then); before, the same rule
    from the environment: ``HF_MODULES_CACHE``, else ``HF_HOME/modules``, else
    ``XDG_CACHE_HOME/huggingface/modules``, else ``~/.cache/huggingface/modules``.
    """
    if environ is None and "evaluate" in sys.modules:
        return default_modules_cache()
    environ = os.environ if environ is None else environ
    if environ.get("HF_MODULES_CACHE"):
        return environ["HF_MODULES_CACHE"]
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "modules")


def loaded_copy(modules_cache: str) -> str | None:
    """The folder ``evaluate.load("longppl")`` loads from the module cache (offline, or when the Hub has
    no such Space): the hash folder whose ``longppl.py`` is newest, as evaluate picks it; ``None`` if none."""
    entry = os.path.join(modules_cache, DYNAMIC_MODULES, "metrics", CACHE_ENTRY)
    newest, newest_time = None, None
    try:
        names = os.listdir(entry)
    except OSError:
        return None
    for name in names:
        if len(name) != 64:  # evaluate's rule: hash folders only (not .staging-*, .lock)
            continue
        try:
            modified = os.stat(os.path.join(entry, name, f"{METRIC_NAME}.py")).st_mtime
        except OSError:
            continue
        if newest_time is None or modified > newest_time:
            newest, newest_time = os.path.join(entry, name), modified
    return newest


def is_current(copy: str | None, folder: str = METRIC_DIR) -> bool:
    """Whether the module-cache folder ``copy`` holds exactly this package's metric code: its
    ``longppl.py`` and every sibling module it holds equal, byte for byte, to those in ``folder``.

    Cheap (a few file reads, no evaluate import). ``longppl.py`` decides which siblings a copy needs,
    so an equal ``longppl.py`` with equal siblings is the code a fresh registration would write.
    """
    if copy is None or not os.path.isfile(os.path.join(copy, f"{METRIC_NAME}.py")):
        return False
    for name in os.listdir(copy):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        ours = os.path.join(folder, name)
        try:
            with open(os.path.join(copy, name), "rb") as theirs_file, open(ours, "rb") as ours_file:
                if theirs_file.read() != ours_file.read():
                    return False
        except OSError:  # a module this package no longer has
            return False
    return True


def _not_writable(path: str, reason: str) -> OSError:
    return OSError(
        f"Cannot register the LongPPL metric: evaluate's module cache {path} is not writable ({reason}). "
        "Set HF_MODULES_CACHE to a writable folder (evaluate.load reads the same variable) and run "
        "`python -m longppl.register` again."
    )


def _package_dirs(modules_cache: str) -> str:
    """Create the importable packages down to the cache entry (each with an ``__init__.py``); return the entry."""
    import evaluate

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


def register_metric(modules_cache: str | None = None, folder: str = METRIC_DIR, if_stale: bool = False) -> str:
    """Copy the metric into evaluate's module cache as the newest ``evaluate-metric/longppl``.

    Args:
        modules_cache: evaluate's module cache (default: :func:`default_modules_cache`). A process
            that calls ``evaluate.load("longppl")`` must see the same ``HF_MODULES_CACHE``.
        folder: the metric folder to copy (default: this package's folder).
        if_stale: write only if the copy evaluate would load is not ``folder``'s code (checked under
            the cache entry's lock, so that processes importing longppl together write it once).

    Returns:
        The folder written, ``<modules_cache>/evaluate_modules/metrics/evaluate-metric--longppl/<hash>``.

    Raises:
        OSError: the module cache cannot be written; the message names the path.

    The copy is built in a temporary folder beside its destination and renamed into place, so a
    failure leaves no half-written module for evaluate to load.
    """
    from datasets.utils.filelock import FileLock
    from evaluate.loading import files_to_hash

    modules_cache = os.path.abspath(modules_cache or default_modules_cache())
    files = module_files(folder)
    code_hash = files_to_hash(files)  # the name evaluate gives the same code
    entry = _package_dirs(modules_cache)
    destination = os.path.join(entry, code_hash)
    try:
        # evaluate takes this lock while it copies a module into the same entry.
        with FileLock(entry + ".lock"):
            copy = loaded_copy(modules_cache)
            if if_stale and is_current(copy, folder):
                return copy
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


def _auto_register_enabled() -> bool:
    return os.environ.get(AUTO_REGISTER_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def ensure_registered() -> str | None:
    """Register the metric if the copy ``evaluate.load("longppl")`` would load is missing or stale;
    run by ``import longppl``.

    Returns:
        The copy evaluate loads, or ``None`` when there is none: ``LONGPPL_AUTO_REGISTER=0``, or a
        cache that cannot be written (then a :class:`UserWarning` says what to do).

    Never raises: a failure here must not break ``import longppl``, whose other uses (the scoring
    core, the trainer, ``evaluate.load(longppl.METRIC_PATH)``) do not need the module cache.
    """
    if not _auto_register_enabled():
        return None
    modules_cache = modules_cache_location()
    copy = loaded_copy(modules_cache)
    if is_current(copy):
        return copy
    if is_project_command()[0]:  # registering imports evaluate (seconds): Ctrl-C lands there too
        keep_interrupts_from_finalizers()
    try:
        return register_metric(modules_cache, if_stale=True)
    except KeyboardInterrupt:
        # Registering imports evaluate (seconds), before a command's own Ctrl-C handling runs: a command
        # started by this import ends with its one line (as commandline.running.interruptible ends one).
        # The copy is written atomically, so nothing is half-written either way.
        exit_if_command_interrupted()
        raise
    except Exception as err:  # noqa: BLE001 (see the docstring: warn, never fail the import)
        warnings.warn(
            f"longppl could not register its metric for evaluate.load('longppl') ({err}). "
            f"evaluate.load(longppl.METRIC_PATH) works regardless; for the bare name, set HF_MODULES_CACHE "
            f"to a writable folder and run `python -m longppl.register`. Set {AUTO_REGISTER_VARIABLE}=0 "
            "to skip this at import.",
            stacklevel=3,
        )
        return None


class CachedCopyNotice(logging.Filter):
    """Filter for evaluate's loader log: its "Using the latest cached version of the module from
    ... since it couldn't be found locally at evaluate-metric--longppl, or remotely on the Hugging
    Face Hub" warning is how evaluate always loads the registered metric, not a failure.

    Dropped when the copy is this package's code; rewritten when it is another (older) copy, to
    say so and how to refresh it. Other records pass unchanged.
    """

    PREFIX = "Using the latest cached version of the module from "

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX) or f"{os.sep}{CACHE_ENTRY}{os.sep}" not in message:
            return True
        copy = message[len(self.PREFIX) :].split(" (last modified on ", 1)[0]
        if is_current(copy):
            return False
        record.msg = (
            f"evaluate.load is loading the LongPPL metric registered at {copy}, which is not the code of "
            f"the installed longppl package ({METRIC_DIR}): run `python -m longppl.register` to refresh it, "
            "or load longppl.METRIC_PATH."
        )
        record.args = ()
        return True


def install_log_filter() -> None:
    """Add :class:`CachedCopyNotice` to evaluate's loader logger, once (no evaluate import needed)."""
    logger = logging.getLogger("evaluate.loading")
    if not any(isinstance(f, CachedCopyNotice) for f in logger.filters):
        logger.addFilter(CachedCopyNotice())


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
