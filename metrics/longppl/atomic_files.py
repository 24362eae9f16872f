"""Writing files and directories so that readers see the old content or the new, never a half.

Files: written to a temporary file in the same folder, flushed to the disk (``fsync``), then
renamed over the target (``os.replace`` is atomic on POSIX and Windows), and the folder flushed
too: after a power loss the target holds the old content or the new, never a name pointing to
bytes that were still in the page cache.

Directories (a ``datasets`` cache): written to a temporary directory beside the target, then
swapped in with two renames: target -> ``.<name>.previous``, temporary -> target (every file of
the new copy flushed before the first rename, the parent folder after the second); the previous
copy is deleted last. A directory cannot be renamed over a non-empty one, so there is a window of
two renames in which the target is missing; :func:`recover_directory` (run before every read and
write) puts the previous copy back if a run died inside that window. An interrupted write
therefore always leaves the previous directory in place or recoverable, and temporary names start
with a dot so that they are not mistaken for results.

Concurrent writers of one directory are serialised by :func:`directory_lock` (``fcntl.flock`` on
``.<name>.lock`` beside it; readers may take it shared so that they never see a swap half done).
The lock is advisory and POSIX only (where ``fcntl`` is missing, e.g. on Windows, it is a no-op);
on a network file system it is as good as the file system's ``flock`` (Linux NFS maps it to
byte-range locks). Temporary directories are named ``.<name>.<kind>-<host>-<pid>-<random>``
(:func:`owned_temp_dir`), so that a later write can tell a dead writer's leftovers (same host,
process gone) from a live writer's and remove only the former (:func:`remove_stale_temp_dirs`);
leftovers of another host, or without an owner in their name, are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; writers are then not serialised
    fcntl = None


def _umask() -> int:
    """The process's umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(path: str) -> None:
    """Give the file ``path`` the mode a plain ``open`` would have given it (0o666 less the umask):
    ``mkstemp`` creates private 0o600 files, which would make results unreadable to the group that
    shares them. (Directories are made with ``os.mkdir``, which honours the umask itself.)"""
    os.chmod(path, 0o666 & ~_umask())


