"""The repository is self-contained and its documents hold together: nothing points outside the
checkout, every relative link in the Markdown documents resolves, the README stays a short front
door, and nothing names an issue of a tracker."""

import os
import re
import subprocess
import sys

import pytest
from helpers import run_guarded

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


def matching_lines(pattern: re.Pattern, paths: list[str]) -> list[str]:
    """``path:line: text`` of every line of ``paths`` that ``pattern`` finds something in."""
    found = []
    for path in paths:
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if pattern.search(line):
                    found.append(f"{path}:{number}: {line.strip()[:120]}")
    return found


def test_nothing_points_outside_the_checkout():
    outside = re.compile(r"\.\./shared|(?<![\w/])shared/(data|paper)|DESIGN\.md")
    offenders = matching_lines(outside, [p for p in text_files() if p != "tests/test_repository.py"])
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


# The word "issue" followed by a number, with or without "#": a reference to a tracker's issue.
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend)\b|\[[^]]*\]\s*=(?!=)|[+]?=(?!=))")


def test_no_script_edits_sys_path():
    """Scripts import the packages as installed (``pip install -e .``), never by editing ``sys.path``."""
    scripts = [p for p in tracked_files() if p.startswith("scripts/") and p.endswith(".py")]
    assert scripts, "no script found under scripts/"
    offenders = matching_lines(SYS_PATH_EDIT, scripts)
    assert not offenders, "scripts that edit sys.path (rely on the install instead):\n" + "\n".join(offenders)


def test_the_sys_path_pattern_finds_edits_and_spares_reads():
    edits = ['sys.path.insert(0, "x")', "sys.path.append(x)", "sys.path[:0] = [x]", "sys.path += [x]"]
    assert all(SYS_PATH_EDIT.search(line) for line in edits)
    assert not any(SYS_PATH_EDIT.search(line) for line in ["print(sys.path)", "x in sys.path", "sys.path == y"])


def test_multi_process_workers_live_in_tests_distributed():
    """A script that a test launches in several processes sits in tests/distributed/ with the tests that
    launch it, not among the single-process tests."""
    tests = [p for p in tracked_files() if p.startswith("tests/") and p.endswith(".py")]
    workers = [p for p in tests if p.endswith("_worker.py")]
    assert workers, "no *_worker.py under tests/"
    misplaced = [p for p in workers if os.path.dirname(p) != "tests/distributed"]
    assert not misplaced, f"move these workers into tests/distributed/: {misplaced}"
    assert "tests/distributed/__init__.py" in tests  # `from distributed import <worker>` in the tests


def test_the_benchmarks_live_in_scripts_bench_outside_the_installed_packages():
    """The benchmarks are scripts of scripts/bench/ (``bench_*.py``) with their shared ``common.py``, run as
    ``python scripts/bench/<name>.py``: none is left in scripts/, and no module of the installed packages
    (setup.cfg's package folders) imports their shared module, which ships with none of them."""
    import configparser

    files = tracked_files()
    assert not [p for p in files if re.fullmatch(r"scripts/bench_\w+\.py", p)], "move the benchmarks to scripts/bench/"
    bench = sorted(p for p in files if p.startswith("scripts/bench/"))
    assert "scripts/bench/common.py" in bench and len(bench) > 2
    assert [p for p in bench if not re.fullmatch(r"scripts/bench/(bench_\w+|common)\.py", p)] == []
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    folders = [line.split("=")[1].strip() for line in setup["options"]["package_dir"].split("\n") if line]
    assert "scripts/bench" not in folders
    packaged = [p for p in files if p.endswith(".py") and any(p.startswith(folder + "/") for folder in folders)]
    uses_common = re.compile(r"^\s*(from common import|import common\b)", re.M)
    assert matching_lines(uses_common, packaged) == []


BENCH = os.path.join(REPO, "scripts", "bench")
BENCHMARKS = sorted(name for name in os.listdir(BENCH) if name.startswith("bench_")) if os.path.isdir(BENCH) else []


