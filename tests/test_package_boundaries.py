"""The three import packages stay layered: ``longppl`` (metric, scoring core, commands) imports neither
``longce`` nor the reproduction; ``longce`` imports ``longppl`` but not the reproduction; the
reproduction (``longppl_reproduce``) may import both. Checked twice: in the source (import statements,
and "module:function" strings that importlib would load) and at run time (what importing every module
of a package pulls into ``sys.modules``)."""

import ast
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

#: {package: (its folder, the packages it must never import)}
PACKAGES = {
    "longppl": ("metrics/longppl", ("longce", "longppl_reproduce")),
    "longce": ("trainer/longce", ("longppl_reproduce",)),
}


def python_files(folder: str) -> list[str]:
    root = os.path.join(REPO, folder)
    return sorted(
        os.path.join(path, name) for path, _, names in os.walk(root) for name in names if name.endswith(".py")
    )


def module_names(folder: str, package: str) -> list[str]:
    root = os.path.join(REPO, folder)
    names = []
    for path in python_files(folder):
        parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join([package, *parts]))
    return names


def forbidden_references(path: str, forbidden: tuple[str, ...]) -> list[str]:
    """``line: what`` for each import of a forbidden package in ``path``, and each string constant that
    names one as a module (``"longce.cli:main"``, ``"longce"``): what importlib would load."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    pattern = re.compile(rf"^({'|'.join(map(re.escape, forbidden))})([.:]\w|$)")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if pattern.match(name)]
    return found


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_source_file_of_a_package_names_a_package_above_it(package):
    folder, forbidden = PACKAGES[package]
    found = {
        os.path.relpath(path, REPO): hits
        for path in python_files(folder)
        if (hits := forbidden_references(path, forbidden))
    }
    assert found == {}


def test_the_source_check_finds_an_import_and_an_importlib_string(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import longce.trainer\nfrom longppl_reproduce import lines\nfrom . import longce\n"
        "TARGET = 'longce.cli:main'\nNOTE = 'longce is the trainer'\n",
        encoding="utf-8",
    )
    assert forbidden_references(str(sample), ("longce", "longppl_reproduce")) == [
        "1: longce.trainer",
        "2: longppl_reproduce",
        "4: longce.cli:main",
    ]


@pytest.mark.parametrize("package", list(PACKAGES))
def test_importing_every_module_of_a_package_loads_no_package_above_it(package):
    folder, forbidden = PACKAGES[package]
    # the Space's app needs gradio (an extra); its imports are covered by the source check above
    modules = [name for name in module_names(folder, package) if name not in ("longppl.space.app", "longppl.__main__")]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
