"""``longppl``: one command for every tool, as ``longppl <command> [options]``.

    longppl score --corpus docs.jsonl --evaluator meta-llama/Llama-3.1-8B --output key_tokens/x
    longppl evaluate --key-tokens key_tokens/x --models Qwen/Qwen2-7B
    longppl score --help

Each command is one of the console scripts, which keep their names (``longppl score`` is
``longppl-score``, ``longppl train`` is ``longce-train``): the same parser, options, output and
one-line errors (``LONGPPL_DEBUG=1`` shows the traceback). ``python -m longppl`` is this command too.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from longppl.commandline.running import help_text, interruptible

#: ``longppl``'s own commands, ``{command: (the console script's entry point "module:function", one line
#: for --help)}``: the entry points are setup.cfg's, so a command and its old name run the same function.
#: Other packages add theirs through setup.cfg's ``longppl.commands`` entry-point group (``longce``'s
#: ``train``, the reproduction's ``reproduce``): this package names neither of them.
COMMANDS = {
    "score": ("longppl.tools.compute_key_tokens:cli", "score a corpus with an evaluator into a key-token cache"),
    "evaluate": ("longppl.tools.evaluate_models:cli", "LongPPL and PPL of models against a key-token cache"),
    "visualize": ("longppl.tools.visualize_key_tokens:cli", "HTML and a histogram of a key-token cache"),
    "cache": ("longppl.tools.cache_tool:cli", "a key-token cache's contents; compaction of its shards"),
    "quickstart": ("longppl.tools.quickstart:cli", "LongPPL in one command, offline on a tiny model"),
}

#: the entry-point group through which a package registers its table of commands
COMMAND_GROUP = "longppl.commands"


def commands() -> dict[str, tuple[str, str]]:
    """Every subcommand: ``COMMANDS`` first, then each installed package's table (``longppl.commands``
    entry points, in the order of their names). Only the tables are imported (small modules without
    imports), not the commands: ``longppl --help`` loads none of them. A package whose table names a
    command already taken is refused, so that no command silently runs another package's tool."""
    from importlib.metadata import entry_points

    found = dict(COMMANDS)
    for point in sorted(entry_points(group=COMMAND_GROUP), key=lambda point: point.name):
        if point.value == f"{__name__}:COMMANDS":
            continue
        for name, target in point.load().items():
            if name in found and found[name] != target:
                raise RuntimeError(
                    f"the {COMMAND_GROUP} entry point {point.name!r} ({point.value}) registers the command "
                    f"{name!r}, which runs {found[name][0]} already; uninstall one of the two packages"
                )
            found[name] = target
    return found


PROG = "longppl"


def build_parser(prog: str = PROG, table: dict[str, tuple[str, str]] | None = None) -> argparse.ArgumentParser:
    """The parser of ``longppl`` itself: ``--help`` (the commands, one line each) and the command's name.
    What follows the name is the command's, parsed by its own tool."""
    table = commands() if table is None else table
    width = max(len(name) for name in table) + 2
    listing = "\n".join(f"  {name:<{width}}{summary}" for name, (_, summary) in table.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s <command> [options]",
        description=help_text(__doc__.split("\n\n")[0] if __doc__ else None),
        epilog=f"commands:\n{listing}\n\n`{prog} <command> --help` shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", metavar="<command>", choices=list(table), help="the tool to run (listed below)")
    parser.set_defaults(table=table)
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run ``longppl <command> [options]``; returns the command's exit status (0).

    ``argv``: the arguments after ``longppl`` (default ``sys.argv[1:]``). No command, ``--help`` or an
    unknown command: argparse's help or one ``longppl: error: ...`` line naming the choices
    (``SystemExit``). Otherwise the command's console-script function runs with the rest of ``argv``,
    under the name ``longppl <command>``: in its usage line, its error lines and the command line a
    report records.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # only the first argument is ours: `longppl score --help` is score's help, not this one's
    # one of longppl's own commands runs without reading the other packages' tables (nor importing them)
    parser = build_parser(prog, COMMANDS if argv[:1] and argv[0] in COMMANDS else None)
    parsed = parser.parse_args(argv[:1])
    command = parsed.command
    module, function = parsed.table[command][0].split(":")
    # Importing a command's module can take seconds (numpy, datasets): a Ctrl-C then is one line too.
    with interruptible(f"{prog} {command}"):
        run = getattr(importlib.import_module(module), function)
    saved = sys.argv
    # The tools take their name from sys.argv[0] (run_command's `prog: error:` line, longce-train's
    # Hugging Face parser, the command line reproduce records), as when started by their own name.
    sys.argv = [f"{prog} {command}", *argv[1:]]
    try:
        return run(argv[1:])
    finally:
        sys.argv = saved
