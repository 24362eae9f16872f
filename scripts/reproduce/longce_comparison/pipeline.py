"""LongCE against CE from a base that keeps the task (the second attempt at the paper's Section 5).

    python scripts/reproduce_longce.py --config configs/reproduce/longce_comparison_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2-longce/ \\
        [--base-model repro2/models/B --evaluator repro2/models/E1]

The base B of the LongPPL population (``longppl_reproduce.population``) is extended by YaRN and
fine-tuned by each method, each seed, on the same data in the same order per seed:

- ``ce``: plain cross-entropy; ``self``: LongCE scored by the model being trained (the paper's);
- ``cache``: LongCE with E1's weights (its key-token cache of the fine-tuning data);
- ``ce-wallclock``: CE for ``self``'s wall time, ``round(steps * self / ce step time)`` steps, the
  step times measured on the same seed's ``ce`` and ``self`` runs.

The config (:class:`Comparison`) names a population config, whose data, benchmarks and models
(tokenizer, B, E1, optional E2, test cases, validation documents) this experiment shares: B and E1
are either given (model folders of a population run or its export: ``base_model``, ``evaluator``,
``--base-model``, ``--evaluator``; copied into this run folder), found in it (``--output-dir`` the
population run's own folder: its tokenizer, data and models are kept), or trained here by the
population's own stage functions (``longppl_reproduce.common.stages``), from the same config and seeds.

Stages (``--stages``, comma separated, or ``all``), each resumable (files written atomically, a
stage skips what its files say is done):

- ``start``: tokenizer, data (the population's ``data`` stage, plus the fine-tuning mix's task
  documents and ``data/finetune.jsonl``, the fine-tuning pool shared by every run), B and E1 (E2)
  given or trained, each through its gate.
- ``extend``: B extended by each of ``extensions`` -> ``models/extended/<name>/``, no fine-tuning;
  its lines accuracy at 512 and on the primary benchmark -> ``eval/extended/<name>.json``.
- ``cache``: E1's key-token cache of the fine-tuning pool (LongCE's window) and the pool with its
  weights -> ``data/finetune-cache-weights/`` (only when ``cache`` is a method).
- ``finetune``: every run -> ``models/finetuned/<extension>-<method>-s<seed>/``, with its step
  times and its accuracy curve at ``finetune.eval_steps`` (accuracy at 512 and on the primary
  benchmark); a finished run is never retrained, one cut off (or whose weights went after its
  training record was written) is trained again from its start.
  ``--seeds`` splits the runs over calls.
- ``evaluate``: per run -> ``eval/finetuned/<run>.json``: lines accuracy at the primary lengths
  (asked line beyond K), at 512, needle, the answer digits' log-likelihood, PPL and LongPPL under
  an evaluator that supplied no training weights (E2 when there is one, else E1 for every method
  but ``cache``).
- ``rerun``: when the void rule holds for an extension (CE's accuracy at 512 at step
  ``void.at_step``, mean over seeds, below ``void.min_ratio`` of the extended base's; ``rerun.when:
  void``, or ``always`` / ``never``), ``rerun.methods`` again at ``rerun.lr_factor`` times the
  learning rate, trained and evaluated as above (``<extension>-<method>-rerun-s<seed>``).
- ``report``: ``results.json`` (every run and seed, mean and standard deviation per method, the
  paired difference of each method against ``ce`` across seeds with its t interval, the void rule,
  the verdict), ``report.md``, ``figures/accuracy_vs_steps-<extension>.png``.

Several starting points (``settings:``, docs/reproduction.md "LongCE beyond one setting"): each
setting names its start model (B, an evaluator, or a model of ``pretrained:``, trained here by the
population's stages), its extension, its fine-tuning length L, its start length, its primary lengths
and its outside evaluator. ``start`` writes each length's pool of distinct book windows
(``data/finetune-<L>.jsonl``, and ``-fresh`` for ``ce-fresh``) and the settings' cases;
``extend`` makes ``models/extended/<setting>/``; ``cache`` the datasets the runs read (``frozen``:
the extended start model's own cached weights; ``cache``: the outside evaluator's) and, with
method ``start`` selected, the evaluators' alpha and validation caches; ``finetune`` trains
``<setting>-<method>-s<seed>`` in a seed's order of the pool (``ce-fresh`` goes on with fresh rows
for ``fresh_factor`` times the steps); ``evaluate`` scores every run and each start model
(``<setting>-start``). ``--settings``, ``--seeds``, ``--methods`` and ``--models`` pick what a call
does, so several processes share a GPU; there are no reruns. ``report`` reads the records alone
(``eval/``, the training records, ``timings.json``) and writes the plan's statistics and decisions
(``longppl_reproduce.longce_comparison.settings_report``): per setting the runs, void runs and arms, mean ± sd,
the paired differences against ``ce`` and the start model, pooled over the settings in the records
(a missing setting, seed or arm is named and left out), ``figures/accuracy_vs_steps-<setting>.png``.
"""

