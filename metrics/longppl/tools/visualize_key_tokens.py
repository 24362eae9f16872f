"""Pictures of a key-token cache, no model needed: a document as HTML with its key tokens
highlighted and each token's LSD and LCL on hover, click or focus (like the paper's Appendix F),
and a histogram of the LSD values of the whole corpus (like its Figure 4(a)), in the format its
name's suffix names (``.png``, ``.jpg``, ``.pdf``, ``.svg``, ...).

    longppl-visualize --key-tokens key_tokens/govreport-llama3.1-8b \\
        --document 3 --html doc3.html --histogram lsd.png

``--document`` is the position of the text among the cache's rows of the chosen evaluator and
settings (``--evaluator``, ``--trunc-len``, ``--sliding-window`` pick one when the cache holds
several), numbered from 1 as the Space numbers its texts (``--document 1``, the default, is the
first). The histogram needs matplotlib.

(``scripts/visualize_key_tokens.py`` and ``python -m longppl.tools.visualize_key_tokens`` run the same
command.)
"""

from __future__ import annotations

import argparse

# Only light modules at import time: ``--help`` must not wait for torch or matplotlib, which are
# imported inside the functions that need them.
from longppl.commandline.running import run_command, tool_parser

# The name in usage lines and messages when main() is called from Python; commands show the name they
# were started by (commandline/running.py).
PROG = "visualize_key_tokens.py"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    from longppl.commandline.cache_options import add_cache_arguments

    parser = tool_parser(prog, __doc__)
    add_cache_arguments(parser)
    parser.add_argument(
        "--document",
        type=int,
        default=1,
        help="which text to show as HTML: its position among the chosen rows, numbered from 1 as the Space "
        "numbers texts (default: %(default)s, the first)",
    )
    parser.add_argument("--html", help="write the document's HTML view here (default: no HTML)")
    parser.add_argument(
        "--lsd-cap",
        type=float,
        default=None,
        help="LSD shown at full shade in the HTML; shading is proportional to LSD clipped to "
        "[0, cap] (default: 2 * alpha, at least 1)",
    )
    parser.add_argument(
        "--histogram",
        help="write the histogram of the corpus's LSD values here, in the format the suffix names: .png, .jpg, "
        ".pdf, .svg, ... (default: no histogram)",
    )
    return parser


def parse_args(argv=None, prog: str = PROG):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not (args.html or args.histogram):
        parser.error("nothing to draw: pass --html FILE and/or --histogram FILE")
    if args.lsd_cap is not None and not args.lsd_cap > 0:
        parser.error(f"--lsd-cap {args.lsd_cap:g} must be positive: it is the LSD shown at full shade")
    return args


def check_outputs(args) -> None:
    """Refuse, before the cache is read, an ``--html`` or ``--histogram`` file that cannot be written (under
    a file, through a loop of links, a folder, not writable) or a histogram suffix no format has."""
    from longppl.atomic_files import cannot_create
    from longppl.commandline.figures import figure_format

    for option, path in (("--html", args.html), ("--histogram", args.histogram)):
        if path:
            problem = cannot_create(path)
            if problem is not None:
                raise ValueError(f"{option} {path!r} {problem}; pass a file name in a folder you can write to.")
    if args.histogram:
        try:
            figure_format(args.histogram)
        except ValueError as err:
            raise ValueError(f"--histogram {err}") from None


def main(argv=None, prog: str = PROG) -> None:
    """Run the tool: write the HTML view and/or the histogram the options ask for.

    Raises:
        ValueError: a cache the tool cannot use or a ``--document`` out of range, with what to do;
            the command prints it as ``<prog>: error: ...``.
    """
    args = parse_args(argv, prog)
    check_outputs(args)
    from longppl.atomic_files import write_file_atomically
    from longppl.commandline.cache_options import open_selected
    from longppl.settings import KeyTokenRule
    from longppl.views.key_token_html import key_token_html

    cache, settings, fingerprint, rows = open_selected(args)
    if args.html:
        if not 1 <= args.document <= len(rows):
            raise ValueError(
                f"--document {args.document} is out of range: the cache holds {len(rows)} texts for this "
                f"evaluator and settings, numbered from 1 (pass 1 to {len(rows)})."
            )
        chosen = rows[args.document - 1]  # texts are numbered from 1, as the Space numbers them
        row = cache.row(chosen)
        details = (
            f"Evaluator {row['evaluator_name'] or '(unnamed)'} ({row['evaluator_dtype']}), "
            f"{settings.describe()}; text {args.document} of {len(rows)}, SHA-256 {row['text_fingerprint'][:16]}…"
        )
        page = key_token_html(
            row["text"],
            cache.scores(chosen),
            trunc_len=settings.trunc_len,
            title=f"Key tokens of text {args.document}",
            details=details,
            lsd_cap=args.lsd_cap,
            rule=KeyTokenRule.of(args),
        )
        write_file_atomically(args.html, lambda handle: handle.write(page))
        print(f"wrote {args.html}")
    if args.histogram:
        import numpy as np

        from longppl.commandline.figures import lsd_histogram
        from longppl.rules.key_tokens import long_short_difference

        lsd = np.concatenate(
            [long_short_difference(s.lp_long, s.lp_short) for s in (cache.scores(row) for row in rows)]
        )
        lsd_histogram(args.histogram, lsd, args.alpha, f"LSD of {len(rows)} texts (K={settings.trunc_len})")
        print(f"wrote {args.histogram}")


def cli(argv=None) -> int:
    """The ``longppl-visualize`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
