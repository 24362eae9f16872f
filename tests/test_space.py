"""The Hub Space: the Gradio app (built, never launched), its limits as a public server, its
requirements, and the push script."""

import configparser
import contextlib
import dataclasses
import html
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import evaluate
import huggingface_hub
import numpy as np
import pytest
import torch
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model

import longppl
from longppl import register
from longppl.settings import KeyTokenRule

gradio = pytest.importorskip("gradio", reason="the Space's tests need gradio: pip install -e '.[space]'")
gr = gradio

K, D, ALPHA, BETA = 47, 13, 0.005, -50.0  # as test_metric: random tiny models have small LSDs


@pytest.fixture(scope="module")
def app():
    from longppl.space import app as space_app

    return space_app


@pytest.fixture(scope="module")
def push_script(repo_root):
    spec = importlib.util.spec_from_file_location(
        "push_metric_to_hub", os.path.join(repo_root, "scripts", "push_metric_to_hub.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODEL, EVALUATOR = "tiny-org/model", "tiny-org/evaluator"  # the allow-list the tests give the Space
SAME_TOKENIZER = "tiny-org/evaluators-tokenizer"  # an evaluated model that tokenizes as the evaluator does


@pytest.fixture(scope="module")
def tiny_models():
    """Tiny evaluated models and an evaluator with their tokenizers, by the ids the Space allows."""
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    return {
        MODEL: (tiny_model("mistral", len(tok), seed=2), tok),
        EVALUATOR: (tiny_model("llama", len(ev_tok), seed=1), ev_tok),
        SAME_TOKENIZER: (tiny_model("mistral", len(ev_tok), seed=3), ev_tok),
    }


@pytest.fixture(scope="module")
def saved_model(tiny_models, tmp_path_factory):
    """A loadable model folder on the server (what a visitor could once get the Space to load)."""
    folder = tmp_path_factory.mktemp("server") / "model"
    model, tokenizer = tiny_models[MODEL]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def space(app, tiny_models, monkeypatch):
    """The app with a tiny allow-list; ``space.loaded`` records the ids it loads."""
    monkeypatch.setattr(app, "SETTINGS", app.SpaceSettings(models=(MODEL, EVALUATOR)))
    loaded = []

    def load_model(model_id, local=False, hub_timeout_s=None):
        loaded.append(model_id)
        return tiny_models[model_id]

    monkeypatch.setattr(app, "load_model", load_model)
    app.loaded = loaded
    return app


@contextlib.contextmanager
def shows_error(pattern: str):
    """Like ``pytest.raises(gr.Error, match=pattern)``, on the message as the page shows it (the app
    escapes it, since gradio renders a message as HTML)."""
    with pytest.raises(gr.Error) as raised:
        yield raised
    shown = html.unescape(raised.value.message)
    assert re.search(pattern, shown), f"{pattern!r} not found in {shown!r}"


def limit(app, monkeypatch, **settings):
    monkeypatch.setattr(app, "SETTINGS", dataclasses.replace(app.SETTINGS, **settings))


def test_blocks_build_without_loading_models(app, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("building the UI must not load a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(app, "_metrics", app.threading.local())
    demo = app.build_demo()
    assert isinstance(demo, gr.Blocks) and getattr(app._metrics, "metric", None) is None
    (handler,) = [fn for fn in demo.fns.values() if fn.fn is app.score]
    labels = [block.label for block in handler.inputs]
    assert labels[1:] == [
        "Evaluated model (Hub id)",
        "Evaluator model (Hub id)",
        "K (short-context length)",
        "d (sliding window)",
        "alpha (LSD threshold)",
        "beta (LCL threshold)",
    ]
    assert [block.label for block in handler.outputs[:3]] == ["LongPPL", "PPL", "Key tokens"]
    assert all(not block.value for block in handler.outputs)  # empty before a run (not "0")
    defaults = {block.label: block.value for block in handler.inputs}
    assert (defaults["K (short-context length)"], defaults["d (sliding window)"]) == (4096, 1024)
    assert (defaults["alpha (LSD threshold)"], defaults["beta (LCL threshold)"]) == (2.0, -2.0)
    # the metric's declared defaults (options.LongPPLOptions), the card's and the metric's alike
    from longppl.metric.options import default_of

    ui_names = {"trunc_len": "K (short-context length)", "sliding_window": "d (sliding window)"}
    ui_names.update(alpha="alpha (LSD threshold)", beta="beta (LCL threshold)")
    assert {name: defaults[label] for name, label in ui_names.items()} == {name: default_of(name) for name in ui_names}


def test_the_ui_offers_only_the_allowed_models(app):
    settings = app.SpaceSettings(models=("a-org/small", "b-org/evaluator"), max_trunc_len=2048)
    (handler,) = [fn for fn in app.build_demo(settings).fns.values() if fn.fn is app.score]
    model, evaluator, trunc_len = handler.inputs[1:4]
    for dropdown in (model, evaluator):
        assert isinstance(dropdown, gr.Dropdown) and not dropdown.allow_custom_value
        assert [value for _, value in dropdown.choices] == ["a-org/small", "b-org/evaluator"]
    assert (model.value, evaluator.value) == ("a-org/small", "b-org/evaluator")
    assert (trunc_len.value, trunc_len.info) == (2048, "1 to 2048 in this Space")


def test_queue_bounds_concurrency_and_waiting_requests(app):
    default = app.build_demo(app.SpaceSettings())
    assert (default._queue.default_concurrency_limit, default._queue.max_size) == (1, 16)
    demo = app.build_demo(app.SpaceSettings(concurrency=2, queue_size=5))
    assert (demo._queue.default_concurrency_limit, demo._queue.max_size) == (2, 5)


def test_settings_from_the_environment(app):
    settings = app.SpaceSettings.from_env(
        {
            "LONGPPL_SPACE_MODELS": " a-org/one, b.org/two_2 ,",
            "LONGPPL_SPACE_MAX_CHARS": "1000",
            "LONGPPL_SPACE_MAX_TOKENS": "300",
            "LONGPPL_SPACE_MAX_K": "64",
            "LONGPPL_SPACE_MAX_WINDOW_TOKENS": "900",
            "LONGPPL_SPACE_TIME_LIMIT_S": "2.5",
            "LONGPPL_SPACE_CONCURRENCY": "3",
            "LONGPPL_SPACE_QUEUE_SIZE": "7",
        }
    )
    assert settings == app.SpaceSettings(("a-org/one", "b.org/two_2"), 1000, 300, 64, 900, 2.5, 3, 7)
    assert app.SpaceSettings.from_env({}) == app.SpaceSettings()
    assert app.SpaceSettings().models == app.DEFAULT_MODELS


def test_the_model_list_takes_the_short_names_of_the_real_models(app):
    """The real models a registry package ships (the models extra) are listed by short name; a folder of
    that name beside the server is not what gets loaded (the name resolves to its converted folder)."""
    settings = app.SpaceSettings.from_env({"LONGPPL_SPACE_MODELS": "gemma-3-270m, smollm2-135m,a-org/one"})
    assert settings.models == ("gemma-3-270m", "smollm2-135m", "a-org/one")
    with pytest.raises(ValueError, match="not a Hub model id: list ids such as Qwen/Qwen2.5-0.5B, or short names"):
        app.SpaceSettings.from_env({"LONGPPL_SPACE_MODELS": "gemma-3-27m"})


@pytest.mark.parametrize(
    "entry",
    ["/tmp/model", "./model", "../org/model", "org/../../etc", "model", "org/name/extra", "C:/model", "org/na me"],
)
def test_settings_refuse_model_entries_that_are_not_hub_ids(app, entry):
    with pytest.raises(ValueError, match="LONGPPL_SPACE_MODELS lists .* which is not a Hub model id"):
        app.SpaceSettings.from_env({"LONGPPL_SPACE_MODELS": f"a-org/one,{entry}"})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("LONGPPL_SPACE_MAX_TOKENS", "lots", "must be an integer >= 2"),
        ("LONGPPL_SPACE_QUEUE_SIZE", "0", "must be an integer >= 1"),
        ("LONGPPL_SPACE_TIME_LIMIT_S", "-1", "must be a number of seconds > 0"),
        ("LONGPPL_SPACE_TIME_LIMIT_S", "nan", "must be a number of seconds > 0"),
    ],
)
def test_settings_refuse_bad_limits(app, name, value, message):
    with pytest.raises(ValueError, match=f"The Space setting {name}='{value}' {message}; fix or remove it"):
        app.SpaceSettings.from_env({name: value})


def test_compute_button_gives_the_metric_values_and_key_tokens(space, tiny_models):
    texts = [govreport_texts()[0][1000:1900], govreport_texts()[1][1000:2400]]
    longppl_value, ppl, view, table = space.score(
        f"{texts[0]}\n{space.SEPARATOR}\n{texts[1]}\n", MODEL, EVALUATOR, K, D, ALPHA, BETA
    )
    (model, tok), (evaluator, ev_tok) = tiny_models[MODEL], tiny_models[EVALUATOR]
    expected = space.load_metric().compute(
        predictions=texts,
        model=model,
        tokenizer=tok,
        evaluator_model=evaluator,
        evaluator_tokenizer=ev_tok,
        trunc_len=K,
        sliding_window=D,
        alpha=ALPHA,
        beta=BETA,
        progress=False,
    )
    assert float(longppl_value) == pytest.approx(expected["longppl"], abs=1e-4)
    assert float(ppl) == pytest.approx(expected["ppl"], abs=1e-4)
    # the texts combined as the official evaluation script combines them (since July 2025)
    keys, tokens = sum(expected["n_key_tokens"]), sum(expected["n_tokens"])
    logs = sum(k * math.log(v) for k, v in zip(expected["n_key_tokens"], expected["longppls"]) if k)
    assert float(longppl_value) == pytest.approx(math.exp(logs / keys), abs=1e-4)
    logs = sum(n * math.log(v) for n, v in zip(expected["n_tokens"], expected["perplexities"]))
    assert float(ppl) == pytest.approx(math.exp(logs / tokens), abs=1e-4)
    assert f"| 2 | {expected['longppls'][1]:.3f} | {expected['perplexities'][1]:.3f} |" in table
    # The key-token view holds each text, numbered from 1, with the evaluator's key tokens (LSD >
    # alpha and LCL > beta, from the evaluator's own log-probs here) marked inline.
    assert view.startswith('<div class="longppl-keys"><div class="legend">')
    documents = re.findall(r'<h3>Text (\d+)</h3><p class="meta">.*?</p><div class="doc">(.*?)</div>', view, re.S)
    assert [number for number, _ in documents] == ["1", "2"]
    for text, (_, document) in zip(texts, documents):
        assert html.unescape(re.sub(r"<[^>]*>", "", document)) == text
        ids = ev_tok(text, return_offsets_mapping=True)
        with torch.no_grad():
            logits = evaluator(torch.tensor([ids["input_ids"]])).logits[0].float()
        lp_long = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids["input_ids"][1:])[:, None])[:, 0]
        keys = []
        for i in range(K, len(ids["input_ids"])):  # a short window per token, as the paper defines it
            s = (i - K) // D * D
            window = torch.tensor([ids["input_ids"][s:i]])
            with torch.no_grad():
                lp_short = torch.log_softmax(evaluator(window).logits[0, -1].float(), -1)[ids["input_ids"][i]]
            lcl = lp_long[i - 1].item()
            if lcl - lp_short.item() > ALPHA and lcl > BETA:
                start, end = ids["offset_mapping"][i]
                keys.append(text[start:end])
        shown = [html.unescape(t) for t in re.findall(r'<span class="t key"[^>]*>(.*?)</span>', document, re.S)]
        assert shown == keys and len(keys) > 0
    assert sorted(space.loaded) == [EVALUATOR, MODEL]


