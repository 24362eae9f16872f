"""The evaluate module: loading, exact values against the plain reference, options, bad input."""

import copy
import json
import math
import os
import warnings

import evaluate
import pytest
from helpers import SlowByteTokenizer, byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model
from reference import full_log_probs, longppl_document
from transformers import LlamaConfig, LlamaModel

import longppl
import longppl.models.loading
import longppl.settings

K, D = 47, 13  # neither divides the document lengths
ALPHA, BETA = 0.005, -50.0  # random tiny models: LSD is small, LCL is about -log(vocab)


@pytest.fixture(scope="module")
def metric(repo_root):
    cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        return evaluate.load("metrics/longppl")
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def setup():
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    evaluator = tiny_model("llama", len(ev_tok), seed=1)
    model = tiny_model("qwen2", len(tok), seed=2)
    texts = [t[1000 : 1000 + size] for t, size in zip(govreport_texts()[:3], (900, 1400, 650))]
    return dict(model=model, tokenizer=tok, evaluator_model=evaluator, evaluator_tokenizer=ev_tok, texts=texts)


def run(metric, setup, **kwargs):
    predictions = kwargs.pop("predictions", setup["texts"])
    args = {k: v for k, v in setup.items() if k != "texts"}
    args.update(trunc_len=K, sliding_window=D, alpha=ALPHA, beta=BETA, progress=False)
    args.update(kwargs)
    return metric.compute(predictions=predictions, **args)


def test_compute_keeps_its_keyword_interface(metric, tmp_path):
    """The metric's keywords are declared once (``options.LongPPLOptions``): every one is documented
    in ``inputs_description``, and the defaults are the settings'."""
    import sys
    from dataclasses import fields

    from longppl.metric.options import LongPPLOptions, option_names

    module = sys.modules["longppl.metric.compute"]  # what the metric file delegates to
    assert len(option_names()) == 32 and "predictions" not in option_names()
    for name in ("predictions",) + option_names():
        assert f"    {name} (" in metric.inputs_description, f"{name} is not documented"
    defaults = {option.name: option.default for option in fields(LongPPLOptions)}
    window, rule = module.WindowSettings(), module.KeyTokenRule()
    # K and d default to None: the settings' defaults, or a key-token cache's own setting
    assert (defaults["trunc_len"], defaults["sliding_window"]) == (None, None)
    (tmp_path / "config.json").write_text("{}")  # a local model folder: checked, not loaded, and no Hub look-up
    options = LongPPLOptions(model_id=str(tmp_path), self_evaluation=True)
    request = module._Request.from_options(["a text"], options)
    assert request.evaluator_settings.window == window and request.rule == rule
    assert [defaults[name] for name in ("alpha", "beta", "use_lcl", "soft", "gamma")] == [
        rule.alpha,
        rule.beta,
        rule.use_lcl,
        rule.soft,
        rule.gamma,
    ]
    assert defaults["aggregation"] == longppl.settings.DEFAULT_AGGREGATION == "official"


def test_an_unknown_keyword_is_named_with_the_valid_ones(metric, setup):
    with pytest.raises(ValueError, match=r"unknown argument\(s\) trunc_length; it takes predictions and model_id, "):
        run(metric, setup, trunc_length=64)


def test_load_from_checkout_and_from_installed_path(metric, tmp_path, monkeypatch):
    assert type(metric).__name__ == "LongPPL" and metric.name == "longppl"  # evaluate's own: "long_ppl"
    assert list(metric.features) == ["predictions"]
    assert "fang2025wrong" in metric.citation and "trunc_len" in metric.inputs_description
    monkeypatch.chdir(tmp_path)  # another directory: the installed package's folder loads too
    again = evaluate.load(longppl.METRIC_PATH)
    assert type(again).__name__ == "LongPPL"