@pytest.mark.slow  # fresh interpreters: seconds each
@pytest.mark.parametrize("script", BENCHMARKS)
def test_each_benchmark_answers_help_run_from_the_repository_root(script):
    """``python scripts/bench/<name>.py --help`` from the repository root, as docs/benchmarks.md runs them: the
    script finds its shared ``common.py`` beside it and the packages as installed."""
    done = run_guarded(
        [sys.executable, os.path.join("scripts", "bench", script), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: {script} ")


def test_the_design_notes_name_every_console_script_and_package_of_setup_cfg():
    """docs/design.md's package section keeps up with setup.cfg: its console scripts, its packages and the
    folders they come from, and the entry-point group that gathers the subcommands."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    scripts = [
        line.split("=")[0].strip() for line in setup["options.entry_points"]["console_scripts"].split("\n") if line
    ]
    folders = [line.split("=")[1].strip() for line in setup["options"]["package_dir"].split("\n") if line]
    packages = [line.strip() for line in setup["options"]["packages"].split("\n") if line]
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as handle:
        section = handle.read().split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w./-]+?)/?`", section))
    missing = [name for name in [*scripts, *packages, *folders, "longppl.commands"] if name not in named]
    assert not missing, f"docs/design.md's Packages section does not name: {missing}"
    assert f"{len(scripts)} console scripts" in section


def design_map() -> dict[str, set[str]]:
    """docs/design.md's Packages table for ``longppl``: ``{room: the module names of its row}``."""
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as handle:
        section = handle.read().split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `metrics/longppl/(\w*)/?` \|.*\| (.*) \|$", section, re.M)
    return {room: set(re.findall(r"`(\w+)\.py`", files)) for room, files in rows}


def readme_map() -> dict[str, set[str]]:
    """The README's Layout for ``longppl``: ``{room: the words of its lines}`` (``""``: the package folder's
    lines, before the first room's)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        layout = handle.read().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = layout.split("\nmetrics/longppl/", 1)[1]
    block = re.split(r"\n\S", block, maxsplit=1)[0]  # up to the next top-level folder
    named, room = {}, ""
    for line in block.splitlines():
        match = re.match(r"^  (\w+)/\s", line)
        room = match.group(1) if match else room
        named.setdefault(room, set()).update(re.findall(r"\w+", line))
    return named


def test_one_map_of_longppl_names_every_module():
    """The package docstring, docs/design.md's Packages table and the README's Layout are one map of
    ``longppl``: each names every module of every room (a module added without them fails here)."""
    from test_package_boundaries import docstring_map, longppl_modules

    maps = {"the package docstring": docstring_map()[1], "docs/design.md": design_map(), "README.md": readme_map()}
    for where, named in maps.items():
        missing = [
            f"{room}/{name}.py" if room else f"{name}.py"
            for room, names in sorted(longppl_modules().items())
            for name in sorted(names)
            if name not in named.get(room, set())
        ]
        assert not missing, f"{where} does not name {missing} in their room"


def test_the_map_check_reads_each_map_by_room():
    assert design_map()["core"] == {
        "logprobs",
        "attention",
        "batching",
        "windows",
        "compilation",
        "progress",
        "scoring",
    }
    assert "key_tokens" in readme_map()["rules"] and "key_tokens" not in readme_map()["core"]
    assert {"settings", "longppl", "app", "register"} <= readme_map()[""] & design_map()[""]


ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.I)
PROJECT_FOLDERS = ("metrics/", "trainer/", "scripts/", "configs/", "docs/")


def test_no_project_file_names_an_issue_number():
    """Code, help, configs and documents explain themselves, without pointing at a tracker's issues."""
    paths = [p for p in text_files() if p.startswith(PROJECT_FOLDERS) or p == "README.md"]
    offenders = matching_lines(ISSUE_NUMBER, paths)
    assert not offenders, "files that name an issue number:\n" + "\n".join(offenders)


def test_the_issue_number_pattern_finds_references_and_spares_other_words():
    word = "issue"  # the samples are built, so that this file names no issue itself
    found = [f"see {word} 14", f"{word.title()}s #3 and #4", f"({word} #15, paper Section 5)"]
    spared = [f"t{word} 14", f"{word}d 3 licences", f"open an {word} with the model name", f"the {word}'s choice"]
    assert all(ISSUE_NUMBER.search(text) for text in found)
    assert not any(ISSUE_NUMBER.search(text) for text in spared)
