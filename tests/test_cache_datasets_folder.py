"""A key-token cache folder is a ``datasets`` folder after every commit: ``datasets.load_from_disk``
opens it as it is (no compaction first) and gives the rows ``KeyTokenCache.load`` gives, after 1, 2
and N commits, after compaction, after a kill between any two steps of a commit (from every layout
a cache can have, earlier versions' included), and the rerun resumes. Commits flush their files to
the disk before naming them."""

import contextlib
import hashlib
import json
import os
import shutil

import datasets
import pytest
from datasets.arrow_writer import ArrowWriter
from distributed.cache_writer_worker import synthetic_rows

from longppl import atomic_files
from longppl.cache.key_token_cache import CACHE_FEATURES, CHECKSUM_FILE, KeyTokenCache, append_rows, compact_cache
from longppl.cache.shards import MANIFEST_FILE, RECORD_KEY, SHARD_FOLDER, STATE_FILE


def texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document {i}: " + "z" * (12 + i) for i in range(n)]


def rows_of(dataset: datasets.Dataset) -> list[tuple]:
    """Every column of every row, in order (NaN compared as text, as ``repr`` writes it)."""
    return [tuple(repr(row[name]) for name in CACHE_FEATURES) for row in dataset]


def assert_datasets_reads_the_cache(path: str, expected_texts: list[str]) -> None:
    """``datasets.load_from_disk`` gives the cache's rows: those ``KeyTokenCache.load`` gives, in order."""
    ours = KeyTokenCache.load(path).dataset
    theirs = datasets.load_from_disk(path)
    assert theirs["text"] == ours["text"] == expected_texts
    assert theirs.features == CACHE_FEATURES and rows_of(theirs) == rows_of(ours)


def file_sha256(file: str) -> str:
    with open(file, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def earlier_version_cache(path: str, base: datasets.Dataset | None, shards: list[datasets.Dataset]) -> None:
    """A cache folder as earlier versions wrote it: a ``save_to_disk`` base with a checksum file that
    lists every file, ``state.json`` included, and shards named in ``longppl_shards.json`` (version 1)."""
    os.makedirs(path)
    if base is not None:
        base.save_to_disk(path)
        files = {name: {"bytes": os.path.getsize(os.path.join(path, name)), "sha256": file_sha256(os.path.join(path, name))} for name in sorted(os.listdir(path))}  # fmt: skip
        with open(os.path.join(path, CHECKSUM_FILE), "w", encoding="utf-8") as handle:
            json.dump({"algorithm": "sha256", "files": files}, handle, indent=1, sort_keys=True)
    entries = []
    for index, rows in enumerate(shards):
        os.makedirs(os.path.join(path, SHARD_FOLDER), exist_ok=True)
        name = f"{SHARD_FOLDER}/{index + 1:016x}-{'0' * 12}.arrow"
        writer = ArrowWriter(features=CACHE_FEATURES, path=os.path.join(path, name))
        writer.write_table(rows.data.table)
        writer.finalize()
        writer.close()
        file = os.path.join(path, name)
        entries.append(dict(file=name, rows=len(rows), bytes=os.path.getsize(file), sha256=file_sha256(file)))
    if entries:
        with open(os.path.join(path, MANIFEST_FILE), "w", encoding="utf-8") as handle:
            json.dump({"format": "longppl-shards", "version": 1, "shards": entries}, handle, indent=1)


def test_load_from_disk_opens_the_cache_after_1_2_and_n_commits_and_after_compaction(tmp_path):
    path = str(tmp_path / "cache")
    expected = []
    for commit in range(5):
        new = texts(f"commit{commit}", 1 + commit % 3)
        append_rows(path, synthetic_rows(new, seed=commit))
        expected += new
        assert_datasets_reads_the_cache(path, expected)  # after 1, 2, ..., 5 commits
    append_rows(path, synthetic_rows(texts("commit0", 1), seed=0))  # a key committed twice (two runs at once)
    assert len(datasets.load_from_disk(path)) == len(expected) + 1
    summary = compact_cache(path)
    assert (summary["rows_before"], summary["rows"], summary["shards"]) == (len(expected) + 1, len(expected), 6)
    assert_datasets_reads_the_cache(path, expected)
    append_rows(path, synthetic_rows(texts("after", 2), seed=9))  # shards on top of the compacted base
    assert_datasets_reads_the_cache(path, expected + texts("after", 2))
    # a later save by the metric (a merge into one base) too
    cache = KeyTokenCache.load(path)
    cache.add(synthetic_rows(texts("metric", 1), seed=10))
    cache.save()
    assert_datasets_reads_the_cache(path, expected + texts("after", 2) + texts("metric", 1))


def test_a_shard_file_that_was_never_committed_is_not_read_by_datasets_either(tmp_path):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))
    [entry] = json.load(open(os.path.join(path, STATE_FILE), encoding="utf-8"))[RECORD_KEY]["shards"]
    shutil.copy(os.path.join(path, entry["file"]), os.path.join(path, SHARD_FOLDER, f"{'f' * 16}-{'0' * 12}.arrow"))
    assert_datasets_reads_the_cache(path, texts("a", 2))


