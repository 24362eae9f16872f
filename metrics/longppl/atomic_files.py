"""Writing files and directories so that readers see the old content or the new, never a half.

Files: written to a temporary file in the same folder, then renamed over the target
(``os.replace`` is atomic on POSIX and Windows).

Directories (a ``datasets`` cache): written to a temporary directory beside the target, then
swapped in with two renames: target -> ``.<name>.previous``, temporary -> target; the previous
copy is deleted last. A directory cannot be renamed over a non-empty one, so there is a window of
two renames in which the target is missing; :func:`recover_directory` (run before every read and
write) puts the previous copy back if a run died inside that window. An interrupted write
therefore always leaves the previous directory in place or recoverable, and temporary names start
with a dot so that they are not mistaken for results.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import IO


def _umask() -> int:
    """The process's umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(path: str, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have given it (0o666 or 0o777 less the
    umask): ``mkstemp``/``mkdtemp`` create private 0o600/0o700 entries, which would make results and
    caches unreadable to the group that shares them."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def write_file_atomically(
    path: str, write: Callable[[IO], None], newline: str | None = None, binary: bool = False
) -> None:
    """Create or replace the file ``path`` with what ``write(handle)`` writes (UTF-8 text, or bytes)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        text = {} if binary else dict(encoding="utf-8", newline=newline)
        with os.fdopen(fd, "wb" if binary else "w", **text) as handle:
            write(handle)
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _previous(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.previous")


def recover_directory(path: str) -> None:
    """Finish or undo a swap that was interrupted (see the module docstring); no-op otherwise."""
    previous = _previous(path)
    if not os.path.isdir(previous):
        return
    if os.path.exists(path):  # the new copy is in place: the previous one is garbage
        shutil.rmtree(previous, ignore_errors=True)
    else:  # died between the two renames: put the previous copy back
        os.rename(previous, path)


def replace_directory_atomically(path: str, write: Callable[[str], None]) -> None:
    """Create or replace the directory ``path`` with what ``write(tmp_dir)`` puts in ``tmp_dir``.

    ``write`` receives an empty directory on the same file system as ``path``.
    """
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    recover_directory(path)
    tmp = tempfile.mkdtemp(prefix=f".{name}.new-", dir=folder)
    previous = _previous(path)
    try:
        apply_umask(tmp, directory=True)
        write(tmp)
        if os.path.exists(path):
            os.rename(path, previous)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        recover_directory(path)
        raise
    # Readers that memory-mapped the previous copy keep their open files (POSIX unlinks lazily).
    shutil.rmtree(previous, ignore_errors=True)
