"""`from longppl import compute_longppl` behaves like the official 0.3.0 package, with safe files."""

import ast
import json
import os

import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model
from reference import longppl_document

import longppl.metric.official as official
from longppl import compute_longppl, find_key_token, load_key_token
from longppl.atomic_files import write_file_atomically
from longppl.models.fingerprints import text_fingerprint

K, D, ALPHA, BETA = 41, 17, 0.005, -50.0


@pytest.fixture(scope="module")
def models():
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    return dict(
        model=tiny_model("mistral", len(tok), seed=4),
        tokenizer=tok,
        evaluator_model=tiny_model("gpt2", len(ev_tok), seed=5),
        evaluator_tokenizer=ev_tok,
    )


@pytest.fixture(scope="module")
def text():
    return govreport_texts()[7][2000:3100]


def call(text, models, **kwargs):
    args = dict(models, trunc_len=K, sliding_window=D, alpha=ALPHA, beta=BETA)
    args.update(kwargs)
    return compute_longppl(text, **args)


def test_same_numbers_and_keys_as_the_official_algorithm(models, text, tmp_path):
    out = call(text, models, save_path=str(tmp_path / "spans.json"))
    ref = longppl_document(
        text,
        models["model"],
        models["tokenizer"],
        models["evaluator_model"],
        models["evaluator_tokenizer"],
        K,
        D,
        ALPHA,
        BETA,
    )
    assert set(out) == {"longppl", "n_key_token", "ppl", "n_token"}
    assert out["n_key_token"] == ref["n_key"] > 0
    assert out["n_token"] == ref["n_tokens"]
    assert out["longppl"] == pytest.approx(ref["longppl"], rel=1e-5)
    assert out["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)


def json_payload(spans, text):
    """A key-span file as earlier versions of this library wrote it (JSON naming its text)."""
    return {
        "format": official.KEY_SPANS_FORMAT,
        "version": official.KEY_SPANS_VERSION,
        "text_sha256": text_fingerprint(text),
        "spans": spans,
    }


def official_load_key_token(save_path):
    """The official package's ``load_key_token``: the first line split at ``;``, each entry a Python
    literal (it calls ``eval``; ``ast.literal_eval`` accepts the same lists and runs nothing)."""
    with open(save_path, encoding="utf-8") as f:
        for line in f.readlines():
            return [ast.literal_eval(key_slice) for key_slice in line.split(";")]


def test_saved_spans_are_read_by_the_official_package_and_by_us(models, text, tmp_path):
    path = tmp_path / "slice_0.txt"
    spans = find_key_token(text, models["evaluator_model"], models["evaluator_tokenizer"], K, D, str(path), ALPHA, BETA)
    assert len(spans) > 1
    assert official_load_key_token(str(path)) == spans.tolist() == load_key_token(str(path))
    older = tmp_path / "older.json"  # JSON written by earlier versions of this library is still read
    older.write_text(json.dumps(json_payload(spans.tolist(), text)))
    assert load_key_token(str(older), text) == spans.tolist()


def test_official_positional_call_and_module_path(models, text):
    from longppl.longppl import compute_longppl as from_submodule  # the official scripts' import

    positional = from_submodule(
        text,
        models["model"],
        models["evaluator_model"],
        models["tokenizer"],
        models["evaluator_tokenizer"],
        None,
        K,
        D,
        ALPHA,
        BETA,
    )
    assert positional == call(text, models)


def test_saved_spans_are_reused_without_evaluator(models, text, tmp_path):
    path = tmp_path / "key" / "slice_0.txt"
    first = call(text, models, save_path=str(path))
    spans = find_key_token(text, models["evaluator_model"], models["evaluator_tokenizer"], K, D, None, ALPHA, BETA)
    assert path.read_text() == ";".join(f"[{a}, {b}]" for a, b in spans.tolist())  # the official format
    again = call(text, dict(models, evaluator_model=None), save_path=str(path))
    assert again == first
    assert os.listdir(path.parent) == ["slice_0.txt"]  # no temporary files left behind


def test_reads_official_span_files(models, text, tmp_path):
    spans = find_key_token(text, models["evaluator_model"], models["evaluator_tokenizer"], K, D, None, ALPHA, BETA)
    path = tmp_path / "slice_0.txt"
    path.write_text(";".join(f"[{a}, {b}]" for a, b in spans.tolist()), encoding="utf-8")
    assert load_key_token(str(path)) == spans.tolist()
    assert call(text, dict(models, evaluator_model=None), save_path=str(path)) == call(text, models)


def test_span_files_are_never_evaluated(tmp_path):
    path = tmp_path / "evil.txt"
    marker = tmp_path / "pwned"
    path.write_text(f"[1, 2];__import__('pathlib').Path({str(marker)!r}).touch()", encoding="utf-8")
    with pytest.raises(ValueError, match="neither a JSON key-span file nor the official"):
        load_key_token(str(path))
    assert not marker.exists()


def test_bad_span_files_and_arguments(models, text, tmp_path):
    with pytest.raises(FileNotFoundError, match="No key-span file"):
        load_key_token(str(tmp_path / "missing.json"))
    other = tmp_path / "other.json"  # the JSON of earlier versions, which names its text
    other.write_text(json.dumps(json_payload([[1, 4]], "a different text")))
    with pytest.raises(ValueError, match="computed for a different text"):
        call(text, dict(models, evaluator_model=None), save_path=str(other))
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"format": "something-else", "spans": []}))
    with pytest.raises(ValueError, match="not a key-span file of this library"):
        load_key_token(str(foreign))
    with pytest.raises(ValueError, match="save_path, which is None"):
        call(text, dict(models, evaluator_model=None))
    with pytest.raises(ValueError, match="model object, so its tokenizer must be given"):
        call(text, dict(models, tokenizer=None))


