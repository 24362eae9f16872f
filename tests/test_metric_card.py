"""The metric card (metrics/longppl/README.md): Space header, evaluate's sections, the paper's values
as the paper's source has them, and its examples run as doctests against tiny local models."""

import configparser
import json
import os
import re
import sys

import pytest
import yaml
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, run_guarded, tiny_model

import longppl

CARD = os.path.join(longppl.METRIC_PATH, "README.md")
# The paper's tables as its LaTeX source has them (verbatim excerpts; provenance in tests/data/README.md).
PAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "longppl_paper_tables.tex")
SECTIONS = [
    "# Metric Card for LongPPL",
    "## Metric Description",
    "## Intended Uses",
    "## How to Use",
    "### Inputs",
    "### Output Values",
    "#### Values from Popular Papers",
    "### Examples",
    "## Limitations and Bias",
    "## Citation",
    "## Further References",
]


def card_parts():
    text = open(CARD, encoding="utf-8").read()
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, "the card must start with a YAML header between --- lines"
    return yaml.safe_load(match.group(1)), match.group(2)


def test_space_header():
    header, _ = card_parts()
    assert header["sdk"] == "gradio" and header["app_file"] == "app.py"
    assert {"evaluate", "metric"} <= set(header["tags"])
    for key in ("title", "emoji", "colorFrom", "colorTo", "pinned", "description"):
        assert header.get(key) not in (None, ""), key


def test_space_header_names_the_installed_gradio():
    gradio = pytest.importorskip("gradio", reason='the Space\'s gradio is the "space" extra: pip install -e ".[space]"')
    header, _ = card_parts()
    assert header["sdk_version"] == gradio.__version__, "pin sdk_version to the gradio the app is tested with"


def _extras(repo_root):
    config = configparser.ConfigParser()
    config.read(os.path.join(repo_root, "setup.cfg"))
    return {
        name: [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]
        for name, value in config["options.extras_require"].items()
    }


def test_space_extra_pins_the_cards_gradio_and_test_extra_stays_lean(repo_root):
    header, _ = card_parts()
    extras = _extras(repo_root)
    assert extras["space"] == [f"gradio=={header['sdk_version']}"]  # the Space's sdk installs this version
    assert not [line for line in extras["test"] if line.lower().startswith("gradio")]


def test_evaluate_card_sections_in_order():
    _, body = card_parts()
    headings = [line for line in body.splitlines() if line.startswith("#") and line.lstrip("#").startswith(" ")]
    assert [h for h in headings if h in SECTIONS] == SECTIONS


def _numbers(cells):
    return [re.sub(r"\\textbf\{(.*?)\}", r"\1", cell).strip() for cell in cells]


def _tex_rows(tex, label):
    """Rows between \\midrule and \\bottomrule of the table labelled ``label``, as lists of cells."""
    table = tex[tex.index(f"\\label{{{label}}}") :]
    body = table[table.index("\\midrule") + len("\\midrule") : table.index("\\bottomrule")]
    return [_numbers(row.split("&")) for row in body.split("\\\\") if row.strip()]


def _card_rows(body, first_cell):
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1:
            rows[cells[0]] = cells[1:]
    assert first_cell in rows
    return rows


def test_paper_values_are_quoted_as_the_paper_has_them():
    tex = open(PAPER, encoding="utf-8").read()
    _, body = card_parts()
    flat = " ".join(body.split())
    # LongPPL per model and evaluator, and PPL
    card = _card_rows(body, "Mixtral-8x7B-32k")
    paper = _tex_rows(tex, "tab: LongPPL-app")
    assert len(paper) == 9
    for row in paper:
        assert card[row[0]] == row[1:], row[0]
    # Pearson correlations: PPL, soft, default (LongBench, LongEval, RULER)
    paper = [row[-3:] for row in _tex_rows(tex, "tab: Correlation-soft")]
    card = _card_rows(body, "PPL")
    assert [card["PPL"], card["LongPPL, soft weights (`soft=True`)"], card["LongPPL (default)"]] == paper
    llama = re.search(r"Llama-3.1-8B.*?coefficients of (\S+), (\S+), and (\S+) with", " ".join(tex.split()))
    assert f"Llama-3.1-8B as evaluator, LongPPL correlates at {llama[1]}, {llama[2]} and {llama[3]}" in flat
    for row in _tex_rows(tex, "tab: LongPPL-ablation-alphabeta")[1:]:
        alpha, beta = re.match(r"\$\\alpha=(\S+), \\beta=(\S+)\$", row[0]).groups()
        assert f"`alpha={alpha}, beta={beta}` gives {', '.join(row[1:])}" in flat
    self_values = [float(v) for v in _tex_rows(tex, "tab: LongPPL-self")[0][1:]]
    assert f"{min(self_values):.2f} to {max(self_values):.2f} over the nine models" in flat
    assert "`alpha=2`, `beta=-2`, `K=4096`, `d=1024`" in flat


