"""The Space in a real browser: the app started as the Space runs it (the uploaded files alone, in a
folder of their own, ``python app.py``) on 127.0.0.1 with tiny local models, driven by headless
Chromium (Debian's package) through Playwright: one computation, read off the page (its counts
labelled and agreeing, its legend, its per-token details on focus, its words unbroken); the
messages of bad fields and of a paste over the limit, each replacing the results on the page (and
results replacing an earlier message); and one model that cannot be loaded, whose message must
appear on the page.

CI (``.ci/run``) installs Chromium and Playwright, and there a missing browser fails the test; on a
developer's machine without them it is skipped with the reason.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import evaluate
import numpy as np
import pytest
from helpers import HANG_GUARD_S, byte_level_bpe, govreport_texts, hang, metaspace_bpe, tiny_model

import longppl

pytest.importorskip("gradio", reason="the Space's tests need gradio: pip install -e '.[space]'")

K, D, ALPHA, BETA = 47, 13, 0.005, -50.0  # as test_space: random tiny models have small LSDs
UNREACHABLE = "tiny-org/unreachable"  # a Hub id, served by a "Hub" that refuses connections
SPACE_ID = "test-org/longppl"  # as Hugging Face sets it in a Space
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _missing(what: str):
    """Fail in CI, which must have installed it (``.ci/run``); skip, saying why, elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}: .ci/run installs it (apt-get install chromium, pip install playwright)")
    pytest.skip(f"{what}: apt-get install chromium && pip install playwright to run the browser test")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def playwright_browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright's Python package is not installed")
    if not os.path.exists(CHROMIUM):
        _missing(f"no Chromium at {CHROMIUM}")
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny evaluated model and evaluator saved as folders (absolute paths)."""
    root = tmp_path_factory.mktemp("space_models")
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    tiny_model("mistral", len(tok), seed=2).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    tiny_model("llama", len(ev_tok), seed=1).save_pretrained(root / "evaluator")
    ev_tok.save_pretrained(root / "evaluator")
    return str(root / "model"), str(root / "evaluator")


@pytest.fixture(scope="module")
def server(models, tmp_path_factory, repo_root):
    """``python app.py`` in a copy of the Space's files, serving the tiny models and an unreachable
    Hub id; yields its URL."""
    spec = importlib.util.spec_from_file_location("push", os.path.join(repo_root, "scripts", "push_metric_to_hub.py"))
    push = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(push)
    space = tmp_path_factory.mktemp("space")
    for name in push.space_files():
        (space / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(longppl.METRIC_PATH, name), space / name)
    port = _free_port()
    model, evaluator = models
    env = {
        key: value for key, value in os.environ.items() if key != "PYTHONPATH"
    }  # the installed package only, as requirements.txt gives the Space
    env.update(
        LONGPPL_SPACE_MODELS=f"{model},{UNREACHABLE},{evaluator}",
        LONGPPL_SPACE_LOCAL_MODELS="1",
        LONGPPL_SPACE_HUB_TIMEOUT_S="5",
        HF_ENDPOINT=f"http://127.0.0.1:{_free_port()}",  # nothing listens there: the Hub is down
        HF_HOME=str(space / "hf_home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        GRADIO_ANALYTICS_ENABLED="False",
        GRADIO_SERVER_NAME="127.0.0.1",
        GRADIO_SERVER_PORT=str(port),
        OMP_NUM_THREADS="1",
        SPACE_ID=SPACE_ID,
    )
    log = open(space / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "app.py"], cwd=space, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the app exited ({process.returncode}):\n{(space / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                hang("the app's server (not answering)", HANG_GUARD_S, (space / "server.log").read_text())
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def page(playwright_browser, server):
    context = playwright_browser.new_context(viewport={"width": 1280, "height": 900})
    # Only the app itself: the test must not reach out (fonts, analytics) and must not wait for it.
    context.route(
        "**/*",
        lambda route: route.continue_() if route.request.url.startswith(server) else route.abort(),
    )
    page = context.new_page()
    page.set_default_timeout(HANG_GUARD_S * 1000)  # a hang guard: the page's waits test what appears, not when
    page.goto(server, wait_until="domcontentloaded")
    page.get_by_role("button", name="Compute").wait_for()
    yield page
    context.close()


def _screenshot(page, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    page.screenshot(path=path, full_page=True)
    print(f"screenshot: {path}")
    return path


def _choose(page, label: str, option: str) -> None:
    page.get_by_label(label).click()
    page.get_by_role("option", name=option).click()


def test_a_computation_shows_longppl_the_table_and_the_key_tokens(page, models, tmp_path):
    model, evaluator = models
    longppl_box, ppl_box = page.get_by_label("LongPPL", exact=True), page.get_by_label("PPL", exact=True)
    assert longppl_box.input_value() == "" and ppl_box.input_value() == ""  # no "0" before a run
    # An example fills the texts and its K and d.
    examples = json.load(open(os.path.join(longppl.METRIC_PATH, "space", "space_examples.json"), encoding="utf-8"))
    page.get_by_text(examples["examples"][1]["title"]).click()
    page.wait_for_function(
        "value => document.querySelector('textarea').value === value", arg=examples["examples"][1]["text"]
    )
    assert page.get_by_label("K (short-context length)").input_value() == str(examples["K"])

    text = govreport_texts()[0][1000:1900]
    _compute_and_wait_for_the_view(page, text)
    page.wait_for_function("() => document.querySelector('table') !== null")
    screenshot = _screenshot(page, tmp_path, "space_result.png")

    expected = evaluate.load(os.path.join(longppl.METRIC_PATH, "longppl.py")).compute(
        predictions=[text],
        model_id=model,
        evaluator_model_id=evaluator,
        trunc_len=K,
        sliding_window=D,
        alpha=ALPHA,
        beta=BETA,
        return_evaluator_scores=True,
        progress=False,
    )
    assert float(longppl_box.input_value()) == pytest.approx(expected["longppl"], abs=1e-4)
    assert float(ppl_box.input_value()) == pytest.approx(expected["ppl"], abs=1e-4)
    headers = page.locator("table thead th").all_inner_texts()
    cells = dict(zip(headers, page.locator("table tbody tr").first.locator("td").all_inner_texts()))
    # The key-token view: the text as it is, its evaluator key tokens marked (LSD > alpha and LCL >
    # beta, computed here from the evaluator's log-probs), LSD and LCL on hover, the K marker, a legend.
    scores = expected["evaluator_scores"][0]
    lsd = scores.lp_long - scores.lp_short
    with np.errstate(invalid="ignore"):
        key = (lsd > ALPHA) & (scores.lp_long > BETA)
    key_texts = [text[start:end] for (start, end), is_key in zip(scores.offsets.tolist(), key) if is_key]
    in_text = int((scores.offsets[:, 1] > scores.offsets[:, 0]).sum())  # the evaluator's tokens of the text: no BOS
    # Every count says whose tokens it counts; the table's evaluator's counts are the view's.
    assert cells == {
        "text": "1",
        "LongPPL": f"{expected['longppls'][0]:.3f}",
        "PPL": f"{expected['perplexities'][0]:.3f}",
        "key tokens (evaluated model's)": str(expected["n_key_tokens"][0]),
        "tokens (evaluated model's)": str(expected["n_tokens"][0]),
        "key tokens (evaluator's)": str(len(key_texts)),
        "tokens (evaluator's)": str(in_text),
    }
    view = page.locator(".longppl-keys")
    meta = view.locator(".meta").first
    assert meta.inner_text().startswith(f"{len(key_texts)} key tokens of the evaluator's {in_text} tokens of this text")
    assert meta.locator('[data-count="key"]').inner_text() == cells["key tokens (evaluator's)"]
    assert meta.locator('[data-count="tokens"]').inner_text() == cells["tokens (evaluator's)"]
    assert (
        "differ when the two tokenizers cut the text differently"
        in page.get_by_text("LongPPL and PPL average").inner_text()
    )
    assert view.locator(".doc").inner_text() == text
    assert view.locator(".t.key").all_inner_texts() == key_texts and len(key_texts) > 0
    index = int(np.flatnonzero(key)[0])
    assert view.locator(".t.key").first.get_attribute("title") == (
        f"token {index}: LSD {lsd[index]:.2f}, LCL {scores.lp_long[index]:.2f}"
    )
    assert view.locator(f'.doc .k-end[data-label="K={K}"]').count() == 1
    assert "Legend." in view.locator(".legend").inner_text()
    # The key tokens are coloured inline, in the text's flow (not one badge per token).
    assert view.locator(".t.key").first.evaluate("e => getComputedStyle(e).display") == "inline"
    assert os.path.getsize(screenshot) > 10_000
    _legend_matches_the_key_tokens(view)
    _details_show_on_focus_and_tap(page, view)
    _words_are_not_chopped(view)


def _look(locator):
    """How the page draws each element of ``locator``: its underline, weight and background's opacity."""
    return locator.evaluate_all(
        """elements => elements.map(e => {
            const style = getComputedStyle(e);
            const alpha = style.backgroundColor.match(/rgba?\\(([^)]*)\\)/)[1].split(",")[3];
            return [style.textDecorationLine, style.fontWeight, alpha === undefined ? 1 : parseFloat(alpha)];
        })"""
    )


