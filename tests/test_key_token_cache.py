"""The key-token cache: schema, exact reuse through the metric, safe reuse, atomic writes, bad input."""

import copy
import hashlib
import os
import sys

import datasets
import evaluate
import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import govreport_texts, model_and_evaluator, tiny_model
from reference import evaluator_scores as reference_evaluator_scores

import longppl
import longppl.core.scoring
from longppl.cache.key_token_cache import CACHE_FEATURES, FORMAT_VERSION, KeyTokenCache, append_rows
from longppl.models.fingerprints import ModelIdentity, text_fingerprint
from longppl.settings import KeyTokenSettings

K, D = 47, 13
ALPHA, BETA = 0.005, -50.0


@pytest.fixture(scope="module")
def metric():
    return evaluate.load(longppl.METRIC_PATH)


@pytest.fixture(scope="module")
def setup():
    texts = [t[1000 : 1000 + size] for t, size in zip(govreport_texts()[:3], (900, 1400, 650))]
    return dict(model_and_evaluator(), texts=texts)


def run(metric, setup, **kwargs):
    args = {k: v for k, v in setup.items() if k != "texts"}
    args.update(predictions=setup["texts"], trunc_len=K, sliding_window=D, alpha=ALPHA, beta=BETA, progress=False)
    args.update(kwargs)
    return metric.compute(**args)


def count_forward_calls(model):
    """A list that grows by one per forward pass of ``model`` (full model or backbone alone)."""
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls


def metric_module(metric):
    return sys.modules["longppl.metric.compute"]  # what the metric file delegates to


@pytest.fixture(scope="module")
def built(metric, setup, tmp_path_factory):
    """A cache of the three texts built through the metric, and the live (uncached) result."""
    path = str(tmp_path_factory.mktemp("built") / "cache")
    live = run(metric, setup)
    cached = run(metric, setup, key_tokens=path)
    return dict(path=path, live=live, cached=cached)


def assert_same_results(a, b):
    assert a["n_key_tokens"] == pytest.approx(b["n_key_tokens"], rel=1e-6)
    assert a["n_tokens"] == b["n_tokens"]
    assert a["longppls"] == pytest.approx(b["longppls"], rel=1e-6)
    assert a["perplexities"] == pytest.approx(b["perplexities"], rel=1e-6)


def test_rows_hold_the_evaluator_scores_in_a_plain_arrow_schema(setup, built):
    dataset = datasets.load_from_disk(built["path"])
    assert dataset.features == CACHE_FEATURES
    assert not any(isinstance(field.type, pa.ExtensionType) for field in dataset.data.schema)
    assert len(dataset) == 3 and set(dataset["format_version"]) == {FORMAT_VERSION}
    assert dataset["text_fingerprint"] == [hashlib.sha256(t.encode()).hexdigest() for t in setup["texts"]]
    assert set(dataset["trunc_len"]) == {K} and set(dataset["sliding_window"]) == {D}
    assert set(dataset["add_special_tokens"]) == {True} and set(dataset["window_bos"]) == {False}
    identity = ModelIdentity.of_model(setup["evaluator_model"], setup["evaluator_tokenizer"])
    assert dataset["evaluator_fingerprint"][0] == identity.fingerprint
    args = (setup["evaluator_model"], setup["evaluator_tokenizer"])
    live = longppl.score_with_evaluator(
        *args, setup["texts"], KeyTokenSettings(K, D), progress=False, per_document=True
    )
    for text, row, scores in zip(setup["texts"], dataset, live):
        assert row["text"] == text
        assert np.array_equal(row["input_ids"], scores.input_ids) and np.array_equal(row["offsets"], scores.offsets)
        assert np.array_equal(row["lp_long"], scores.lp_long, equal_nan=True)
        assert np.array_equal(row["lp_short"], scores.lp_short, equal_nan=True)
    # and the plain reference (one window per forward, full logits), on the shortest text
    ids, offsets, lp_long, lp_short = reference_evaluator_scores(*args, setup["texts"][2], K, D)
    row = dataset[2]
    assert row["input_ids"] == ids and row["offsets"] == offsets
    stored_long, stored_short = np.array(row["lp_long"]), np.array(row["lp_short"])
    assert np.isnan(stored_long[0]) and np.isnan(stored_short[:K]).all() and not np.isnan(stored_short[K:]).any()
    np.testing.assert_allclose(stored_long[1:], lp_long[1:], rtol=1e-5)
    np.testing.assert_allclose(stored_short[K:], lp_short[K:], rtol=1e-5)