# ---- a kill between any two steps of a commit ----


class Killed(BaseException):
    """Stands for SIGKILL: raised right after a step, so that nothing of the commit runs after it."""


# the calls that change what a folder holds: a commit's steps are these, one after another
STEPS = ("mkdir", "rename", "replace", "remove", "unlink", "rmdir")


@contextlib.contextmanager
def killed_after_step(monkeypatch, step: int, root: str):
    """Raise ``Killed`` right after the ``step``-th change (counted from 1) to a name under ``root``."""
    done = []
    with monkeypatch.context() as patch:
        for name in STEPS:

            def changed(*args, _call=getattr(os, name), **kwargs):
                result = _call(*args, **kwargs)
                if os.fspath(args[0]).startswith(root):
                    done.append(args[0])
                    if len(done) == step:
                        raise Killed(f"killed after step {step}: {_call.__name__} {args[0]}")
                return result

            patch.setattr(os, name, changed)
        yield done


def layouts():
    """Every kind of folder a commit may meet: ``{name: builder(path) -> texts it holds}``."""

    def nothing(path):
        return []

    def empty_folder(path):
        os.makedirs(path)
        return []

    def shards(path):
        append_rows(path, synthetic_rows(texts("s1", 2), seed=1))
        append_rows(path, synthetic_rows(texts("s2", 1), seed=2))
        return texts("s1", 2) + texts("s2", 1)

    def base_and_shards(path):
        KeyTokenCache(synthetic_rows(texts("base", 2), seed=3)).save(path)
        append_rows(path, synthetic_rows(texts("s1", 1), seed=1))
        return texts("base", 2) + texts("s1", 1)

    def earlier_base(path):
        earlier_version_cache(path, synthetic_rows(texts("base", 2), seed=3), [])
        return texts("base", 2)

    def earlier_shards(path):
        earlier_version_cache(path, None, [synthetic_rows(texts("s1", 2), seed=1)])
        return texts("s1", 2)

    def earlier_base_and_shards(path):
        earlier_version_cache(
            path, synthetic_rows(texts("base", 1), seed=3), [synthetic_rows(texts(f"s{i}", 1), seed=i) for i in (1, 2)]
        )
        return texts("base", 1) + texts("s1", 1) + texts("s2", 1)

    def earlier_first_commit_killed(path):  # an earlier version killed before its first manifest
        earlier_version_cache(path, None, [synthetic_rows(texts("lost", 1), seed=4)])
        os.remove(os.path.join(path, MANIFEST_FILE))
        return []

    return {f.__name__: f for f in (nothing, empty_folder, shards, base_and_shards, earlier_base, earlier_shards, earlier_base_and_shards, earlier_first_commit_killed)}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(layouts()))
