"""Where a key-token cache may be written: paths that are not a cache's folder are refused before
anything is scored (an empty path once replaced the working directory), links are followed to one
cache, files the user put in a cache folder survive saves, and a full or unwritable disk gives one
clear line with nothing left behind."""

import errno
import json
import os
import re
import resource
import sys

import datasets
import evaluate
import numpy as np
import pytest
from distributed.cache_writer_worker import synthetic_rows
from helpers import byte_level_bpe, govreport_texts, model_and_evaluator, run_guarded, tiny_model

import longppl
import longppl.core.scoring
import longppl.metric.compute  # noqa: F401 (the metric's module binds scoring's functions when first imported: before a test patches them)
from longppl.atomic_files import _lock_path
from longppl.cache import key_token_cache, storage
from longppl.cache.key_token_cache import CHECKSUM_FILE, KeyTokenCache, cache_directory, open_cache

K, D = 47, 13


def rows(*names, seed=0):
    return synthetic_rows([f"{name} " * 12 for name in names], seed=seed)


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding a user's file, and a home folder of its own."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("mine too")
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(home))
    return folder


def untouched(work):
    assert sorted(os.listdir(work)) == ["notes.txt"] and (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "value, detail",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        (".", "is the current folder"),
        ("./", "is the current folder"),
        ("..", "is a folder that holds the current one"),
        ("/", "is the root of the file system"),
        ("~", "is the home folder"),
        ("notes.txt", "is a file"),
    ],
)
def test_paths_that_are_never_a_cache_are_refused_when_writing(work, value, detail):
    with pytest.raises(ValueError, match=re.escape(f"key_tokens={value!r} {detail}")) as raised:
        cache_directory(value, create=True)
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith("key_tokens=")
    with pytest.raises(ValueError, match=re.escape(f"key_tokens={value!r} {detail}")):
        KeyTokenCache.load(value, create=True)
    cache = KeyTokenCache(rows("a"))
    with pytest.raises(ValueError, match=re.escape(f"path={value!r} {detail}")):
        cache.save(value)
    untouched(work)


def test_paths_under_a_file_or_through_a_loop_of_links_are_refused_before_scoring(work):
    os.symlink("loop", work / "loop")
    for value, detail in (
        ("notes.txt/sub", f"is inside {str(work / 'notes.txt')!r}, which is a file"),
        ("loop", "goes through a loop of symbolic links"),
        ("loop/sub", "goes through a loop of symbolic links"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"--output={value!r} {detail}")):
            cache_directory(value, argument="--output", create=True)
    os.remove(work / "loop")
    untouched(work)


def test_a_folder_of_other_files_is_refused_and_an_empty_one_accepted(work):
    (work / "project").mkdir()
    (work / "project" / "main.py").write_text("print()")
    with pytest.raises(ValueError, match=r"key_tokens='project' is a folder holding other files \(main\.py\), not a"):
        KeyTokenCache.load("project", create=True)
    with pytest.raises(ValueError, match="path='project' is a folder holding other files"):
        KeyTokenCache(rows("a")).save("project")
    assert os.listdir(work / "project") == ["main.py"]
    # reading a non-cache folder is harmless, and says what it is
    with pytest.raises(ValueError, match="is not a key-token cache"):
        KeyTokenCache.load("project")
    (work / "empty").mkdir()
    cache = KeyTokenCache.load("empty", create=True)
    assert len(cache) == 0
    cache.add(rows("a", "b"))
    cache.save()
    assert len(KeyTokenCache.load("empty")) == 2


def test_a_save_replaces_only_a_cache(work, monkeypatch):
    """The last guard, under the lock: files appearing in the target after the first check stop the swap."""
    cache = KeyTokenCache.load("cache", create=True)
    cache.add(rows("a"))
    real_check = key_token_cache.cache_directory

    def check_then_someone_writes(path, argument="key_tokens", create=False):
        real = real_check(path, argument, create)
        os.makedirs(real, exist_ok=True)
        with open(os.path.join(real, "report.docx"), "w") as handle:
            handle.write("someone else's")
        return real

    monkeypatch.setattr(key_token_cache, "cache_directory", check_then_someone_writes)
    with pytest.raises(ValueError, match="is a folder holding other files \\(report.docx\\)"):
        cache.save()
    assert os.listdir(work / "cache") == ["report.docx"]


@pytest.fixture(scope="module")
def models():
    return model_and_evaluator()


@pytest.mark.parametrize("value", ["", ".", "~"])
def test_the_metric_and_the_trainer_refuse_before_scoring(work, models, value, monkeypatch):
    from longce import add_key_token_weights

    scored = []
    monkeypatch.setattr(longppl.core.scoring, "score_with_evaluator", lambda *a, **k: scored.append(1))
    metric = evaluate.load(longppl.METRIC_PATH)
    text = govreport_texts()[0][:600]
    with pytest.raises(ValueError, match=re.escape(f"key_tokens={value!r} ")):
        metric.compute(predictions=[text], key_tokens=value, trunc_len=K, sliding_window=D, progress=False, **models)
    with pytest.raises(ValueError, match=re.escape(f"key_tokens={value!r} ")):
        add_key_token_weights(
            datasets.Dataset.from_dict({"text": [text]}),
            key_tokens=value,
            tokenizer=models["tokenizer"],
            evaluator_model=models["evaluator_model"],
            evaluator_tokenizer=models["evaluator_tokenizer"],
            trunc_len=K,
            sliding_window=D,
        )
    assert scored == []
    untouched(work)


@pytest.fixture(scope="module")
def score_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t[:500]}) + "\n" for t in govreport_texts()[:2]), encoding="utf-8")
    ev_tok = byte_level_bpe()
    tiny_model("llama", len(ev_tok), seed=1).save_pretrained(root / "evaluator")
    ev_tok.save_pretrained(root / "evaluator")
    return dict(corpus=str(corpus), evaluator=str(root / "evaluator"))