def test_arguments_in_another_order_are_one_error_naming_the_order(models, text):
    m, tok, ev, ev_tok = (models[k] for k in ("model", "tokenizer", "evaluator_model", "evaluator_tokenizer"))
    order = r"compute_longppl takes \(text, model, evaluator_model, tokenizer, evaluator_tokenizer"
    with pytest.raises(ValueError, match=r"evaluator_model is a \w+, not a model or its Hub id / path; " + order):
        compute_longppl(text, m, tok, ev, ev_tok)  # the tokenizer right after its model
    with pytest.raises(ValueError, match=rf"^tokenizer is a {type(ev).__name__}, not a tokenizer; " + order):
        compute_longppl(text, m, ev, ev, ev_tok)  # a model where its tokenizer goes
    with pytest.raises(ValueError, match=r"model is a dict, not a model"):
        compute_longppl(text, {"model": m}, ev, tok, ev_tok)


def test_interrupted_save_keeps_previous_file(models, text, tmp_path, monkeypatch):
    path = tmp_path / "spans.json"
    call(text, models, save_path=str(path))
    before = path.read_text()

    def broken_dump(*args, **kwargs):
        raise KeyboardInterrupt("interrupted while writing")

    monkeypatch.setattr(official, "write_file_atomically", lambda path, write: write_file_atomically(path, broken_dump))
    with pytest.raises(KeyboardInterrupt):
        official.save_key_spans(str(path), np.array([[0, 1]]))
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["spans.json"]


def test_a_save_path_that_is_a_link_is_written_through(models, text, tmp_path):
    target = tmp_path / "store" / "spans.txt"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "spans-link.txt"
    link.symlink_to(target)
    out = call(text, models, save_path=str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)  # still the user's link
    assert target.read_text() != "old" and official_load_key_token(str(target)) == load_key_token(str(link))
    assert call(text, dict(models, evaluator_model=None), save_path=str(link)) == out
    # the temporary file went beside the target (one rename), and nothing is left beside either
    assert sorted(os.listdir(tmp_path)) == ["spans-link.txt", "store"] and os.listdir(target.parent) == ["spans.txt"]
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError, match="symbolic links"):
        official.save_key_spans(str(loop), np.array([[0, 1]]))
    assert loop.is_symlink()


def test_no_key_tokens_returns_none_like_official(models, text):
    with pytest.warns(UserWarning, match="No key tokens"):
        out = call(text, models, alpha=100.0)
    assert out["longppl"] is None and out["n_key_token"] is None and out["ppl"] > 1