def _save_to_hub_cache(hub_cache, repo_id, model, tokenizer):
    """Lay a model out as huggingface_hub's cache holds a download, so that offline loading finds it."""
    commit = "0" * 40
    folder = hub_cache / f"models--{repo_id.replace('/', '--')}"
    model.save_pretrained(folder / "snapshots" / commit)
    tokenizer.save_pretrained(folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


@pytest.mark.slow
def test_card_examples_run(tmp_path):
    """Every example of the card, verbatim, as a doctest in a fresh process: the Hub ids it names are
    tiny random models in an offline Hub cache, the metric is loaded by its bare name in a fresh
    module cache."""
    home = tmp_path / "home"
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    _save_to_hub_cache(home / "hub", "meta-llama/Llama-3.1-8B", tiny_model("llama", len(ev_tok), seed=1), ev_tok)
    _save_to_hub_cache(home / "hub", "Qwen/Qwen2-7B", tiny_model("qwen2", len(tok), seed=2), tok)
    # no register_metric here: a fresh setup, as a new user's; the card's example must itself make the
    # bare name resolve (import longppl)
    work = tmp_path / "work"
    work.mkdir()
    texts = govreport_texts()
    with open(work / "long_documents.jsonl", "w", encoding="utf-8") as handle:
        for text in (texts[6][:10500], texts[4][:6000]):  # about 4.4k and 2.6k evaluator tokens; K = 4096
            handle.write(json.dumps({"text": text}) + "\n")
    env = dict(
        os.environ,
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        HF_MODULES_CACHE=str(home / "modules"),
        HF_HUB_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
    )
    examples = work / "card_examples.txt"
    examples.write_text("\n".join(card_code_blocks()), encoding="utf-8")
    done = run_guarded(
        [sys.executable, "-m", "doctest", "-o", "ELLIPSIS", str(examples)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def card_code_blocks() -> list[str]:
    """The card's ```python blocks, verbatim; each must be a doctest (``>>>`` lines and their output)."""
    _, body = card_parts()
    blocks = re.findall(r"^```python\n(.*?)^```$", body, re.S | re.M)
    assert len(blocks) >= 3, "the card's examples are its ```python blocks"
    for block in blocks:
        assert block.startswith(">>> "), f"a ```python block of the card is not a doctest:\n{block}"
    return blocks


def test_inputs_table_is_the_options_dataclass():
    """The card's inputs table lists the fields of ``LongPPLOptions`` with their types, defaults and
    help, as ``options_table`` renders them: a field added, renamed or re-defaulted without the card fails."""
    from dataclasses import fields

    from longppl.metric.options import LongPPLOptions, options_table

    _, body = card_parts()
    section = body[body.index("### Inputs") : body.index("### Output Values")]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == options_table()
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()[2:]}
    assert list(rows) == ["`predictions`"] + [f"`{option.name}`" for option in fields(LongPPLOptions)]
    # defaults as the settings give them, not retyped
    from longppl import settings

    assert rows["`alpha`"] == f"`{settings.DEFAULT_ALPHA}`" and rows["`gamma`"] == f"`{settings.DEFAULT_GAMMA}`"
    assert rows["`trunc_len`"] == f"`{settings.DEFAULT_TRUNC_LEN}`" and rows["`aggregation`"] == '`"official"`'


def test_the_tables_say_which_aggregation_made_them(repo_root):
    """The card's table of the paper's values and the README's quickstart table name the corpus rule
    that made them: the default, the official evaluation script as it stands."""
    from longppl.settings import DEFAULT_AGGREGATION

    _, body = card_parts()
    lead = " ".join(body[body.index("#### Values from Popular Papers") : body.index("| Evaluated model |")].split())
    assert (
        f'official evaluation script as it stands (since July 2025), which is this metric\'s default `aggregation="{DEFAULT_AGGREGATION}"`'
        in lead
    )
    assert 'by `aggregation="official-pre-2025-07"`' in lead  # the official table's values before July 2025
    with open(os.path.join(repo_root, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    before_table = readme[: readme.index("| model ")].rstrip().splitlines()[-1]
    assert before_table.endswith(f"alpha=2, beta=-2, aggregation={DEFAULT_AGGREGATION}"), before_table