def _legend_matches_the_key_tokens(view):
    """The legend shows key tokens as the view draws them: underlined, bold, at every shade they have."""
    drawn, shown = _look(view.locator(".doc .t.key")), _look(view.locator(".legend .swatch.key"))
    assert {(line, weight) for line, weight, _ in drawn} == {(line, weight) for line, weight, _ in shown}
    assert {line for line, _, _ in drawn} == {"underline"}
    assert min(a for _, _, a in shown) <= min(a for _, _, a in drawn)
    assert max(a for _, _, a in drawn) <= max(a for _, _, a in shown)


def _detail(locator) -> str:
    """What the page shows under a focused token (its ``::after``), or "" when nothing."""
    return locator.evaluate(
        """e => { const after = getComputedStyle(e, "::after");
                  return after.display === "none" || after.content === "none" ? "" : after.content; }"""
    )


def _details_show_on_focus_and_tap(page, view):
    """LSD and LCL reach keyboards and touch screens: Tab steps through the key tokens and a click
    focuses any token; the focused one shows them under it."""
    keys = view.locator(".doc .t.key")
    first = keys.first
    assert _detail(first) == ""  # nothing shown until focused
    first.focus()
    assert first.evaluate("e => e === document.activeElement")
    assert _detail(first) == f'"{first.get_attribute("title")}"' and "LSD" in _detail(first)
    page.keyboard.press("Tab")
    assert keys.nth(1).evaluate("e => e === document.activeElement")  # the next key token, not the next token
    plain = view.locator(".doc .t:not(.key):not(.noscore)").first
    plain.click()
    assert plain.evaluate("e => e === document.activeElement") and "LSD" in _detail(plain)


