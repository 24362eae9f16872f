"""The key-token cache in shards: appends that never rewrite old files, one memory-mapped Dataset over
them, old single-folder caches, compaction, damaged shards and manifests, a full disk; and
``longppl score`` committing shards as it goes, killed (SIGKILL) at several points on one and two
processes, then resumed to the uninterrupted run's cache."""

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import datasets
import numpy as np
import pytest
from distributed.cache_writer_worker import IDENTITY, SETTINGS, all_texts, synthetic_rows
from helpers import (
    accelerate_launch_on_cpu,
    assert_same_cache,
    byte_level_bpe,
    govreport_texts,
    run_guarded,
    tiny_model,
    wait_guarded,
)

from longppl.cache import storage
from longppl.cache.key_token_cache import CacheDamagedError, KeyTokenCache, append_rows
from longppl.cache.shards import RECORD_KEY, SHARD_FOLDER, STATE_FILE
from longppl.settings import KeyTokenSettings
from longppl.tools import cache_tool

HERE = os.path.dirname(os.path.abspath(__file__))
SCORE_WORKER = os.path.join(HERE, "distributed", "score_worker.py")


def committed(path: str) -> list[dict]:
    """The shards ``state.json`` of the cache ``path`` records, in commit order."""
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as handle:
        return json.load(handle)[RECORD_KEY]["shards"]


def texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document {i}: " + "y" * (15 + i) for i in range(n)]


def files_state(path: str) -> dict[str, tuple[int, str]]:
    """``{relative file: (mtime_ns, sha256)}`` of every file under ``path``."""
    state = {}
    for folder, _, names in os.walk(path):
        for name in names:
            file = os.path.join(folder, name)
            with open(file, "rb") as handle:
                state[os.path.relpath(file, path)] = (
                    os.stat(file).st_mtime_ns,
                    hashlib.sha256(handle.read()).hexdigest(),
                )
    return state


def rows_of(cache: KeyTokenCache) -> dict[str, tuple]:
    """``{text: (input_ids, lp_long, lp_short)}`` of a cache, NaN kept (compared with ``np.array_equal``)."""
    data = cache.dataset
    return {
        t: (ids, np.array(long, dtype=np.float32), np.array(short, dtype=np.float32))
        for t, ids, long, short in zip(data["text"], data["input_ids"], data["lp_long"], data["lp_short"])
    }


def same_rows(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[t][0] == b[t][0] and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a[t][1:], b[t][1:])) for t in a
    )


def test_append_adds_shards_and_never_rewrites_old_files(tmp_path):
    path = str(tmp_path / "cache")
    first, second = texts("first", 3), texts("second", 2)
    append_rows(path, synthetic_rows(first, seed=1))
    before = files_state(path)
    append_rows(path, synthetic_rows(second, seed=2))
    after = files_state(path)
    # every file of the first commit is untouched (same mtime, same bytes), except the record
    assert {name: after[name] for name in before if name != STATE_FILE} == {
        name: state for name, state in before.items() if name != STATE_FILE
    }
    shards = sorted(name for name in after if name.startswith(SHARD_FOLDER + os.sep))
    assert len(shards) == 2
    cache = KeyTokenCache.load(path)
    assert cache.texts(range(len(cache))) == first + second
    # one Dataset over the shard files themselves, memory-mapped (no copy in memory or on disk)
    assert sorted(os.path.relpath(f["filename"], path) for f in cache.dataset.cache_files) == shards
    expected = {
        **rows_of(KeyTokenCache(synthetic_rows(first, seed=1))),
        **rows_of(KeyTokenCache(synthetic_rows(second, seed=2))),
    }
    assert same_rows(rows_of(cache), expected)
    assert cache.find(second, SETTINGS, IDENTITY.fingerprint) == [3, 4]


def test_an_old_single_folder_cache_loads_and_takes_shards_beside_it(tmp_path):
    path = str(tmp_path / "cache")
    old = KeyTokenCache(synthetic_rows(texts("old", 4), seed=3))
    old.save(path)  # what every earlier version wrote: one save_to_disk folder
    base = {name: state for name, state in files_state(path).items() if name != STATE_FILE}
    assert KeyTokenCache.load(path).texts(range(4)) == texts("old", 4)
    append_rows(path, synthetic_rows(texts("new", 2), seed=4))
    assert {name: files_state(path)[name] for name in base} == base  # all but the record, state.json
    cache = KeyTokenCache.load(path)
    assert cache.texts(range(6)) == texts("old", 4) + texts("new", 2)
    # a save to the cache (the metric's) merges base and shards into one folder again, losing nothing
    cache.add(synthetic_rows(texts("metric", 1), seed=5))
    cache.save()
    assert sorted(os.listdir(path)) == [
        "data-00000-of-00001.arrow",
        "dataset_info.json",
        "longppl_checksums.json",
        "state.json",
    ]
    assert KeyTokenCache.load(path).texts(range(7)) == texts("old", 4) + texts("new", 2) + texts("metric", 1)