def _table(table: str) -> list[dict]:
    """The per-text Markdown table's rows, as ``{column: cell}``."""
    header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]

    def cells(line):
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    return [dict(zip(cells(header), cells(row))) for row in rows]


def test_counts_say_whose_tokens_they_count_and_agree_where_they_count_the_same(space, monkeypatch, tiny_models):
    limit(space, monkeypatch, models=(MODEL, SAME_TOKENIZER, EVALUATOR))
    text = govreport_texts()[0][1000:1900]
    ev_tok = tiny_models[EVALUATOR][1]
    ev_offsets = ev_tok(text, return_offsets_mapping=True)["offset_mapping"]
    text_tokens = sum(end > start for start, end in ev_offsets)  # what the view shows: no BOS
    assert text_tokens == len(ev_offsets) - 1
    counted = {}
    for model_id in (MODEL, SAME_TOKENIZER):
        _, _, view, table = space.score(text, model_id, EVALUATOR, K, D, ALPHA, BETA)
        [row] = _table(table)
        assert list(row) == [
            "text",
            "LongPPL",
            "PPL",
            "key tokens (evaluated model's)",
            "tokens (evaluated model's)",
            "key tokens (evaluator's)",
            "tokens (evaluator's)",
        ]
        meta = re.search(r'<p class="meta">(.*?)</p>', view).group(1)
        shown = {name: int(value) for name, value in re.findall(r'data-count="(\w+)">(\d+)<', meta)}
        assert re.sub(r"<[^>]*>", "", meta).startswith(
            f"{shown['key']} key tokens of the evaluator's {shown['tokens']} "
        )
        # the view's counts are the table's evaluator's counts, and count what the view draws
        assert (int(row["key tokens (evaluator's)"]), int(row["tokens (evaluator's)"])) == (
            shown["key"],
            shown["tokens"],
        )
        assert shown["key"] == view.count('class="t key"') > 0 and shown["tokens"] == text_tokens
        n_model = len(tiny_models[model_id][1](text, add_special_tokens=False)["input_ids"])
        assert int(row["tokens (evaluated model's)"]) == n_model
        counted[model_id] = row
    # the evaluated model's tokens are the evaluator's: the same tokens, the same key tokens
    same = counted[SAME_TOKENIZER]
    assert same["tokens (evaluated model's)"] == same["tokens (evaluator's)"]
    assert same["key tokens (evaluated model's)"] == same["key tokens (evaluator's)"]
    other = counted[MODEL]  # another tokenizer cuts the text otherwise, and the table says why they differ
    assert other["tokens (evaluated model's)"] != other["tokens (evaluator's)"]
    assert "differ when the two tokenizers cut the text differently" in table