def test_model_given_as_path(models, text, tmp_path):
    models["model"].save_pretrained(tmp_path / "m")
    models["tokenizer"].save_pretrained(tmp_path / "m")
    by_path = call(text, dict(models, tokenizer=None, model=str(tmp_path / "m")))
    assert by_path["n_key_token"] == call(text, models)["n_key_token"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trunc_len=0), "trunc_len must be an integer >= 1, got 0"),
        (dict(trunc_len=-5), "trunc_len must be an integer >= 1, got -5"),
        (dict(sliding_window=-1), "sliding_window must be an integer >= 1, got -1"),
        (dict(alpha=float("nan")), "alpha must be a finite number, got nan"),
        (dict(beta=float("inf")), "beta must be a finite number, got inf"),
    ],
)
def test_arguments_are_checked_as_in_the_metric(models, text, kwargs, message):
    with pytest.raises(ValueError, match=message):
        call(text, models, **kwargs)
    with pytest.raises(ValueError, match=message):
        find_key_token(
            text,
            models["evaluator_model"],
            models["evaluator_tokenizer"],
            **dict(dict(trunc_len=K, sliding_window=D, alpha=ALPHA, beta=BETA), **kwargs),
        )


def test_tokenizer_of_another_model_is_named(models, text):
    with pytest.raises(ValueError, match=r"The model's tokenizer gives token id \d+ .*only 50 token embeddings"):
        call(text, dict(models, model=tiny_model("mistral", 50, seed=4)))
    with pytest.raises(ValueError, match=r"The evaluator's tokenizer gives token id \d+ .*only 50 token embeddings"):
        call(text, dict(models, evaluator_model=tiny_model("gpt2", 50, seed=5)))
    with pytest.raises(ValueError, match="text must be a non-empty string"):
        call(["a list"], models)


def test_official_span_files_with_numbers_that_are_not_offsets(models, text, tmp_path):
    path = tmp_path / "slice_0.txt"
    path.write_text("[1, 4];[99999999999999999999999, 99999999999999999999999]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"span 1 \[99999999999999999999999, .*\] ends past the text"):
        load_key_token(str(path))
    path.write_text("[1, 4];[10, 7]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"span 1 \[10, 7\] is not a character span \(0 <= start <= end\)"):
        load_key_token(str(path))
    path.write_text(f"[1, 4];[10, {len(text) + 5}]", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"span 1 \[10, {len(text) + 5}\] ends past the text \(the text has"):
        call(text, dict(models, evaluator_model=None), save_path=str(path))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(json.dumps(json_payload([[1, "4"]], text)))
    with pytest.raises(ValueError, match=r"span 0 \[1, '4'\] is not a pair of integers"):
        load_key_token(str(bad_json))


def test_spans_out_of_order_count_what_the_official_code_counts(models, text, tmp_path):
    """The official cal_overlap walks tokens and spans together; with reversed spans it reaches the
    tokens of the first span listed (the last in the text) and passes every other span."""
    from reference import full_log_probs, official_overlap

    spans = find_key_token(
        text, models["evaluator_model"], models["evaluator_tokenizer"], K, D, None, ALPHA, BETA
    ).tolist()
    assert len(spans) >= 3
    reversed_spans = spans[::-1]
    path = tmp_path / "slice_0.txt"
    path.write_text(";".join(f"[{a}, {b}]" for a, b in reversed_spans), encoding="utf-8")
    with pytest.warns(UserWarning, match="not in text order.*counted as the official code counts them"):
        out = call(text, dict(models, evaluator_model=None), save_path=str(path))
    enc = models["tokenizer"](text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
    key = [i for i in official_overlap(offsets, reversed_spans) if i >= 1]
    full = full_log_probs(models["model"], ids)
    key_nll = [-float(full[i - 1, ids[i]]) for i in key]
    assert out["n_key_token"] == len(key) > 0
    assert out["longppl"] == pytest.approx(float(np.exp(np.mean(key_nll))), rel=1e-5)


def test_model_path_that_does_not_exist(models, text, tmp_path):
    missing = str(tmp_path / "nonexistent")
    with pytest.raises(ValueError, match=r"evaluator_model='.*nonexistent' is not an existing directory \(no such"):
        call(text, dict(models, evaluator_model=missing, evaluator_tokenizer=None))
