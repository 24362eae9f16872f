"""``python -m longppl.harness <lm_eval arguments>``: lm-evaluation-harness's command line (``lm_eval``)
with the ``longppl`` model type registered and the LongPPL tasks on its ``--include_path``::

    python -m longppl.harness run --model longppl --model_args pretrained=Qwen/Qwen2-7B,dtype=bfloat16 \\
        --tasks longppl --metadata key_tokens=key_tokens/govreport-llama8b --output_path results

Every argument is ``lm_eval``'s (``run``, ``ls``, ``validate``; without a subcommand, ``run``); ``run
--help`` adds what they mean for a LongPPL task (:data:`RUN_EPILOG`, ``--limit``). A bad input (a
missing cache, settings that match none of its combinations, a misspelt setting or task name, a
document longer than the model's positions, ...) ends the command with one line, ``python -m
longppl.harness: error: ...``, as the ``longppl`` commands do (``LONGPPL_DEBUG=1`` shows the
traceback). Under ``accelerate launch -m longppl.harness run ...`` each process scores its share of
the documents.
"""

from __future__ import annotations

import sys

PROG = "python -m longppl.harness"
#: The start of lm_eval's error for task names it does not know (``Tasks not found: a, b``).
MISSING_TASKS = "Tasks not found: "
#: What ``--limit`` does to a LongPPL task, after lm_eval's own help of it.
LIMIT_HELP = (
    "; for a LongPPL task, its first N documents in the key-token cache's row order (a fraction: that share "
    "of them, rounded up), so that LongPPL, PPL and their standard errors are those of these documents only "
    "(for a quick check: the whole cache gives the numbers to report)"
)
#: The LongPPL part of ``run --help``, before lm_eval's own examples.
RUN_EPILOG = f"""\
LongPPL (docs/harness.md):
  {PROG} run --model longppl --model_args pretrained=Qwen/Qwen2-7B,dtype=bfloat16 \\
      --tasks longppl --metadata key_tokens=key_tokens/govreport-llama8b --output_path results
  --model longppl takes every argument of --model hf. The task longppl scores the texts of the
  key-token cache that --metadata key_tokens names (a copy of longppl.harness.TEMPLATE_PATH names
  its own by dataset_path). --metadata key=value sets, for every LongPPL task of the run:
  {{settings}}.
  --limit N scores only the first N documents of each LongPPL task (see --limit above).

"""


def main(argv: list[str] | None = None) -> int:
    """Run ``lm_eval``'s command line on ``argv`` (default ``sys.argv[1:]``); returns 0.

    Exits with ``<prog>: error: <message>`` (status 1) on a ``ValueError`` or ``FileNotFoundError``.
    """
    import longppl.harness as harness

    from ._internal import USER_ERRORS, debugging

    arguments = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    # HarnessCLI reads sys.argv itself (it inserts "run" when no subcommand is given)
    sys.argv = [PROG, *arguments]
    args = None
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        setup_logging()
        parser = HarnessCLI()
        describe(parser)
        args = parser.parse_args()
        if hasattr(args, "include_path"):
            given = args.include_path
            if given is None and getattr(args, "config", None):
                # a --config YAML's include_path, which the command line's would otherwise replace
                from lm_eval.config.evaluate_config import EvaluatorConfig

                given = EvaluatorConfig.load_yaml_config(args.config).get("include_path")
            args.include_path = harness.include_paths(given)
        parser.execute(args)
    except USER_ERRORS as err:
        if debugging():
            raise
        sys.exit(f"{PROG}: error: {with_task_suggestions(str(err), getattr(args, 'include_path', None))}")
    finally:
        sys.argv = saved
    return 0


def describe(cli) -> None:
    """Make lm_eval's parser (a ``HarnessCLI``) describe this command: :data:`PROG` in its usage lines,
    :data:`RUN_EPILOG` in ``run --help`` and :data:`LIMIT_HELP` after ``--limit``'s help. A parser laid
    out otherwise (another lm_eval) keeps its own help."""
    from .task import SETTINGS

    main, subcommands = getattr(cli, "_parser", None), getattr(cli, "_subparsers", None)
    if main is None or subcommands is None:
        return
    main.prog = PROG
    for name, parser in subcommands.choices.items():
        parser.prog = f"{PROG} {name}"
        if parser.usage:
            parser.usage = parser.usage.replace("lm-eval", PROG, 1)
    run = subcommands.choices.get("run")
    if run is None:
        return
    run.epilog = RUN_EPILOG.format(settings=", ".join(SETTINGS)) + (run.epilog or "")
    for action in run._actions:
        if "--limit" in action.option_strings and action.help:
            action.help = action.help.rstrip(".") + LIMIT_HELP


def with_task_suggestions(message: str, include_path=None) -> str:
    """lm_eval's error ``message``; when it is :data:`MISSING_TASKS` (``Tasks not found: longpl``), each
    name with the closest task name lm_eval knows (``longpl (did you mean longppl?)``), the LongPPL tasks
    and those of ``include_path`` included, and how to list them."""
    if not message.startswith(MISSING_TASKS):
        return message
    import longppl.harness as harness

    from ._internal import with_closest

    missing = [name.strip() for name in message[len(MISSING_TASKS) :].split(",") if name.strip()]
    try:
        known = harness.task_manager(include_path).all_tasks
    except Exception:  # noqa: BLE001 - the hint is extra: lm_eval's own message still says what failed
        known = []
    return f"{MISSING_TASKS}{with_closest(missing, known)}; `{PROG} ls tasks` lists the tasks."


if __name__ == "__main__":
    raise SystemExit(main())