def test_per_document_scores_do_not_depend_on_the_other_texts(setup):
    args = (setup["evaluator_model"], setup["evaluator_tokenizer"])
    together = longppl.score_with_evaluator(
        *args, setup["texts"], KeyTokenSettings(K, D), progress=False, per_document=True
    )
    for text, scores in zip(setup["texts"], together):
        (alone,) = longppl.score_with_evaluator(
            *args, [text], KeyTokenSettings(K, D), progress=False, per_document=True
        )
        assert np.array_equal(alone.lp_long, scores.lp_long, equal_nan=True)
        assert np.array_equal(alone.lp_short, scores.lp_short, equal_nan=True)


@pytest.mark.parametrize(
    "options",
    [{}, dict(alpha=0.02, beta=-7.0), dict(soft=True, gamma=1.05), dict(use_lcl=False, beta=-1.0)],
    ids=["defaults", "other-thresholds", "soft", "no-lcl"],
)
def test_cached_compute_equals_live_compute_without_evaluator_passes(metric, setup, built, options):
    live = run(metric, setup, **options)
    assert_same_results(built["cached"], built["live"])
    calls = count_forward_calls(setup["evaluator_model"])
    with_evaluator = run(metric, setup, key_tokens=built["path"], **options)
    without_evaluator = run(
        metric, setup, key_tokens=built["path"], evaluator_model=None, evaluator_tokenizer=None, **options
    )
    assert calls == []
    assert_same_results(with_evaluator, live)
    assert_same_results(without_evaluator, live)
    assert sum(live["n_key_tokens"]) > 0


def test_evaluator_given_by_path_is_not_loaded_when_every_text_is_cached(metric, setup, tmp_path, monkeypatch):
    folder = str(tmp_path / "evaluator")
    setup["evaluator_model"].save_pretrained(folder)
    setup["evaluator_tokenizer"].save_pretrained(folder)
    by_path = dict(setup, evaluator_model=None, evaluator_tokenizer=None)
    path = str(tmp_path / "cache")
    first = run(metric, by_path, key_tokens=path, evaluator_model_id=folder, device="cpu", torch_dtype="float32")
    loaded = []
    real = metric_module(metric).load_causal_lm
    monkeypatch.setattr(metric_module(metric), "load_causal_lm", lambda name, *a: loaded.append(name) or real(name, *a))
    again = run(metric, by_path, key_tokens=path, evaluator_model_id=folder, device="cpu", torch_dtype="float32")
    assert loaded == []
    assert_same_results(again, first)
    # another dtype is another evaluator: loaded and run, rows added beside the float32 ones
    run(metric, by_path, key_tokens=path, evaluator_model_id=folder, device="cpu", torch_dtype="bfloat16")
    assert loaded == [folder]
    assert sorted(c["evaluator_dtype"] for c in KeyTokenCache.load(path).configurations()) == ["bfloat16", "float32"]


def test_adding_documents_scores_only_the_new_ones(metric, setup, tmp_path, monkeypatch):
    path = str(tmp_path / "cache")
    run(metric, setup, key_tokens=path, predictions=setup["texts"][:2])
    before = KeyTokenCache.load(path)
    old_rows = [before.scores(i) for i in range(2)]
    scored = []
    module = metric_module(metric)
    real = module.score_with_evaluator
    monkeypatch.setattr(
        module,
        "score_with_evaluator",
        lambda ev, tok, texts, *a, **k: scored.extend(texts) or real(ev, tok, texts, *a, **k),
    )
    result = run(metric, setup, key_tokens=path)
    assert scored == [setup["texts"][2]]
    after = KeyTokenCache.load(path)
    assert len(after) == 3
    for old, row in zip(old_rows, after.find(setup["texts"][:2], _settings())):
        assert np.array_equal(after.scores(row).lp_short, old.lp_short, equal_nan=True)
    assert_same_results(result, run(metric, setup))