def _scores(lsd, lcl):
    """Evaluator scores of a text of one word per token (a BOS first), with the given LSD and LCL."""
    from longppl.core.scoring import EvaluatorScores

    words = [f"w{i} " for i in range(len(lsd))]
    starts = np.cumsum([0] + [len(w) for w in words])
    offsets = np.array([[0, 0]] + [[a, b] for a, b in zip(starts[:-1], starts[1:])])
    lp_long = np.array([np.nan, *lcl])
    lp_short = lp_long - np.array([np.nan, *lsd])
    return "".join(words), EvaluatorScores(np.arange(len(offsets)), offsets, lp_long, lp_short)


@pytest.mark.parametrize(
    "lsd, counted",
    [
        ([np.nan, 3.0], "1 key token of the evaluator's 2 tokens of this text (100.0% of the 1 with"),
        ([3.0], "1 key token of the evaluator's 1 token of this text (100.0% of the 1 with"),
        ([np.nan, 3.0, 2.5], "2 key tokens of the evaluator's 3 tokens of this text (100.0% of the 2 with"),
        ([np.nan, 0.5], "0 key tokens of the evaluator's 2 tokens of this text (0.0% of the 1 with"),
    ],
)
def test_the_key_token_counts_agree_with_their_nouns(app, lsd, counted):
    text, scores = _scores(lsd, [-1.0] * len(lsd))
    view = app.key_token_view([text], [scores], KeyTokenRule(2.0, -2.0), 1)
    meta = re.sub(r"<[^>]*>", "", re.search(r'<p class="meta">(.*?)</p>', view).group(1))
    assert meta.startswith(counted), meta


def _opacities(fragment: str, css: str) -> list[float]:
    return [
        float(value)
        for value in re.findall(
            rf'<span class="{css}"[^>]*? style="background: rgba\(255, 127, 31, ([\d.]+)\)"', fragment
        )
    ]


@pytest.mark.parametrize("alpha, cap", [(0.005, None), (2.0, None), (-1.0, 3.0), (5.0, 4.0)])
def test_the_legend_shows_every_way_a_key_token_looks(alpha, cap):
    from longppl.views import key_token_html as views

    nan = np.nan
    lsd = [nan, nan, alpha + 1e-3, alpha + 0.01, (alpha + 4) / 2, alpha + 0.5, 5.0, 9.0, alpha - 1, -3.0]
    text, scores = _scores(lsd, [-1.0] * len(lsd))
    cap = views.check_lsd_cap(cap, alpha)
    legend = views.key_token_legend(alpha, -2.0, True, 2, cap)
    _, document = views.key_token_document(text, scores, alpha, -2.0, True, 2, cap)
    drawn, shown = _opacities(document, "t key"), _opacities(legend, "swatch key")
    assert len(drawn) == sum(value > alpha for value in lsd) >= 3 and shown
    # every key token's shade lies within the legend's key swatches, the faintest a key token can be included
    assert min(shown) <= min(drawn) and max(drawn) <= max(shown)
    assert min(shown) == pytest.approx(views.lsd_opacity(max(alpha, 0.0), cap), abs=1e-3)
    assert max(shown) == pytest.approx(views.MAX_OPACITY, abs=1e-3)