def test_compaction_merges_shards_keeps_each_key_once_and_the_users_files(tmp_path, capsys):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))  # two runs that scored the same documents
    append_rows(path, synthetic_rows(texts("b", 1), seed=2))
    (tmp_path / "cache" / "NOTES.md").write_text("mine", encoding="utf-8")
    before = rows_of(KeyTokenCache.load(path))
    summary = cache_tool.main(["compact", path])
    assert summary["shards"] == 3 and summary["rows_before"] == 5 and summary["rows"] == 3
    assert "3 shards compacted, 3 rows (2 repeated rows dropped)" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(path, SHARD_FOLDER)) and committed(path) == []
    assert (tmp_path / "cache" / "NOTES.md").read_text(encoding="utf-8") == "mine"
    cache = KeyTokenCache.load(path)
    assert cache.texts(range(3)) == texts("a", 2) + texts("b", 1) and same_rows(rows_of(cache), before)
    info = cache_tool.main(["info", path])
    assert info["rows"] == 3 and info["shards"] == 0


def test_compaction_while_runs_commit_counts_the_rows_it_read(tmp_path, monkeypatch, capsys):
    """Scoring runs commit whenever the cache's lock is free: a compaction reads, merges and swaps
    under one lock, so its counts are of one state (never a negative number of dropped rows), and
    what is committed after it stays."""
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))  # two rows repeated
    lock, arrivals, busy = storage.directory_lock, [], []

    @contextlib.contextmanager
    def lock_then_a_commit(*args, **kwargs):
        with lock(*args, **kwargs) as held:
            yield held
        if not busy:  # the moment the lock is free, a run commits a shard of 3 documents
            busy.append(1)
            arrivals.append(texts(f"run{len(arrivals)}", 3))
            append_rows(path, synthetic_rows(arrivals[-1], seed=len(arrivals)))
            busy.pop()

    monkeypatch.setattr(storage, "directory_lock", lock_then_a_commit)
    summary = cache_tool.main(["compact", path])
    monkeypatch.undo()
    assert "(2 repeated rows dropped)" in capsys.readouterr().out
    assert summary["rows_before"] - summary["rows"] == 2 and summary["rows"] == 2 + 3 * (len(arrivals) - 1)
    cache = KeyTokenCache.load(path)
    assert sorted(cache.texts(range(len(cache)))) == sorted(texts("a", 2) + [t for run in arrivals for t in run])


def test_a_damaged_shard_is_dropped_by_repair_and_the_rest_kept(tmp_path, capsys):
    path = str(tmp_path / "cache")
    for index in range(3):
        append_rows(path, synthetic_rows(texts(f"part{index}", 2), seed=index))
    damage_truncate(path, os.path.join(path, committed(path)[1]["file"]))
    with pytest.raises(
        CacheDamagedError, match=rf"Drop the damaged shards with `longppl cache repair {re.escape(path)}`"
    ) as caught:
        KeyTokenCache.load(path)
    assert "run the same `longppl score` command again to score their documents" in str(caught.value)
    summary = cache_tool.main(["repair", path])
    out = capsys.readouterr().out
    assert [d["rows"] for d in summary["dropped"]] == [2] and summary["rows"] == 4 and summary["shards"] == 2
    assert "1 damaged shards dropped, 4 rows kept" in out and "is " in out.splitlines()[0]
    cache = KeyTokenCache.load(path)
    assert cache.texts(range(4)) == texts("part0", 2) + texts("part2", 2)
    assert datasets.load_from_disk(path)["text"] == cache.texts(range(4))
    # the documents are scored again and committed (as the rerun of longppl score does)
    append_rows(path, synthetic_rows(texts("part1", 2), seed=1))
    assert len(KeyTokenCache.load(path)) == 6
    assert cache_tool.main(["repair", path])["dropped"] == []
    assert "no damaged shard, 6 rows" in capsys.readouterr().out


