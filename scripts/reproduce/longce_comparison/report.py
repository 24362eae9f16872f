"""The ``report`` stage: the runs' rows, the paired differences against CE, the verdict, the curves and
``report.md`` (a config with settings: ``settings_report``'s statistics and decisions).
"""

from __future__ import annotations

import dataclasses
import os

from longppl.commandline.running import command_line

from ..common.config import Population
from ..common.report_text import closing_sections, fmt, spread
from ..common.run_folder import RunFolder, finite
from .config import START, Arm, Comparison, Selection, arms, chosen_settings, evaluator_names
from .evaluation import void_of

# ------------------------------------------------------------------ report


def arm_row(run: RunFolder, arm: Arm) -> dict:
    """A run's row of the results: its training record's steps and times, and its evaluation."""
    from ..common.family import TRAINING_RECORD

    trained = run.read_json("models", "finetuned", arm.name, TRAINING_RECORD)
    found = run.read_json("eval", "finetuned", f"{arm.name}.json")
    primary = {n: v["accuracy"] for n, v in found["lines"].items()}
    likelihood = {n: sum(v) / len(v) for n, v in found["log_likelihood"].items()}
    return {
        "run": arm.name,
        "extension": arm.extension.name,
        "method": arm.method,
        "seed": arm.seed,
        "rerun": arm.rerun,
        "steps": trained["steps"],
        "lr": trained["lr"],
        "self_ce_step_ratio": trained["self_ce_step_ratio"],
        "step_seconds": trained["step_seconds"]["median"],
        "seconds": trained["seconds"],
        "final_loss": trained["final_loss"],
        "curve": trained["curve"],
        "accuracy": primary,
        "primary_accuracy": sum(primary.values()) / len(primary),
        "acc512": found["acc512"]["accuracy"],
        "needle": found["needle"]["accuracy"],
        "log_likelihood": sum(likelihood.values()) / len(likelihood),
        "log_likelihood_by_length": likelihood,
        "ppl": found["ppl"],
        "longppl": found["longppl"],
        "longppl_evaluator": found["longppl_evaluator"],
        "key_tokens": found["key_tokens"],
        "alpha": found["alpha"],
        "device": trained["device"],
    }


#: The measures summarised and compared across seeds (the first is the primary outcome).
MEASURES = ("primary_accuracy", "acc512", "needle", "log_likelihood", "ppl", "longppl", "step_seconds")


def compare(rows: list[dict], methods: list[str], level: float) -> dict:
    """Per method: ``{measure: mean and sd}``; per LongCE variant (and ``ce-wallclock``): the paired
    difference against ``ce`` over the seeds both have (``self`` also against ``ce-wallclock``),
    with its t interval, for every measure with finite values."""
    from ..common.statistics import paired_t_interval

    by = {m: {r["seed"]: r for r in rows if r["method"] == m} for m in methods}
    summary = {m: {k: spread([r[k] for r in by[m].values()]) for k in MEASURES} for m in methods}
    pairs = [(m, "ce") for m in methods if m != "ce" and "ce" in methods]
    if "ce-wallclock" in methods and "self" in methods:
        pairs.append(("self", "ce-wallclock"))
    differences = {}
    for variant, baseline in pairs:
        seeds = sorted(set(by[variant]) & set(by[baseline]))
        entry = {}
        for measure in MEASURES:
            a = [by[variant][s][measure] for s in seeds]
            b = [by[baseline][s][measure] for s in seeds]
            kept = [(x, y) for x, y in zip(a, b) if finite(x) and finite(y)]
            if len(kept) < 2:
                entry[measure] = {"skipped": f"{len(kept)} seeds with finite values of both; 2 are needed"}
                continue
            entry[measure] = paired_t_interval([x for x, _ in kept], [y for _, y in kept], level)
        differences[f"{variant} - {baseline}"] = entry
    return {"summary": summary, "differences": differences}


def verdict(void: dict, differences: dict) -> str:
    """The plan's success rule: ``self``'s paired difference against ``ce`` in primary accuracy above
    0 with its interval excluding 0 -> reproduced; a void comparison counts for nothing."""
    if void["void"]:
        return "void"
    found = differences.get("self - ce", {}).get("primary_accuracy", {})
    if "low" not in found:
        return "undecided: no paired self - ce difference in primary accuracy"
    return "reproduced" if found["low"] > 0 else "not reproduced"