def test_lsd_and_lcl_reach_touch_and_keyboard_without_repeating_them(app):
    from longppl.views import key_token_html as views

    lsd = [np.nan, np.nan, 3.0, 0.5, 2.5, -1.0]
    lcl = [-1.0, -0.5, -1.0, -1.0, -3.0, -0.2]
    text, scores = _scores(lsd, lcl)
    _, document = views.key_token_document(text, scores, 2.0, -2.0, True, 2)
    pieces = re.findall(r'<span class="(t[^"]*)" title="([^"]*)"[^>]*?( tabindex="(-1|0)")?>', document)
    assert len(pieces) == 6
    # Tab steps through the key tokens; a click or tap focuses any piece (tabindex -1)
    assert [(css, focus) for css, _, _, focus in pieces] == [
        ("t noscore", "-1"),
        ("t noscore", "-1"),
        ("t key", "0"),
        ("t", "-1"),
        ("t", "-1"),
        ("t", "-1"),
    ]
    # the focused piece shows its title (LSD and LCL) under it, from the title itself: nothing repeated
    rules = {selector.strip(): body for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", views.STYLE)}
    focused = rules[".longppl-keys .t:focus::after"]
    assert "content: attr(title)" in focused and "position: absolute" in focused
    assert all(document.count(title) == 1 for _, title, _, _ in pieces)
    assert "click or tap it; Tab steps through the key tokens" in app.key_token_view(
        [text], [scores], KeyTokenRule(2.0, -2.0), 2
    )


def test_no_piece_of_a_word_gets_a_box_of_its_own():
    """The pieces of a word split into several tokens join up: no piece has a border, a box shadow, a
    margin, padding or round corners (the focus ring of the one focused piece aside)."""
    from longppl.views import key_token_html as views

    boxes = ("border", "box-shadow", "margin", "padding", "outline")
    for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", views.STYLE):
        for selector in selectors.split(","):
            if not re.search(r"\.(t|key|noscore)\b", selector) or ":focus" in selector or ".legend" in selector:
                continue
            properties = [part.split(":")[0].strip() for part in body.split(";") if part.strip()]
            assert not [p for p in properties if p.startswith(boxes)], selector
    text, scores = _scores([np.nan, 3.0, 3.5], [-1.0, -1.0, -1.0])
    _, document = views.key_token_document(text, scores, 2.0, -2.0, True, 1)
    styles = re.findall(r' style="([^"]*)"', document)
    assert styles and all(re.fullmatch(r"background: rgba\([\d., ]+\)", style) for style in styles)


@pytest.mark.parametrize(
    "texts, trunc_len, message",
    [
        ("  \n---\n  ", K, "Paste at least one long text"),
        ("some text", 2.5, r"^K must be an integer >= 1, got 2\.5\.$"),  # the metric's trunc_len, in the UI's name
    ],
)
def test_bad_input_is_shown_in_the_ui(space, texts, trunc_len, message):
    with shows_error(message):
        space.score(texts, MODEL, EVALUATOR, trunc_len, D, ALPHA, BETA)


def test_the_metrics_words_become_the_uis():
    from longppl.space import app

    assert app.in_ui_terms("sliding_window must be an integer >= 1, got 0.") == "d must be an integer >= 1, got 0."
    assert app.in_ui_terms("predictions[2] is an empty string") == "text 3 is an empty string"
    assert app.in_ui_terms("Texts [0, 2] have no key tokens") == "Texts 1, 3 have no key tokens"
    assert app.in_ui_terms("Texts [4] have no key tokens") == "Text 5 has no key tokens"


def test_warnings_number_texts_from_1_and_say_k(space):
    long_text, short_text = govreport_texts()[0][1000:1900], "A short text."
    with pytest.warns(UserWarning) as caught:
        longppl_value, _, view, table = space.score(
            f"{long_text}\n---\n{short_text}", MODEL, EVALUATOR, K, D, ALPHA, BETA
        )
    messages = [str(w.message) for w in caught]
    assert any(
        m.startswith(f"Text 2 has at most K={K} evaluator tokens, so no token has a short context")
        and "smaller K." in m
        for m in messages
    ), messages
    assert not any("trunc_len" in m or "[1]" in m for m in messages)
    assert "| 2 | – |" in table and "<h3>Text 2</h3>" in view and float(longppl_value) > 0


def test_a_lone_surrogate_is_refused_with_a_message(space):
    with shows_error(
        r"^Text 2 holds a character that is not valid Unicode \(U\+D800, a lone surrogate, at character 4\); "
        r"remove it",
    ):
        space.score("fine\n---\nabc\ud800def", MODEL, EVALUATOR, K, D, ALPHA, BETA)
    assert space.loaded == []


REFUSED_MODEL = rf"The (evaluated|evaluator) model must be one of the models this Space offers: {MODEL}, {EVALUATOR}\."


@pytest.mark.parametrize("role", ["evaluated", "evaluator"])
@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.1-8B", "gpt2", "", None, f"{MODEL}-x"])
def test_a_model_outside_the_allow_list_is_refused_before_loading(space, role, model_id):
    ids = [model_id, EVALUATOR] if role == "evaluated" else [MODEL, model_id]
    with shows_error(REFUSED_MODEL.replace("(evaluated|evaluator)", role)):
        space.score("some text", *ids, K, D, ALPHA, BETA)
    assert space.loaded == []


@pytest.mark.parametrize("path", ["/etc", "/etc/passwd", "/tmp", "./", "../..", "C:\\Windows", "~/.cache"])
def test_a_local_path_is_refused_without_looking_at_it(space, monkeypatch, saved_model, path):
    for model_id in (path, saved_model):

        def no_file_system(*args, **kwargs):
            raise AssertionError("the file system was looked at")

        with monkeypatch.context() as patch:
            for name in ("exists", "isdir", "isfile"):
                patch.setattr(space.os.path, name, no_file_system)
            with shows_error(REFUSED_MODEL) as refused:
                space.score("some text", MODEL, model_id, K, D, ALPHA, BETA)
        assert model_id not in str(refused.value) and "etc" not in str(refused.value)
    assert space.loaded == []


def test_too_many_characters_are_refused_before_loading(space, monkeypatch):
    limit(space, monkeypatch, max_chars=100)
    with shows_error(REFUSED_MODEL):  # 100 characters pass on to the next check
        space.score("x" * 100, "nowhere/else", EVALUATOR, K, D, ALPHA, BETA)
    with shows_error(
        r"^The texts have 120 characters, 20 more than this Space scores per request \(100\); nothing was scored "
        r"or cut: shorten them, or score long texts and corpora on your own hardware \(`longppl score`, then "
        r"`longppl evaluate`\)\. To go beyond",
    ):
        space.score("x" * 120, MODEL, EVALUATOR, K, D, ALPHA, BETA)
    assert space.loaded == []


def test_the_texts_box_cuts_no_paste(app):
    """A browser cuts a paste to a text box's maximum length without a word: the box has none, so the
    whole paste reaches ``score``, which refuses it saying by how much it is over."""
    (handler,) = [fn for fn in app.build_demo(app.SpaceSettings(max_chars=100)).fns.values() if fn.fn is app.score]
    texts = handler.inputs[0]
    assert texts.max_length is None and texts.preprocess("x" * 120) == "x" * 120


def test_limit_messages_name_this_spaces_id_or_the_readmes_way(space, monkeypatch, repo_root):
    refused = r"The evaluated model must be one of the models this Space offers: .*\. "
    monkeypatch.setenv("SPACE_ID", "my-org/longppl")  # as Hugging Face sets it in a Space
    with shows_error(
        refused + r"To go beyond, run the metric on your own hardware: pip install longppl-hf, then "
        r'evaluate\.load\("my-org/longppl"\)\.$'
    ):
        space.score("some text", "nowhere/else", EVALUATOR, K, D, ALPHA, BETA)
    readme = open(os.path.join(repo_root, "README.md"), encoding="utf-8").read()
    assert "import longppl" in readme and 'evaluate.load("longppl")' in readme  # what users are told to do
    for space_id in (None, "", "not an id", "../x"):
        if space_id is None:
            monkeypatch.delenv("SPACE_ID")
        else:
            monkeypatch.setenv("SPACE_ID", space_id)
        with shows_error(
            refused + r"To go beyond, run the metric on your own hardware: pip install longppl-hf, then import "
            r'longppl, then evaluate\.load\("longppl"\)\.$'
        ) as raised:
            space.score("some text", "nowhere/else", EVALUATOR, K, D, ALPHA, BETA)
        assert "<this Space" not in html.unescape(raised.value.message)


def _demo_handler(app, settings):
    demo = app.build_demo(settings)
    (handler,) = [fn for fn in demo.fns.values() if fn.fn is app.score]
    return demo, handler


def test_compute_clears_the_results_before_scoring(app):
    """A request that fails leaves its message alone: the results of an earlier one are cleared first."""
    demo, handler = _demo_handler(app, app.SpaceSettings())
    [clear] = [fn for fn in demo.fns.values() if fn._id == handler.trigger_after]
    assert not handler.trigger_only_on_success and clear.outputs == handler.outputs
    [(button_id, event)] = clear.targets
    assert event == "click" and demo.blocks[button_id].value == "Compute"
    cleared = clear.fn()
    assert len(cleared) == len(handler.outputs) and all(value == "" for value in cleared)
    assert all(not block.postprocess(value) for block, value in zip(handler.outputs, cleared))


LABELS = {
    "K": "K (short-context length)",
    "d": "d (sliding window)",
    "alpha": "alpha (LSD threshold)",
    "beta": "beta (LCL threshold)",
}


@pytest.mark.parametrize(
    "field, what",
    [
        ("K", r"an integer from 1 to 4096 \(default: 4096\)"),
        ("d", r"an integer >= 1 \(default: 1024\)"),
        ("alpha", r"a number \(default: 2\)"),
        ("beta", r"a number \(default: -2\)"),
    ],
)
def test_an_empty_field_is_named_with_what_to_enter(space, field, what):
    values = dict(K=K, d=D, alpha=ALPHA, beta=BETA)
    values[field] = None  # what gradio passes for a box left empty
    with shows_error(rf"^The field {re.escape(LABELS[field])} is empty; enter {what}\.$"):
        space.score("some text", MODEL, EVALUATOR, *values.values())
    assert space.loaded == []


def test_k_and_d_out_of_range_get_our_message_naming_the_field(space, monkeypatch):
    limit(space, monkeypatch, max_trunc_len=40)
    _, handler = _demo_handler(space, space.SETTINGS)
    trunc_len, sliding_window = handler.inputs[3:5]
    # gradio's own range check (its message names no field) must not answer before ours
    assert trunc_len.preprocess(5000) == 5000 and sliding_window.preprocess(0) == 0
    for value in (K, 0, -3):
        with shows_error(
            rf"^K \(short-context length\) is {value}, outside this Space's range of 1 to 40; enter an integer "
            r"from 1 to 40\." + (r" To go beyond, run the metric on your own hardware: .*$" if value > 40 else "$")
        ):
            space.score("some text", MODEL, EVALUATOR, value, D, ALPHA, BETA)
    with shows_error(r"^d \(sliding window\) is 0; enter an integer >= 1 \(default: 1024\)\.$"):
        space.score("some text", MODEL, EVALUATOR, 40, 0, ALPHA, BETA)
    assert space.loaded == []


def test_too_many_tokens_are_refused(space, monkeypatch, tiny_models):
    text = govreport_texts()[0][1000:1900]
    n_evaluator = len(tiny_models[EVALUATOR][1](text)["input_ids"])  # with its BOS
    limit(space, monkeypatch, max_tokens=n_evaluator - 1)
    with shows_error(
        rf"The texts have {n_evaluator} tokens for the evaluator model, more than "
        rf"this Space scores per request \({n_evaluator - 1}\)",
    ):
        space.score(text, MODEL, EVALUATOR, K, D, ALPHA, BETA)
    # Roles swapped, so that the evaluated model's tokenizer (byte-level) cuts the text finer.
    n_evaluated = len(tiny_models[EVALUATOR][1](text, add_special_tokens=False)["input_ids"])
    n_evaluator = len(tiny_models[MODEL][1](text)["input_ids"])
    assert n_evaluator < n_evaluated
    limit(space, monkeypatch, max_tokens=n_evaluated - 1)
    with shows_error(
        rf"The texts have {n_evaluated} tokens for the evaluated model, more than "
        rf"this Space scores per request \({n_evaluated - 1}\)",
    ):
        space.score(text, EVALUATOR, MODEL, K, D, ALPHA, BETA)


def test_too_much_short_window_work_is_refused(space, monkeypatch, tiny_models):
    text = govreport_texts()[0][1000:1900]
    n = len(tiny_models[EVALUATOR][1](text)["input_ids"])
    windows = [(s, min(s + K + 1, n)) for s in range(0, n - K, 1)][1:]  # d = 1; the first comes from the long pass
    work = sum(end - start for start, end in windows)
    limit(space, monkeypatch, max_window_tokens=work - 1)
    with shows_error(
        rf"With K = {K} and d = 1 the evaluator would read {work} tokens in short "
        rf"windows, more than this Space allows \({work - 1}\); use a larger d",
    ):
        space.score(text, MODEL, EVALUATOR, K, 1, ALPHA, BETA)
    limit(space, monkeypatch, max_window_tokens=work)
    assert float(space.score(text, MODEL, EVALUATOR, K, 1, ALPHA, BETA)[1]) > 0  # at the limit: scored


def test_time_limit_stops_scoring_inside_a_forward_pass(space, monkeypatch, tiny_models):
    text = govreport_texts()[0][1000:1900]
    evaluated_layers = []
    model = tiny_models[MODEL][0]
    hooks = [layer.register_forward_hook(lambda *_: evaluated_layers.append(1)) for layer in model.model.layers]
    limit(space, monkeypatch, time_limit_s=1e-9)
    try:
        with shows_error(
            r"This request took longer than this Space allows \(1e-09 s\) and was "
            r"stopped during: LongPPL evaluator: long context: pass of \d+ tokens\.",
        ):
            space.score(text, MODEL, EVALUATOR, K, D, ALPHA, BETA)
    finally:
        for hook in hooks:
            hook.remove()
    # where it stopped, not how fast: in the evaluator's first pass (the message), before the evaluated model ran
    assert evaluated_layers == []
    limit(space, monkeypatch, time_limit_s=300.0)
    assert float(space.score(text, MODEL, EVALUATOR, K, D, ALPHA, BETA)[1]) > 0  # the next request is served


def test_models_are_loaded_from_the_hub_without_remote_code(app, monkeypatch, tiny_models):
    import transformers

    calls = []

    def record(kind, result):
        def from_pretrained(model_id, **kwargs):
            calls.append((kind, model_id, kwargs.get("trust_remote_code")))
            return result

        return from_pretrained

    model, tok = tiny_models[MODEL]
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model", model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer", tok))
    monkeypatch.setattr(app, "_check_hub", lambda model_id, timeout_s: calls.append(("hub", model_id, timeout_s)))
    assert app.load_model.__wrapped__("HuggingFaceTB/SmolLM2-135M", False, 3.0) == (model, tok)
    assert sorted(calls) == [
        ("hub", "HuggingFaceTB/SmolLM2-135M", 3.0),  # asked once, with the short timeout, before loading
        ("model", "HuggingFaceTB/SmolLM2-135M", False),
        ("tokenizer", "HuggingFaceTB/SmolLM2-135M", False),
    ]