def _words_are_not_chopped(view):
    """Pieces of one word (tokens with no text between them) sit edge to edge, with no border, box
    shadow, rounded corner, margin or padding of their own."""
    view.evaluate("() => document.activeElement && document.activeElement.blur()")  # no focus ring
    pairs = view.locator(".doc").evaluate(
        """doc => {
            const pairs = [];
            for (const a of doc.querySelectorAll(".t")) {
                const b = a.nextSibling;
                if (!(b instanceof Element) || !b.classList.contains("t")) continue;
                if (!/\\w$/.test(a.textContent) || !/^\\w/.test(b.textContent)) continue;
                const ra = a.getClientRects(), rb = b.getClientRects();
                const last = ra[ra.length - 1], first = rb[0];
                if (Math.abs(last.top - first.top) > 1) continue;  // the word wraps between them
                pairs.push([first.left - last.right, a.textContent + "|" + b.textContent]);
            }
            return pairs;
        }"""
    )
    assert pairs, "the text has no word split into several tokens"
    assert all(abs(gap) < 0.5 for gap, _ in pairs), pairs
    boxes = view.locator(".doc .t").evaluate_all(
        """elements => elements.map(e => { const s = getComputedStyle(e);
            return [s.boxShadow, s.borderTopWidth, s.borderLeftWidth, s.borderRadius, s.marginLeft,
                    s.paddingLeft, s.outlineStyle]; })"""
    )
    assert set(map(tuple, boxes)) == {("none", "0px", "0px", "0px", "0px", "0px", "none")}