def stage_report(config: Comparison, pop: Population, run: RunFolder, selection=None) -> dict:
    """``results.json`` and ``report.md`` over ``seeds`` (default: every seed of the config; fewer
    when a run could not finish them all, which the report then states)."""
    if config.settings:
        return settings_report(config, pop, run, selection or Selection())
    seeds = list((selection.seeds if selection else None) or config.finetune.seeds)
    if len(seeds) < 2:
        raise ValueError(f"The report compares methods across seeds: --seeds names {seeds}; name at least 2.")
    unfinished = sorted(
        {arm.seed for arm in arms(config, seeds=seeds) if not run.has("eval", "finetuned", f"{arm.name}.json")}
    )
    if unfinished:
        finished = [seed for seed in seeds if seed not in unfinished]
        raise ValueError(
            f"Seeds {unfinished} have runs not evaluated in {run.path('eval', 'finetuned')}: run the 'finetune' and "
            f"'evaluate' stages for them, or report the finished seeds with --seeds {','.join(map(str, finished))}."
        )
    extensions = {}
    for extension in config.extensions:
        rows = [arm_row(run, arm) for arm in arms(config, seeds=seeds) if arm.extension == extension]
        void = void_of(config, run, extension, seeds=seeds)
        found = compare(rows, list(config.finetune.methods), config.level)
        reruns = [arm for arm in arms(config, rerun=True, seeds=seeds) if arm.extension == extension]
        rerun = None
        if all(run.has("eval", "finetuned", f"{arm.name}.json") for arm in reruns):
            rerun_rows = [arm_row(run, arm) for arm in reruns]
            rerun = {"runs": rerun_rows, **compare(rerun_rows, list(config.rerun.methods), config.level)}
            rerun["void"] = void_of(config, run, extension, rerun=True, seeds=seeds)
            rerun["verdict"] = verdict(rerun["void"], rerun["differences"])
        if not void["void"]:
            final = verdict(void, found["differences"])
        elif rerun is not None:
            final = f"void at the configured lr; at {config.rerun.lr_factor:g} x lr: {rerun['verdict']}"
        else:
            final = f"void: the rerun at {config.rerun.lr_factor:g} x the learning rate is due (stage 'rerun')"
        extensions[extension.name] = {
            "extension": dataclasses.asdict(extension),
            "extended_base": run.read_json("eval", "extended", f"{extension.name}.json"),
            "void": void,
            "rerun_due": void["void"] and rerun is None,
            "runs": rows,
            **found,
            "verdict": final,
            "rerun": rerun,
        }
    first, second = evaluator_names(config, pop)
    results = {
        "command": command_line("longppl-reproduce-longce"),
        "config": dataclasses.asdict(config),
        "population_config": dataclasses.asdict(pop),
        "seeds": {
            "run": pop.seed,
            "finetune": seeds,  # the seeds reported
            "configured": list(config.finetune.seeds),
            pop.base.name: pop.base.seed,
        },
        "evaluators": {"E1": first, "E2": second},
        "longppl": {
            **dataclasses.asdict(config.scoring.window),
            "alpha": next(iter(extensions.values()))["runs"][0]["alpha"],  # the number, calibrated or given
            "beta": config.scoring.beta,
        },
        "base_gate": run.read_json("eval", "gates", f"{pop.base.name}.json")["accuracy"],
        "extensions": extensions,
        "timings": run.timings(),
    }
    results["figures"] = draw_curves(run, extensions)
    return run.write_report(results, format_report(results))