def test_repair_leaves_a_damaged_base_to_rebuilding(tmp_path):
    path = str(tmp_path / "cache")
    KeyTokenCache(synthetic_rows(texts("base", 2), seed=1)).save(path)
    append_rows(path, synthetic_rows(texts("a", 2), seed=2))
    damage_truncate(path, os.path.join(path, "data-00000-of-00001.arrow"))
    with pytest.raises(CacheDamagedError, match="Its rows cannot be trusted: delete the directory and rebuild it"):
        cache_tool.main(["repair", path])


@pytest.mark.parametrize(
    "output, message",
    [
        ("folder", "is a folder"),
        ("cache", "is a folder"),
        ("notes.txt/out.parquet", r"is inside '\S+notes\.txt', which is a file"),
        ("notes.txt", r"exists; pass --overwrite to replace it"),
    ],
)
def test_curate_refuses_an_output_it_must_not_write_in_one_line(tmp_path, monkeypatch, output, message):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("curate", 2), seed=7))
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ended:
        cache_tool.cli(["curate", path, "--output", output])
    line = str(ended.value.code)
    assert "\n" not in line and f": error: --output {output!r} " in line
    assert re.search(message, line), line
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "mine" and os.listdir(tmp_path / "folder") == []
    assert sorted(os.listdir(tmp_path)) == ["cache", "folder", "notes.txt"]


def test_curate_replaces_a_file_when_asked_to(tmp_path):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("curate", 2), seed=7))
    output = tmp_path / "curation.parquet"
    output.write_text("an earlier file", encoding="utf-8")
    cache_tool.main(["curate", path, "--output", str(output), "--overwrite"])
    assert datasets.Dataset.from_parquet(str(output))["text"] == texts("curate", 2)


def test_rows_of_other_settings_live_beside_each_other(tmp_path):
    """Two jobs writing one cache with different settings: each keeps its rows, found by its settings."""
    path = str(tmp_path / "cache")
    other = KeyTokenSettings(8, 4)
    append_rows(path, synthetic_rows(texts("x", 2), seed=1))
    append_rows(path, synthetic_rows(texts("x", 2), seed=2, settings=other))
    cache = KeyTokenCache.load(path)
    assert cache.find(texts("x", 2), SETTINGS, IDENTITY.fingerprint) == [0, 1]
    assert cache.find(texts("x", 2), other, IDENTITY.fingerprint) == [2, 3]
    with pytest.raises(ValueError, match="2 evaluator/settings combinations"):
        cache.select()


@pytest.mark.slow
def test_concurrent_appends_and_saves_keep_every_row(tmp_path):
    """Four writers at once, each round after a barrier: three commit shards, one adds and saves (the
    metric's path, which rewrites the cache with the shards merged in). No row may be lost, without
    any rerun to fill the gaps."""
    path, barrier = str(tmp_path / "cache"), str(tmp_path / "barrier")
    os.makedirs(barrier)
    writers, rows, rounds = 4, 3, 3
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    worker = os.path.join(HERE, "distributed", "cache_writer_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, path, str(w), str(rows), str(rounds), barrier, str(writers)]
            + (["--append"] if w < 3 else []),
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    for proc in procs:
        assert wait_guarded(proc) == 0, proc.stderr.read()[-3000:]
    cache = KeyTokenCache.load(path)
    expected = all_texts(writers, rounds, rows)
    assert len(cache) == len(expected) == 36 and set(cache.texts(range(len(cache)))) == expected


def damage_truncate(path, shard):
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)


def damage_flip(path, shard):
    with open(shard, "r+b") as handle:
        handle.seek(os.path.getsize(shard) - 40)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def damage_remove(path, shard):
    os.remove(shard)


def damage_record(path, shard):
    with open(os.path.join(path, STATE_FILE), "w", encoding="utf-8") as handle:
        handle.write('{"_data_files": [')


def damage_escape(path, shard):
    state = json.load(open(os.path.join(path, STATE_FILE), encoding="utf-8"))
    state[RECORD_KEY]["shards"][0]["file"] = "../elsewhere.arrow"
    json.dump(state, open(os.path.join(path, STATE_FILE), "w", encoding="utf-8"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (damage_truncate, r"its shard shards/\S+\.arrow is \d+ bytes, but \d+ were committed \(truncated"),
        (damage_flip, r"the content of its shard shards/\S+\.arrow does not match its SHA-256 checksum"),
        (damage_remove, r"its record names the shard shards/\S+\.arrow, which is missing"),
        (damage_record, r"its file state\.json is unreadable \(JSONDecodeError"),
        (damage_escape, r"names '\.\./elsewhere\.arrow', not a file in shards/"),
    ],
)
def test_a_damaged_shard_or_manifest_is_named_in_one_line(tmp_path, damage, message):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 3), seed=1))
    append_rows(path, synthetic_rows(texts("b", 3), seed=2))
    shard = os.path.join(path, committed(path)[1]["file"])
    damage(path, shard)
    with pytest.raises(CacheDamagedError, match=message) as caught:
        KeyTokenCache.load(path)
    assert "\n" not in str(caught.value) and "delete the directory and rebuild it" in str(caught.value)