def score_command(score_files, output, cwd, preexec_fn=None):
    command = [sys.executable, "-m", "longppl.tools.compute_key_tokens", "--corpus", score_files["corpus"]]
    command += ["--evaluator", score_files["evaluator"], "--output", output, "--trunc-len", str(K)]
    command += ["--sliding-window", str(D)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return run_guarded(command, cwd=cwd, env=env, capture_output=True, text=True, preexec_fn=preexec_fn)


@pytest.mark.slow
@pytest.mark.parametrize("value", ["", "."])
def test_the_score_command_refuses_an_empty_or_current_output(work, score_files, value):
    done = score_command(score_files, value, work)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert f"error: --output={value!r} is " in lines[0]
    untouched(work)


def test_a_link_to_a_cache_writes_into_its_target_under_one_lock(tmp_path):
    target = tmp_path / "store" / "cache"
    KeyTokenCache(rows("a")).save(str(target))
    link = tmp_path / "linked"
    link.symlink_to(target, target_is_directory=True)
    assert cache_directory(str(link), create=True) == str(target)
    assert _lock_path(cache_directory(str(link))) == _lock_path(str(target))
    for round, name in enumerate(("b", "c")):  # two saves through the link: both land in the target
        cache = KeyTokenCache.load(str(link), create=True)
        cache.add(rows(name, seed=round + 1))
        cache.save()
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(KeyTokenCache.load(str(target)).texts(range(3))) == [f"{n} " * 12 for n in "abc"]
    assert sorted(os.listdir(tmp_path)) == ["linked", "store"] and os.listdir(tmp_path / "store") == ["cache"]
    # a cache saved "elsewhere" that is the link's target merges instead of copying over it
    other = KeyTokenCache(rows("d", seed=9))
    other.save(str(link))
    assert len(KeyTokenCache.load(str(target))) == 1  # a save to another cache's folder replaces it (documented)
    assert os.path.islink(link)


def test_files_the_user_put_in_a_cache_folder_survive_saves(tmp_path):
    path = tmp_path / "cache"
    KeyTokenCache(rows("a")).save(str(path))
    (path / "README.md").write_text("# my cache")
    (path / "notes").mkdir()
    (path / "notes" / "how.txt").write_text("scored on 8 GPUs")
    for name in ("b", "c"):
        cache = KeyTokenCache.load(str(path))
        cache.add(rows(name))
        cache.save()
    assert (path / "README.md").read_text() == "# my cache"
    assert (path / "notes" / "how.txt").read_text() == "scored on 8 GPUs"
    assert len(KeyTokenCache.load(str(path))) == 3  # its checksums are verified, the user's files not listed
    with open(path / CHECKSUM_FILE) as handle:
        assert "README.md" not in json.load(handle)["files"]


def test_an_interrupted_swap_is_recovered_by_every_loader(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    KeyTokenCache(rows("a", "b")).save(str(path))
    os.rename(path, tmp_path / ".cache.previous")  # killed between the two renames of a swap
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the Hub"))
    assert len(open_cache(str(path))) == 2
    assert sorted(os.listdir(tmp_path)) == ["cache"]


def full_disk(self, folder, *args, **kwargs):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "data-00000-of-00001.arrow"), "wb") as handle:
        handle.write(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_keeps_the_old_cache_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    KeyTokenCache(rows("a")).save(str(path))
    cache = KeyTokenCache.load(str(path))
    cache.add(rows("b"))
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full_disk)
    with pytest.raises(
        ValueError,
        match=r"Could not write the key-token cache .*No space left on device .*about [\d.]*[1-9][\d.]* [KM]iB",
    ):
        cache.save()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["cache"]
    assert KeyTokenCache.load(str(path)).texts([0]) == ["a " * 12]


def test_an_unwritable_folder_is_refused_before_scoring(tmp_path, monkeypatch):
    def refused(*args, **kwargs):  # as root, permissions cannot be taken away: the probe is made to fail
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(storage.tempfile, "mkdtemp", refused)
    with pytest.raises(
        ValueError, match=r"key_tokens='.*new' cannot be written: creating a folder in .* failed \(Permission denied\)"
    ):
        KeyTokenCache.load(str(tmp_path / "new"), create=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_score_command_over_a_file_size_limit(tmp_path, score_files):
    limit = 4096  # more than what the run writes besides its shard, less than the shard of two documents

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    for _ in range(2):
        done = score_command(score_files, str(tmp_path / "cache"), tmp_path, preexec_fn=limited)
        assert done.returncode == 1, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert re.search(
            r"error: Could not write the key-token cache .*File too large.*about [\d.]*[1-9][\d.]* [KM]iB", lines[-1]
        )
        assert "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []  # no shards folder, no cache, no lock


def test_crafted_rows_are_refused_on_read(tmp_path):
    good = rows("a")
    bad = good.map(lambda row: {"offsets": [[0, 10_000]] + row["offsets"][1:]})
    cache = KeyTokenCache(bad)
    with pytest.raises(
        ValueError,
        match=r"row 0 of the key-token cache is inconsistent: token 0 spans characters \[0, 10000\) of a text of 24",
    ):
        cache.scores(0)
    short = good.map(lambda row: {"lp_short": row["lp_short"][:-1]})
    with pytest.raises(ValueError, match=r"row 0 .* is inconsistent: .*lp_short holds 23 values for 24 tokens"):
        KeyTokenCache(short).scores(0)
    assert np.array_equal(KeyTokenCache(good).scores(0).offsets[:2], [[0, 1], [1, 2]])
