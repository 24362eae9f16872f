"""The key-token cache under faults: concurrent writers, another tokenizer, damaged files, leftovers of
killed writers, one evaluator under two spellings of its path."""

import hashlib
import json
import os
import re
import subprocess
import sys

import datasets
import evaluate
import numpy as np
import pytest
from distributed.cache_writer_worker import IDENTITY, SETTINGS, all_texts, synthetic_rows
from helpers import byte_level_bpe, communicate_guarded, govreport_texts, metaspace_bpe, tiny_model

import longppl
from longppl.atomic_files import _host, owned_temp_name
from longppl.cache.key_token_cache import CHECKSUM_FILE, CacheDamagedError, KeyTokenCache, KeyTokenSettings
from longppl.models.fingerprints import ModelIdentity, tokenizer_fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "cache_writer_worker.py")
K, D = 47, 13
ALPHA, BETA = 0.005, -50.0


def run_writers(path, barrier, writers, rows, rounds, *extra):
    """Start ``writers`` worker processes at once; return their completed processes."""
    os.makedirs(barrier, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, path, str(w), str(rows), str(rounds), barrier, str(writers), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    return [(p, *communicate_guarded(p)) for p in procs]


@pytest.mark.slow
def test_concurrent_writers_keep_every_row(tmp_path):
    path = str(tmp_path / "cache")
    writers, rows, rounds = 3, 4, 2
    for proc, _, err in run_writers(path, str(tmp_path / "barrier"), writers, rows, rounds):
        assert proc.returncode == 0, err[-3000:]
    cache = KeyTokenCache.load(path)
    expected = all_texts(writers, rounds, rows)
    found = cache.texts(range(len(cache)))
    assert len(found) == len(expected) == 24 and set(found) == expected
    # every row holds its own writer's scores
    for w in range(writers):
        texts = [f"writer {w} round 1 row {i}: " + "x" * (20 + i) for i in range(rows)]
        reference = synthetic_rows(texts, seed=1000 * w + 1)
        for text, row in zip(texts, cache.find(texts, SETTINGS, IDENTITY.fingerprint)):
            position = reference["text"].index(text)
            stored = np.array(reference[position]["lp_short"], dtype=np.float32)
            assert np.array_equal(cache.scores(row).lp_short, stored, equal_nan=True)
    assert sorted(os.listdir(tmp_path)) == ["barrier", "cache"]  # no lock file or temporary left


def test_a_writer_killed_in_its_save_leaves_the_cache_and_its_leftovers_go_at_the_next_save(tmp_path):
    path = str(tmp_path / "cache")
    KeyTokenCache(synthetic_rows(["first text " * 3], seed=1)).save(path)
    [(proc, _, err)] = run_writers(path, str(tmp_path / "barrier"), 1, 2, 1, "--die-in-save")
    assert proc.returncode == -9, err[-3000:]
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(".cache.new-")]
    assert len(leftovers) == 1 and f"-{proc.pid}-" in leftovers[0]
    assert KeyTokenCache.load(path).texts([0]) == ["first text " * 3]
    # a live writer's temporary folders (this process) and a dead one's shards
    live_new = owned_temp_name(path, "new")
    live_shards = owned_temp_name(path, "shards")
    dead_shards = live_shards.replace(f"-{os.getpid()}-", f"-{proc.pid}-")
    other_host = dead_shards.replace(f".shards-{_host()}-", ".shards-elsewhere-")
    for folder in (live_new, live_shards, dead_shards, other_host):
        os.makedirs(os.path.join(folder, "0"))
    cache = KeyTokenCache.load(path)
    cache.add(synthetic_rows(["second text " * 3], seed=2))
    cache.save()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["barrier", "cache"] + [os.path.basename(f) for f in (live_new, live_shards, other_host)]
    )
    assert KeyTokenCache.load(path).texts([0, 1]) == ["first text " * 3, "second text " * 3]


@pytest.fixture
def saved_cache(tmp_path):
    path = str(tmp_path / "cache")
    texts = [f"document {i} " + "lorem ipsum " * 400 for i in range(3)]
    KeyTokenCache(synthetic_rows(texts, seed=3)).save(path)
    return path


