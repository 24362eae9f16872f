"""``python -m longppl.harness <lm_eval arguments>``: lm-evaluation-harness's command line (``lm_eval``)
with the ``longppl`` model type registered and the LongPPL tasks on its ``--include_path``::

    python -m longppl.harness run --model longppl --model_args pretrained=Qwen/Qwen2-7B,dtype=bfloat16 \\
        --tasks longppl --metadata key_tokens=key_tokens/govreport-llama8b --output_path results

Every argument is ``lm_eval``'s (``run``, ``ls``, ``validate``; without a subcommand, ``run``). A bad
input (a missing cache, settings that match none of its combinations, a document longer than the
model's positions, ...) ends the command with one line, ``python -m longppl.harness: error: ...``, as
the ``longppl`` commands do (``LONGPPL_DEBUG=1`` shows the traceback). Under ``accelerate launch -m
longppl.harness run ...`` each process scores its share of the documents.
"""

from __future__ import annotations

import sys

PROG = "python -m longppl.harness"


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
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        setup_logging()
        parser = HarnessCLI()
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
        sys.exit(f"{PROG}: error: {err}")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