def test_a_shard_file_the_manifest_does_not_name_is_not_read(tmp_path):
    """A writer killed between moving its shard in and naming it: its rows were never committed."""
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))
    shard = os.path.join(path, committed(path)[0]["file"])
    with open(shard, "rb") as source, open(os.path.join(path, SHARD_FOLDER, "orphan.arrow"), "wb") as copy:
        copy.write(source.read())
    assert len(KeyTokenCache.load(path)) == 2


def test_a_full_disk_mid_shard_keeps_every_committed_row_and_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "cache")
    append_rows(path, synthetic_rows(texts("a", 2), seed=1))
    before = files_state(path)

    class FullDisk(storage.ArrowWriter):
        def write_table(self, *args, **kwargs):
            super().write_table(*args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "ArrowWriter", FullDisk)
    with pytest.raises(
        ValueError, match=r"No space left on device \(errno 28\); it needs about .* while the new shard"
    ):
        append_rows(path, synthetic_rows(texts("b", 2), seed=2))
    assert files_state(path) == before and sorted(os.listdir(tmp_path)) == ["cache"]
    assert KeyTokenCache.load(path).texts(range(2)) == texts("a", 2)


# ---- longppl score: commits as it goes, killed and resumed ----

K, D = 31, 11


@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    """A corpus of 10 documents, a saved tiny evaluator, and the uninterrupted single-process cache."""
    root = tmp_path_factory.mktemp("shards")
    corpus_texts = [t[300 : 300 + 150 + 40 * i] for i, t in enumerate(govreport_texts()[:10])]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts), encoding="utf-8")
    tokenizer = byte_level_bpe()
    tiny_model("llama", len(tokenizer), seed=1).save_pretrained(root / "evaluator")
    tokenizer.save_pretrained(root / "evaluator")
    files = dict(root=root, corpus=str(corpus), evaluator=str(root / "evaluator"), texts=corpus_texts)
    reference = str(root / "reference")
    done = run_score(files, reference, processes=1)
    assert done.returncode == 0, done.stderr[-3000:]
    files["reference"] = reference
    return files


def run_score(files, output, processes=1, die=None, shard_documents=2):
    options = ["--corpus", files["corpus"], "--evaluator", files["evaluator"], "--output", output,
               "--trunc-len", str(K), "--sliding-window", str(D), "--shard-documents", str(shard_documents)]  # fmt: skip
    ours = ["--die", die] if die else []
    launcher = [*accelerate_launch_on_cpu(processes), SCORE_WORKER] if processes > 1 else [sys.executable, SCORE_WORKER]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return run_guarded([*launcher, *ours, *options], env=env, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, n, kept", [("renamed", 1, 0), ("written", 3, 4), ("renamed", 2, 2), ("committed", 4, 8)]
)
def test_a_killed_single_process_run_keeps_its_shards_and_resumes_to_the_same_cache(scoring, tmp_path, point, n, kept):
    output = str(tmp_path / "cache")
    killed = run_score(scoring, output, die=f"0:{point}:{n}")
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: no handler ran
    # every shard committed before the kill is there, and nothing else (shards of 2 documents)
    assert len(KeyTokenCache.load(output, create=True)) == kept
    resumed = run_score(scoring, output)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"10 documents ({10 - kept} scored now, {kept} already cached)" in resumed.stdout
    assert_same_cache(scoring["reference"], output)
    assert datasets.load_from_disk(output)["text"] == KeyTokenCache.load(output).dataset["text"]
    # the killed writer's temporary folder was removed by the next commit (its process is gone)
    assert sorted(os.listdir(tmp_path)) == ["cache"]