def setting_row(run: RunFolder, arm: Arm) -> dict:
    """A run's (or start model's) row: its evaluation's outcomes and, for a run, its training record's
    steps, step time, fresh steps and void rule."""
    from ..common.family import TRAINING_RECORD

    found = run.read_json("eval", "finetuned", f"{arm.name}.json")
    accuracy = {n: v["accuracy"] for n, v in found["lines"].items()}
    likelihood = [sum(v) / len(v) for v in found["log_likelihood"].values()]
    beyond = found.get("beyond_start")
    row = {
        "run": arm.name,
        "setting": arm.setting.name,
        "method": arm.method,
        "seed": arm.seed,
        "accuracy": accuracy,
        "primary_accuracy": sum(accuracy.values()) / len(accuracy),
        "acc_start": found["acc_start"]["accuracy"],
        "beyond_start": sum(v["accuracy"] for v in beyond.values()) / len(beyond) if beyond else None,
        "recall": found["recall"]["accuracy"] if found.get("recall") else None,
        "needle": found["needle"]["accuracy"],
        "log_likelihood": sum(likelihood) / len(likelihood),
        "ppl": found["ppl"],
        "longppl": found["longppl"],
        "step_seconds": None,
        "void": False,
    }
    if arm.method != START:
        trained = run.read_json("models", "finetuned", arm.name, TRAINING_RECORD)
        row.update(
            steps=trained["steps"],
            step_seconds=trained["step_seconds"]["median"],
            fresh=trained.get("fresh"),
            void=bool(trained["void"]["void"]),
            void_rule=trained["void"],
            curve=trained["curve"],
        )
    return row


def settings_report(config: Comparison, pop: Population, run: RunFolder, selection: Selection) -> dict:
    """``results.json`` and ``report.md`` of a config with settings, from the records alone
    (``eval/finetuned/``, each run's training record, ``timings.json``): per setting the start model,
    every evaluated run, void runs and arms, mean and sd per arm and the plan's paired differences
    with their t intervals; the pooled statistics over the settings in the records; the plan's
    decisions (``longppl_reproduce.longce_comparison.settings_report``). A setting, seed or arm not in the
    records is listed as missing and left out."""
    from . import settings_report as analysis

    seeds = list(selection.seeds or config.finetune.seeds)
    methods = list(config.finetune.methods)
    settings = {}
    for setting in chosen_settings(config, selection.settings):
        start = Arm(setting.extension, START, 0, False, setting)
        runs = arms(config, seeds=seeds, selection=Selection(settings=(setting.name,)))
        done = [a for a in runs if run.has("eval", "finetuned", f"{a.name}.json")]
        rows = [setting_row(run, a) for a in done]
        start_row = setting_row(run, start) if run.has("eval", "finetuned", f"{start.name}.json") else None
        settings[setting.name] = {
            "setting": dataclasses.asdict(setting),
            "start": start_row,
            "runs": rows,
            "missing": [a.name for a in runs if a not in done],
            **analysis.analyse_setting(rows, start_row, methods, len(seeds), config.level),
        }
    if analysis.absent_settings(settings) == list(settings):  # not one setting in the records
        raise ValueError(
            f"No evaluation records of settings {', '.join(settings)} in {run.path('eval', 'finetuned')}: run the "
            "'evaluate' stage, or untar the device's records-<phase>.tgz into --output-dir."
        )
    pooled = analysis.pool_settings(settings, config.level)
    decisions = analysis.decide({name: found["differences"] for name, found in settings.items()}, pooled)
    results = {
        "command": command_line("longppl-reproduce-longce"),
        "config": dataclasses.asdict(config),
        "seeds": seeds,
        "settings": settings,
        "pooled": pooled,
        "decisions": decisions,
        "timings": run.timings(),
    }
    results["figures"] = draw_curves(run, {name: found for name, found in settings.items() if found["runs"]})
    return run.write_report(results, analysis.format_settings_report(results))


