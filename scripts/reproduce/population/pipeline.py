"""LongPPL against long-context ability over a population of context extensions (the second attempt).

    python scripts/reproduce_longppl.py --config configs/reproduce/population_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2/

A base model B is trained from scratch at a short context, then extended to the evaluation length
``L`` by several methods (PI, NTK-aware, YaRN, ABF, EABF), each fine-tuned for several step counts:
the population differs in long-context ability while its short-context training is shared.
Evaluators (E1, optionally E2, ...) are trained apart, at ``L``, and are not members. Each evaluator
calibrates its own alpha before any member is scored; the analysis plan (exclusions, statistics) is
in the config: ``analysis.plan`` ``second`` (this module's report) or ``third`` (the third attempt's,
``longppl_reproduce.population.third_attempt``: format-only exclusion, a composite of lines, needle and the
two-hop task of ``longppl_reproduce.common.two_hop``, clusters = configurations, a decision rule).

Stages (``--stages``, comma separated, or ``all``), each resumable: every file is written
atomically and a stage skips what its files say is done, so a run can be split into short calls
(a model counts as trained when its training record and its files are all there: one whose weights
were deleted or cut off is trained again). A record that is not JSON or not of its shape stops the
run with one line naming it (delete it, and its stage computes it again).

- ``tokenizer``: byte-level BPE on the first ``data.tokenizer_books`` books -> ``tokenizer/``.
- ``data``: ``data/train_tokens.npy`` (training books, one stream); ``data/validation.jsonl``
  (documents of ``L`` tokens from the validation books' bodies) and ``data/null.jsonl`` (the same
  with all but their last ``data.null_keep`` tokens taken from another book); task-document pools
  ``data/pools/<kind>-<seq_len>-<within>.npz``; test cases ``data/cases/`` (lines at the gate
  lengths, lines beyond K per length, needle, answer tokens).
- ``base``: B -> ``models/<base>/``, then its gate (lines accuracy at ``gate.length``) ->
  ``eval/gates/<base>.json``; a failed gate stops the run with a message (and is recorded).
- ``evaluators``: every enabled evaluator (``--evaluators`` selects) likewise.
- ``members``: every member (``--members`` / ``--shard i/n`` select) -> ``models/members/<name>/``:
  B extended, then fine-tuned for its steps with its own seed (0 steps: the extension alone).
- ``calibrate``: per evaluator (``--evaluators`` selects), its key-token caches (``longppl-score``) of
  the real and the null documents -> ``caches/``; alpha from the tokens past ``L - K`` ->
  ``eval/calibration.json`` (the first evaluator) or ``eval/calibration-<name>.json``; the first
  evaluator's secondary-window cache too, so that ``evaluate`` only reads caches.
- ``evaluate``: per member -> ``eval/members/<name>.json``: lines accuracy per length (asked line
  beyond K), at the gate length, needle accuracy, two-hop accuracy (when
  ``evaluation.two_hop_length`` is set), the answer's log-likelihood, and PPL / LongPPL
  against every evaluator cache (primary and secondary windows, soft, the alpha x beta grid), with
  per-document sums for bootstraps. Members are scored in this process with the library's scoring
  functions (``longppl.core.scoring``, what ``longppl-evaluate`` runs): EABF members need their attention
  function registered in the process that loads them.
- ``answer_tokens``: Figure 5(b) on E1 -> ``eval/answer_tokens.json``.
- ``report``: ``results.json``, ``report.md``, ``figures/``.
- ``export``: B and E1 in bf16, shards of at most 15 MB, into ``--export-dir``.

Processes side by side (one per GPU) share the members with ``--claim <id>`` (one id per call): each
member is trained / evaluated by the first process to claim it (``claims/<id>/``).

Wall times per stage and per model are summed over calls in ``timings.json``; every seed is in
``results.json``.
"""

from __future__ import annotations

import argparse

from longppl.commandline.running import run_command, tool_parser

from ..common.config import folder_name, read_population
from ..common.run_folder import RunFolder
from ..common.stages import parse_stages, selected_evaluators, stage_base, stage_calibrate, stage_data, stage_tokenizer
from .models import (
    parse_shard,
    selected_members,
    stage_answer_tokens,
    stage_evaluate,
    stage_evaluators,
    stage_export,
    stage_members,
)
from .report import stage_report

#: The stages in their order: ``--stages`` names them, each is called as ``stage(config, run, members, ...)``
#: (``evaluators`` and ``calibrate`` also get ``evaluators=``, ``members`` and ``evaluate`` ``claim=``,
#: ``export`` ``export_dir=``).
STAGES = {
    "tokenizer": stage_tokenizer,
    "data": stage_data,
    "base": stage_base,
    "evaluators": stage_evaluators,
    "members": stage_members,
    "calibrate": stage_calibrate,
    "evaluate": stage_evaluate,
    "answer_tokens": stage_answer_tokens,
    "report": stage_report,
    "export": stage_export,
}


# ------------------------------------------------------------------ command line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="the experiment's YAML config (required)")
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument(
        "--corpus", help="training books (.jsonl, .jsonl.gz, datasets dir or Hub id); overrides the config's"
    )
    parser.add_argument("--validation-corpus", help="validation books, same formats; overrides the config's")
    parser.add_argument(
        "--stages",
        type=lambda value: parse_stages(value, STAGES),
        default=[s for s in STAGES if s != "export"],
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (every one but export; default: all)",
    )
    parser.add_argument("--members", help="comma-separated members to train / evaluate in this call (default: all)")
    parser.add_argument(
        "--shard",
        type=parse_shard,
        help="i/n: train / evaluate only every n-th of the (selected) members from the i-th, e.g. one process per GPU",
    )
    parser.add_argument(
        "--claim",
        help="an id shared by processes working side by side in one call (e.g. one per GPU): each member is "
        "trained / evaluated by the first process to claim it (claims/<id>/); use a new id for every call",
    )
    parser.add_argument(
        "--evaluators", help="comma-separated evaluators to train / calibrate in this call (default: every enabled one)"
    )
    parser.add_argument("--export-dir", help="where the export stage writes B and E1 (bf16, shards <= 15 MB)")
    return parser


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config = read_population(args.config, args.corpus, args.validation_corpus)
    members = [m.strip() for m in args.members.split(",") if m.strip()] if args.members else None
    chosen = selected_members(config, members, args.shard)  # an unknown name fails before any work
    if args.shard:
        members = [m.name for m in chosen]
    if args.claim and folder_name(args.claim):
        raise ValueError(f"--claim {args.claim!r}: {folder_name(args.claim)} (it names a folder under claims/).")
    evaluators = [e.strip() for e in args.evaluators.split(",") if e.strip()] if args.evaluators else None
    selected_evaluators(config, evaluators)
    run = RunFolder(args.output_dir)

    def run_stage(stage: str):
        extra = {"export_dir": args.export_dir} if stage == "export" else {}
        if stage in ("evaluators", "calibrate"):
            extra = {"evaluators": evaluators}
        if stage in ("members", "evaluate"):
            extra = {"claim": args.claim}
        return STAGES[stage](config, run, members, **extra)

    return run.run_stages(args.stages, run_stage)


def cli(argv=None) -> int:
    """The ``longppl-reproduce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