def test_values_equal_the_official_algorithm(metric, setup):
    result = run(metric, setup)
    refs = [
        longppl_document(
            text,
            setup["model"],
            setup["tokenizer"],
            setup["evaluator_model"],
            setup["evaluator_tokenizer"],
            K,
            D,
            ALPHA,
            BETA,
        )
        for text in setup["texts"]
    ]
    assert sorted(result) == [
        "longppl",
        "longppls",
        "mean_perplexity",
        "n_key_tokens",
        "n_tokens",
        "perplexities",
        "ppl",
        "settings",
    ]
    assert result["settings"] == dict(
        trunc_len=K,
        sliding_window=D,
        alpha=ALPHA,
        beta=BETA,
        use_lcl=True,
        soft=False,
        gamma=longppl.settings.DEFAULT_GAMMA,
        window_from="arguments",
    )
    assert result["n_key_tokens"] == [r["n_key"] for r in refs]
    assert result["n_tokens"] == [r["n_tokens"] for r in refs]
    assert all(r["n_key"] > 5 for r in refs)
    for got, ref in zip(result["longppls"], refs):
        assert got == pytest.approx(ref["longppl"], rel=1e-5)
    for got, ref in zip(result["perplexities"], refs):
        assert got == pytest.approx(ref["ppl"], rel=1e-5)
    # The default is the official evaluation script as it stands (since July 2025): per-text values
    # averaged in the log domain, weighted by key tokens (LongPPL) and by n_token (PPL).
    keys, tokens = sum(r["n_key"] for r in refs), sum(r["n_tokens"] for r in refs)
    official_longppl = math.exp(sum(r["n_key"] * math.log(r["longppl"]) for r in refs) / keys)
    official_ppl = math.exp(sum(r["n_tokens"] * math.log(r["ppl"]) for r in refs) / tokens)
    assert result["longppl"] == pytest.approx(official_longppl, rel=1e-5)
    assert result["ppl"] == pytest.approx(official_ppl, rel=1e-5)
    # The official script before July 2025: the same weights on the values themselves.
    before = run(metric, setup, aggregation="official-pre-2025-07")
    before_longppl = sum(r["n_key"] * r["longppl"] for r in refs) / keys
    before_ppl = sum(r["n_tokens"] * r["ppl"] for r in refs) / tokens
    assert before["longppl"] == pytest.approx(before_longppl, rel=1e-5)
    assert before["ppl"] == pytest.approx(before_ppl, rel=1e-5)
    # The same formulas on the metric's own per-text values, to float rounding: the rules are told apart
    # far beyond it (tiny random models give texts of similar perplexity, so the two rules are close).
    assert before["longppls"] == result["longppls"] and before["perplexities"] == result["perplexities"]
    per_text = list(zip(result["n_key_tokens"], result["longppls"], result["n_tokens"], result["perplexities"]))
    keys, tokens = sum(k for k, *_ in per_text), sum(n for _, _, n, _ in per_text)
    official_longppl = math.exp(sum(k * math.log(value) for k, value, _, _ in per_text) / keys)
    official_ppl = math.exp(sum(n * math.log(value) for _, _, n, value in per_text) / tokens)
    assert result["longppl"] == pytest.approx(official_longppl, rel=1e-12)
    assert result["ppl"] == pytest.approx(official_ppl, rel=1e-12)
    assert before["longppl"] == pytest.approx(sum(k * value for k, value, _, _ in per_text) / keys, rel=1e-12)
    assert before["ppl"] == pytest.approx(sum(n * value for _, _, n, value in per_text) / tokens, rel=1e-12)
    assert before["longppl"] > result["longppl"] * (1 + 1e-6) and before["ppl"] > result["ppl"] * (1 + 1e-6)
    # evaluate's perplexity metric: the plain mean of the per-text perplexities
    assert result["mean_perplexity"] == pytest.approx(sum(r["ppl"] for r in refs) / len(refs), rel=1e-5)
    pooled = run(metric, setup, aggregation="pooled")
    assert pooled["longppl"] == pytest.approx(
        math.exp(sum(r["key_nll"] for r in refs) / sum(r["n_key"] for r in refs)), rel=1e-5
    )
    assert pooled["ppl"] == pytest.approx(
        math.exp(sum(r["nll"] for r in refs) / sum(r["n_pred"] for r in refs)), rel=1e-5
    )


def test_no_lcl_condition_matches_reference(metric, setup):
    result = run(metric, setup, beta=-1.0, use_lcl=False)
    ref = longppl_document(
        setup["texts"][1],
        setup["model"],
        setup["tokenizer"],
        setup["evaluator_model"],
        setup["evaluator_tokenizer"],
        K,
        D,
        ALPHA,
        -1.0,
        use_lcl=False,
    )
    assert result["n_key_tokens"][1] == ref["n_key"] > 0
    with pytest.warns(UserWarning, match="no key tokens"):
        with_lcl = run(metric, setup, beta=-1.0)
    assert with_lcl["n_key_tokens"][1] == 0  # LCL > -1 is out of reach for a random model


