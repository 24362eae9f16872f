"""The repository is self-contained and its documents hold together: nothing points outside the
checkout, every relative link in the Markdown documents resolves, and the README stays a short front
door."""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tracked_files() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (git ls-files failed): the file list comes from git")
    return [path for path in done.stdout.splitlines() if os.path.isfile(os.path.join(REPO, path))]


def text_files() -> list[str]:
    suffixes = (".py", ".md", ".cfg", ".toml", ".yaml", ".yml", ".txt", ".json", ".jsonl", ".tex")
    return [p for p in tracked_files() if p.endswith(suffixes) or p.startswith(".ci/")]


def test_nothing_points_outside_the_checkout():
    outside = re.compile(r"\.\./shared|(?<![\w/])shared/(data|paper)|DESIGN\.md")
    offenders = []
    for path in text_files():
        if path == "tests/test_repository.py":
            continue
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if outside.search(line):
                    offenders.append(f"{path}:{number}: {line.strip()[:120]}")
    assert not offenders, "files that name something outside the repository:\n" + "\n".join(offenders)


def test_relative_links_of_the_markdown_documents_resolve():
    broken = []
    for path in [p for p in tracked_files() if p.endswith(".md")]:
        text = open(os.path.join(REPO, path), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file_part = target.split("#", 1)[0]
            if not os.path.exists(os.path.join(REPO, os.path.dirname(path), file_part)):
                broken.append(f"{path}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_readme_is_a_short_front_door():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert len(readme.encode("utf-8")) <= 12 * 1024, "keep measurements and design in docs/, the README short"
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings[:3] == ["Contents", "Set up", "Layout"], headings
    for heading in headings[1:]:
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert f"(#{anchor})" in readme, f"the contents do not link section {heading!r}"
