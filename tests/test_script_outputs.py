"""What a person looks at: the tools' --help, the correlation figure, the key-token HTML page, and
the warning when a corpus has no key tokens. No model is needed here (the tools' runs against a
real cache are in test_key_token_scripts.py)."""

import html.parser
import json
import math
import os
import re
import shutil
import sys

import numpy as np
import pytest
from helpers import run_guarded

from longppl.commandline.correlation import least_squares_line, pearson
from longppl.commandline.figures import correlation_figure, correlation_scatter, lsd_histogram, short_model_names
from longppl.commandline.reports import explain_missing_key_tokens
from longppl.core.scoring import EvaluatorScores
from longppl.settings import KeyTokenRule
from longppl.views.key_token_html import MAX_OPACITY, key_token_html

NAN = float("nan")

# Runs a tool's --help as `python -m longppl.tools.X --help` would (runpy, __main__), then reports which
# heavy modules that imported, and every option of the tool's parser with its expanded help.
HELP_PROBE = r"""
import importlib, json, runpy, sys
module = sys.argv[1]
sys.argv = [module, "--help"]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in ("torch", "transformers", "evaluate", "matplotlib") if m in sys.modules)
parser = importlib.import_module(module).build_parser()
formatter = parser._get_formatter()
options = [
    {"option": a.option_strings[-1], "help": formatter._expand_help(a) if a.help else "",
     "default": a.default if isinstance(a.default, (int, float, str)) and not isinstance(a.default, bool) else None}
    for a in parser._actions if a.option_strings and a.dest != "help"
]
print("@@PROBE@@" + json.dumps({"code": code, "heavy": heavy, "options": options}))
"""


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """evaluate's module cache with this checkout's metric registered, as after the README's first
    command. The shared default cache may hold another checkout's copy, and `import longppl` then
    registers this one, a one-off that loads evaluate: not what --help costs."""
    from longppl import register

    cache = tmp_path_factory.mktemp("modules")
    register.register_metric(str(cache))
    return str(cache)