def _gated_error():
    """What transformers raises for a gated model: an OSError raised from the Hub's GatedRepoError."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError

    response = httpx2.Response(401, request=httpx2.Request("GET", "https://hub.example/tiny-org/model"))
    try:
        raise GatedRepoError("401 Client Error: access to model tiny-org/model is restricted", response=response)
    except GatedRepoError as err:
        try:
            raise OSError("You are trying to access a gated repo.\nMake sure to have access to it.") from err
        except OSError as wrapped:
            return wrapped


@pytest.mark.parametrize(
    "failure, message",
    [
        (
            lambda: OSError(
                "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them"
            ),
            r"^Could not reach the Hub for tiny-org/model: We couldn't connect to 'https://huggingface\.co' to load "
            r"the files, and couldn't find them; try again later\.$",
        ),
        (
            lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            r"^Not enough memory to load tiny-org/model \(CUDA out of memory\. Tried to allocate 2\.00 GiB\); "
            r"try again later, or pick a smaller model\.$",
        ),
        (_gated_error, r"^tiny-org/model is a gated model and this Space has no access to it; pick another model"),
        (
            lambda: OSError("tiny-org/model does not appear to have a file named config.json."),
            r"^Could not load tiny-org/model: tiny-org/model does not appear to have a file named config\.json\.; "
            r"try again later, or pick another model\.$",
        ),
    ],
    ids=["hub-unreachable", "out-of-memory", "gated", "other"],
)
def test_a_model_that_cannot_be_loaded_says_why(app, monkeypatch, failure, message):
    import transformers

    def fail(*args, **kwargs):
        raise failure()

    monkeypatch.setattr(app, "SETTINGS", app.SpaceSettings(models=(MODEL, EVALUATOR)))
    monkeypatch.setattr(app, "_check_hub", lambda model_id, timeout_s: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    app.load_model.cache_clear()
    with shows_error(message):
        app.score("some text", MODEL, EVALUATOR, K, D, ALPHA, BETA)


@pytest.fixture
def silent_hub(monkeypatch):
    """A "Hub" at 127.0.0.1 that accepts connections and never answers; yields its listening socket."""
    import socket

    from huggingface_hub import constants

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield listener
    listener.close()


def test_a_hub_that_does_not_answer_fails_after_one_short_question(app, monkeypatch, silent_hub):
    import transformers
    from huggingface_hub import HfApi

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was called: it would retry for a minute")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    asked, model_info = [], HfApi.model_info
    monkeypatch.setattr(HfApi, "model_info", lambda self, *a, **k: asked.append(k) or model_info(self, *a, **k))
    with shows_error(r"^Could not reach the Hub for tiny-org/model: .*; try again later\.$"):
        app.load_model.__wrapped__(MODEL, False, 1.0)
    silent_hub.setblocking(False)
    connections = []
    with contextlib.suppress(BlockingIOError):
        while True:
            connections.append(silent_hub.accept()[0])
    for connection in connections:
        connection.close()
    # asked once, with the Space's short timeout, and never again (a retry would be a second connection):
    # it fails as soon as that timeout runs out
    assert [k.get("timeout") for k in asked] == [1.0] and len(connections) == 1


def test_local_model_folders_are_served_only_when_the_settings_allow_them(app, saved_model, monkeypatch):
    settings = app.SpaceSettings.from_env(
        {"LONGPPL_SPACE_MODELS": f"{saved_model},a-org/one", "LONGPPL_SPACE_LOCAL_MODELS": "1"}
    )
    assert settings.models == (saved_model, "a-org/one") and settings.local_models
    with pytest.raises(ValueError, match="which is not a Hub model id"):
        app.SpaceSettings.from_env({"LONGPPL_SPACE_MODELS": saved_model})  # not without the switch
    for entry in ("./model", "model", os.path.join(saved_model, "missing")):
        with pytest.raises(ValueError, match=f"LONGPPL_SPACE_MODELS lists {re.escape(repr(entry))}"):
            app.SpaceSettings.from_env({"LONGPPL_SPACE_MODELS": entry, "LONGPPL_SPACE_LOCAL_MODELS": "1"})
    with pytest.raises(ValueError, match=r"LONGPPL_SPACE_LOCAL_MODELS='yes' must be 1 or 0"):
        app.SpaceSettings.from_env({"LONGPPL_SPACE_LOCAL_MODELS": "yes"})

    def no_hub(*args):
        raise AssertionError("the Hub was asked about a local folder")

    monkeypatch.setattr(app, "_check_hub", no_hub)
    model, tokenizer = app.load_model.__wrapped__(saved_model, True)
    assert model.config.model_type == "mistral" and len(tokenizer) > 0


def test_an_allowed_id_that_is_also_a_local_folder_is_not_loaded(app, monkeypatch, tmp_path):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a local folder was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    (tmp_path / "some-org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with shows_error("The Space is misconfigured: the listed model 'some-org/model' is not loaded"):
        app.load_model.__wrapped__("some-org/model")


def test_split_texts(app):
    assert app.split_texts("a\nb\n---\n\nc\n ---  \n\n---\n") == ["a\nb", "c"]
    assert app.split_texts("one --- line") == ["one --- line"]


def _setup_cfg(repo_root):
    config = configparser.ConfigParser()
    config.read(os.path.join(repo_root, "setup.cfg"))
    return config


def test_space_requirements(repo_root):
    """requirements.txt installs the package at this version (the Space's files are thin shells over
    it), and the package's install_requires name every library its code imports at module level.

    A library of an optional extra (matplotlib for ``figures.py``) may be imported inside a function
    only, where its absence is a clear error when that function is used, not when the module loads.
    """
    required = [line.strip() for line in open(os.path.join(longppl.METRIC_PATH, "requirements.txt")) if line.strip()]
    config = _setup_cfg(repo_root)
    assert required == [f"{config['metadata']['name']}=={config['metadata']['version']}"]
    install_requires = config["options"]["install_requires"].split()
    names = {re.split(r"[<>=!~ ]", line)[0].lower() for line in install_requires if line.strip()}
    extras = {
        re.split(r"[<>=!~ \[]", line.strip())[0].lower()
        for name, value in config["options.extras_require"].items()
        if name not in ("test", "space")
        for line in value.splitlines()
        if line.strip() and not line.strip().startswith("#")
    }
    distributions = importlib.metadata.packages_distributions()
    top_level, in_functions, optional = set(), set(), set()
    statement = r"(?:import\s+([A-Za-z_]\w*)|from\s+([A-Za-z_]\w*)(?:\.\w+)*\s+import\b)"
    for folder, _, files in os.walk(longppl.METRIC_PATH):
        for name in files:
            if not name.endswith(".py") or name == "app.py":  # gradio comes with the Space's sdk
                continue
            source = open(os.path.join(folder, name), encoding="utf-8").read()
            relative = os.path.relpath(os.path.join(folder, name), longppl.METRIC_PATH)
            if relative.split(os.sep)[0] == "harness" or relative == os.path.join("tools", "score_pipeline.py"):
                # optional (`import longppl` never imports them): the harness sub-package and the datatrove
                # step; their libraries are their extras'
                optional |= {a or b for a, b in re.findall(r"^\s*" + statement, source, re.M)}
                continue
            top_level |= {a or b for a, b in re.findall("^" + statement, source, re.M)}
            in_functions |= {a or b for a, b in re.findall(r"^\s+" + statement, source, re.M)}
    ours = set(sys.stdlib_module_names) | {"__future__", "longppl"}

    def normal(names):  # a distribution's name as PEP 503 compares them (lm_eval is lm-eval)
        return {re.sub(r"[-_.]+", "-", name).lower() for name in names}

    for module in sorted(optional - ours):
        assert normal(distributions[module]) & normal(names | extras), f"{module} is in no requirement or extra"
    for module in sorted(top_level - ours):
        assert {d.lower() for d in distributions[module]} & names, f"{module} is imported but not in install_requires"
    for module in sorted(in_functions - top_level - ours):
        # an optional library need not be installed here (torchao, the fp8 extra's): then its module name
        # is its distribution's
        found = distributions.get(module, [module])
        assert normal(found) & normal(names | extras), f"{module} is in no requirement or extra"


def test_gradio_is_the_space_extra(repo_root):
    space_extra = _setup_cfg(repo_root)["options.extras_require"]["space"].split()
    assert f"gradio=={gr.__version__}" in space_extra  # the version the card's sdk_version names


def test_dry_run_lists_the_thin_shells_only(push_script, repo_root, capsys):
    push_script.main(["--repo-id", "my-org/longppl", "--dry-run"])
    listed = capsys.readouterr().out.split()
    # the metric file, the app, the card and the requirements that install the package: no package code
    assert listed == ["README.md", "app.py", "longppl.py", "requirements.txt"]
    assert {os.path.basename(p) for p in register.module_files()} <= set(listed)
    tracked = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            *(f"metrics/longppl/{n}" for n in listed),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(tracked) == len(listed)


def test_dry_run_refuses_a_folder_without_the_shells(push_script, tmp_path, capsys):
    folder = tmp_path / "longppl"
    folder.mkdir()
    (folder / "longppl.py").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        push_script.main(["--repo-id", "my-org/longppl", "--dry-run", "--folder", str(folder)])
    assert "lacks the Space's README.md, app.py, requirements.txt" in str(exit_info.value.code)


class RecordingApi:
    calls = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return "https://huggingface.co/spaces/my-org/longppl/commit/abc"


@pytest.fixture
def recording_api(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi.calls


def test_push_creates_a_gradio_space_and_uploads_exactly_the_listed_files(push_script, recording_api, capsys):
    push_script.main(["--repo-id", "my-org/longppl", "--token", "hf_test"])
    assert recording_api[0] == ("init", "hf_test")
    assert recording_api[1] == (
        "create_repo",
        "my-org/longppl",
        dict(repo_type="space", space_sdk="gradio", exist_ok=True, private=False),
    )
    upload = recording_api[2][1]
    assert upload["repo_id"] == "my-org/longppl" and upload["repo_type"] == "space"
    assert upload["folder_path"] == push_script.METRIC_FOLDER
    assert upload["allow_patterns"] == push_script.space_files()
    assert "huggingface.co/spaces/my-org/longppl" in capsys.readouterr().out


def test_push_without_a_token_fails_before_any_upload(push_script, recording_api, monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(SystemExit) as exit_info:
        push_script.main(["--repo-id", "my-org/longppl"])
    message = str(exit_info.value.code)
    assert "No Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login`" in message
    assert recording_api == []


@pytest.mark.parametrize(
    "repo_id",
    [
        "longppl",
        "my-org/longppl/extra",
        "my-org/",
        "/longppl",
        "-org/longppl",
        "my-org/long ppl",
        "my-org/long--ppl",
        "my-org/longppl..",
    ],
)
def test_push_refuses_a_repo_id_that_is_not_owner_name(push_script, recording_api, repo_id):
    with pytest.raises(SystemExit) as exit_info:
        push_script.main([f"--repo-id={repo_id}", "--token", "hf_test"])
    message = str(exit_info.value.code)
    assert f"--repo-id {repo_id!r} is not a Space id" in message and "Pass owner/name" in message
    assert recording_api == []


def test_app_runs_from_a_copy_of_the_space_folder(push_script, tmp_path, monkeypatch):
    """The Space is the uploaded files alone, in a folder not named longppl, over the installed package."""
    space = tmp_path / "space"
    space.mkdir()
    for name in push_script.space_files():
        shutil.copyfile(os.path.join(longppl.METRIC_PATH, name), space / name)
    spec = importlib.util.spec_from_file_location("space_app", space / "app.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "space_app", module)  # as an import (or `python app.py`) has it
    spec.loader.exec_module(module)
    from longppl.space import app as space_app

    assert module.demo is space_app.demo and isinstance(module.demo, gr.Blocks)
    metric = space_app.load_metric()
    assert type(metric).__name__ == "LongPPL"
    assert "return_key_spans" in metric.inputs_description
    # evaluate.load of the uploaded metric file gives the same metric, from the installed package
    copied = evaluate.load(str(space / "longppl.py"))
    assert type(copied).__name__ == "LongPPL" and copied.inputs_description == metric.inputs_description
