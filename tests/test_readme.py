"""The README's Python snippets load as written on a fresh machine: after the set-up command, in a
new HOME with no Hugging Face caches (no module registered with evaluate yet) and no Hub access."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
        done = subprocess.run(
            [sys.executable, "-c", "\n".join(lines)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, "\n".join(lines) + "\n--- fails in a fresh HOME:\n" + done.stderr[-2000:]
