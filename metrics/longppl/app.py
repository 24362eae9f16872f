"""The LongPPL Space: long texts in; LongPPL, PPL and the highlighted key tokens out.

evaluate's ``launch_gradio_widget`` passes only the feature columns (the texts) to ``compute``, so
it cannot take model ids or settings (and it fails on current gradio); this small Blocks UI is
ours. Nothing is loaded at start-up: the metric and both models load when "Compute" is clicked.

The Space is this folder as it is (``app.py`` beside ``longppl.py``, nothing pip-installed but
``requirements.txt``), so the metric is loaded from the file next to this one, not imported from
an installed package.
"""

from __future__ import annotations

import math
import os
import warnings

import evaluate
import gradio as gr

HERE = os.path.dirname(os.path.abspath(__file__))
#: A line holding only this separates documents in the texts box.
SEPARATOR = "---"
KEY_LABEL = "key"

_metric = None


def load_metric():
    """The LongPPL metric from ``longppl.py`` beside this file, loaded once, on first use."""
    global _metric
    if _metric is None:
        # The file itself, not the folder: evaluate loads a folder only if it is named longppl,
        # and a Space's folder is not.
        _metric = evaluate.load(os.path.join(HERE, "longppl.py"))
    return _metric


def split_texts(raw: str | None) -> list[str]:
    """Documents of the texts box: separated by lines holding only ``---``; blank ones dropped."""
    documents, current = [], []
    for line in (raw or "").splitlines(keepends=True):
        if line.strip() == SEPARATOR:
            documents.append("".join(current))
            current = []
        else:
            current.append(line)
    documents.append("".join(current))
    return [doc.strip("\n") for doc in documents if doc.strip()]


def highlight(texts: list[str], key_spans: list[list[list[int]]]) -> list[tuple[str, str | None]]:
    """``HighlightedText`` segments: each text cut at its key spans, key pieces labelled ``"key"``."""
    segments: list[tuple[str, str | None]] = []
    for index, (text, spans) in enumerate(zip(texts, key_spans)):
        if index:
            segments.append((f"\n\n{SEPARATOR}\n\n", None))
        position = 0
        for start, end in spans:
            if start > position:
                segments.append((text[position:start], None))
            segments.append((text[start:end], KEY_LABEL))
            position = end
        if position < len(text):
            segments.append((text[position:], None))
    return segments


def _number(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)  # an empty box rather than "NaN"


def summary(result: dict) -> str:
    """A Markdown table: LongPPL, PPL, key tokens and tokens of each text."""
    rows = ["| text | LongPPL | PPL | key tokens | tokens |", "|---:|---:|---:|---:|---:|"]
    for index, values in enumerate(
        zip(result["longppls"], result["perplexities"], result["n_key_tokens"], result["n_tokens"]), 1
    ):
        longppl, ppl, n_key, n_tokens = values
        rows.append(f"| {index} | {longppl:.3f} | {ppl:.3f} | {n_key} | {n_tokens} |")
    return "\n".join(rows)


def score(raw_texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta):
    """The "Compute" button: ``(LongPPL, PPL, highlighted key tokens, per-text table)``.

    Bad input (and the metric's own ``ValueError``) is shown in the UI as a ``gr.Error``; the
    metric's warnings (e.g. a text too short to have key tokens) as ``gr.Warning``.
    """
    texts = split_texts(raw_texts)
    if not texts:
        raise gr.Error(f"Paste at least one long text (separate several with a line holding only {SEPARATOR}).")
    ids = {"model": (model_id or "").strip(), "evaluator model": (evaluator_model_id or "").strip()}
    for role, value in ids.items():
        if not value:
            raise gr.Error(f"Give the {role}'s Hub id (e.g. meta-llama/Llama-3.1-8B).")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = load_metric().compute(
                predictions=texts,
                model_id=ids["model"],
                evaluator_model_id=ids["evaluator model"],
                trunc_len=trunc_len,
                sliding_window=sliding_window,
                alpha=alpha,
                beta=beta,
                return_key_spans=True,
                progress=False,
            )
        except ValueError as err:
            raise gr.Error(str(err)) from err
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            gr.Warning(str(warning.message))
    return (
        _number(result["longppl"]),
        _number(result["ppl"]),
        highlight(texts, result["key_spans"]),
        summary(result),
    )


def build_demo() -> gr.Blocks:
    """The Space's UI (builds components only: no model or metric is loaded)."""
    with gr.Blocks(title="LongPPL") as demo:
        gr.Markdown(
            "# LongPPL\n"
            "Perplexity over the **key tokens** of long texts: the tokens an evaluator model predicts much "
            "better with the full context than with only the last K tokens (Fang et al., ICLR 2025). "
            "Texts need more than K evaluator tokens. Models are downloaded and run on this Space's hardware: "
            "7-8B models need a GPU; a gated evaluator needs an `HF_TOKEN` secret with access."
        )
        texts = gr.Textbox(
            label=f"Texts (separate documents with a line holding only {SEPARATOR})", lines=12, max_lines=30
        )
        with gr.Row():
            model_id = gr.Textbox(label="Evaluated model (Hub id)", value="Qwen/Qwen2-7B")
            evaluator_model_id = gr.Textbox(label="Evaluator model (Hub id)", value="meta-llama/Llama-3.1-8B")
        with gr.Row():
            trunc_len = gr.Number(label="K (short-context length)", value=4096, precision=0, minimum=1)
            sliding_window = gr.Number(label="d (sliding window)", value=1024, precision=0, minimum=1)
            alpha = gr.Number(label="alpha (LSD threshold)", value=2.0)
            beta = gr.Number(label="beta (LCL threshold)", value=-2.0)
        button = gr.Button("Compute", variant="primary")
        with gr.Row():
            longppl = gr.Number(label="LongPPL")
            ppl = gr.Number(label="PPL")
        key_tokens = gr.HighlightedText(label="Key tokens", color_map={KEY_LABEL: "#f97316"}, combine_adjacent=True)
        per_text = gr.Markdown()
        button.click(
            score,
            inputs=[texts, model_id, evaluator_model_id, trunc_len, sliding_window, alpha, beta],
            outputs=[longppl, ppl, key_tokens, per_text],
        )
    return demo


demo = build_demo()

if __name__ == "__main__":
    demo.launch()