@pytest.mark.slow
def test_a_truncated_shard_is_repaired_and_its_documents_scored_again_by_the_same_command(scoring, tmp_path):
    output = str(tmp_path / "cache")
    shutil.copytree(scoring["reference"], output)
    damage_truncate(output, os.path.join(output, committed(output)[2]["file"]))
    refused = run_score(scoring, output)
    assert refused.returncode == 1 and f"`longppl cache repair {output}`" in refused.stderr.strip().splitlines()[-1]
    assert cache_tool.main(["repair", output])["rows"] == 8
    resumed = run_score(scoring, output)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "10 documents (2 scored now, 8 already cached)" in resumed.stdout
    assert_same_cache(scoring["reference"], output)


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:committed:1", "0:written:2"])
def test_a_killed_two_process_run_resumes_to_the_single_process_cache(scoring, tmp_path, die):
    output = str(tmp_path / "cache")
    killed = run_score(scoring, output, processes=2, die=die)
    assert killed.returncode != 0
    partial = len(KeyTokenCache.load(output))
    assert 0 < partial < 10
    resumed = run_score(scoring, output, processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"({10 - partial} scored now, {partial} already cached)" in resumed.stdout
    assert_same_cache(scoring["reference"], output)


# ---- the same step under datatrove's executor (several workers standing in for nodes) ----

PIPELINE_WORKER = os.path.join(HERE, "distributed", "pipeline_worker.py")


def require_datatrove():
    """Fail in CI, which installs the ``corpus`` extra (``.ci/run``); skip, saying why, elsewhere."""
    try:
        import datatrove  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("datatrove is not installed: CI installs it with pip install -e '.[corpus]'")
        pytest.skip("the datatrove step's tests need datatrove: pip install -e '.[corpus]'")


def run_pipeline(files, output, logs, tasks, workers, die=None):
    options = ["--corpus", files["corpus"], "--evaluator", files["evaluator"], "--output", output,
               "--trunc-len", str(K), "--sliding-window", str(D), "--shard-documents", "2"]  # fmt: skip
    command = [
        sys.executable,
        PIPELINE_WORKER,
        str(tasks),
        str(workers),
        logs,
        *(["--die", die] if die else []),
        *options,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return run_guarded(command, env=env, capture_output=True, text=True, start_new_session=True)


def test_the_task_shares_split_the_distinct_documents_whatever_the_cache_holds():
    require_datatrove()
    from longppl.tools.score_pipeline import task_share

    corpus = ["a" * n for n in (5, 9, 2, 7, 7, 3, 9)]  # the documents of 7 and 9 repeat: each is scored once
    shares = [task_share(corpus, rank, 3) for rank in range(3)]
    assert sorted(t for share in shares for t in share) == sorted(set(corpus))
    # longest first, each to the least loaded task: 9 | 7 | 5; then 3 to the third, 2 to the second
    assert [sorted(map(len, share)) for share in shares] == [[9], [2, 7], [3, 5]]


@pytest.mark.slow
def test_the_datatrove_step_on_three_workers_killed_mid_run_resumes_to_the_single_process_cache(scoring, tmp_path):
    require_datatrove()
    output, logs = str(tmp_path / "cache"), str(tmp_path / "logs")
    killed = run_pipeline(scoring, output, logs, tasks=3, workers=3, die="1:1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    partial = len(KeyTokenCache.load(output))
    assert 0 < partial < 10
    resumed = run_pipeline(scoring, output, logs, tasks=3, workers=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(logs, "completions"))) == ["00000", "00001", "00002"]
    assert_same_cache(scoring["reference"], output)
    # run again: every task is complete, nothing is scored, the cache is unchanged
    before = files_state(output)
    again = run_pipeline(scoring, output, logs, tasks=3, workers=2)
    assert again.returncode == 0 and files_state(output) == before


# ---- curation columns ----


def direct_curation(lp_long, lp_short, k, alpha, beta):
    """The curation columns of one document, token by token in plain Python (the reference)."""
    n = len(lp_long)
    lsd = [None if math.isnan(lp_long[i]) or math.isnan(lp_short[i]) else float(lp_long[i]) - float(lp_short[i]) for i in range(n)]  # fmt: skip
    scored = [i for i in range(n) if lsd[i] is not None]
    key = [i for i in scored if lsd[i] > alpha and float(lp_long[i]) > beta]
    ordered = sorted(lsd[i] for i in scored)
    rank = 0.9 * (len(ordered) - 1)
    low = int(math.floor(rank))
    p90 = ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (rank - low)
    long_ = [float(lp_long[i]) for i in range(1, n)]
    return dict(
        tokens=n,
        scored_tokens=len(scored),
        key_tokens=len(key),
        key_share=len(key) / n,
        lsd_mean=sum(lsd[i] for i in scored) / len(scored),
        lsd_p90=p90,
        longppl=math.exp(-sum(float(lp_long[i]) for i in key) / len(key)) if key else float("nan"),
        ppl=math.exp(-sum(long_) / len(long_)),
        benefit_near=sum(lsd[i] for i in scored if i < 2 * k),
        benefit_far=sum(lsd[i] for i in scored if i >= 2 * k),
    )


def test_curation_columns_match_a_direct_computation(tmp_path):
    path = str(tmp_path / "cache")
    documents = texts("curate", 6)
    append_rows(path, synthetic_rows(documents, seed=7))
    output = str(tmp_path / "curation.parquet")
    cache_tool.main(["curate", path, "--output", output, "--alpha", "0.3", "--beta", "-1.5"])
    table = datasets.Dataset.from_parquet(output)
    cache = KeyTokenCache.load(path)
    assert table["text"] == documents and table["text_fingerprint"] == cache.dataset["text_fingerprint"]
    for row in range(len(documents)):
        scores = cache.scores(row)
        expected = direct_curation(scores.lp_long, scores.lp_short, SETTINGS.trunc_len, 0.3, -1.5)
        got = table[row]
        assert expected["key_tokens"] > 0 and expected["benefit_far"] != 0  # the columns are exercised
        for name, value in expected.items():
            # LSD is float32, as everywhere in the library; the reference sums in float64
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5, nan_ok=True), (row, name)


def test_curate_without_an_output_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cache_tool.main(["curate", str(tmp_path / "cache")])
    assert "curate needs --output" in capsys.readouterr().err


# ---- the context ladder ----


def only_k(path: str, k: int, folder: str) -> str:
    """The rows of the cache ``path`` with ``trunc_len == k``, saved alone in ``folder``."""
    dataset = KeyTokenCache.load(path).dataset
    KeyTokenCache(dataset.select([i for i, t in enumerate(dataset["trunc_len"]) if t == k])).save(folder)
    return folder


@pytest.mark.slow
def test_a_ladder_of_k_gives_the_rows_of_separate_runs_per_k(scoring, tmp_path, monkeypatch):
    from accelerate import PartialState

    from longppl.core import scoring as scoring_module
    from longppl.tools import compute_key_tokens

    long_passes = []
    long_pass = scoring_module.long_context_log_probs
    monkeypatch.setattr(
        scoring_module, "long_context_log_probs", lambda *a, **k: long_passes.append(1) or long_pass(*a, **k)
    )
    common = ["--corpus", scoring["corpus"], "--evaluator", scoring["evaluator"], "--sliding-window", str(D)]
    try:
        ladder = str(tmp_path / "ladder")
        summary = compute_key_tokens.main([*common, "--output", ladder, "--trunc-len", str(K), "17", "64"])
        assert summary["scored"] == 10 and len(long_passes) == 10  # one long pass per document for the 3 K
        for k in (17, 64):
            compute_key_tokens.main([*common, "--output", str(tmp_path / f"alone{k}"), "--trunc-len", str(k)])
    finally:
        PartialState._reset_state()  # compute_key_tokens set up accelerate's (process-wide) state
    assert len(KeyTokenCache.load(ladder)) == 30
    for k, alone in ((K, scoring["reference"]), (17, str(tmp_path / "alone17")), (64, str(tmp_path / "alone64"))):
        assert_same_cache(alone, only_k(ladder, k, str(tmp_path / f"ladder{k}")))


@pytest.mark.slow
def test_a_ladder_extended_by_a_k_commits_only_the_new_rows(scoring, tmp_path):
    from accelerate import PartialState

    from longppl.tools import compute_key_tokens

    common = ["--corpus", scoring["corpus"], "--evaluator", scoring["evaluator"], "--sliding-window", str(D)]
    ladder = str(tmp_path / "ladder")
    try:
        compute_key_tokens.main([*common, "--output", ladder, "--trunc-len", str(K), "17"])
        summary = compute_key_tokens.main([*common, "--output", ladder, "--trunc-len", str(K), "17", "64"])
    finally:
        PartialState._reset_state()
    assert summary["scored"] == 10
    dataset = KeyTokenCache.load(ladder).dataset
    assert sorted(dataset["trunc_len"]) == [17] * 10 + [K] * 10 + [64] * 10  # each key once
    assert_same_cache(scoring["reference"], only_k(ladder, K, str(tmp_path / "ladderK")))