def _message(page, text: str):
    """The error message on the page that holds ``text`` (gradio shows it until it is closed)."""
    message = page.get_by_text(text, exact=False).last
    message.wait_for()
    return message.inner_text()


def _compute_and_wait_for_the_view(page, text: str) -> None:
    page.get_by_label("Texts", exact=False).fill(text)
    for label, value in [("K (short-context length)", K), ("d (sliding window)", D)]:
        page.get_by_label(label).fill(str(value))
    page.get_by_label("alpha (LSD threshold)").fill(str(ALPHA))
    page.get_by_label("beta (LCL threshold)").fill(str(BETA))
    page.get_by_role("button", name="Compute").click()
    page.locator(".longppl-keys .doc").wait_for()


def _results_are_gone(page) -> None:
    page.wait_for_function("() => document.querySelector('.longppl-keys .doc') === null")
    assert page.get_by_label("LongPPL", exact=True).input_value() == ""
    assert page.locator("table").count() == 0


def test_bad_fields_and_long_pastes_get_our_messages_and_clear_the_results(page, tmp_path):
    text = govreport_texts()[0][1000:1900]
    _compute_and_wait_for_the_view(page, text)
    # An emptied field is named, with what to enter, and the earlier results go.
    page.get_by_label("alpha (LSD threshold)").fill("")
    page.get_by_role("button", name="Compute").click()
    shown = _message(page, "The field alpha (LSD threshold) is empty")
    assert "The field alpha (LSD threshold) is empty; enter a number (default: 2)." in shown and "None" not in shown
    _results_are_gone(page)
    _screenshot(page, tmp_path, "space_empty_field.png")
    # The field filled again: the new results come, and the earlier message (shown until closed) goes.
    _compute_and_wait_for_the_view(page, text)
    page.get_by_text("The field alpha (LSD threshold) is empty").wait_for(state="detached")
    assert page.get_by_role("button", name="Close").count() == 0  # no message left open over the results
    # A K beyond the Space's range: our message (field, range, what to do), not gradio's.
    page.get_by_label("K (short-context length)").fill("5000")
    page.get_by_role("button", name="Compute").click()
    shown = _message(page, "K (short-context length) is 5000")
    assert (
        "K (short-context length) is 5000, outside this Space's range of 1 to 4096; enter an integer from 1 to 4096. "
        f'To go beyond, run the metric on your own hardware: pip install longppl-hf, then evaluate.load("{SPACE_ID}").'
    ) in shown
    assert page.get_by_text("greater than maximum").count() == 0
    _results_are_gone(page)
    # A paste over the limit is not cut: all of it reaches the Space, which says how much is over.
    page.get_by_label("K (short-context length)").fill(str(K))
    texts_box = page.get_by_label("Texts", exact=False)
    texts_box.fill("")
    texts_box.focus()
    page.keyboard.insert_text("x" * 60_000)  # as a paste arrives: the browser would cut it to a maxlength
    assert len(texts_box.input_value()) == 60_000
    page.get_by_role("button", name="Compute").click()
    shown = _message(page, "The texts have 60000 characters")
    assert (
        "The texts have 60000 characters, 10000 more than this Space scores per request (50000); nothing was "
        "scored or cut: shorten them, or score long texts and corpora on your own hardware (`longppl score`, "
        "then `longppl evaluate`)."
    ) in shown
    assert "<this Space" not in shown
    _screenshot(page, tmp_path, "space_long_paste.png")


def test_a_model_that_cannot_be_loaded_says_why_on_the_page(page, tmp_path):
    page.get_by_label("Texts", exact=False).fill(govreport_texts()[0][1000:1900])
    _choose(page, "Evaluator model (Hub id)", UNREACHABLE)
    page.get_by_role("button", name="Compute").click()
    message = page.get_by_text(f"Could not reach the Hub for {UNREACHABLE}:")
    message.wait_for()
    page.wait_for_timeout(1000)  # the message fades in
    _screenshot(page, tmp_path, "space_error.png")
    assert "try again later" in message.inner_text()
    assert page.get_by_label("LongPPL", exact=True).input_value() == ""
