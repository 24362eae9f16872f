"""Progress inside documents: window batches, decoder layers and LM-head chunks; bit-identical
scores with and without it; a callback that raises stops scoring within one layer."""

import numpy as np
import pytest
import torch
from helpers import byte_level_bpe, govreport_texts, tiny_model

import longppl
from longppl.core import progress as progress_module
from longppl.core.batching import long_context_log_probs
from longppl.core.compilation import compiled_blocks, repeated_blocks
from longppl.core.progress import Progress
from longppl.core.scoring import score_with_evaluator, score_with_model
from longppl.core.windows import window_bounds
from longppl.settings import KeyTokenSettings, WindowSettings

K, D, BUDGET = 47, 13, 256


@pytest.fixture(scope="module")
def setup():
    tok = byte_level_bpe()
    model = tiny_model("llama", len(tok), seed=1, num_hidden_layers=3)
    texts = [govreport_texts()[0][1000:2500], govreport_texts()[1][1000:1600]]
    return model, tok, texts


def scores(setup, **kwargs):
    model, tok, texts = setup
    return score_with_evaluator(model, tok, texts, KeyTokenSettings(K, D), max_tokens_per_batch=BUDGET, **kwargs)


def test_progress_leaves_scores_bit_identical_and_reports_layers_chunks_and_windows(setup, monkeypatch):
    model, tok, texts = setup
    plain = scores(setup, progress=False)
    n_tokens = [len(s.input_ids) for s in plain]
    monkeypatch.setattr(progress_module, "LARGE_PASS_TOKENS", 100)  # the tiny texts count as large
    events = []
    reported = scores(setup, progress=True, progress_callback=lambda *event: events.append(event))
    for a, b in zip(plain, reported):
        assert np.array_equal(a.lp_long, b.lp_long, equal_nan=True)
        assert np.array_equal(a.lp_short, b.lp_short, equal_nan=True)
    long_pass = f"LongPPL evaluator: long context: pass of {max(n_tokens)} tokens"
    layers = [(done, total) for desc, done, total in events if desc == long_pass]
    assert layers == [(1, 3), (2, 3), (3, 3)]  # the longest text's pass alone: its 3 decoder layers
    head = [(done, total) for desc, done, total in events if desc == "LongPPL evaluator: long context: LM head"]
    assert head[-1][0] == head[-1][1] >= 1
    n_windows = sum(
        len(window_bounds(n, WindowSettings(K, D))) - 1 for n in n_tokens
    )  # the first comes from the long pass
    window_desc = f"LongPPL evaluator: short windows (K={K}): windows"
    windows = [(done, total) for desc, done, total in events if desc == window_desc]
    assert windows == [(i, n_windows) for i in range(1, n_windows + 1)]
    texts_done = [e for e in events if e[0] == f"LongPPL evaluator: short windows (K={K})"]
    assert texts_done == [(f"LongPPL evaluator: short windows (K={K})", i, 2) for i in (1, 2)]


def test_bars_appear_only_for_large_passes(setup, capsys, monkeypatch):
    model, tok, texts = setup
    scores(setup, progress=True)
    assert "pass of" not in capsys.readouterr().err  # short texts: no bars inside them
    monkeypatch.setattr(progress_module, "LARGE_PASS_TOKENS", 100)
    scores(setup, progress=True)
    err = capsys.readouterr().err
    assert "pass of" in err and "layer" in err and "LM head" in err and "window" in err


def test_evaluated_model_pass_reports_layers(setup, monkeypatch):
    model, tok, texts = setup
    plain = score_with_model(model, tok, texts, progress=False)
    monkeypatch.setattr(progress_module, "LARGE_PASS_TOKENS", 100)
    events = []
    reported = score_with_model(model, tok, texts, progress=True, progress_callback=lambda *e: events.append(e))
    assert all(np.array_equal(a.lp, b.lp, equal_nan=True) for a, b in zip(plain, reported))
    assert [e for e in events if e[0].endswith("tokens")][:3] == [
        (f"LongPPL: evaluated model: pass of {2 * len(plain[0].input_ids)} tokens", i, 3) for i in (1, 2, 3)
    ]
    assert events[-1] == ("LongPPL: evaluated model", 2, 2)


class Stop(Exception):
    pass


def test_a_raising_callback_stops_within_one_layer_and_cleans_up(setup):
    model, tok, texts = setup
    layers = repeated_blocks(model)
    calls = []
    counters = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in layers]

    def deadline(desc, done, total):
        if "pass of" in desc:
            raise Stop(f"stopped at {desc} {done}/{total}")

    model.train()
    try:
        with pytest.raises(Stop, match=r"stopped at LongPPL evaluator: long context: pass of \d+ tokens 1/3"):
            scores(setup, progress=False, progress_callback=deadline)
    finally:
        for handle in counters:
            handle.remove()
    assert len(calls) == 1  # the first layer ran, the second never started
    assert all(not layer._forward_hooks for layer in layers)  # our hooks are gone
    assert model.training  # the model's mode is restored
    model.eval()


def test_hooks_count_only_the_thread_that_registered_them(setup):
    import threading

    model, tok, texts = setup
    events = []
    reporter = Progress(enabled=False, callback=lambda *e: events.append(e), desc="mine")
    ids = torch.tensor([tok(texts[1])["input_ids"]])
    with reporter.forward_pass(model, ids.shape[1]), torch.no_grad():
        other = threading.Thread(target=lambda: model(ids))
        other.start()
        other.join()
        assert events == []  # another request's pass on the shared model
        model(ids)
    assert [e[1:] for e in events] == [(1, 3), (2, 3), (3, 3)]


def test_layer_hooks_work_on_compiled_blocks(setup):
    model, tok, texts = setup
    ids = [torch.tensor(tok(text)["input_ids"]) for text in texts]
    plain = long_context_log_probs(model, ids, BUDGET)
    events = []
    reporter = Progress(enabled=False, callback=lambda *e: events.append(e), desc="compiled")
    with torch.inference_mode(), compiled_blocks(model, backend="eager"):
        compiled = long_context_log_probs(model, ids, BUDGET, progress=reporter)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(plain, compiled))
    assert [e[1:] for e in events if "pass of" in e[0]][:3] == [(1, 3), (2, 3), (3, 3)]


@pytest.fixture(scope="module")
def metric():
    import evaluate

    return evaluate.load(longppl.METRIC_PATH)


def test_the_metric_passes_progress_callback_through(metric, setup):
    model, tok, texts = setup
    events = []
    args = dict(
        predictions=texts,
        model=model,
        tokenizer=tok,
        evaluator_model=model,
        evaluator_tokenizer=tok,
        trunc_len=K,
        sliding_window=D,
        alpha=0.005,
        beta=-50.0,
        progress=False,
    )
    plain = metric.compute(**args)
    reported = metric.compute(**args, progress_callback=lambda *e: events.append(e))
    assert reported == plain
    assert {desc for desc, _, _ in events} >= {"LongPPL evaluator: long context", "LongPPL: evaluated model"}
    assert any("pass of" in desc for desc, _, _ in events)  # with a callback, every pass reports its layers


def test_the_metric_refuses_a_progress_callback_that_is_not_callable(metric, setup):
    model, tok, texts = setup
    with pytest.raises(
        ValueError,
        match=r"progress_callback must be a function callback\(desc, done, total\), "
        r"got 'tqdm'",
    ):
        metric.compute(
            predictions=texts,
            model=model,
            tokenizer=tok,
            evaluator_model=model,
            evaluator_tokenizer=tok,
            progress_callback="tqdm",
        )
