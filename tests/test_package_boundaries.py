"""The three import packages stay layered: ``longppl`` (metric, scoring core, commands) imports neither
``longce`` nor the reproduction; ``longce`` imports ``longppl`` but not the reproduction; the
reproduction (``longppl_reproduce``) may import both. Checked twice: in the source (import statements,
and "module:function" strings that importlib would load) and at run time (what importing every module
of a package pulls into ``sys.modules``). Inside each package no modules import each other around a
circle (imports inside functions counted), and the reproduction's experiments never import each other."""

import ast
import importlib.util
import os
import re
import sys

import pytest
from conftest import REPO
from helpers import run_guarded

#: {package: (its folder, the packages it must never import)}
PACKAGES = {
    "longppl": ("metrics/longppl", ("longce", "longppl_reproduce")),
    "longce": ("trainer/longce", ("longppl_reproduce",)),
    "longppl_reproduce": ("scripts/reproduce", ()),
}


def python_files(folder: str) -> list[str]:
    root = os.path.join(REPO, folder)  # an absolute folder stays itself
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
    if not forbidden:
        return []
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


@pytest.mark.slow  # fresh interpreters or processes: seconds each
@pytest.mark.parametrize("package", list(PACKAGES))
def test_importing_every_module_of_a_package_loads_no_package_above_it(package):
    folder, forbidden = PACKAGES[package]
    # the Space's app and its shell need gradio (an extra), longppl.harness lm-eval and the datatrove step
    # datatrove (other extras, where installed); their imports are covered by the source check above
    skipped = ("longppl.app", "longppl.space.app", "longppl.__main__", "longppl.harness.__main__")
    no_harness = importlib.util.find_spec("lm_eval") is None
    no_datatrove = importlib.util.find_spec("datatrove") is None
    modules = [
        name
        for name in module_names(folder, package)
        if name not in skipped
        and not (no_harness and name.startswith("longppl.harness"))
        and not (no_datatrove and name == "longppl.tools.score_pipeline")
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r}))\n"
    )
    done = run_guarded(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# Inside `longppl`: rooms on floors. The package docstring's map gives each room its floor ("- floor N,
# ``room/``: ..." for a sub-package; "- floor N, ...: ``module``, ..." for modules of the package folder),
# and a room may import only rooms on lower floors, so that the arrows between rooms run one way.
LONGPPL = os.path.join(REPO, "metrics", "longppl")


def longppl_modules() -> dict[str, set[str]]:
    """``{room: its module names}`` of the package as it is on disk: a sub-package by its folder name, the
    package folder's own modules under ``""`` (``__init__`` files left out: they are their room's)."""
    rooms = {}
    for path in python_files("metrics/longppl"):
        parts = os.path.relpath(path, LONGPPL).split(os.sep)
        if parts[-1] != "__init__.py":
            rooms.setdefault(parts[0] if len(parts) > 1 else "", set()).add(parts[-1][: -len(".py")])
    return rooms


def docstring_map() -> tuple[dict[str, int], dict[str, set[str]]]:
    """The package docstring's map: ``{room: floor}`` (a module of the package folder is a room of its
    own) and ``{room: the names it lists}`` (``""`` for the package folder)."""
    with open(os.path.join(LONGPPL, "__init__.py"), encoding="utf-8") as handle:
        doc = ast.get_docstring(ast.parse(handle.read()))
    top = longppl_modules()[""]
    floors, named = {}, {}
    for floor, text in re.findall(r"^- floor (\d+), (.*?)(?=^- floor |\Z)", doc, re.M | re.S):
        names = re.findall(r"``([^`]+)``", text)
        if names and names[0].endswith("/"):
            floors[names[0][:-1]] = int(floor)
            named.setdefault(names[0][:-1], set()).update(names)
        else:
            floors.update({name: int(floor) for name in names if name in top})
            named.setdefault("", set()).update(names)
    return floors, named


def import_statements(path: str, package: list[str]) -> list[tuple[str, set[str]]]:
    """Each import anywhere in the module at ``path``, of the package ``package`` (its parts), as ``(the
    module it enters, the absolute names it imports)``: ``from .x import y`` gives ``(<package>.x,
    {<package>.x.y})``, ``import a.b`` gives ``("", {"a.b"})``."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.append(("", {alias.name for alias in node.names}))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            imported = ".".join(part for part in (base, node.module or "") if part)
            found.append((imported, {f"{imported}.{alias.name}" for alias in node.names}))
    return found


def imports_of(path: str, package: list[str]) -> set[str]:
    """The absolute names of what the module at ``path``, of the package ``package`` (its parts),
    imports anywhere in it: ``from .x import y`` gives ``<package>.x`` and ``<package>.x.y``."""
    return {name for entered, names in import_statements(path, package) for name in ({entered} | names) if name}


def imported_rooms(path: str, folder: str = LONGPPL) -> set[str]:
    """The rooms of ``longppl`` (whose folder is ``folder``) that the module at ``path`` imports, relatively
    or absolutely, by the names :func:`docstring_map` gives them."""
    parts = os.path.relpath(path, folder).split(os.sep)
    targets = imports_of(path, ["longppl", *parts[:-1]])
    # `from . import settings` names the module settings; `from .core import scoring` the room core
    return {target.split(".")[1] for target in targets if target.startswith("longppl.")}


def upward_imports(floors: dict[str, int], folder: str = LONGPPL) -> list[str]:
    """``module -> room`` for each import of a room on the same floor or above (none: the arrows run
    down); ``module: not on the map`` for a module whose room has no floor."""
    found = []
    for path, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.endswith(".py")):
            parts = os.path.relpath(os.path.join(path, name), folder).split(os.sep)
            if parts == ["__init__.py"]:  # the package's front door: it may name any room lazily
                continue
            room = parts[0] if len(parts) > 1 else name[: -len(".py")]
            shown = "/".join(parts)
            if room not in floors:
                found.append(f"{shown}: not on the map")
                continue
            for target in sorted(imported_rooms(os.path.join(path, name), folder) - {room}):
                if floors.get(target, 1 << 30) >= floors[room]:
                    found.append(f"{shown} -> {target}")
    return found


def test_rooms_of_longppl_import_only_rooms_on_lower_floors():
    floors, _ = docstring_map()
    rooms = {"settings", "rules", "core", "cache", "metric", "commandline", "space", "tools", "register", "longppl"}
    assert rooms | {"app"} <= set(floors)
    # what the commands share stands below them, and the registration that `import longppl` runs stands above
    # the Ctrl-C handling it shares with them
    assert floors["commandline"] < floors["tools"] and floors["commandline"] < floors["register"]
    assert upward_imports(floors) == []


def command_modules() -> set[str]:
    """The modules of ``longppl.tools`` that setup.cfg makes commands: its console scripts' and the
    ``longppl <command>`` table's targets (``longppl.commands``), and the modules those targets name."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    points = setup["options.entry_points"]
    targets = [
        line.split("=", 1)[1].strip()
        for key in ("console_scripts", "longppl.commands")
        for line in points[key].splitlines()
        if "=" in line
    ]
    modules = {target.split(":")[0] for target in targets}
    for target in targets:  # a table of commands ("module:COMMANDS") names its commands' modules in strings
        module, name = target.split(":")
        if module.startswith("longppl.tools.") and name == "COMMANDS":
            path = os.path.join(LONGPPL, *module.split(".")[1:]) + ".py"
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            strings = [
                node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            ]
            modules |= {value.split(":")[0] for value in strings if re.fullmatch(r"longppl\.tools\.\w+:\w+", value)}
    return {module.rsplit(".", 1)[1] for module in modules if module.startswith("longppl.tools.")}


def test_the_commands_room_holds_only_commands():
    """``longppl.tools`` is the commands: each of its modules is a console script or a ``longppl <command>``,
    or ``score_pipeline`` (``longppl score`` as a datatrove step). What they share lives in a room below
    (``commandline/``), which the harness, the trainer and the reproduction import instead of the commands."""
    commands = command_modules()
    assert {"main", "compute_key_tokens", "evaluate_models", "visualize_key_tokens", "cache_tool"} <= commands
    assert longppl_modules()["tools"] - commands == {"score_pipeline"}


def test_the_floor_check_finds_an_upward_import_and_a_room_off_the_map(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "scoring.py").write_text(
        "from ..metric.compute import compute_metric\nfrom .. import settings\n"
    )
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "thing.py").write_text("")
    floors = {"settings": 0, "core": 2, "metric": 5}
    found = upward_imports(floors, str(tmp_path))
    assert sorted(found) == ["core/scoring.py -> metric", "extra/thing.py: not on the map"]


