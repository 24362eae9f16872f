"""The README's Python snippets load as written on a fresh machine: after the set-up command, in a
new HOME with no Hugging Face caches (no module registered with evaluate yet) and no Hub access; and
they run in full on a CPU, the reader's objects bound to tiny models."""

from __future__ import annotations

import os
import re
import sys

import pytest
from helpers import run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where a fresh machine has nothing yet; each is unset so that the libraries fall back to HOME.
CACHE_VARIABLES = (
    "HF_HOME",
    "HF_MODULES_CACHE",
    "HF_DATASETS_CACHE",
    "HF_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "XDG_CACHE_HOME",
    "LONGPPL_CACHE_DIR",
    "LONGPPL_AUTO_REGISTER",
)


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python blocks of ``markdown``, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.M | re.S)


def loading_lines(block: str) -> list[str]:
    """The lines of a snippet that load something: imports and ``evaluate.load(...)`` calls. The rest
    needs the reader's models and texts (``model``, ``long_texts``, ...)."""
    return [
        line
        for line in block.splitlines()
        if line.startswith(("import ", "from ")) or re.match(r"\w+ = evaluate\.load\(", line)
    ]


@pytest.mark.slow  # a fresh interpreter per snippet
def test_every_readme_snippet_loads_in_a_fresh_home(tmp_path):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        blocks = python_blocks(handle.read())
    assert len(blocks) >= 3  # evaluate a model, the drop-in, LongCETrainer
    code = [loading_lines(block) for block in blocks]
    assert all(code), "a ```python block of the README loads nothing"
    assert any(re.match(r"\w+ = evaluate\.load\(\"longppl\"\)", line) for lines in code for line in lines)
    home, cwd = tmp_path / "home", tmp_path / "work"  # cwd: no ./longppl folder for evaluate to find
    home.mkdir()
    cwd.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in CACHE_VARIABLES}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    for lines in code:  # each snippet in its own interpreter, as a reader would run it
        done = run_guarded([sys.executable, "-c", "\n".join(lines)], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, "\n".join(lines) + "\n--- fails in a fresh HOME:\n" + done.stderr[-2000:]


# What each README snippet leaves to the reader (its models, texts, data), bound here to tiny models;
# the Hub ids the snippets name are tiny models in an offline Hub cache (below).
PLACEHOLDERS = """
import sys
sys.path.insert(0, {tests!r})
import datasets
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model
from transformers import default_data_collator

evaluator_tokenizer, tokenizer = byte_level_bpe(), metaspace_bpe()
evaluator_model = tiny_model("llama", len(evaluator_tokenizer), seed=1)
model = tiny_model("qwen2", len(tokenizer), seed=2)
long_texts = [govreport_texts()[6][:10500]]  # about 4.4k evaluator tokens: longer than K = 4096
text = long_texts[0]
ids = tokenizer(text)["input_ids"][:256]
dataset = datasets.Dataset.from_dict({{"input_ids": [ids], "attention_mask": [[1] * len(ids)], "labels": [ids]}})
collator = default_data_collator
"""
# What each snippet must have computed (random tiny models have no key tokens at alpha = 2, so LongPPL
# itself may be NaN / None here): its results, a trained step.
CHECKS = (
    "assert results['n_tokens'][0] > 0 and set(results) >= {'longppl', 'ppl'}, results",
    "assert out['n_token'] > 0 and set(out) == {'longppl', 'n_key_token', 'ppl', 'n_token'}, out",
    "assert trainer.state.global_step > 0",
)


@pytest.mark.slow  # a fresh interpreter per snippet, each scoring or training tiny models
def test_every_readme_snippet_runs_as_written_on_a_cpu(tmp_path):
    """The snippets in full, on the CPU the set-up targets (no GPU visible), the reader's objects bound
    to tiny models: each runs as written and computes what it shows (texts as long as the snippets ask
    are scored without the too-short warning; the Trainer snippet trains without a GPU)."""
    from helpers import byte_level_bpe, metaspace_bpe, tiny_model
    from test_metric_card import _save_to_hub_cache

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        blocks = python_blocks(handle.read())
    assert len(blocks) == len(CHECKS)
    home, cwd = tmp_path / "home", tmp_path / "work"
    cwd.mkdir()
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    _save_to_hub_cache(home / "hub", "meta-llama/Llama-3.1-8B", tiny_model("llama", len(ev_tok), seed=1), ev_tok)
    _save_to_hub_cache(home / "hub", "Qwen/Qwen2-7B", tiny_model("qwen2", len(tok), seed=2), tok)
    env = {key: value for key, value in os.environ.items() if key not in CACHE_VARIABLES}
    env.update(
        HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        HF_HUB_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    prelude = PLACEHOLDERS.format(tests=os.path.join(REPO, "tests"))
    for block, check in zip(blocks, CHECKS):
        done = run_guarded(
            [sys.executable, "-c", "\n".join([prelude, block, check])],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, block + "\n--- fails on a CPU:\n" + done.stderr[-3000:]
        assert "have at most trunc_len" not in done.stderr  # texts as long as the snippet says are enough