def _settings(**changes):
    from longppl.cache.key_token_cache import KeyTokenSettings

    return KeyTokenSettings(**dict(dict(trunc_len=K, sliding_window=D), **changes))


def test_other_evaluator_is_recomputed_and_other_settings_are_an_error(metric, setup, built, tmp_path):
    path = str(tmp_path / "cache")
    KeyTokenCache.load(built["path"]).save(path)
    other = dict(setup, evaluator_model=tiny_model("llama", len(setup["evaluator_tokenizer"]), seed=11))
    calls = count_forward_calls(other["evaluator_model"])
    result = run(metric, other, key_tokens=path)
    assert len(calls) > 0
    assert_same_results(result, run(metric, other))
    assert [c["rows"] for c in KeyTokenCache.load(path).configurations()] == [3, 3]
    with pytest.raises(ValueError, match="rows of 2 evaluators for these texts"):
        run(metric, setup, key_tokens=path, evaluator_model=None, evaluator_tokenizer=None)
    no_evaluator = dict(evaluator_model=None, evaluator_tokenizer=None)
    for changed, shown in [
        (dict(trunc_len=41), "trunc_len=41"),
        (dict(window_bos=True), "window_bos=True"),
        (dict(evaluator_add_special_tokens=False), "add_special_tokens=False"),
    ]:
        with pytest.raises(ValueError, match=rf"no rows for 3 of 3 texts \(predictions \[0, 1, 2\]\) with .*{shown}"):
            run(metric, setup, key_tokens=built["path"], **no_evaluator, **changed)


def test_missing_texts_without_evaluator_are_listed(metric, setup, tmp_path):
    path = str(tmp_path / "cache")
    run(metric, setup, key_tokens=path, predictions=setup["texts"][1:])
    with pytest.raises(ValueError, match=r"no rows for 1 of 3 texts \(predictions \[0\]\).*it holds 2 rows"):
        run(metric, setup, key_tokens=path, evaluator_model=None, evaluator_tokenizer=None)
    with pytest.raises(FileNotFoundError, match="No key-token cache at"):
        run(metric, setup, key_tokens=str(tmp_path / "nowhere"), evaluator_model=None, evaluator_tokenizer=None)


def test_a_dataset_object_is_used_and_updated_in_memory(metric, setup, built, tmp_path):
    # A Parquet round trip is what push_to_hub / load_dataset do to the cache.
    parquet = str(tmp_path / "cache.parquet")
    datasets.load_from_disk(built["path"]).select([0, 2]).to_parquet(parquet)
    dataset = datasets.Dataset.from_parquet(parquet)
    result = run(metric, setup, key_tokens=dataset)
    assert_same_results(result, built["live"])
    assert len(dataset) == 2 and os.listdir(tmp_path) == ["cache.parquet"]


def test_a_sharded_cache_shared_as_the_hub_serves_it_gives_the_same_results(metric, setup, built, tmp_path):
    """A cache of shards, never compacted, opened by datasets and shared: what
    ``datasets.load_from_disk(path).push_to_hub(repo)`` uploads (datasets writes each of its shards
    ``shard(n, i, contiguous=True).to_parquet(...)`` as ``data/train-0000i-of-0000n.parquet``),
    read back by ``load_dataset`` from such a folder, as from the repository. (The Hub itself is
    out of reach here; the upload is not exercised.)"""
    rows = KeyTokenCache.load(built["path"]).dataset
    path = str(tmp_path / "cache")
    append_rows(path, rows.select([0]))
    append_rows(path, rows.select([1, 2]))
    shared = datasets.load_from_disk(path)
    assert len(shared.cache_files) == 2  # the two shards themselves, memory-mapped
    hub = tmp_path / "hub"
    for index in range(2):
        shared.shard(2, index, contiguous=True).to_parquet(str(hub / "data" / f"train-{index:05d}-of-00002.parquet"))
    loaded = datasets.load_dataset(str(hub), split="train")
    assert loaded.features == CACHE_FEATURES and loaded["text"] == shared["text"] == rows["text"]
    for name in ("input_ids", "offsets"):
        assert loaded[name] == rows[name]
    for name in ("lp_long", "lp_short"):
        assert all(
            np.array_equal(a, b, equal_nan=True)
            for a, b in zip(loaded.with_format("numpy")[name], rows.with_format("numpy")[name])
        )
    assert_same_results(run(metric, setup, key_tokens=loaded), built["live"])
    assert_same_results(run(metric, setup, key_tokens=path), built["live"])