def draw_curves(run: RunFolder, extensions: dict) -> list[str]:
    """Mean primary accuracy against fine-tuning steps, a line per run, a colour per method (none
    without matplotlib; ``results.json`` holds the curves)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    from longppl.atomic_files import write_file_atomically

    drawn = []
    for name, found in extensions.items():
        colours = {}
        figure, axis = plt.subplots(figsize=(6, 4))
        for row in found["runs"]:
            colour = colours.setdefault(row["method"], f"C{len(colours)}")
            axis.plot(
                [p["step"] for p in row["curve"]],
                [p["mean"] for p in row["curve"]],
                color=colour,
                alpha=0.8,
                marker="o",
                markersize=3,
            )
        for method, colour in colours.items():
            axis.plot([], [], color=colour, label=method)
        axis.set_xlabel("fine-tuning step")
        axis.set_ylabel("primary lines accuracy")
        axis.set_ylim(-0.02, 1.02)  # a fraction: autoscaling would blow one right answer up to a spike
        axis.legend(title="method")
        figure.tight_layout()
        path = run.path("figures", f"accuracy_vs_steps-{name}.png")
        write_file_atomically(
            path, lambda handle, figure=figure: figure.savefig(handle, format="png", dpi=120), binary=True
        )
        plt.close(figure)
        drawn.append(os.path.relpath(path, run.root))
    return drawn


def _table(rows: list[dict]) -> list[str]:
    out = ["| run | method | seed | steps | lr | primary acc | acc512 | needle | answer LL | PPL | LongPPL | step ms |"]
    out.append("|---" * 12 + "|")
    for r in rows:
        out.append(
            f"| {r['run']} | {r['method']} | {r['seed']} | {r['steps']} | {r['lr']:g} | {fmt(r['primary_accuracy'])} | "
            f"{fmt(r['acc512'])} | {fmt(r['needle'])} | {fmt(r['log_likelihood'])} | {fmt(r['ppl'], 2)} | "
            f"{fmt(r['longppl'], 2)} | {fmt(r['step_seconds'] * 1e3, 1)} |"
        )
    return out


def _comparison_tables(found: dict) -> list[str]:
    out = ["| method | " + " | ".join(MEASURES) + " |", "|---" * (len(MEASURES) + 1) + "|"]
    for method, summary in found["summary"].items():
        cells = [f"{fmt(s['mean'])} ± {fmt(s['sd'])}" if s["n"] else "n/a" for s in summary.values()]
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| paired difference (95% t interval) | " + " | ".join(MEASURES) + " |",
        "|---" * (len(MEASURES) + 1) + "|",
    ]
    for pair, entry in found["differences"].items():
        cells = [
            f"{fmt(d['value'])} [{fmt(d['low'])}, {fmt(d['high'])}]" if "value" in d else "n/a" for d in entry.values()
        ]
        out.append(f"| {pair} | " + " | ".join(cells) + " |")
    return out


def format_report(results: dict) -> str:
    """``report.md``: per extension, the extended base, the void rule, every run, mean ± sd per
    method, the paired differences, the verdict, the rerun; wall times."""
    out = ["# LongCE against CE from a base that keeps the task", "", "```", results["command"], "```", ""]
    evaluators = results["evaluators"]
    out.append(
        f"B's gate accuracy: {fmt(results['base_gate'])}. LongPPL evaluator: "
        + (
            f"{evaluators['E2']}, the second evaluator."
            if evaluators["E2"]
            else f"{evaluators['E1']}, the first evaluator (none for the cache method, which it weighted)."
        )
        + " Key tokens: K {trunc_len}, d {sliding_window}, LSD > {alpha:g}, LCL > {beta:g}.".format(
            **results["longppl"]
        )
    )
    reported, configured = results["seeds"]["finetune"], results["seeds"]["configured"]
    if reported != configured:
        missing = [seed for seed in configured if seed not in reported]
        out.append(
            f"Seeds reported: {len(reported)} of the {len(configured)} configured ({', '.join(map(str, reported))}; "
            f"not reported: {', '.join(map(str, missing))})."
        )
    for name, found in results["extensions"].items():
        base, void = found["extended_base"]["benchmark"], found["void"]
        out += ["", f"## {name}", ""]
        out.append(
            f"Extended base, no fine-tuning: accuracy at 512 {fmt(base['acc512'])}, primary {fmt(base['mean'])}."
        )
        out.append(
            f"Void rule: CE's accuracy at 512 at step {void['at_step']} is {fmt(void['ce_acc512'])} against a threshold of "
            f"{fmt(void['threshold'])}: " + ("**void**" if void["void"] else "not void") + "."
        )
        if found["rerun_due"]:
            out.append(
                "The accuracy comparison is void: the rerun at the rerun's learning rate is due (stage `rerun`)."
            )
        out += ["", *_table(found["runs"]), "", *_comparison_tables(found), "", f"**Verdict: {found['verdict']}.**"]
        if found["rerun"]:
            rerun, void = found["rerun"], found["rerun"]["void"]
            out += ["", "### Rerun", "", *_table(rerun["runs"]), "", *_comparison_tables(rerun), ""]
            out.append(
                f"Void rule of the rerun: CE's accuracy at 512 {fmt(void['ce_acc512'])}, threshold "
                f"{fmt(void['threshold'])}. Verdict of the rerun: {rerun['verdict']}."
            )
    return "\n".join(out + closing_sections(results)) + "\n"