def _truncate(path):
    arrow = os.path.join(path, "data-00000-of-00001.arrow")
    with open(arrow, "r+b") as handle:
        handle.truncate(os.path.getsize(arrow) // 2)


def _empty(path):
    open(os.path.join(path, "data-00000-of-00001.arrow"), "wb").close()


def _bad_json(name):
    def damage(path):
        with open(os.path.join(path, name), "w") as handle:
            handle.write('{"_data_files": [')

    return damage


def _drop_data_file(path):
    with open(os.path.join(path, "state.json")) as handle:
        state = json.load(handle)
    state["_data_files"] = state["longppl_shards"]["shards"] = []
    with open(os.path.join(path, "state.json"), "w") as handle:
        json.dump(state, handle)


def _no_files(path):
    with open(os.path.join(path, CHECKSUM_FILE), "w") as handle:
        json.dump({"algorithm": "sha256", "files": {}}, handle)


def _flip_scores(path):
    # 4 kB of the scores (lp_long / lp_short come last in each row group) bit-flipped in place
    arrow = os.path.join(path, "data-00000-of-00001.arrow")
    with open(arrow, "r+b") as handle:
        data = bytearray(handle.read())
        start = len(data) - 8192
        data[start : start + 4096] = bytes(b ^ 0x10 for b in data[start : start + 4096])
        handle.seek(0)
        handle.write(data)


@pytest.mark.parametrize(
    "damage, detail",
    [
        (_truncate, r"its file data-00000-of-00001\.arrow is \d+ bytes, but \d+ were written \(truncated"),
        (_empty, r"its file data-00000-of-00001\.arrow is 0 bytes, but \d+ were written"),
        (_bad_json("state.json"), r"its file state\.json is unreadable \(JSONDecodeError"),
        (
            _drop_data_file,
            r"its state\.json names the files \[\], but its checksum file \['data-00000-of-00001\.arrow'\]",
        ),
        (_bad_json("dataset_info.json"), r"its file dataset_info\.json is 17 bytes, but \d+ were written"),
        (_bad_json(CHECKSUM_FILE), rf"its checksum file {CHECKSUM_FILE} is unreadable \(JSONDecodeError"),
        (_no_files, rf"its checksum file {CHECKSUM_FILE} lists no files"),
        (_flip_scores, r"the content of its file data-00000-of-00001\.arrow does not match its SHA-256 checksum"),
    ],
    ids=[
        "truncated",
        "empty",
        "state-json",
        "state-no-files",
        "info-json",
        "checksum-json",
        "checksum-no-files",
        "bit-flips",
    ],
)
def test_damaged_files_give_a_clear_error(saved_cache, damage, detail):
    damage(saved_cache)
    with pytest.raises(
        CacheDamagedError,
        match=rf"key-token cache at '{re.escape(saved_cache)}' is damaged: {detail}.*delete the "
        r"directory and rebuild it .*or restore it from a copy",
    ):
        KeyTokenCache.load(saved_cache)


@pytest.mark.parametrize(
    "damage, detail",
    [
        (_truncate, r"datasets could not read it \(OSError: Expected to be able to read"),
        (_empty, r"datasets could not read it \(ArrowInvalid"),
        (_bad_json("state.json"), r"its file state\.json is unreadable \(JSONDecodeError"),
    ],
    ids=["truncated", "empty", "state-json"],
)
def test_damaged_files_without_checksums_give_a_clear_error_too(saved_cache, damage, detail):
    os.remove(os.path.join(saved_cache, CHECKSUM_FILE))  # as written by a plain Dataset.save_to_disk
    assert len(KeyTokenCache.load(saved_cache)) == 3
    damage(saved_cache)
    with pytest.raises(CacheDamagedError, match=rf"at '{re.escape(saved_cache)}' is damaged: {detail}"):
        KeyTokenCache.load(saved_cache)


def test_damage_surfaces_in_the_metric_and_the_script(saved_cache, tmp_path):
    _flip_scores(saved_cache)
    metric = evaluate.load(longppl.METRIC_PATH)
    tok = metaspace_bpe()
    with pytest.raises(ValueError, match=rf"key-token cache at '{re.escape(saved_cache)}' is damaged"):
        metric.compute(
            predictions=["some text"],
            model=tiny_model("mistral", len(tok)),
            tokenizer=tok,
            key_tokens=saved_cache,
            progress=False,
        )
    from accelerate import PartialState

    from longppl.tools import compute_key_tokens

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": "a document"}) + "\n", encoding="utf-8")
    evaluator = tmp_path / "evaluator"
    ev_tok = byte_level_bpe()
    tiny_model("llama", len(ev_tok)).save_pretrained(evaluator)
    ev_tok.save_pretrained(evaluator)
    try:
        with pytest.raises(ValueError, match=rf"key-token cache at '{re.escape(saved_cache)}' is damaged"):
            compute_key_tokens.main(["--corpus", str(corpus), "--evaluator", str(evaluator), "--output", saved_cache])
    finally:
        PartialState._reset_state()


def test_checksums_cover_every_file_the_save_wrote(saved_cache):
    with open(os.path.join(saved_cache, CHECKSUM_FILE)) as handle:
        record = json.load(handle)
    # all but state.json, which each commit of a shard replaces: it is checked against the files
    written = sorted(name for name in os.listdir(saved_cache) if name not in (CHECKSUM_FILE, "state.json"))
    assert sorted(record["files"]) == written == ["data-00000-of-00001.arrow", "dataset_info.json"]
    for name, entry in record["files"].items():
        with open(os.path.join(saved_cache, name), "rb") as handle:
            content = handle.read()
        assert entry == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


# --- the evaluator's tokenizer is part of its identity ---------------------------------------------


def test_tokenizer_fingerprint_follows_what_makes_the_ids():
    with_bos, without_bos = byte_level_bpe(add_bos=True), byte_level_bpe(add_bos=False)
    smaller = byte_level_bpe(vocab_size=500)
    prints = {tokenizer_fingerprint(t) for t in (with_bos, without_bos, smaller, metaspace_bpe())}
    assert len(prints) == 4
    from helpers import SlowByteTokenizer

    slow = SlowByteTokenizer()
    assert tokenizer_fingerprint(slow) == tokenizer_fingerprint(SlowByteTokenizer())
    assert tokenizer_fingerprint(slow) != tokenizer_fingerprint(SlowByteTokenizer(bos_token="</s>"))
    # a call with truncation changes the backend's per-call state, not the identity
    before = tokenizer_fingerprint(with_bos)
    with_bos("some text " * 20, truncation=True, max_length=5)
    assert tokenizer_fingerprint(with_bos) == before


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory):
    """One evaluator's weights saved twice: with a BOS-adding tokenizer and with one that adds none."""
    root = tmp_path_factory.mktemp("evaluators")
    with_bos, without_bos = byte_level_bpe(add_bos=True), byte_level_bpe(add_bos=False)
    model = tiny_model("llama", len(with_bos), seed=1)
    for name, tok in (("bos", with_bos), ("nobos", without_bos)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    texts = [t[1000 : 1000 + size] for t, size in zip(govreport_texts()[:2], (700, 500))]
    tok = metaspace_bpe()
    return dict(
        root=root,
        model=model,
        tokenizers=(with_bos, without_bos),
        texts=texts,
        evaluated=tiny_model("qwen2", len(tok), seed=2),
        tokenizer=tok,
    )


def _compute(metric, setup, **kwargs):
    return metric.compute(
        predictions=setup["texts"],
        model=setup["evaluated"],
        tokenizer=setup["tokenizer"],
        trunc_len=K,
        sliding_window=D,
        alpha=ALPHA,
        beta=BETA,
        progress=False,
        **kwargs,
    )


@pytest.mark.parametrize("given", ["object", "folder"])
def test_another_tokenizer_does_not_reuse_rows(two_tokenizers, tmp_path, given):
    metric = evaluate.load(longppl.METRIC_PATH)
    setup, path = two_tokenizers, str(tmp_path / "cache")
    if given == "object":
        evaluators = [dict(evaluator_model=setup["model"], evaluator_tokenizer=tok) for tok in setup["tokenizers"]]
    else:
        evaluators = [
            dict(evaluator_model_id=str(setup["root"] / name), device="cpu", torch_dtype="float32")
            for name in ("bos", "nobos")
        ]
    first = _compute(metric, setup, key_tokens=path, **evaluators[0])
    second = _compute(metric, setup, key_tokens=path, **evaluators[1])
    live = _compute(metric, setup, **evaluators[1])
    assert second["n_key_tokens"] == live["n_key_tokens"] and second["longppls"] == pytest.approx(live["longppls"])
    assert second["n_key_tokens"] != first["n_key_tokens"]
    cache = KeyTokenCache.load(path)
    assert [c["rows"] for c in cache.configurations()] == [2, 2]
    lengths = sorted(len(cache.scores(row).input_ids) for row in range(4))
    assert lengths[0::2] == [n - 1 for n in lengths[1::2]]  # the same texts with and without BOS


# --- one evaluator, two spellings ------------------------------------------------------------------


def test_one_evaluator_under_two_spellings_is_one_combination(two_tokenizers, tmp_path, monkeypatch):
    import torch

    setup = two_tokenizers
    monkeypatch.chdir(setup["root"])
    relative, absolute = "bos", str(setup["root"] / "bos")
    rows = [
        synthetic_rows([text], 4, ModelIdentity.of_checkpoint(name, torch.float32), KeyTokenSettings(K, D))
        for name, text in ((relative, setup["texts"][0]), (absolute, setup["texts"][1]))
    ]
    cache = KeyTokenCache(datasets.concatenate_datasets(rows))
    [combination] = cache.configurations()
    assert combination["rows"] == 2 and sorted(combination["evaluator_names"]) == sorted([relative, absolute])
    fingerprint = combination["evaluator_fingerprint"]
    for evaluator in (None, relative, absolute, "./bos", fingerprint[:22]):
        settings, found, selected = cache.select(evaluator)
        assert (found, selected, settings.trunc_len) == (fingerprint, [0, 1], K)
    assert "rows from evaluator bos = " in cache.describe() or f"rows from evaluator {absolute} = " in cache.describe()