from __future__ import annotations

import argparse

from longppl.commandline.running import run_command, tool_parser

from ..common import stages
from ..common.run_folder import RunFolder
from .config import START, Comparison, Selection, model_specs, read_comparison
from .evaluation import stage_evaluate, stage_rerun
from .report import stage_report
from .start import stage_start
from .training import stage_cache, stage_extend, stage_finetune

#: The stages in their order: ``--stages`` names them, each is called as ``stage(config, pop, run, selection)``.
STAGES = {
    "start": stage_start,
    "extend": stage_extend,
    "cache": stage_cache,
    "finetune": stage_finetune,
    "evaluate": stage_evaluate,
    "rerun": stage_rerun,
    "report": stage_report,
}

# ------------------------------------------------------------------ command line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="the comparison's YAML config (required)")
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument("--corpus", help="training books; overrides the population config's")
    parser.add_argument("--validation-corpus", help="validation books; overrides the population config's")
    parser.add_argument(
        "--base-model", help="B's model folder (a population run's models/B or its export); overrides the config's"
    )
    parser.add_argument("--evaluator", help="E1's model folder; overrides the config's")
    parser.add_argument("--second-evaluator", help="E2's model folder; overrides the config's")
    parser.add_argument(
        "--stages",
        type=lambda value: stages.parse_stages(value, STAGES),
        default=list(STAGES),
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (default)",
    )
    parser.add_argument(
        "--seeds",
        help="comma-separated fine-tuning seeds to train / evaluate / report in this call (default: all); "
        "a report over fewer seeds than the config's says so",
    )
    parser.add_argument(
        "--settings", help="comma-separated settings (a config with settings) this call runs (default: all)"
    )
    parser.add_argument(
        "--methods",
        help="comma-separated methods this call trains / evaluates / makes the datasets of (default: all); "
        "'start' selects the settings' start models (their evaluation, and in the cache stage the "
        "evaluators' alpha and validation caches)",
    )
    parser.add_argument(
        "--models",
        help="comma-separated models the start stage trains (a config with settings; default: the selected "
        "settings' start models and outside evaluators; 'none': the data only)",
    )
    return parser


def parse_seeds(value: str | None, config: Comparison) -> list[int] | None:
    if not value:
        return None
    try:
        seeds = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {value!r}.") from None
    unknown = [s for s in seeds if s not in config.finetune.seeds]
    if unknown:
        raise ValueError(
            f"--seeds names {unknown}, which are not in the config's finetune.seeds {list(config.finetune.seeds)}."
        )
    return seeds


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config, pop = read_comparison(
        args.config, args.corpus, args.validation_corpus, args.base_model, args.evaluator, args.second_evaluator
    )
    seeds = parse_seeds(args.seeds, config)
    selection = Selection(
        tuple(seeds) if seeds is not None else None,
        parse_names(args.settings, "--settings", [s.name for s in config.settings]),
        parse_names(args.methods, "--methods", [*config.finetune.methods, START]),
        parse_names(args.models, "--models", list(model_specs(config, pop)), empty="none"),
    )
    if not config.settings and (selection.settings or selection.methods or selection.models):
        raise ValueError(
            "--settings, --methods and --models select parts of a config with settings; this one has none."
        )
    run = RunFolder(args.output_dir)
    return run.run_stages(args.stages, lambda stage: STAGES[stage](config, pop, run, selection))


def parse_names(value: str | None, flag: str, known: list[str], empty: str | None = None) -> tuple[str, ...] | None:
    """The comma-separated names of ``value`` (``None`` when not given; ``empty``: none at all), each one of ``known``."""
    if value is None:
        return None
    if empty is not None and value.strip() == empty:
        return ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag} names {unknown or value!r}; choose from {', '.join(known)}.")
    return names


def cli(argv=None) -> int:
    """The ``longppl-reproduce-longce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
