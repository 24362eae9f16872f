"""The command line of the real-models experiment: ``python -m longppl_reproduce.real_models.cli
<stage> [options]``. ``STAGES`` maps each stage's name to its function (``function(args)``).

- ``transcribe``: the earlier studies' published tables (``--page``) into records (``--records``).
- ``report-records``: every table and statistic rebuilt from the records alone (``--output``).
- ``prepare``: the documents and task sets of both tokenizers (CPU, one process per core).
- ``report-real``: the LongPPL study's analysis by its plan, from its records alone (``analysis``).
- ``calibrate`` / ``instrument`` / ``finetune`` / ``score`` / ``documents``: the device phases of the LongPPL study on real models
  (``phases``): each appends one JSON line per finished unit to ``<run>/records/*.jsonl`` and skips
  what is there, and stops starting new units after ``--budget-seconds``.
- ``chain``: ``finetune``, ``score`` and ``documents`` a member at a time (so that a session's end loses
  no fine-tuned member but the ones in hand).
- ``longce-start`` / ``longce-weights`` / ``longce-train`` / ``longce-evaluate`` / ``longce-chain``: the
  device phases of the LongCE study from a real start (``longce_start``), resumable in the same way
  (``longce-chain``, module ``longce_chain``: train and evaluate a unit at a time, and begin none
  that the units measured before say would not end within ``--budget-seconds``).
- ``longce-report``: that study's analysis by its plan (paired t intervals, Holm decisions, void
  rule, pooled means), from ``<run>/records/*.jsonl`` alone (``longce_report``):
  ``<run>/longce_results.json`` and ``<run>/longce_report.md``.
"""

from __future__ import annotations

import argparse
import os
import sys


def stage_transcribe(args) -> None:
    from . import records

    for path in records.transcribe(args.page, args.records):
        print(path)


def stage_report_records(args) -> None:
    from . import records

    found = records.report(args.records, resamples=args.resamples)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = f"{args.output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(found["markdown"])
    os.replace(tmp, args.output)
    print(args.output)


def stage_prepare(args) -> None:
    from . import phases

    phases.prepare(phases.Run.from_args(args), workers=args.workers)


def stage_calibrate(args) -> None:
    from . import phases

    phases.calibrate(phases.Run.from_args(args))


def stage_instrument(args) -> None:
    from . import phases

    phases.instrument(phases.Run.from_args(args))


def stage_finetune(args) -> None:
    from . import phases

    phases.finetune(phases.Run.from_args(args))


def stage_score(args) -> None:
    from . import phases

    phases.score(phases.Run.from_args(args))


def stage_documents(args) -> None:
    from . import phases

    phases.documents(phases.Run.from_args(args))


def stage_chain(args) -> None:
    from . import phases

    phases.chain(phases.Run.from_args(args))


def stage_longce(args) -> None:
    from . import longce_chain, longce_start, phases

    stages = {**longce_start.stages(), "longce-chain": longce_chain.chain}
    stages[args.stage](phases.Run.from_args(args), longce_start.Choice.from_args(args))


def _write_outputs(folder: str, texts: dict) -> None:
    """Each ``{name: text}`` written to ``folder/name`` atomically (never half a file), its path printed."""
    from longppl.atomic_files import write_file_atomically

    for name, text in texts.items():
        path = os.path.join(folder, name)
        write_file_atomically(path, lambda handle, text=text: handle.write(text))
        print(path)


def stage_report_real(args) -> None:
    """The study's analysis from the run's records alone: ``<run>/results.json`` and ``report.md``."""
    import json

    from . import analysis, phases

    run = phases.Run.from_args(args)
    found = analysis.analyse(
        analysis.with_task_documents(run.records("members").rows(), run.records("task_documents").rows()),
        run.records("instrument").rows(),
        run.records("calibration").rows(),
        analysis.plan_rules(args.resamples),
    )
    _write_outputs(
        args.run, {"results.json": json.dumps(found, indent=1, default=str), "report.md": analysis.format_report(found)}
    )


def stage_longce_report(args) -> None:
    """The LongCE-from-a-real-start analysis from the run's records alone: ``<run>/longce_results.json``
    and ``<run>/longce_report.md``. ``--small`` reads the smoke run's starts, seeds and checkpoints."""
    import json

    from . import longce_report, longce_start, phases

    folder = os.path.join(args.run, "records")
    names = ("longce_start", "longce_weights", "longce_train", "longce_evaluate")
    if not any(os.path.isfile(os.path.join(folder, f"{name}.jsonl")) for name in names):
        raise ValueError(
            f"No LongCE records ({', '.join(n + '.jsonl' for n in names)}) in {folder}: run the 'longce-start' "
            "phase first, or pass the run folder that holds them with --run."
        )
    records = {name: phases.Records(os.path.join(folder, f"{name}.jsonl")).rows() for name in names}
    sizes = longce_start.SMALL if args.small else longce_start.PLAN
    found = longce_report.analyse(
        records, [s.name for s in sizes.starts], longce_start.ARMS, sizes.seeds, sizes.checkpoints
    )
    _write_outputs(
        args.run,
        {
            "longce_results.json": json.dumps(found, indent=1, default=str),
            "longce_report.md": longce_report.format_report(found),
        },
    )


STAGES = {
    "transcribe": stage_transcribe,
    "report-records": stage_report_records,
    "prepare": stage_prepare,
    "calibrate": stage_calibrate,
    "instrument": stage_instrument,
    "finetune": stage_finetune,
    "score": stage_score,
    "documents": stage_documents,
    "chain": stage_chain,
    "report-real": stage_report_real,
    "longce-start": stage_longce,
    "longce-weights": stage_longce,
    "longce-train": stage_longce,
    "longce-evaluate": stage_longce,
    "longce-chain": stage_longce,
    "longce-report": stage_longce_report,
}


def build_parser() -> argparse.ArgumentParser:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    parser = argparse.ArgumentParser(
        prog="python -m longppl_reproduce.real_models.cli", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--page", default=os.path.join(root, "docs", "reproduction.md"))
    parser.add_argument("--records", default=os.path.join(root, "docs", "records"))
    parser.add_argument("--output", default="records-report.md")
    parser.add_argument(
        "--resamples",
        type=int,
        default=10000,
        help="report-records, report-real: bootstrap resamples (the plans' 10000)",
    )
    parser.add_argument("--run", default="outputs/real", help="the run folder of the device phases")
    parser.add_argument("--books", default="books", help="folder with train.jsonl.gz and validation.jsonl.gz")
    parser.add_argument("--gemma", default="gemma-3-270m", help="Gemma 3 270M: its short name, a *.gguf or a folder")
    parser.add_argument("--smollm2", default="smollm2-135m", help="SmolLM2-135M: its short name, a *.gguf or a folder")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=480.0,
        help="begin no unit after this many seconds (longce-chain: nor one that would not end within them)",
    )
    parser.add_argument("--members", default=None, help="comma-separated member names (default: all)")
    parser.add_argument("--small", action="store_true", help="tiny lengths and counts (a CPU smoke run)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="prepare: processes (default: one per core); longce-chain: the chain processes started on its"
        " device, this one included (default 1; before its first training it waits for them to join)",
    )
    parser.add_argument("--starts", default=None, help="longce-*: comma-separated starts (s1, s2; default: both)")
    parser.add_argument(
        "--arms", default=None, help="longce-train/evaluate/chain: comma-separated arms (default: all five)"
    )
    parser.add_argument(
        "--seeds", default=None, help="longce-train/evaluate/chain: comma-separated seeds (default: all)"
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        STAGES[args.stage](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