def import_graph(folder: str, package: str) -> dict[str, set[str]]:
    """``{module: the modules of the same package it imports}``, counting imports inside functions too.

    ``from . import sibling`` enters the package ``.`` only to reach its module ``sibling``: when that
    package is one the importing module lies in, it was initialised before the module anyway, so the
    import is an arrow to ``sibling`` alone (a package ``__init__`` that imports its pipeline, as the
    reproduction's experiments do, would otherwise close a circle with every module that reaches a
    sibling so). An import of a name the package itself defines (``from . import NAME``) stays an
    arrow to the package."""
    paths = dict(zip(module_names(folder, package), python_files(folder)))
    graph = {}
    for module, path in paths.items():
        own = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        ancestors = {".".join(own[:i]) for i in range(1, len(own) + 1)}
        targets = set()
        for entered, names in import_statements(path, own):
            targets |= names
            if not (entered in ancestors and names <= set(paths)):
                targets.add(entered)
        graph[module] = {t for t in targets if t in paths and t not in (module, package)}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or around a circle (Tarjan's algorithm)."""
    index, low, stack, cycles = {}, {}, [], []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_modules_of_a_package_import_each_other_around_a_circle(package):
    folder, _ = PACKAGES[package]
    assert import_cycles(import_graph(folder, package)) == []


def test_the_circle_check_finds_a_circle_through_a_lazy_import(tmp_path):
    (tmp_path / "a.py").write_text("from .b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import C\n")
    (tmp_path / "c.py").write_text("import pkg.a\n")
    (tmp_path / "d.py").write_text("from . import a\n")
    graph = import_graph(str(tmp_path), "pkg")
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_reaching_a_sibling_through_its_own_package_closes_no_circle_but_a_name_of_the_package_does(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("from .pipeline import cli\n")
    (tmp_path / "sub" / "pipeline.py").write_text("from .report import report\n\ncli = report\n")
    (tmp_path / "sub" / "report.py").write_text("def report():\n    from . import helper\n")
    (tmp_path / "sub" / "helper.py").write_text("")
    assert import_cycles(import_graph(str(tmp_path), "pkg")) == []
    (tmp_path / "sub" / "helper.py").write_text("from . import cli\n")  # a name __init__ defines
    assert import_cycles(import_graph(str(tmp_path), "pkg")) == [
        ["pkg.sub", "pkg.sub.helper", "pkg.sub.pipeline", "pkg.sub.report"]
    ]


# The reproduction is laid out by experiment: `common/` below (tasks, models, stages, statistics, run
# folders), one sub-package per experiment above it. An experiment imports `common` (and the libraries),
# never another experiment; `common` imports no experiment.
REPRODUCE, SHARED = "scripts/reproduce", "common"


def experiment_crossings(folder: str, package: str, shared: str = SHARED) -> list[str]:
    """``module -> module`` for each import (inside functions too) from one experiment's sub-package into
    another's, or from the shared sub-package or the package's own modules into an experiment."""

    def experiment(module: str) -> str | None:
        parts = module.split(".")
        is_package = os.path.isdir(os.path.join(REPO, folder, *parts[1:2]))
        return parts[1] if len(parts) > 1 and is_package and parts[1] != shared else None

    found = []
    for module, targets in sorted(import_graph(folder, package).items()):
        for target in sorted(targets):
            if experiment(target) is not None and experiment(target) != experiment(module):
                found.append(f"{module} -> {target}")
    return found


def test_experiments_of_the_reproduction_never_import_each_other():
    experiments = sorted(
        name
        for name in os.listdir(os.path.join(REPO, REPRODUCE))
        if os.path.isfile(os.path.join(REPO, REPRODUCE, name, "__init__.py")) and name != SHARED
    )
    assert {"population", "longce_comparison"} <= set(experiments)
    assert experiment_crossings(REPRODUCE, "longppl_reproduce") == []


def test_the_experiment_check_finds_one_experiment_reaching_another_and_common_reaching_one(tmp_path):
    for folder in ("common", "alpha", "beta"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "common" / "tasks.py").write_text("def f():\n    from ..beta import run\n")
    (tmp_path / "alpha" / "run.py").write_text(
        "from ..common import tasks\n\n\ndef g():\n    from ..beta.run import x\n"
    )
    (tmp_path / "beta" / "run.py").write_text("from ..common.tasks import f\nfrom . import helper\n")
    (tmp_path / "beta" / "helper.py").write_text("")
    assert experiment_crossings(str(tmp_path), "pkg") == [
        "pkg.alpha.run -> pkg.beta.run",
        "pkg.common.tasks -> pkg.beta",  # its __init__, entered to reach run
        "pkg.common.tasks -> pkg.beta.run",
    ]