def test_a_commit_killed_after_any_step_leaves_a_folder_datasets_reads_and_the_rerun_resumes(
    tmp_path, monkeypatch, layout
):
    template = str(tmp_path / "template" / "cache")
    held = layouts()[layout](template)
    try:  # earlier versions' folders: without state.json, or with one that names the base only
        read_before = datasets.load_from_disk(template)["text"] == held
    except FileNotFoundError:
        read_before = False
    new = texts("new", 2)
    step = 0
    while True:
        step += 1
        root = str(tmp_path / f"step{step}")
        path = os.path.join(root, "cache")
        os.makedirs(root)
        if os.path.exists(template):
            shutil.copytree(template, path, symlinks=True)
        with killed_after_step(monkeypatch, step, root) as done:
            try:
                append_rows(path, synthetic_rows(new, seed=7))
                finished = True
            except Killed:
                finished = False
        # what the folder holds now: the rows before the commit, or those after it; nothing else
        cache = KeyTokenCache.load(path, create=True)
        now = cache.texts(range(len(cache)))
        assert now in (held, held + new), (step, done)
        # datasets reads it as it is (an earlier version's folder becomes one at this commit)
        if read_before or now == held + new:
            assert_datasets_reads_the_cache(path, now)
        if now == held:  # the rerun commits the rows again, and finds nothing in its way
            append_rows(path, synthetic_rows(new, seed=7))
            assert not os.path.exists(os.path.join(path, MANIFEST_FILE))  # the record moved into state.json
        assert_datasets_reads_the_cache(path, held + new)
        if finished:
            break
    assert step > 3  # the commit had steps to be killed after


def test_an_earlier_versions_cache_migrates_at_its_next_commit_keeping_every_file_of_its_base(tmp_path):
    path = str(tmp_path / "cache")
    earlier_version_cache(path, synthetic_rows(texts("base", 2), seed=3), [synthetic_rows(texts("s1", 1), seed=1)])
    before = {name: file_sha256(os.path.join(path, name)) for name in os.listdir(path) if name.endswith(".arrow")}
    assert len(datasets.load_from_disk(path)) == 2  # earlier versions' state.json named the base only
    assert KeyTokenCache.load(path).texts(range(3)) == texts("base", 2) + texts("s1", 1)  # still read
    append_rows(path, synthetic_rows(texts("s2", 1), seed=2))
    assert_datasets_reads_the_cache(path, texts("base", 2) + texts("s1", 1) + texts("s2", 1))
    assert {name: file_sha256(os.path.join(path, name)) for name in before} == before
    with open(os.path.join(path, CHECKSUM_FILE), encoding="utf-8") as handle:
        assert sorted(json.load(handle)["files"]) == ["data-00000-of-00001.arrow", "dataset_info.json"]


# ---- flushed to the disk before named ----


def test_a_shard_is_flushed_before_state_json_names_it_and_state_json_before_its_rename(tmp_path, monkeypatch):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 1), seed=1))
    events = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", os.fspath(b))) or replace(a, b))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", os.fspath(b))) or rename(a, b))
    append_rows(path, synthetic_rows(texts("b", 1), seed=2))
    [_, entry] = json.load(open(os.path.join(path, STATE_FILE), encoding="utf-8"))[RECORD_KEY]["shards"]
    shard, state = os.path.join(path, entry["file"]), os.path.join(path, STATE_FILE)
    commit = events.index(("replace", state))
    # the shard's bytes (in its temporary folder), then its name in shards/, reach the disk before the commit
    flushed_shard = [i for i, (what, name) in enumerate(events) if what == "fsync" and name.endswith(entry["file"][7:])]
    assert flushed_shard and flushed_shard[0] < events.index(("rename", shard)) < commit
    assert ("fsync", os.path.join(path, SHARD_FOLDER)) in events[events.index(("rename", shard)) : commit]
    # state.json's new bytes before its rename, its folder after
    assert events[commit - 1][0] == "fsync" and os.path.basename(events[commit - 1][1]).startswith(".state.json.")
    assert ("fsync", path) in events[commit:]


def test_a_save_flushes_every_file_of_the_new_copy_before_swapping_it_in(tmp_path, monkeypatch):
    path = str(tmp_path / "cache")
    flushed = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: flushed.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    swaps = []
    monkeypatch.setattr(atomic_files.os, "rename", lambda a, b, _r=os.rename: swaps.append(list(flushed)) or _r(a, b))
    KeyTokenCache(synthetic_rows(texts("a", 2), seed=1)).save(path)
    names = {os.path.basename(name) for name in swaps[-1]}  # flushed before the new copy took the name
    assert {"data-00000-of-00001.arrow", STATE_FILE, "dataset_info.json", CHECKSUM_FILE} <= names
    assert flushed[-1] == str(tmp_path)  # and the folder holding the name, after