def test_not_a_cache_or_an_incompatible_one(metric, setup, built, tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is not a key-token cache: it is not a directory written by datasets"):
        KeyTokenCache.load(str(junk))
    other = str(tmp_path / "other")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(other)
    with pytest.raises(
        ValueError, match=r"is a datasets folder that is not a LongPPL key-token cache \(its columns are \['text'\]\)"
    ):
        run(metric, setup, key_tokens=other)
    old = str(tmp_path / "old")
    dataset = datasets.load_from_disk(built["path"])
    dataset.map(lambda row: {"format_version": 0}).save_to_disk(old)
    with pytest.raises(
        ValueError,
        match=r"written in key-token cache format \[0\], but this version of longppl "
        r"reads format 2",
    ):
        run(metric, setup, key_tokens=old)
    extra = str(tmp_path / "extra")
    dataset.add_column("note", ["x"] * 3).save_to_disk(extra)
    with pytest.raises(ValueError, match=r"unexpected columns \['note'\]"):
        KeyTokenCache.load(extra)
    with pytest.raises(ValueError, match="is a DatasetDict with splits \\['train'\\].*pass one split"):
        run(metric, setup, key_tokens=datasets.DatasetDict(train=dataset))
    with pytest.raises(TypeError, match="key_tokens is a int; pass the directory"):
        run(metric, setup, key_tokens=3)


def test_interrupted_save_leaves_the_previous_cache(built, setup, tmp_path, monkeypatch):
    path = str(tmp_path / "cache")
    cache = KeyTokenCache.load(built["path"])
    cache.save(path)
    rows = datasets.load_from_disk(path).select([0])

    def broken_save(self, folder, *args, **kwargs):
        with open(os.path.join(folder, "data-00000-of-00001.arrow"), "wb") as handle:
            handle.write(b"half")
        raise KeyboardInterrupt("killed while saving")

    fresh = KeyTokenCache.load(path)
    fresh.add(rows.map(lambda row: {"trunc_len": 5}))
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", broken_save)
    with pytest.raises(KeyboardInterrupt):
        fresh.save()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["cache"]
    assert len(KeyTokenCache.load(path)) == 3
    # Killed between the two renames of the swap: the previous copy is put back on the next open.
    os.rename(path, str(tmp_path / ".cache.previous"))
    assert len(KeyTokenCache.load(path)) == 3 and os.listdir(tmp_path) == ["cache"]


def test_fingerprints_follow_weights_dtype_and_files(setup, tmp_path):
    evaluator = setup["evaluator_model"]
    identity = ModelIdentity.of_model(evaluator)
    assert ModelIdentity.of_model(copy.deepcopy(evaluator)) == identity
    tuned = copy.deepcopy(evaluator)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.mul_(1.001)
    assert ModelIdentity.of_model(tuned).fingerprint != identity.fingerprint
    assert ModelIdentity.of_model(copy.deepcopy(evaluator).to(torch.bfloat16)).fingerprint != identity.fingerprint
    evaluator.save_pretrained(tmp_path / "a")
    evaluator.save_pretrained(tmp_path / "b")
    tuned.save_pretrained(tmp_path / "c")
    a, b, c = (ModelIdentity.of_checkpoint(str(tmp_path / n), torch.float32) for n in "abc")
    assert a.fingerprint == b.fingerprint != c.fingerprint and a.fingerprint.startswith("checkpoint:")
    assert ModelIdentity.of_checkpoint(str(tmp_path / "a"), torch.bfloat16).fingerprint != a.fingerprint
    assert text_fingerprint("é") == hashlib.sha256("é".encode()).hexdigest()


def test_rows_are_chunked_below_arrow_offset_limits_and_re_added_rows_replace(built, monkeypatch):
    import longppl.cache.key_token_cache as module
    import longppl.cache.schema as schema

    cache = KeyTokenCache.load(built["path"])
    texts = cache.texts(range(3))
    scores = [cache.scores(row) for row in range(3)]
    identity = ModelIdentity("ev", "", "float32", cache.row(0)["evaluator_fingerprint"])
    whole = module.key_token_rows(texts, scores, _settings(), identity)
    monkeypatch.setattr(schema, "_MAX_CHUNK_ITEMS", max(len(s.input_ids) for s in scores))  # one row per chunk
    rows = module.key_token_rows(texts, scores, _settings(), identity)
    assert whole.data.column("lp_long").num_chunks == 1 and rows.data.column("lp_long").num_chunks == 3
    assert rows.to_dict()["offsets"] == whole.to_dict()["offsets"] and rows["text"] == whole["text"]
    # Re-adding a row with the same key replaces it (here: changed log-probs of text 1).
    changed = copy.deepcopy(scores[1])
    changed.lp_long[1:] -= 1.0
    cache.add(module.key_token_rows([texts[1]], [changed], _settings(), identity))
    assert len(cache) == 3 and cache.texts(range(3)) == [texts[0], texts[2], texts[1]]
    assert np.array_equal(cache.scores(cache.find([texts[1]], _settings())[0]).lp_long, changed.lp_long, equal_nan=True)
    assert [cache.row(i)["evaluator_name"] for i in range(3)] == ["", "", "ev"]


def test_packed_documents_share_passes_and_keep_each_alone_result_up_to_rounding(setup):
    """``pack_documents``: documents of the same length share (unpadded) forward passes, and each
    gets the scores it gets alone, up to float rounding (the kernels may sum in another order for
    another number of rows, e.g. on several CPU threads); without it, each has passes of its own."""
    evaluator, tokenizer = setup["evaluator_model"], setup["evaluator_tokenizer"]
    cut = longppl.core.scoring.truncate_texts([t[2000:6000] for t in govreport_texts()[:6]], tokenizer, 120)
    texts = [t for t in cut if len(tokenizer(t)["input_ids"]) == 121][:4]  # 120 tokens and the BOS
    assert len(texts) >= 3
    calls = count_forward_calls(evaluator)
    options = dict(progress=False, per_document=True)
    together = longppl.score_with_evaluator(
        evaluator, tokenizer, texts, KeyTokenSettings(K, D), pack_documents=True, **options
    )
    # one long pass and one pass per window length (47 + 13 = 60 and the tail), not two per document
    assert 2 <= len(calls) < 2 * len(texts)
    calls.clear()
    longppl.score_with_evaluator(evaluator, tokenizer, texts, KeyTokenSettings(K, D), **options)
    assert len(calls) == 2 * len(texts)  # the default: two passes of its own per document
    for text, scores in zip(texts, together):
        alone = longppl.score_with_evaluator(evaluator, tokenizer, [text], KeyTokenSettings(K, D), **options)[0]
        np.testing.assert_allclose(scores.lp_long, alone.lp_long, rtol=0, atol=1e-5)
        np.testing.assert_allclose(scores.lp_short, alone.lp_short, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="pack_documents=True needs per_document=True"):
        longppl.score_with_evaluator(
            evaluator, tokenizer, texts, KeyTokenSettings(K, D), progress=False, pack_documents=True
        )


def test_the_cache_setting_is_used_when_k_and_d_are_not_passed(metric, setup, built, tmp_path):
    def run_without_window(key_tokens, **kwargs):  # no evaluator, and K, d not passed
        args = dict(predictions=setup["texts"], model=setup["model"], tokenizer=setup["tokenizer"])
        return metric.compute(**args, key_tokens=key_tokens, alpha=ALPHA, beta=BETA, progress=False, **kwargs)

    out = run_without_window(built["path"])  # the cache holds one setting (K, D): it is used, and said
    assert_same_results(out, built["cached"])
    assert (out["settings"]["trunc_len"], out["settings"]["sliding_window"]) == (K, D)
    assert out["settings"]["window_from"] == "key_tokens" and built["cached"]["settings"]["window_from"] == "arguments"
    # a second setting: the caller must choose, and the error lists both
    path = str(tmp_path / "two")
    cache = KeyTokenCache.load(built["path"])
    cache.add(cache.dataset.map(lambda row: {"sliding_window": 7}))
    cache.save(path)
    with pytest.raises(
        ValueError,
        match=f"holds rows with 2 settings of K and d \\(trunc_len={K}, sliding_window=7; trunc_len={K}, sliding_window={D}\\).*pass them",
    ):
        run_without_window(path)
    assert_same_results(run_without_window(path, sliding_window=D), built["cached"])  # K from the cache


def test_an_evaluator_is_chosen_by_each_form_the_messages_and_docs_show():
    """Two evaluators in one cache: the full stored name, another spelling of its path, its folder name
    and the start of its fingerprint (with or without ``checkpoint:``, as ``describe`` prints it) all
    pick it; a form shared by both is one error line listing both."""
    from longppl.cache.key_token_cache import KeyTokenSettings, key_token_rows
    from longppl.core.scoring import EvaluatorScores

    def rows(text, name, fingerprint):
        n = 3
        scores = EvaluatorScores(
            np.arange(n), np.stack([np.arange(n), np.arange(n) + 1], 1), np.zeros(n), np.full(n, np.nan)
        )
        return key_token_rows([text], [scores], KeyTokenSettings(K, D), ModelIdentity(name, "", "float32", fingerprint))

    first, second = "checkpoint:88d3ba6040b1" + "0" * 52, "checkpoint:12ab34cd56ef" + "0" * 52
    cache = KeyTokenCache(
        datasets.concatenate_datasets(
            [
                rows("abc", "/data/models/evaluator", first),
                rows("abc", "/data/other/judge/", second),
            ]
        )
    )
    assert "checkpoint:88d3ba6040b…" in cache.describe()
    for form in (
        "/data/models/evaluator",
        "/data/models/../models/evaluator",
        "evaluator",
        "88d3ba6040b",
        "checkpoint:88d3",
        "88d3ba6040b1000",
    ):
        assert cache.select(form)[1] == first, form
    assert cache.select("judge")[1] == second and cache.select("12ab")[1] == second
    with pytest.raises(ValueError) as err:
        cache.select()
    message = str(err.value)
    assert "\n" not in message and "/data/models/evaluator [88d3ba6040b1]" in message and "[12ab34cd56ef]" in message
    with pytest.raises(ValueError, match="0 evaluator/settings combinations .*evaluator=nobody"):
        cache.select("nobody")
    with pytest.raises(ValueError, match="2 evaluator/settings combinations .*candidates"):
        cache.select("checkpoint:")


#: The names ``key_token_cache`` offered when it was one file; they stay importable from it.
CACHE_NAMES = (
    "CACHE_FEATURES",
    "CHECKSUM_FILE",
    "FORMAT_VERSION",
    "CacheDamagedError",
    "KeyTokenCache",
    "KeyTokenSettings",
    "append_rows",
    "cache_directory",
    "cached_evaluator_scores",
    "check_cache_dataset",
    "compact_cache",
    "key_token_rows",
    "open_cache",
    "repair_cache",
    "verify_checksums",
    "write_failed",
)


def test_the_cache_room_is_split_by_concern():
    """Storage and integrity apart from lookup and use: the modules on disk never import the cache
    object, what a row is (``schema``) touches no file, no module is over 500 lines, and every name
    of the one-file ``key_token_cache`` is still importable from it."""
    import ast

    import longppl.cache.key_token_cache as module

    room = os.path.dirname(module.__file__)

    def imported(name: str) -> set[str]:
        with open(os.path.join(room, name), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        return found | {(node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}

    for name in sorted(os.listdir(room)):
        if name.endswith(".py"):
            with open(os.path.join(room, name), encoding="utf-8") as handle:
                assert len(handle.read().splitlines()) <= 500, f"cache/{name} is over 500 lines"
    for name in ("storage.py", "integrity.py", "schema.py", "shards.py"):
        assert "key_token_cache" not in imported(name), f"cache/{name} imports the cache object"
    assert not {"os", "shutil", "tempfile", "atomic_files", "storage", "integrity"} & imported("schema.py")
    assert [name for name in CACHE_NAMES if not hasattr(module, name)] == []
    assert set(CACHE_NAMES) <= set(module.__all__)