@pytest.mark.parametrize("tool", ["evaluate_models", "visualize_key_tokens"])
def test_help_is_quick_and_explains_every_option(tool, modules_cache):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=modules_cache)
    done = run_guarded(
        [sys.executable, "-c", HELP_PROBE, f"longppl.tools.{tool}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    help_text, probe = done.stdout.split("@@PROBE@@")
    probe = json.loads(probe)
    assert probe["code"] == 0 and "usage:" in help_text
    assert probe["heavy"] == []  # torch, transformers, evaluate, matplotlib: after the arguments are parsed
    missing = [o["option"] for o in probe["options"] if not o["help"].strip()]
    assert missing == []
    for option in probe["options"]:
        default = option["default"]
        if default is not None:  # a default that is a value must be stated
            shown = format(default, "g") if isinstance(default, float) else str(default)
            assert shown in option["help"], (option["option"], option["help"])
    if tool == "evaluate_models":
        helps = {o["option"]: o["help"] for o in probe["options"]}
        assert "(default: 5)" in helps["--gamma"] and "(default: 32768)" in helps["--max-tokens-per-batch"]
        assert "pooled" in helps["--aggregation"] and "(default: official)" in helps["--aggregation"]
        assert "official-pre-2025-07: the official evaluation script before July 2025" in helps["--aggregation"]
        assert "progress" in helps["--no-progress"]


# ---------------------------------------------------------------------------------- correlation figure


def test_short_model_names():
    models = [
        "Qwen/Qwen2-7B",
        "/ckpt/a/model/",
        "/ckpt/b/model",
        "mistralai/Mistral-7B-v0.1",
        "local",
        "x/run/final",
        "y/run/final",
    ]
    assert short_model_names(models) == [
        "Qwen2-7B",
        "a/model",
        "b/model",
        "Mistral-7B-v0.1",
        "local",
        "x/run/final",
        "y/run/final",
    ]
    assert short_model_names(["C:\\models\\llama"]) == ["llama"]


def plain_least_squares(x, y):
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    return slope, my - slope * mx


def test_least_squares_line_against_the_plain_formula():
    x, y = [3.0, 1.0, 4.0, 1.5, 5.0], [2.0, 7.0, 1.0, 8.0, 2.5]
    assert least_squares_line(x, y) == pytest.approx(plain_least_squares(x, y), rel=1e-12)
    assert all(math.isnan(v) for v in least_squares_line([2.0, 2.0], [1.0, 3.0]))
    assert all(math.isnan(v) for v in least_squares_line([2.0], [1.0]))
    with pytest.raises(ValueError, match=r"same length, got shapes \(2,\) and \(3,\)"):
        least_squares_line([1.0, 2.0], [1.0, 2.0, 3.0])


def test_correlation_figure_has_short_labels_one_colour_and_fit_lines(tmp_path):
    models = ["/data/ckpt/llama-7b", "/data/ckpt/llama-7b-yarn", "org/llama-7b", "mistral-7b"]
    longppl_values, ppl_values = [3.1, 2.4, 4.0, 2.9], [6.2, 6.0, 6.9, 5.1]
    scores = [30.0, 35.5, 24.0, 33.0]
    figure = correlation_figure(models, longppl_values, ppl_values, scores, "LongBench")
    labels = ["ckpt/llama-7b", "llama-7b-yarn", "org/llama-7b", "mistral-7b"]
    colours = set()
    for ax, values in zip(figure.axes[:2], (longppl_values, ppl_values)):
        assert [t.get_text() for t in ax.texts] == labels
        colours |= {tuple(c) for collection in ax.collections for c in collection.get_facecolors()}
        (fit,) = [line for line in ax.get_lines() if "least-squares" in line.get_label()]
        r = pearson(values, scores)
        assert fit.get_label() == f"least-squares fit (Pearson r = {r:.2f})"
        slope, intercept = plain_least_squares(values, scores)
        assert list(fit.get_xdata()) == [min(values), max(values)]
        assert list(fit.get_ydata()) == pytest.approx([slope * x + intercept for x in fit.get_xdata()], rel=1e-12)
        assert fit.get_label() in [t.get_text() for t in ax.get_legend().get_texts()]
        assert f"Pearson {r:.2f}" in ax.get_title()
    assert len(colours) == 1  # one colour: it carries no meaning the legend would have to explain
    path = tmp_path / "correlation.png"
    correlation_scatter(str(path), models, longppl_values, ppl_values, scores)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "name, magic",
    [("lsd.jpg", b"\xff\xd8\xff"), ("lsd.JPEG", b"\xff\xd8\xff"), ("lsd.pdf", b"%PDF"), ("lsd", b"\x89PNG")],
)
def test_a_figure_is_written_in_the_format_its_suffix_names(tmp_path, name, magic):
    lsd_histogram(str(tmp_path / name), np.array([0.1, 0.4, 3.0, np.nan]), alpha=2.0)
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_a_figure_suffix_without_a_format_is_refused_and_nothing_written(tmp_path):
    with pytest.raises(ValueError, match=r"'.*lsd\.xyz': a figure cannot be written as \.xyz; .*\.png, \.jpg"):
        lsd_histogram(str(tmp_path / "lsd.xyz"), np.array([0.1, 3.0]), alpha=2.0)
    assert os.listdir(tmp_path) == []


def test_correlation_figure_without_a_line_when_x_is_constant():
    figure = correlation_figure(["a", "b"], [2.0, 2.0], [5.0, 6.0], [1.0, 2.0])
    assert [line.get_label() for line in figure.axes[0].get_lines()] == []
    assert len(figure.axes[1].get_lines()) == 1


# ------------------------------------------------------------------------------------- key-token HTML


class Spans(html.parser.HTMLParser):
    """The page's <span> and <div> elements in document order: (tag, attributes, text inside)."""

    def __init__(self):
        super().__init__()
        self.elements, self.open, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.elements.append([tag, dict(attrs), ""])
        self.open.append(self.elements[-1])

    def handle_endtag(self, tag):
        self.open.pop()

    def handle_data(self, data):
        for element in self.open:
            element[2] += data
        self.text.append(data)


def parse(page):
    parser = Spans()
    parser.feed(page)
    return parser


def opacity(style):
    return float(style.split("rgba(")[1].rstrip(")").split(",")[3]) if style else 0.0


def test_html_shades_by_lsd_marks_where_the_first_k_tokens_end_and_has_a_legend():
    text = "<b>Tom & Jerry</b> went to the market to buy 'fresh' bread."
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+|\s+", text)]
    n, k = len(words) + 1, 4
    offsets = np.array([[0, 0]] + [list(w) for w in words])
    rng = np.random.default_rng(0)
    lp_long = np.concatenate([[NAN], -rng.uniform(0.1, 3.0, n - 1)])
    lsd_values = np.concatenate([[NAN] * k, np.linspace(-1.0, 5.0, n - k)])
    rng.shuffle(lsd_values[k:])
    lp_short = lp_long - lsd_values
    scores = EvaluatorScores(np.arange(n), offsets, lp_long, lp_short)
    alpha, beta, cap = 2.0, -2.5, 4.0
    page = key_token_html(text, scores, alpha, beta, trunc_len=k, lsd_cap=cap)
    parsed = parse(page)
    # all text escaped: the document round-trips and no tag of it became markup
    doc = next(e for e in parsed.elements if e[1].get("class") == "doc")
    assert doc[2] == text and "&lt;b&gt;Tom" in page and "<b>Tom" not in page and "Jerry</b>" not in page
    assert not any(e[0] == "b" and "Tom" in e[2] for e in parsed.elements)
    legend = next(e for e in parsed.elements if e[1].get("class") == "legend")
    assert "Legend." in legend[2] and "shaded in proportion to LSD clipped to [0, 4]" in legend[2]
    assert "Key tokens (LSD > 2 and LCL > -2.5) are underlined and bold" in legend[2]
    assert "the first K=4 evaluator tokens, which have no short-context score" in legend[2]
    # token spans in order, and the marker between token K-1 and token K
    inside = [
        e
        for e in parsed.elements
        if e[0] == "span" and ("t" in e[1].get("class", "").split() or e[1].get("class") == "k-end")
    ]
    inside = inside[next(i for i, e in enumerate(inside) if e[1].get("title", "").startswith("token 1:")) :]
    classes = [e[1]["class"] for e in inside]
    assert classes.count("k-end") == 1
    marker = classes.index("k-end")
    assert inside[marker - 1][1]["title"].startswith(f"token {k - 1}: ")
    assert inside[marker + 1][1]["title"].startswith(f"token {k}: ")
    assert "before this point, no short-context score" in inside[marker][1]["title"]
    assert inside[marker][1]["data-label"] == f"K={k}"
    tokens = [e for e in inside if e[1]["class"] != "k-end"]
    assert all(e[1]["class"] == "t noscore" and "style" not in e[1] for e in tokens[: k - 1])
    # shading: MAX_OPACITY * clip(LSD / cap, 0, 1), so monotone in LSD; key tokens outlined (class key)
    shown = [
        (float(lsd_values[i]), opacity(e[1].get("style")), e[1]["class"]) for i, e in enumerate(tokens, 1) if i >= k
    ]
    for lsd, value, _ in shown:
        assert value == pytest.approx(MAX_OPACITY * min(max(lsd / cap, 0.0), 1.0), abs=1e-3)
    ordered = [value for _, value, _ in sorted(shown)]
    assert ordered == sorted(ordered) and ordered[0] == 0 and ordered[-1] == pytest.approx(MAX_OPACITY)
    key = scores.key_mask(KeyTokenRule(alpha, beta))
    assert [css == "t key" for _, _, css in shown] == list(key[k:])
    assert 0 < key.sum() < n - k
    lsd_k = lp_long[k] - lp_short[k]
    assert tokens[k - 1][1]["title"] == f"token {k}: LSD {lsd_k:.2f}, LCL {lp_long[k]:.2f}"  # hover kept


def test_html_of_a_text_within_the_first_k_tokens_has_no_marker():
    text = "short text"
    scores = EvaluatorScores(
        np.arange(3), np.array([[0, 0], [0, 5], [5, 10]]), np.array([NAN, -1.0, -2.0]), np.array([NAN, NAN, NAN])
    )
    page = key_token_html(text, scores, 2.0, -2.0, trunc_len=8)
    assert 'class="k-end" data-label="K=8"' not in page.split('<div class="doc">')[1]
    assert "No token has a short-context score: the text is at most K=8 evaluator tokens long." in page
    with pytest.raises(ValueError, match=r"lsd_cap=0 must be a positive LSD"):
        key_token_html(text, scores, 2.0, -2.0, lsd_cap=0)


# ---------------------------------------------------------------------------- no key tokens: why


def test_explain_missing_key_tokens_names_the_cause():
    short = EvaluatorScores(np.arange(3), np.zeros((3, 2)), np.array([NAN, -1.0, -2.0]), np.array([NAN, NAN, NAN]))
    assert explain_missing_key_tokens([short, short], KeyTokenRule(2.0, -2.0, True), 4096) == (
        "none of the 2 texts is longer than K=4096 evaluator tokens, so no token has a short-context score "
        "(LSD) to be a key token. Use longer texts, or score the cache with a smaller --trunc-len "
        "(longppl-score)."
    )
    scored = EvaluatorScores(
        np.arange(4), np.zeros((4, 2)), np.array([NAN, -1.0, -3.0, -0.5]), np.array([NAN, NAN, -6.5, -1.25])
    )
    message = explain_missing_key_tokens([short, scored], KeyTokenRule(2.0, -2.0, True), 2)
    assert message.startswith(
        "none of the 2 evaluator tokens with a short-context score meets the key-token rule LSD > 2 and "
        "LCL > -2 (largest LSD 3.50; 1 tokens have LSD > 2): alpha/beta are too strict"
    )
    assert message.endswith(
        "Try a lower --alpha or --beta, or --no-lcl; longppl-visualize --histogram shows the LSD distribution."
    )
    assert "Try a lower --alpha;" in explain_missing_key_tokens([scored], KeyTokenRule(4.0, -2.0, False), 2)
    assert explain_missing_key_tokens([scored], KeyTokenRule(2.0, -4.0, True), 2).startswith(
        "the evaluator has 1 key tokens, but no token of the evaluated model lies within their character spans"
    )


def test_lsd_cap_must_be_positive(capsys):
    from longppl.tools import visualize_key_tokens

    with pytest.raises(SystemExit):
        visualize_key_tokens.parse_args(["--key-tokens", "cache", "--html", "doc.html", "--lsd-cap", "0"])
    assert "--lsd-cap 0 must be positive: it is the LSD shown at full shade" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- commands' errors


def test_run_command_turns_a_bad_input_into_one_line_and_status_1(monkeypatch, capsys):
    from longppl.commandline.running import run_command

    calls = []

    def fine(argv, prog):
        calls.append((argv, prog))
        return {"results": "for Python callers, not an exit status"}

    def refuses(argv, prog):
        raise ValueError("scores.csv, line 3: score 'x' of 'm' is not a number.")

    monkeypatch.setattr(sys, "argv", ["/venv/bin/longppl-evaluate", "--models", "m"])
    assert run_command(fine, ["--models", "m"]) == 0
    assert calls == [(["--models", "m"], "longppl-evaluate")]  # the name it was started by
    with pytest.raises(SystemExit) as stop:
        run_command(refuses)
    assert stop.value.code == "longppl-evaluate: error: scores.csv, line 3: score 'x' of 'm' is not a number."

    def crashes(argv, prog):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_command(crashes)


def test_run_command_reports_a_missing_input_file_in_one_line_and_longppl_debug_shows_the_traceback(
    monkeypatch,
):
    from longppl.commandline.running import run_command

    def missing(argv, prog):
        raise FileNotFoundError("No key-token cache at 'keys' (score a corpus into it first).")

    monkeypatch.setattr(sys, "argv", ["/venv/bin/longppl-evaluate"])
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        run_command(missing)
    assert stop.value.code == "longppl-evaluate: error: No key-token cache at 'keys' (score a corpus into it first)."
    for value in ("1", "true"):
        monkeypatch.setenv("LONGPPL_DEBUG", value)  # the same variable for every command, longce-train's too
        with pytest.raises(FileNotFoundError, match="No key-token cache at 'keys'"):
            run_command(missing)
    monkeypatch.setenv("LONGPPL_DEBUG", "0")
    with pytest.raises(SystemExit):
        run_command(missing)


@pytest.mark.slow  # fresh interpreters: seconds
def test_the_installed_command_says_what_was_wrong_without_a_traceback(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('["text"]\n', encoding="utf-8")
    evaluator = tmp_path / "evaluator"  # a model folder (never loaded: the corpus fails first)
    evaluator.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (evaluator / name).write_text("{}", encoding="utf-8")
    command = shutil.which("longppl-score", path=os.path.dirname(sys.executable))
    assert command is not None, "reinstall the project (pip install -e .) to get its console scripts"
    done = run_guarded(
        [command, "--corpus", str(corpus), "--evaluator", str(evaluator), "--output", str(tmp_path / "out")],
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"longppl-score: error: {corpus}, line 1 is a JSON list, not an object with a 'text' field."
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
