"""Atomic writes keep the permissions a plain write would give (the umask), so results and caches can
be shared; and a failed write leaves nothing behind."""

import os
import stat

import pytest
from helpers import HANG_GUARD_S

from longppl.atomic_files import replace_directory_atomically, write_file_atomically


@pytest.fixture
def umask():
    def set_mask(mask):
        os.umask(mask)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


@pytest.mark.parametrize(
    "mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775), (0o077, 0o600, 0o700)]
)
def test_files_and_directories_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    target = tmp_path / "results.json"
    write_file_atomically(str(target), lambda handle: handle.write("{}"))
    assert stat.S_IMODE(target.stat().st_mode) == file_mode

    def write(folder):
        with open(os.path.join(folder, "state.json"), "w") as handle:
            handle.write("{}")

    cache = tmp_path / "cache"
    replace_directory_atomically(str(cache), write)
    assert stat.S_IMODE(cache.stat().st_mode) == dir_mode
    assert stat.S_IMODE((cache / "state.json").stat().st_mode) == file_mode


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def fail(handle):
        handle.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_file_atomically(str(target), fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_directory_lock_excludes_writers_admits_readers_together_and_leaves_no_file(tmp_path):
    import threading
    import time

    from longppl.atomic_files import directory_lock

    path = str(tmp_path / "cache")
    events, held = [], threading.Event()

    def writer():
        with directory_lock(path):
            held.set()
            time.sleep(0.3)
            events.append("first writer out")

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait()
    with directory_lock(path):  # waits for the first writer
        events.append("second writer in")
    thread.join()
    assert events == ["first writer out", "second writer in"]
    assert os.listdir(tmp_path) == []

    reading, done, released = threading.Event(), threading.Event(), []

    def reader():
        with directory_lock(path, shared=True):
            reading.set()
            # held until the second reader is done; a second reader that waited for this one would be
            # released only by the hang guard, which the assertion below then names
            released.append("by the test" if done.wait(HANG_GUARD_S) else f"by the hang guard ({HANG_GUARD_S:g} s)")

    thread = threading.Thread(target=reader)
    thread.start()
    reading.wait()
    with directory_lock(path, shared=True) as locked:  # a second reader does not wait for the first
        assert locked and os.listdir(tmp_path) == [".cache.lock"]
    done.set()
    thread.join()
    assert released == ["by the test"]
    assert os.listdir(tmp_path) == []  # the last reader removed the file
    with directory_lock(str(tmp_path / "missing" / "cache"), shared=True) as locked:
        assert not locked
    assert os.listdir(tmp_path) == []  # a reader creates no folders