def fsync_path(path: str) -> None:
    """Flush the file or folder ``path`` to the disk (``os.fsync``). A folder is flushed so that the
    names created, renamed or removed in it survive a power loss; file systems that cannot flush a
    folder (``EINVAL``, ``ENOTSUP``: some network and FUSE file systems) are let be."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file and folder under ``folder`` (and ``folder`` itself) to the disk, files first."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(os.path.join(root, name))
        fsync_path(root)


def write_file_atomically(
    path: str, write: Callable[[IO], None], newline: str | None = None, binary: bool = False
) -> None:
    """Create or replace the file ``path`` with what ``write(handle)`` writes (UTF-8 text, or bytes).

    A ``path`` that is a symbolic link is written through, as ``open(path, "w")`` would: the temporary
    file goes beside the link's target and is renamed onto it, so the link stays a link (to new
    content). A loop of links is an ``OSError`` (``ELOOP``), before anything is written. The file is
    flushed to the disk before the rename and its folder after it (:func:`fsync_path`), so that a
    power loss never leaves the name on bytes that were not written.
    """
    if os.path.islink(path):
        path = os.path.realpath(path)
        if os.path.islink(path):  # realpath stops where a loop of links begins
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        text = {} if binary else dict(encoding="utf-8", newline=newline)
        with os.fdopen(fd, "wb" if binary else "w", **text) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder)


def cannot_create(path: str, folder: bool = False) -> str | None:
    """Why ``path`` cannot be created or replaced (a file, or with ``folder`` a folder), as the end of a
    sentence about it (``"is inside '/x/f', which is a file"``); ``None`` when nothing stands in the way.

    Checked before the work whose result goes there, so that a command fails in a second instead of
    after hours of scoring: a path at or under a loop of symbolic links, under a file, a folder where
    a file is wanted (or a file where a folder is), and a first existing folder (where the missing
    ones would be created) that this user cannot write. Links are followed, as a write follows them.
    """
    target = os.path.abspath(path)
    here = target
    while True:
        try:
            mode = os.stat(here).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):  # not there yet, or a file above it (found next)
            pass
        except OSError as err:
            if err.errno == errno.ELOOP:
                return f"goes through a loop of symbolic links ({here})"
            return f"cannot be looked up: {err.strerror or err} ({here})"
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
    if here == target:
        if stat.S_ISDIR(mode) != folder:
            return "is a folder" if not folder else "is a file"
        where = here if folder else os.path.dirname(here)
    elif not stat.S_ISDIR(mode):
        return f"is inside {here!r}, which is a file"
    else:
        where = here
    if not os.access(where, os.W_OK | os.X_OK):
        return f"cannot be written: this user may not create files in {where!r}"
    return None


def _previous(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.previous")


def swap_interrupted(path: str) -> bool:
    """Whether a swap of ``path`` is under way or was interrupted (its previous copy is still there)."""
    return os.path.isdir(_previous(path))


def recover_directory(path: str) -> None:
    """Finish or undo a swap that was interrupted (see the module docstring); no-op otherwise."""
    previous = _previous(path)
    if not os.path.isdir(previous):
        return
    if os.path.exists(path):  # the new copy is in place: the previous one is garbage
        shutil.rmtree(previous, ignore_errors=True)
    else:  # died between the two renames: put the previous copy back
        os.rename(previous, path)


def _lock_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.lock")


@contextlib.contextmanager
def directory_lock(path: str, shared: bool = False, optional: bool = False) -> Iterator[bool]:
    """Hold the advisory lock of the directory ``path`` (which need not exist) for the ``with`` body.

    Args:
        shared: a reader's lock (any number at once); otherwise exclusive (one writer, no readers).
        optional: where the lock file cannot be created (a read-only folder), go on without the
            lock instead of raising (for readers of a cache they cannot write anyway).
    Yields:
        whether the lock is held.

    The lock file ``.<name>.lock`` is removed by the last holder, so a folder is left as it was.
    Removing it is safe because every taker checks, once locked, that the name still refers to
    the file it locked (else someone removed it meanwhile and it tries again).
    Not re-entrant: a process that holds the lock must not take it again (it would wait forever).
    """
    if fcntl is None:
        yield False
        return
    lock = _lock_path(path)
    if shared and not os.path.isdir(os.path.dirname(lock)):  # nothing there to read: create no folders
        yield False
        return
    while True:
        try:
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            # read-only suffices for flock: another user's lock file (mode 0o644) can be locked too
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError as err:
            if optional and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                yield False
                return
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            held = os.fstat(fd)
            named = _stat_or_none(lock)
        except BaseException:
            os.close(fd)
            raise
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the holder before us removed that file: lock the one at the name now
    try:
        yield True
    finally:
        try:
            # The last holder removes the file; a reader holds it shared, so it tries to become the
            # only holder first (without waiting) and leaves the file if someone else holds it.
            if not shared or _try_exclusive(fd):
                named = _stat_or_none(lock)
                if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                    with contextlib.suppress(OSError):  # e.g. another user's file in a sticky folder: harmless
                        os.unlink(lock)
        finally:
            os.close(fd)  # releases the lock


def _try_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _stat_or_none(path: str):
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def owned_temp_name(path: str, kind: str) -> str:
    """A fresh name ``.<name>.<kind>-<host>-<pid>-<random>`` beside ``path`` (not created), owned by
    this process: :func:`remove_stale_temp_dirs` removes it only once this process is gone."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{kind}-{_host()}-{os.getpid()}-{os.urandom(6).hex()}")


def owned_temp_dir(path: str, kind: str) -> str:
    """Create and return an empty directory :func:`owned_temp_name` beside ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    while True:
        tmp = owned_temp_name(path, kind)
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def remove_stale_temp_dirs(path: str) -> list[str]:
    """Remove the temporary directories beside ``path`` whose owner (see :func:`owned_temp_name`)
    ran on this host and is gone; return them. Others' (live, other hosts, unnamed) stay."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(name)}\.[a-z]+-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[0-9a-f]+")
    removed = []
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return removed
    host = _host()
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None or match["host"] != host or _process_alive(int(match["pid"])):
            continue
        shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
        removed.append(os.path.join(folder, entry))
    return removed


def replace_directory_atomically(path: str, write: Callable[[str], None]) -> None:
    """Create or replace the directory ``path`` with what ``write(tmp_dir)`` puts in ``tmp_dir``.

    ``write`` receives an empty directory on the same file system as ``path``. Stale temporary
    directories of dead writers are removed first. Concurrent writers must hold
    :func:`directory_lock` around this (and around whatever they read to compute the new content).
    """
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    recover_directory(path)
    remove_stale_temp_dirs(path)
    tmp = owned_temp_dir(path, "new")
    previous = _previous(path)
    try:  # owned_temp_dir's os.mkdir already honours the umask (unlike mkdtemp)
        write(tmp)
        fsync_tree(tmp)  # the new copy's bytes are on the disk before any name points to them
        if os.path.exists(path):
            os.rename(path, previous)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        recover_directory(path)
        raise
    fsync_path(folder)
    # Readers that memory-mapped the previous copy keep their open files (POSIX unlinks lazily).
    shutil.rmtree(previous, ignore_errors=True)