def test_batching_does_not_change_results(metric, setup):
    small = run(metric, setup, max_tokens_per_batch=1)
    large = run(metric, setup, max_tokens_per_batch=100_000)
    assert small["n_key_tokens"] == large["n_key_tokens"]
    for a, b in zip(small["longppls"] + small["perplexities"], large["longppls"] + large["perplexities"]):
        assert a == pytest.approx(b, rel=1e-5)


def test_model_ids_and_paths(metric, setup, tmp_path):
    # A Llama-family evaluated model: transformers reloads a qwen2 folder's tokenizer as
    # Qwen2Tokenizer, which re-tokenizes differently from the tokenizer object saved there.
    setup = dict(setup, model=tiny_model("mistral", len(setup["tokenizer"]), seed=2))
    for name in ("model", "evaluator_model"):
        setup[name].save_pretrained(tmp_path / name)
    setup["tokenizer"].save_pretrained(tmp_path / "model")
    setup["evaluator_tokenizer"].save_pretrained(tmp_path / "evaluator_model")
    by_object = run(metric, setup)
    by_path = metric.compute(
        predictions=setup["texts"],
        model_id=str(tmp_path / "model"),
        evaluator_model_id=str(tmp_path / "evaluator_model"),
        trunc_len=K,
        sliding_window=D,
        alpha=ALPHA,
        beta=BETA,
        device="cpu",
        torch_dtype="float32",
        progress=False,
    )
    assert by_path["n_key_tokens"] == by_object["n_key_tokens"]
    assert by_path["longppl"] == pytest.approx(by_object["longppl"], rel=1e-5)


def test_soft_weights_match_character_average_reference(metric, setup):
    from reference import evaluator_scores, full_log_probs

    gamma = 1.05
    result = run(metric, setup, soft=True, gamma=gamma)
    text = setup["texts"][0]
    ids, offsets, lp_long, lp_short = evaluator_scores(
        setup["evaluator_model"], setup["evaluator_tokenizer"], text, K, D
    )
    # Each character: the mean weight of the evaluator tokens covering it (byte tokens of one character all do).
    covering = [[] for _ in text]
    for (a, b), lo, sh in zip(offsets, lp_long, lp_short):
        weight = 1.0 if math.isnan(sh) else min(math.exp(lo - sh), gamma)
        for c in range(a, b):
            covering[c].append(weight)
    per_char = [sum(ws) / len(ws) if ws else 1.0 for ws in covering]
    enc = setup["tokenizer"](text, add_special_tokens=False, return_offsets_mapping=True)
    full = full_log_probs(setup["model"], enc["input_ids"])
    num = den = 0.0
    for i in range(1, len(enc["input_ids"])):
        a, b = enc["offset_mapping"][i]
        w = sum(per_char[a:b]) / (b - a) if b > a else 1.0
        num += w * -float(full[i - 1, enc["input_ids"][i]])
        den += w
    assert result["longppls"][0] == pytest.approx(math.exp(num / den), rel=1e-5)
    assert result["n_key_tokens"][0] == pytest.approx(den, rel=1e-5)


def test_self_evaluation_opt_in(metric, setup):
    args = dict(setup)
    args.update(evaluator_model=None, evaluator_tokenizer=None)
    result = run(metric, args, self_evaluation=True)
    same = run(metric, setup, evaluator_model=setup["model"], evaluator_tokenizer=setup["tokenizer"])
    assert result["n_key_tokens"] == same["n_key_tokens"]
    assert result["longppl"] == pytest.approx(same["longppl"], rel=1e-6)


def test_progress_bar_reports_documents(metric, setup, capsys):
    run(metric, setup, progress=True, predictions=setup["texts"][:2])
    err = capsys.readouterr().err
    assert "LongPPL evaluator: long context" in err and "LongPPL: evaluated model" in err and "2/2" in err


