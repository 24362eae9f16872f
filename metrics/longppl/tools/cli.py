"""How the command-line tools run as commands: the console scripts of setup.cfg (``longppl-score``,
``longppl-evaluate``, ``longppl-visualize``, ``longppl-quickstart``), their subcommands of ``longppl``
(``longppl score``, :mod:`longppl.tools.main`), ``python -m longppl.tools.X`` and the thin wrappers in
``scripts/`` all go through :func:`run_command`.

Each tool module has ``build_parser(prog)`` and ``main(argv=None, prog=...)``: ``main`` is the Python
API (it returns the tool's results and raises ``ValueError`` on bad input, as the tests use it), and
``cli(argv=None)`` is the command, ``run_command(main, argv)``. ``longce-train`` (``longce.cli``) runs
through it too, so every command reports a bad input the same way: one ``<prog>: error: ...`` line,
and the traceback only with ``LONGPPL_DEBUG=1``. The module docstring is the parser's description,
rendered for the terminal by :func:`help_text`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable

#: Set to 1 (or true/yes/on) to see the traceback of a bad input instead of the one-line error. An
#: environment variable rather than a ``--debug`` flag: ``longce-train`` takes every ``TrainingArguments``
#: field as a flag, and ``--debug`` is one of them (transformers' debug options).
DEBUG_VARIABLE = "LONGPPL_DEBUG"

#: What a command reports in one line: bad inputs the tools explain in their message (a missing
#: column, an unknown model in a score file, a missing input file or folder, ...).
USER_ERRORS = (ValueError, FileNotFoundError)

# ``literal`` (reStructuredText inline code, as the docstrings write it) and :role:`target` (a Sphinx
# cross-reference): both read as plain `literal` in a terminal.
_RST_LITERAL = re.compile(r"``(.+?)``", re.S)
_RST_ROLE = re.compile(r":[a-z]+:`([^`]+)`")


def help_text(doc: str | None) -> str:
    """A docstring as a command's ``--help`` shows it: reStructuredText markup rendered for a terminal.

    ``x`` (inline literal) and :role:`x` (cross-reference) become `x`, as Markdown and the README
    write code. The layout (paragraphs, indented examples, lists) is kept, so the parser shows it with
    ``argparse.RawDescriptionHelpFormatter``. ``None`` (docstrings stripped by ``python -OO``) gives "".
    """
    text = _RST_LITERAL.sub(r"`\1`", doc or "")
    return _RST_ROLE.sub(r"`\1`", text)


def other_spelling(option: str) -> str | None:
    """The other spelling of a long option: ``--key-tokens`` for ``--key_tokens`` and back; ``None`` for a
    short option (``-h``) or a long one of a single word (``--alpha``), which has only one."""
    if not option.startswith("--"):
        return None
    body = option[2:]
    if "-" in body:
        return "--" + body.replace("-", "_")
    if "_" in body:
        return "--" + body.replace("_", "-")
    return None


class ToolParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose long options take both spellings, ``--key-tokens`` and ``--key_tokens``.

    The tools declare one spelling (``--a-b``); ``longce-train`` (Hugging Face's parser of dataclass
    fields) takes both, so a user who mixes the commands need not remember which one each wants. The
    other spelling is registered as an alias of the same action: it parses to the same destination, and
    ``--help``, usage and error messages show the declared spelling only. An abbreviation (``--key``)
    that matches both spellings of one option is that option, not an ambiguity.
    """

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        for option in action.option_strings:
            alias = other_spelling(option)
            if alias is not None and alias not in self._option_string_actions:
                # not in action.option_strings: help and messages show the declared spelling only
                self._option_string_actions[alias] = action
        return action

    def _get_option_tuples(self, option_string):
        # Both spellings of an option share one action: a prefix of both is still one option. The first
        # item of each tuple is the action (Python 3.11's 3-tuples and 3.12's 4-tuples alike).
        seen, unique = set(), []
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in seen:
                seen.add(id(match[0]))
                unique.append(match)
        return unique


def tool_parser(prog: str | None, doc: str | None) -> argparse.ArgumentParser:
    """The parser of a tool's ``build_parser``: ``prog``, and the tool's module docstring ``doc`` as its
    description, rendered by :func:`help_text` and shown with its layout. A :class:`ToolParser`: every
    long option takes both spellings (``--key-tokens`` and ``--key_tokens``)."""
    return ToolParser(prog=prog, description=help_text(doc), formatter_class=argparse.RawDescriptionHelpFormatter)


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

    A ``ValueError`` or ``FileNotFoundError`` (``USER_ERRORS``: a bad input the tool explains, e.g. a
    missing column, an unknown model in a score file, a missing input file) ends the command with
    ``<prog>: error: <message>`` and status 1, like argparse's own usage errors, instead of a
    traceback; with ``LONGPPL_DEBUG=1`` it propagates, traceback and all. Other exceptions are bugs or
    environment failures, and keep their traceback. ``main``'s return value (results, for Python
    callers) is not an exit status, so it is dropped here.
    """
    prog = invoked_name()
    try:
        main(argv, prog=prog)
    except USER_ERRORS as err:
        if debugging():
            raise
        sys.exit(f"{prog}: error: {err}")
    return 0


def debugging(environ: dict[str, str] | None = None) -> bool:
    """Whether ``LONGPPL_DEBUG`` asks for tracebacks (1, true, yes or on)."""
    from longppl.models.sources import env_flag  # standard library only: the commands run this before torch

    return env_flag(DEBUG_VARIABLE, environ)
