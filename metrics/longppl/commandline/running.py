"""How the command-line tools run as commands: the console scripts of setup.cfg (``longppl-score``,
``longppl-evaluate``, ``longppl-visualize``, ``longppl-quickstart``), their subcommands of ``longppl``
(``longppl score``, :mod:`longppl.tools.main`), ``python -m longppl.tools.X`` and the thin wrappers in
``scripts/`` all go through :func:`run_command`.

Each tool module has ``build_parser(prog)`` and ``main(argv=None, prog=...)``: ``main`` is the Python
API (it returns the tool's results and raises ``ValueError`` on bad input, as the tests use it), and
``cli(argv=None)`` is the command, ``run_command(main, argv)``. ``longce-train`` (``longce.cli``) runs
through it too, so every command reports a bad input the same way: one ``<prog>: error: ...`` line,
and the traceback only with ``LONGPPL_DEBUG=1``; Ctrl-C ends it with one ``<prog>: interrupted`` line and
status 130 (:func:`interruptible`). The module docstring is the parser's description,
rendered for the terminal by :func:`help_text`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator

# The exit status of a command ended by Ctrl-C (130) and the rest of the Ctrl-C handling, which
# `import longppl` runs too (longppl.register), before any command code.
from .interrupts import end_interrupted, keep_interrupts_from_finalizers

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

    def parse_known_args(self, args=None, namespace=None):
        """argparse's parsing, then the checks every command's values share: an argument that is not
        valid UTF-8 (bytes a terminal passed through as surrogates) is one usage error, and a leading
        ``~`` of a string option (``~``, ``~/x``, ``~user/x``) is the home folder, as a shell expands it,
        so that ``--output-dir=~/x`` or a quoted ``"~/x"`` names the same folder as ``~/x``."""
        given = sys.argv[1:] if args is None else list(args)
        for value in given:
            if isinstance(value, str) and not _is_utf8(value):
                shown = os.fsencode(value).decode("utf-8", "backslashreplace")
                self.error(
                    f"argument '{shown}' is not valid UTF-8 (a file name in another encoding?): rename the file "
                    "or folder to a UTF-8 name, or pass another one."
                )
        unknown = [
            name
            for name in long_options(given)
            # a parser with subcommands leaves their options to them (each a ToolParser too)
            if self._subparsers is None and not any(option.startswith(name) for option in self._option_string_actions)
        ]
        if unknown:  # before argparse's checks (required options...): the typo is the error to name first
            self.error(unknown_options_message(unknown, list(self._option_string_actions), self.prog))
        parsed, extras = super().parse_known_args(given, namespace)
        for action in self._actions:
            # Strings only (no type= conversion): paths, Hub ids, names. A Hub id or a name never starts
            # with ``~``, so expanding every such value covers each path option of every command.
            if action.type is None and isinstance(action, (argparse._StoreAction, argparse._AppendAction)):
                value = getattr(parsed, action.dest, None)
                if isinstance(value, str):
                    setattr(parsed, action.dest, _expand_home(value))
                elif isinstance(value, list):
                    setattr(parsed, action.dest, [_expand_home(v) if isinstance(v, str) else v for v in value])
        return parsed, extras

    def error(self, message: str):
        """A usage error as one line, ``<prog>: error: <message>`` (status 2, as argparse's), without the
        usage block that argparse prints first: ``--help`` shows it."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _get_option_tuples(self, option_string):
        # Both spellings of an option share one action: a prefix of both is still one option. The first
        # item of each tuple is the action (Python 3.11's 3-tuples and 3.12's 4-tuples alike).
        seen, unique = set(), []
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in seen:
                seen.add(id(match[0]))
                unique.append(match)
        return unique


def long_options(argv: list[str]) -> list[str]:
    """The ``--name`` of each long option in ``argv`` (``--name=value`` too), up to a bare ``--``."""
    names = []
    for arg in argv:
        if arg == "--":
            break
        if isinstance(arg, str) and arg.startswith("--") and len(arg) > 2:
            names.append(arg.split("=", 1)[0])
    return names


def unknown_options_message(unknown: list[str], options: list[str], prog: str) -> str:
    """The error for options no flag takes, each with its closest option (:func:`with_closest_option`)."""
    return f"unknown option(s) {with_closest_option(unknown, options)}; `{prog} --help` lists the options."


def with_closest_option(unknown: list[str], options: list[str]) -> str:
    """``--trunk-len (did you mean --trunc-len?), --x``: each unknown option with the closest of the
    long ``options`` (difflib), the hint every command gives (``longce-train`` too)."""
    return with_closest(unknown, [o for o in options if o.startswith("--")])


def with_closest(unknown: list[str], names: list[str]) -> str:
    """``alhpa (did you mean alpha?), x``: each unknown name with the closest of ``names``
    (:func:`closest`), or alone where none is close."""
    named = []
    for name in unknown:
        close = closest(name, names)
        named.append(f"{name} (did you mean {close}?)" if close else name)
    return ", ".join(named)


def closest(name: str, names: list[str]) -> str | None:
    """The one of ``names`` closest to ``name`` (difflib's ``get_close_matches``: similarity at least
    0.6), or ``None`` where none is that close."""
    import difflib

    close = difflib.get_close_matches(name, names, n=1)
    return close[0] if close else None


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: bytes of another encoding, passed through by os.fsdecode
        return False
    return True


def _expand_home(value: str) -> str:
    return os.path.expanduser(value) if value.startswith("~") else value


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
    with interruptible(prog):
        try:
            main(argv, prog=prog)
        except USER_ERRORS as err:
            if debugging():
                raise
            sys.exit(f"{prog}: error: {err}")
    return 0


@contextlib.contextmanager
def interruptible(prog: str) -> Iterator[None]:
    """End the command with one ``<prog>: interrupted`` line and status 130 (``INTERRUPTED_STATUS``) when
    Ctrl-C (SIGINT, ``KeyboardInterrupt``) arrives in the ``with`` body, instead of a traceback
    (``LONGPPL_DEBUG=1`` shows it). Files are written to a temporary name and renamed
    (``longppl.atomic_files``), so an interrupted command leaves each output whole or as it was.

    The ``longppl`` dispatcher wraps the import of a command's module in it too: a command spends its
    first seconds importing torch and transformers, where a Ctrl-C is as likely as during the work.
    A Ctrl-C that lands in a finalizer, where Python would drop it, is given again
    (``longppl.commandline.interrupts.keep_interrupts_from_finalizers``).
    """
    keep_interrupts_from_finalizers()
    try:
        yield
    except KeyboardInterrupt:
        if debugging():
            raise
        end_interrupted(prog)


def read_yaml_file(path: str):
    """The plain data (``yaml.safe_load``) of the YAML file ``path``: the commands' configs and recipes
    (``longce-train --config``, ``longppl reproduce --config``) are all read through here.

    Returns:
        what the file holds (a mapping for a config; ``None`` for an empty file); the caller checks
        its shape.
    Raises:
        ValueError: the file does not parse (naming it, the YAML problem and its line and column), or
            is not UTF-8 text. A missing file is the caller's to report (each names its own option).
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {err.start}): a config is a YAML text file; give its path."
        ) from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {_yaml_problem(err)}; fix the file there and run again.") from None


def _yaml_problem(err) -> str:
    """A YAML error in one line: ``<problem> at line L, column C (<context> at line L', column C')``,
    lines and columns counted from 1 as editors do (PyYAML's marks count from 0)."""

    def at(mark) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem = getattr(err, "problem", None)
    if problem is None:  # a ReaderError (a character YAML does not allow) has no marks
        return " ".join(str(err).split())
    text = f"{problem}{at(getattr(err, 'problem_mark', None))}"
    context = getattr(err, "context", None)
    if context:
        text += f" ({context}{at(getattr(err, 'context_mark', None))})"
    return text


def debugging(environ: dict[str, str] | None = None) -> bool:
    """Whether ``LONGPPL_DEBUG`` asks for tracebacks (1, true, yes or on)."""
    from longppl.models.sources import env_flag  # standard library only: the commands run this before torch

    return env_flag(DEBUG_VARIABLE, environ)
