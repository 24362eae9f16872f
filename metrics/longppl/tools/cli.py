"""How the command-line tools run as commands: the console scripts of setup.cfg (``longppl-score``,
``longppl-evaluate``, ``longppl-visualize``, ``longppl-quickstart``), ``python -m longppl.tools.X`` and
the thin wrappers in ``scripts/`` all go through :func:`run_command`.

Each tool module has ``build_parser(prog)`` and ``main(argv=None, prog=...)``: ``main`` is the Python
API (it returns the tool's results and raises ``ValueError`` on bad input, as the tests use it), and
``cli(argv=None)`` is the command, ``run_command(main, argv)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def invoked_name() -> str:
    """The name the command was started by, as argparse shows it in ``usage:`` (``longppl-score``, or
    ``compute_key_tokens.py`` through its wrapper in scripts/)."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "longppl"


def command_line(default: str) -> str:
    """The command this process was started with, to record in a report: a console script by its
    name (``longppl-reproduce``, not the virtual environment's absolute path to it), a script by its
    path relative to the working directory, then the arguments as given."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else default
    if not program.endswith(".py"):
        program = os.path.basename(program)
    elif os.path.isabs(program):
        program = os.path.relpath(program)
    return " ".join([program, *sys.argv[1:]])


def run_command(main: Callable[..., object], argv: list[str] | None = None) -> int:
    """Run a tool's ``main(argv, prog=...)`` as a command; returns the exit status, 0.

    A ``ValueError`` (a bad input the tool explains: a missing column, an unknown model in a score
    file...) ends the command with ``<prog>: error: <message>`` and status 1, like argparse's own
    usage errors, instead of a traceback. Other exceptions are bugs or environment failures, and keep
    their traceback. ``main``'s return value (results, for Python callers) is not an exit status, so it
    is dropped here.
    """
    prog = invoked_name()
    try:
        main(argv, prog=prog)
    except ValueError as err:
        sys.exit(f"{prog}: error: {err}")
    return 0