def test_short_text_gets_nan_and_warning_others_still_scored(metric, setup):
    texts = [setup["texts"][0], "Only a few words here."]
    with pytest.warns(UserWarning, match=r"Texts \[1\] have at most trunc_len=47 evaluator tokens"):
        result = run(metric, setup, predictions=texts)
    assert math.isnan(result["longppls"][1]) and result["n_key_tokens"][1] == 0
    assert not math.isnan(result["longppls"][0]) and not math.isnan(result["perplexities"][1])
    assert result["longppl"] == pytest.approx(result["longppls"][0])


def test_no_key_tokens_anywhere_gives_nan_and_warning(metric, setup):
    with pytest.warns(UserWarning, match="corpus LongPPL is NaN") as caught:
        result = run(metric, setup, alpha=50.0)
    assert all(w.filename == __file__ for w in caught)  # warnings point at the caller's line
    assert math.isnan(result["longppl"]) and not math.isnan(result["ppl"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(predictions=[]), "predictions is empty"),
        (dict(predictions=["  "]), r"predictions\[0\] is an empty string"),
        (dict(predictions=["fine text", 17]), r"predictions\[1\] is a int, not a string"),
        (dict(alpha=float("inf")), "alpha must be a finite number"),
        (dict(beta=float("nan")), "beta must be a finite number"),
        (dict(trunc_len=0), "trunc_len must be an integer >= 1"),
        (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
        (dict(sliding_window=2.5), "sliding_window must be an integer >= 1"),
        (dict(gamma=0.0), "gamma must be > 0"),
        (dict(gamma=-1.0, soft=True), "gamma must be > 0"),
        (dict(max_tokens_per_batch=0), "max_tokens_per_batch must be an integer >= 1"),
        (dict(aggregation="mean"), "aggregation must be one of 'official', 'official-pre-2025-07', 'pooled'"),
        (dict(evaluator_model=None, evaluator_tokenizer=None), "No evaluator given.*self_evaluation=True"),
        (dict(self_evaluation=True), "do not pass an evaluator too"),
        (dict(tokenizer=None), "model is a model object, so pass its tokenizer too"),
        (dict(model_id="some/model"), "either model_id or model"),
        (
            dict(evaluator_model="models/evaluator", evaluator_tokenizer=None),
            r"evaluator_model='models/evaluator' is a Hub id or path: pass it as evaluator_model_id='models/evaluator'",
        ),
        (dict(predictions=None, references=["a long text"]), "takes no references: pass them as predictions="),
    ],
)
def test_bad_input_messages(metric, setup, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(metric, setup, **kwargs)


def test_model_without_causal_lm_head(metric, setup):
    bare = LlamaModel(
        LlamaConfig(
            vocab_size=len(setup["tokenizer"]),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    for role in ("model", "evaluator_model"):
        with pytest.raises(ValueError, match="LlamaModel is not a causal language model with an LM head"):
            run(metric, setup, **{role: bare})


def test_tokenizer_without_offsets_or_decoding(metric, setup):
    class Opaque(SlowByteTokenizer):
        def _decode(self, *args, **kwargs):
            raise NotImplementedError("no decoder")

    model = tiny_model("llama", 259)
    with pytest.raises(ValueError, match="Opaque gives no offset mapping and cannot decode"):
        run(metric, setup, model=model, tokenizer=Opaque())


def test_slow_tokenizer_model_is_scored(metric, setup):
    """A model whose tokenizer has no offset mapping is mapped through the decode fallback."""
    slow = SlowByteTokenizer()
    model = tiny_model("gpt2", 259, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decode round-trips: no approximate-alignment warning
        result = run(metric, setup, model=model, tokenizer=slow)
    byte_counts = [len(t.encode("utf-8")) for t in setup["texts"]]
    assert result["n_tokens"] == byte_counts
    assert all(n > 0 for n in result["n_key_tokens"])
    assert all(math.isfinite(v) for v in result["longppls"])


def test_max_length_counts_evaluator_tokens(metric, setup):
    max_length = 150
    result = run(metric, setup, max_length=max_length)
    cut = []
    for text in setup["texts"]:
        enc = setup["evaluator_tokenizer"](text, add_special_tokens=False, return_offsets_mapping=True)
        cut.append(text[: enc["offset_mapping"][max_length - 1][1]])
    expected = run(metric, setup, predictions=cut)
    for text in cut:
        assert len(setup["evaluator_tokenizer"](text, add_special_tokens=False)["input_ids"]) == max_length
    assert result["n_tokens"] == expected["n_tokens"]
    assert result["n_key_tokens"] == expected["n_key_tokens"]
    assert result["longppls"] == pytest.approx(expected["longppls"], rel=1e-6)
    with pytest.raises(ValueError, match="max_length counts the evaluator's tokens.*pass evaluator_model_id"):
        run(metric, setup, max_length=max_length, key_tokens="unused", evaluator_model=None, evaluator_tokenizer=None)


def test_max_length_means_the_same_in_the_metric_and_compute_key_tokens(metric, setup, tmp_path, monkeypatch):
    """A cache built with longppl-score --max-length N holds the texts compute(max_length=N) cuts."""
    import sys

    from accelerate import PartialState

    from longppl.cache.key_token_cache import KeyTokenCache
    from longppl.tools import compute_key_tokens

    folder = str(tmp_path / "evaluator")
    setup["evaluator_model"].save_pretrained(folder)
    setup["evaluator_tokenizer"].save_pretrained(folder)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup["texts"]), encoding="utf-8")
    cache = str(tmp_path / "cache")
    try:
        compute_key_tokens.main(
            [
                "--corpus",
                str(corpus),
                "--evaluator",
                folder,
                "--output",
                cache,
                "--trunc-len",
                str(K),
                "--sliding-window",
                str(D),
                "--max-length",
                "120",
            ]
        )
    finally:
        PartialState._reset_state()
    rows = len(KeyTokenCache.load(cache))
    loaded = []
    metric_module = sys.modules["longppl.metric.compute"]  # what the metric file delegates to
    monkeypatch.setattr(metric_module, "load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    monkeypatch.setattr(metric_module, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    result = run(
        metric,
        dict(setup, evaluator_model=None, evaluator_tokenizer=None),
        key_tokens=cache,
        evaluator_model_id=folder,
        device="cpu",
        torch_dtype="float32",
        max_length=120,
    )
    assert loaded == [] and len(KeyTokenCache.load(cache)) == rows == 3  # every cut text was found
    assert result["n_key_tokens"] == run(metric, setup, max_length=120)["n_key_tokens"]


def test_window_bos_needs_a_bos_token(metric, setup):
    no_bos = copy.deepcopy(byte_level_bpe(add_bos=False))  # the cached one is shared by other tests
    no_bos.bos_token = None
    with pytest.raises(ValueError, match="window_bos=True needs a BOS token"):
        run(metric, setup, evaluator_tokenizer=no_bos, window_bos=True)
    with_bos = run(metric, setup, window_bos=True)
    assert with_bos["n_tokens"] == run(metric, setup)["n_tokens"]


def test_add_batch_then_compute(metric, setup):
    direct = run(metric, setup)
    metric.add_batch(predictions=setup["texts"][:2])
    metric.add(prediction=setup["texts"][2])
    args = {k: v for k, v in setup.items() if k != "texts"}
    streamed = metric.compute(trunc_len=K, sliding_window=D, alpha=ALPHA, beta=BETA, progress=False, **args)
    assert streamed["n_key_tokens"] == direct["n_key_tokens"]
    assert streamed["longppl"] == pytest.approx(direct["longppl"], rel=1e-6)
    with pytest.raises(ValueError, match=r"predictions\[1\] is a float, not a string"):
        metric.add_batch(predictions=["text", 1.5])
    with pytest.raises(ValueError, match=r"predictions\[0\] is an empty string"):
        metric.add(prediction="")


def test_key_spans_are_the_model_key_tokens(metric, setup):
    result = run(metric, setup, return_key_spans=True)
    assert result["n_key_tokens"] == run(metric, setup)["n_key_tokens"]
    for text, spans in zip(setup["texts"], result["key_spans"]):
        ref = longppl_document(
            text,
            setup["model"],
            setup["tokenizer"],
            setup["evaluator_model"],
            setup["evaluator_tokenizer"],
            K,
            D,
            ALPHA,
            BETA,
        )
        assert spans == ref["key_spans"] and len(spans) > 0
        assert all(0 <= start < end <= len(text) for start, end in spans)
    with pytest.raises(ValueError, match="return_key_spans=True lists the key tokens of the hard rule.*soft=False"):
        run(metric, setup, return_key_spans=True, soft=True)


def count_forward_calls(model):
    calls = []
    handle = model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def test_batch_size_is_the_token_budget_of_batch_size_windows(metric, setup):
    calls, handle = count_forward_calls(setup["evaluator_model"])
    try:
        by_budget = run(metric, setup, max_tokens_per_batch=3 * (K + D))
        budget_calls = len(calls)
        calls.clear()
        by_batch_size = run(metric, setup, batch_size=3)
        assert len(calls) == budget_calls
        calls.clear()
        run(metric, setup)  # the default budget packs everything into fewer passes
        assert len(calls) < budget_calls
    finally:
        handle.remove()
    assert by_batch_size == by_budget
    with pytest.raises(ValueError, match="batch_size and max_tokens_per_batch both set the size"):
        run(metric, setup, batch_size=3, max_tokens_per_batch=1000)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        run(metric, setup, batch_size=0)


def test_add_start_token_prepends_the_bos_as_evaluate_perplexity_does(metric, setup):
    base = run(metric, setup)
    with_start = run(metric, setup, add_start_token=True)
    assert with_start == run(metric, setup, add_special_tokens=True)  # this tokenizer adds exactly its BOS
    assert with_start["n_tokens"] == [n + 1 for n in base["n_tokens"]]  # the BOS, so the first word is scored
    assert run(metric, setup, add_start_token=False) == base
    assert run(metric, setup, add_start_token=True, add_special_tokens=False) == with_start
    with pytest.raises(ValueError, match="add_start_token=True puts the tokenizer's BOS token .* pass only one"):
        run(metric, setup, add_start_token=True, add_special_tokens=True)
    # A tokenizer with a BOS that it does not add (GPT-2, Qwen): the BOS is put first all the same,
    # and the perplexity is that of [BOS] + the text's tokens (plain reference: one forward, full logits).
    gpt2_like = metaspace_bpe(add_bos=False)
    assert gpt2_like("a text")["input_ids"][0] != gpt2_like.bos_token_id
    out = run(metric, setup, tokenizer=gpt2_like, add_start_token=True, return_key_spans=True)
    for text, ppl, n in zip(setup["texts"], out["perplexities"], out["n_tokens"]):
        ids = [gpt2_like.bos_token_id] + gpt2_like(text, add_special_tokens=False)["input_ids"]
        lp = full_log_probs(setup["model"], ids)
        nll = -sum(float(lp[i - 1, ids[i]]) for i in range(1, len(ids))) / (len(ids) - 1)
        assert n == len(ids) and ppl == pytest.approx(math.exp(nll), rel=1e-5)
    no_bos = copy.deepcopy(gpt2_like)
    no_bos.bos_token = None
    with pytest.raises(
        ValueError, match="add_start_token=True puts .* but [A-Za-z]+ has no BOS token .bos_token_id is None."
    ):
        run(metric, setup, tokenizer=no_bos, add_start_token=True)


def test_dtype_is_transformers_5_name_of_torch_dtype(metric, setup, tmp_path, monkeypatch):
    import sys

    module = sys.modules["longppl.metric.compute"]  # what the metric file delegates to
    seen = []
    real = module.load_model
    monkeypatch.setattr(
        module, "load_model", lambda name, device, dtype: seen.append(dtype) or real(name, device, dtype)
    )
    setup = dict(setup, model=tiny_model("mistral", len(setup["tokenizer"]), seed=2))
    setup["model"].save_pretrained(tmp_path / "model")
    setup["tokenizer"].save_pretrained(tmp_path / "model")
    by_path = dict(setup, model=None, tokenizer=None, model_id=str(tmp_path / "model"), device="cpu")
    result = run(metric, by_path, dtype="bfloat16")
    assert seen == ["bfloat16"]
    assert run(metric, by_path, dtype="float32", torch_dtype="float32")["n_key_tokens"] == result["n_key_tokens"]
    with pytest.raises(ValueError, match="torch_dtype='float32' and dtype='bfloat16' disagree.*pass only one"):
        run(metric, by_path, dtype="bfloat16", torch_dtype="float32")


@pytest.mark.parametrize(
    "predictions, message",
    [
        ("a single long string", "predictions is a single string; pass a list of texts, e.g. predictions=.text."),
        ({"text": "a dict"}, "predictions must be a list of strings, got a dict"),
        ((t for t in ["a generator"]), "predictions must be a list of strings, got a generator"),
        (42, "predictions must be a list of strings, got a int"),
    ],
)
def test_predictions_must_be_a_list_of_strings(metric, setup, predictions, message):
    with pytest.raises(ValueError, match=message):
        run(metric, setup, predictions=predictions)
    with pytest.raises(ValueError, match=message):
        metric.add_batch(predictions=predictions)


def test_a_tuple_or_a_dataset_column_of_texts_is_accepted(metric, setup):
    import datasets

    column = datasets.Dataset.from_dict({"text": setup["texts"]})["text"]
    assert run(metric, setup, predictions=column) == run(metric, setup, predictions=tuple(setup["texts"]))


def test_devices_are_checked_before_anything_loads(metric, setup, monkeypatch):
    import torch

    with pytest.raises(ValueError, match="device='tpu0' is not a device: pass 'cuda' .or 'cuda:<index>', or 'gpu'"):
        run(metric, setup, device="tpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # evaluate's perplexity takes device="gpu": here it is CUDA (so, on this machine, no device)
    with pytest.raises(ValueError, match=r"device='cuda', but PyTorch sees no cuda device here"):
        run(metric, setup, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert longppl.models.loading.check_device("gpu") == longppl.models.loading.check_device("GPU") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda', but PyTorch sees no cuda device here.*pass device='cpu'"):
        run(metric, setup, device="cuda")
    with pytest.raises(ValueError, match="device='meta' cannot run a model"):
        run(metric, setup, device="meta")


def test_model_paths_that_do_not_exist(metric, setup, tmp_path):
    missing = str(tmp_path / "nonexistent")
    for role in ("model", "evaluator_model"):
        args = dict(setup, **{role: None, f"{role}_id": missing})
        args.pop("tokenizer" if role == "model" else "evaluator_tokenizer")
        with pytest.raises(ValueError, match=f"{role}_id='.*nonexistent' is not an existing directory .no such path"):
            run(metric, args)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="model_id='.*file.txt' is a file; pass the directory"):
        run(metric, dict(setup, model=None, tokenizer=None, model_id=str(tmp_path / "file.txt")))


def test_offline_hub_id_not_in_the_cache_fails_without_network(metric, setup, tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)

    connections = []

    def no_network(*args, **kwargs):
        connections.append(args)
        raise AssertionError("the check must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(
        ValueError,
        match=r"model_id='nobody/no-such-model' is not an existing directory \(no such path here\), and as a Hub "
        r"model id it is not in the local Hugging Face cache .*HF_HUB_OFFLINE=1",
    ):
        run(metric, dict(setup, model=None, tokenizer=None, model_id="nobody/no-such-model"))
    # what makes it fast: nobody is asked (even a refused connection, caught and retried, would show here)
    assert connections == []


def test_tokenizer_of_another_model_is_named_before_any_forward_pass(metric, setup):
    small = tiny_model("qwen2", 100, seed=2)
    calls, handle = count_forward_calls(setup["evaluator_model"])
    try:
        with pytest.raises(
            ValueError,
            match=r"The model's tokenizer gives token id \d+ for predictions\[0\], but "
            r"the model has only 100 token embeddings.*tokenizer saved with the model",
        ):
            run(metric, setup, model=small)
    finally:
        handle.remove()
    assert calls == []  # not even the evaluator ran
    with pytest.raises(ValueError, match=r"The evaluator's tokenizer gives token id \d+ .*only 100 token embeddings"):
        run(metric, setup, evaluator_model=tiny_model("llama", 100, seed=1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_lcl="no"), "use_lcl must be True or False, got 'no'"),
        (dict(soft="false"), "soft must be True or False, got 'false'"),
        (dict(window_bos=1), "window_bos must be True or False, got 1"),
        (dict(trunc_len=-5), "trunc_len must be an integer >= 1, got -5"),
        (dict(sliding_window=-1), "sliding_window must be an integer >= 1, got -1"),
        (dict(gamma=float("nan")), "gamma must be a finite number"),
        (
            dict(gamma=float("inf"), soft=True),
            r"gamma must be a finite number > 0 .*infinity would leave them unbounded",
        ),
    ],
)
def test_shared_setting_checks(metric, setup, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(metric, setup, **kwargs)
