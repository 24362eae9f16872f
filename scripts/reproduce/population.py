"""LongPPL against long-context ability over a population of context extensions (the second attempt).

    python scripts/reproduce_longppl.py --config configs/reproduce/population_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2/

A base model B is trained from scratch at a short context, then extended to the evaluation length
``L`` by several methods (PI, NTK-aware, YaRN, ABF, EABF), each fine-tuned for several step counts:
the population differs in long-context ability while its short-context training is shared.
Evaluators (E1, optionally E2, ...) are trained apart, at ``L``, and are not members. Each evaluator
calibrates its own alpha before any member is scored; the analysis plan (exclusions, statistics) is
in the config: ``analysis.plan`` ``second`` (this module's report) or ``third`` (the third attempt's,
``longppl_reproduce.third_attempt``: format-only exclusion, a composite of lines, needle and the
two-hop task of ``longppl_reproduce.two_hop``, clusters = configurations, a decision rule).

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
import dataclasses
import json
import math
import os
import time
from fractions import Fraction

from longppl.commandline.running import command_line, run_command, tool_parser

from .config import Population, folder_name, read_population
from .report_text import closing_sections, fmt
from .run_folder import RunFolder, finite
from .stages import (  # stage_tokenizer, stage_data, stage_base, stage_calibrate: main runs stages by name
    batches,
    benchmark_results,
    cache_scores,
    calibrated_alpha,
    calibration_parts,
    check_gate,
    device_of,
    evaluator_cache,
    extended_config,
    gate_specs,
    load_member,
    load_tokenizer,
    longppl_of,
    model_folder,
    parse_stages,
    pretrain,
    read_benchmark_cases,
    read_cases,
    selected_evaluators,
    stage_base,  # noqa: F401
    stage_calibrate,  # noqa: F401
    stage_data,  # noqa: F401
    stage_tokenizer,  # noqa: F401
)

STAGES = (
    "tokenizer",
    "data",
    "base",
    "evaluators",
    "members",
    "calibrate",
    "evaluate",
    "answer_tokens",
    "report",
    "export",
)


# ------------------------------------------------------------------ training


def member_folder(run: RunFolder, name: str) -> str:
    return os.path.dirname(run.path("models", "members", name, "x"))


def stage_evaluators(config: Population, run: RunFolder, members=None, evaluators=None) -> None:
    for spec in selected_evaluators(config, evaluators):
        pretrain(config, run, spec)


def parse_shard(value: str) -> tuple[int, int]:
    """``"i/n"`` (``0 <= i < n``) as ``(i, n)``: the i-th of n interleaved slices of the members."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{value!r} is not a shard; give i/n with 0 <= i < n, e.g. 0/4")
    return index, count


def selected_members(config: Population, names, shard: tuple[int, int] | None = None):
    """The members named in ``names`` (all when empty), in the config's order; with ``shard``
    ``(i, n)`` only every n-th of them from the i-th (interleaved, so that each slice holds every
    step count: one process per GPU gets about equal work)."""
    members = config.members()
    known = [m.name for m in members]
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"--members names {unknown}, which are not members of the config's population: {known}.")
    chosen = [m for m in members if names is None or m.name in names]
    return chosen[shard[0] :: shard[1]] if shard else chosen


def claim_order(members: list) -> list:
    """The order processes sharing a call (``--claim``) take members in: every first seed before any
    second one (config order within), so that a call cut short leaves whole replicates undone
    rather than whole configurations."""
    return sorted(members, key=lambda m: m.replicate)


def claimed(run: RunFolder, claim: str | None, stage: str, member: str) -> bool:
    """With ``claim`` (``--claim``, one id per call shared by the processes working side by side):
    whether ANOTHER process of this call has taken ``member`` for ``stage``; else this process takes
    it now (the file ``claims/<claim>/<stage>/<member>`` is created exclusively, so exactly one
    process gets each member). Without ``claim``: ``False``. Claims of an earlier call (another id)
    are ignored, so a member a cut-off call left half done is taken up again."""
    if not claim:
        return False
    path = run.path("claims", claim, stage, member)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    return False


def stage_members(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from .family import Variant, is_trained, train_variant

    base = model_folder(run, config.base.name)
    if not is_trained(base):
        raise ValueError(f"The base {config.base.name} is not trained ({base}): run the 'base' stage first.")
    check_gate(config, run, config.base)
    tokenizer = load_tokenizer(run)
    chosen = selected_members(config, members)
    for member in claim_order(chosen) if claim else chosen:
        folder = member_folder(run, member.name)
        if is_trained(folder):
            run.log(f"members: {member.name} trained, kept")
            continue
        if claimed(run, claim, "members", member.name):
            continue
        model_config, attention = extended_config(config, base, member.extension)
        training = dataclasses.replace(config.finetune.training, steps=member.steps)
        variant = Variant(
            member.name,
            {"base": config.base.name, "extension": dataclasses.asdict(member.extension)},
            training.settings(member.seed),
        )

        def start(model_config=model_config, attention=attention):
            return AutoModelForCausalLM.from_pretrained(base, config=model_config, attn_implementation=attention)

        run.log(f"members: {member.name} ({member.extension.method}, {member.steps} steps, seed {member.seed})")
        mix = config.finetune.mix
        with run.timed("train", member.name):
            train_variant(
                variant,
                tokenizer,
                batches(run, training.seq_len, mix, member.seed),
                folder,
                device_of(config),
                run.log,
                start_from=start,
            )


# ------------------------------------------------------------------ evaluation


def longppl_columns(config: Population, run: RunFolder, alpha: float) -> dict[str, dict]:
    """``{column: {cache, alpha, beta, soft}}``: what LongPPL of every member is computed with."""
    scoring, first = config.scoring, config.evaluators[0].name
    primary = evaluator_cache(config, run, first, scoring.primary, "validation")
    columns = {
        "primary": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": False},
        "secondary": {
            "cache": evaluator_cache(config, run, first, scoring.secondary, "validation"),
            "alpha": alpha,
            "beta": scoring.beta,
            "soft": False,
        },
        "soft": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": True},
    }
    for a in (alpha, *scoring.sensitivity_alphas):
        for b in scoring.sensitivity_betas:
            columns[f"alpha={a:g},beta={b:g}"] = {"cache": primary, "alpha": a, "beta": b, "soft": False}
    for spec in config.evaluators[1:]:
        if spec.enabled:  # each evaluator with the alpha it calibrated itself
            own = calibrated_alpha(run, calibration_parts(config, spec.name))
            cache = evaluator_cache(config, run, spec.name, scoring.primary, "validation")
            columns[f"primary:{spec.name}"] = {"cache": cache, "alpha": own, "beta": scoring.beta, "soft": False}
    return columns


def stage_evaluate(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from .family import is_trained

    chosen = selected_members(config, members)
    pending = [
        m for m in (claim_order(chosen) if claim else chosen) if not run.has("eval", "members", f"{m.name}.json")
    ]
    if not pending:
        return
    alpha = calibrated_alpha(run)
    columns = longppl_columns(config, run, alpha)
    caches = {column["cache"]: cache_scores(column["cache"]) for column in columns.values()}
    cases = read_benchmark_cases(config, run)
    for member in pending:
        path = ("eval", "members", f"{member.name}.json")
        folder = member_folder(run, member.name)
        if not is_trained(folder):
            if claim:  # another process of this call may still be training it: left for a later pass
                run.log(f"evaluate: {member.name} is not trained yet, left for a later pass")
                continue
            raise ValueError(f"Member {member.name} is not trained ({folder}): run the 'members' stage first.")
        if claimed(run, claim, "evaluate", member.name):
            continue
        start = time.perf_counter()
        model, tokenizer = load_member(folder, device_of(config))
        evaluation = config.evaluation
        record = {"member": member.name, "seed": member.seed, "steps": member.steps}
        record["extension"] = dataclasses.asdict(member.extension)
        record.update(benchmark_results(model, tokenizer, cases, config))
        record["longppl"] = longppl_of(
            model, tokenizer, columns, caches, config.scoring.gamma, evaluation.max_tokens_per_batch
        )
        seconds = time.perf_counter() - start
        record["seconds"] = seconds
        run.write_json(record, *path)
        run.add_seconds("evaluate", member.name, seconds)
        mean = sum(v["accuracy"] for v in record["lines"].values()) / len(record["lines"])
        run.log(
            f"evaluate: {member.name} primary accuracy {mean:.3f}, LongPPL {record['longppl']['primary']['longppl']:.3f}, "
            f"PPL {record['longppl']['primary']['ppl']:.3f} ({seconds:.1f}s)"
        )


def stage_answer_tokens(config: Population, run: RunFolder, members=None) -> None:
    """Figure 5(b) on E1: answer tokens vs the other answer-side tokens, by LSD alone and LSD + LCL,
    at the configured alphas and the calibrated one (counts, for Wilson intervals)."""
    if run.has("eval", "answer_tokens.json"):
        return
    import numpy as np

    from longppl.settings import WindowSettings

    from . import answer_tokens

    alpha = calibrated_alpha(run)
    evaluator = config.evaluators[0].name
    model, tokenizer = load_member(model_folder(run, evaluator), device_of(config))
    window = WindowSettings(config.scoring.primary.trunc_len, config.scoring.primary.sliding_window)
    scored = answer_tokens.answer_token_scores(model, tokenizer, read_cases(run, "answer_tokens.jsonl"), window=window)
    lsd, lcl, is_answer = (np.asarray(scored[k]) for k in ("lsd", "lcl", "is_answer"))
    by_alpha = {
        f"{a:g}": answer_tokens.classify_answer_tokens(lsd, lcl, is_answer, alpha=a, beta=config.scoring.beta)
        for a in dict.fromkeys((*config.answer_tokens.alphas, alpha))
    }
    record = {"evaluator": evaluator, "calibrated_alpha": alpha, "tokens": int(lsd.size)}
    record.update(answer_tokens=int(is_answer.sum()), by_alpha=by_alpha)
    run.write_json(record, "eval", "answer_tokens.json")
    run.log(f"answer_tokens: {record['answer_tokens']} answer tokens of {record['tokens']}")


# ------------------------------------------------------------------ report


def member_row(member, record: dict, analysis) -> dict:
    """A member's row of the results table."""
    primary = record["longppl"]["primary"]
    per_length = {n: v["accuracy"] for n, v in record["lines"].items()}
    outputs = sum(v["total"] for v in record["lines"].values())
    from .third_attempt import no_answer_shape_share

    row = {
        "member": member.name,
        "method": member.extension.method,
        "extension": member.extension.name,
        "configuration": member.configuration,
        "control": member.extension.control,
        "factor": member.extension.factor,
        "rope_theta": member.extension.rope_theta,
        "steps": member.steps,
        "seed": member.seed,
        "acc512": record["acc512"]["accuracy"],
        "accuracy": per_length,
        # exact fractions, rounded once: members with equal counts tie exactly (a float sum's last bit
        # depends on the order of the lengths, and Spearman's average ranks see the difference)
        "primary_accuracy": float(
            sum(Fraction(v["correct"], v["total"]) for v in record["lines"].values()) / len(record["lines"])
        ),
        "no_number_share": sum(v["no_number"] for v in record["lines"].values()) / outputs,
        "no_answer_shape_share": no_answer_shape_share(record),
        "needle": record["needle"]["accuracy"],
        "two_hop": record["two_hop"]["accuracy"] if "two_hop" in record else None,
        "log_likelihood": {n: float(sum(v) / len(v)) for n, v in record["log_likelihood"].items()},
        "mean_log_likelihood": float(
            sum(sum(v) for v in record["log_likelihood"].values())
            / sum(len(v) for v in record["log_likelihood"].values())
        ),
        "ppl": primary["ppl"],
        "longppl": primary["longppl"],
        "longppl_secondary": record["longppl"]["secondary"]["longppl"],
        "soft_longppl": record["longppl"]["soft"]["longppl"],
        "key_tokens": primary["key_tokens"],
        "sensitivity": {k: v["longppl"] for k, v in record["longppl"].items() if k.startswith("alpha=")},
        **{
            f"longppl:{k[len('primary:') :]}": v["longppl"]
            for k, v in record["longppl"].items()
            if k.startswith("primary:")
        },
        "intervals": {
            "ppl": document_interval(primary["documents"]["nll"], primary["documents"]["tokens"], analysis),
            "longppl": document_interval(primary["documents"]["key_nll"], primary["documents"]["key_tokens"], analysis),
        },
        "seconds": record["seconds"],
    }
    return row


def document_interval(nll, counts, analysis) -> dict:
    """A percentile bootstrap interval over documents of the corpus perplexity
    ``exp(sum nll / sum counts)`` (documents resampled with replacement; ``nll[i]`` and ``counts[i]``
    are document ``i``'s summed negative log-likelihood and token count, or key-token weight)."""
    import numpy as np

    nll, counts = np.asarray(nll, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    rng = np.random.default_rng(analysis.seed)
    picks = rng.integers(0, nll.shape[0], size=(analysis.resamples, nll.shape[0]))
    totals = counts[picks].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = np.exp(nll[picks].sum(axis=1) / totals)[totals > 0]
    value = math.exp(nll.sum() / counts.sum()) if counts.sum() > 0 else float("nan")
    tail = (1 - analysis.level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail]) if samples.size else (float("nan"), float("nan"))
    return {"value": value, "low": float(low), "high": float(high), "level": analysis.level}


def exclusion(row: dict, base_acc512: float, analysis) -> str | None:
    """Why ``row`` is left out of the analysis (the plan's rules), or ``None``."""
    if row["acc512"] < analysis.min_acc512_ratio * base_acc512:
        return (
            f"accuracy at 512 tokens {row['acc512']:.3f} is below {analysis.min_acc512_ratio:g} of the base's "
            f"{base_acc512:.3f}"
        )
    if row["no_number_share"] > analysis.max_no_number_share:
        return f"{row['no_number_share']:.0%} of its lines outputs hold no number"
    return None


def statistics_of(
    rows: list[dict], analysis, measure: str = "longppl", benchmark: str = "primary_accuracy", share: bool = True
) -> dict:
    """The plan's statistics over ``rows``: correlations of ``measure`` (LongPPL) and PPL with
    ``benchmark`` (bootstrap intervals, over members and clustered by extension method), their
    paired difference, Williams' t, the partial correlation given acc512, and the inconclusive flag
    with its reasons: fewer than ``analysis.min_members`` members, or (for a benchmark that is a
    ``share`` in [0, 1], i.e. an accuracy) more than ``analysis.inconclusive_share`` of them at its
    floor or ceiling. A log-likelihood has neither, so ``share=False`` leaves that count out
    (``at_floor_or_ceiling`` is ``None``)."""
    from . import statistics

    usable = [r for r in rows if finite(r[measure]) and finite(r["ppl"]) and finite(r[benchmark])]
    if len(usable) < 3:
        return {
            "members": [r["member"] for r in usable],
            "skipped": f"{len(usable)} members with a finite {measure}, PPL and {benchmark}; 3 are needed",
            "inconclusive": True,
        }
    longppl = [r[measure] for r in usable]
    ppl = [r["ppl"] for r in usable]
    accuracy = [r[benchmark] for r in usable]
    clusters = [r["method"] for r in usable]
    common = analysis.bootstrap
    found = {"members": [r["member"] for r in usable], "n": len(usable)}
    for method in ("pearson", "spearman"):
        found[method] = {
            "longppl": statistics.bootstrap_correlation(longppl, accuracy, method, **common),
            "ppl": statistics.bootstrap_correlation(ppl, accuracy, method, **common),
            "difference": statistics.paired_bootstrap_difference(longppl, ppl, accuracy, method, **common),
            "longppl_by_method": statistics.bootstrap_correlation(
                longppl, accuracy, method, clusters=clusters, **common
            ),
            "ppl_by_method": statistics.bootstrap_correlation(ppl, accuracy, method, clusters=clusters, **common),
            "difference_by_method": statistics.paired_bootstrap_difference(
                longppl, ppl, accuracy, method, clusters=clusters, **common
            ),
        }
    r_ay, r_by = found["pearson"]["longppl"]["value"], found["pearson"]["ppl"]["value"]
    r_ab = statistics.correlation(longppl, ppl)
    if not all(finite(r) for r in (r_ay, r_by, r_ab)):  # a side without variance (e.g. every accuracy 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "a correlation is undefined"}
    elif abs(r_ab) >= 1 - 1e-12:  # the two measures rank alike: nothing to compare (the test divides by 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "|r(LongPPL, PPL)| = 1"}
    else:
        found["williams_t"] = statistics.williams_t(r_ay, r_by, r_ab, len(usable))
    found["partial_given_acc512"] = statistics.bootstrap_partial_correlation(
        longppl, accuracy, [r["acc512"] for r in usable], **common
    )
    reasons = []
    if len(usable) < analysis.min_members:
        reasons.append(f"{len(usable)} members analysed, fewer than the {analysis.min_members} the plan needs")
    extreme = int(sum(a <= analysis.floor or a >= analysis.ceiling for a in accuracy)) if share else None
    if share and extreme > analysis.inconclusive_share * len(usable):
        reasons.append(
            f"{extreme} of {len(usable)} members at <= {analysis.floor} or >= {analysis.ceiling}, "
            f"more than {analysis.inconclusive_share:.0%}"
        )
    found.update(inconclusive=bool(reasons), inconclusive_reasons=reasons, at_floor_or_ceiling=extreme)
    return found


def sensitivity_statistics(rows: list[dict], analysis, benchmark: str = "primary_accuracy") -> dict:
    """Pearson and Spearman correlations (bootstrap intervals over members) of every other
    measure in the rows with ``benchmark``: LongPPL at each (alpha, beta) of the sensitivity grid,
    with the secondary window, the soft (LongCE-weighted) LongPPL, and PPL for reference.

    Returns ``{measure: {"pearson": ..., "spearman": ...}}`` (``statistics.bootstrap_correlation``
    records); a measure some row lacks or holds as non-finite is left out."""
    from . import statistics

    measures = {
        f"LongPPL {k}": [r["sensitivity"].get(k) for r in rows] for k in (rows[0]["sensitivity"] if rows else ())
    }
    measures.update(
        {
            "LongPPL, secondary window": [r["longppl_secondary"] for r in rows],
            "soft LongPPL": [r["soft_longppl"] for r in rows],
            "PPL": [r["ppl"] for r in rows],
        }
    )
    accuracy = [r[benchmark] for r in rows]
    common = analysis.bootstrap
    return {
        name: {
            method: statistics.bootstrap_correlation(values, accuracy, method, **common)
            for method in ("pearson", "spearman")
        }
        for name, values in measures.items()
        if len(rows) >= 3 and all(finite(v) for v in values)
    }


def verdict(found: dict, analysis) -> dict:
    """The plan's outcome for the primary statistics ``found`` (:func:`statistics_of`):
    ``"inconclusive"`` by its rules; ``"reproduced"`` when LongPPL's Pearson r with the accuracy is at
    most ``analysis.success_max_r``, the upper end of its interval below ``analysis.success_max_high``
    and the whole interval of r(LongPPL) - r(PPL) below 0; else ``"not reproduced"``. Each condition
    is returned with whether it holds, so the report shows why."""
    if "skipped" in found:
        return {"outcome": "inconclusive", "conditions": [], "reasons": [found["skipped"]]}
    r, difference = found["pearson"]["longppl"], found["pearson"]["difference"]
    conditions = [
        (
            f"Pearson r(LongPPL, accuracy) {r['value']:.3f} <= {analysis.success_max_r}",
            r["value"] <= analysis.success_max_r,
        ),
        (
            f"its {analysis.level:.0%} upper bound {r['high']:.3f} < {analysis.success_max_high}",
            r["high"] < analysis.success_max_high,
        ),
        (f"r(LongPPL) - r(PPL): interval's upper bound {difference['high']:.3f} < 0", difference["high"] < 0),
    ]
    if found["inconclusive"]:
        outcome = "inconclusive"
    else:
        outcome = "reproduced" if all(held for _, held in conditions) else "not reproduced"
    return {
        "outcome": outcome,
        "conditions": [{"condition": text, "holds": bool(held)} for text, held in conditions],
        "reasons": found["inconclusive_reasons"],
    }


def results_header(config: Population) -> dict:
    """What every ``results.json`` starts with: the command line, the config and every seed."""
    return {
        "command": command_line("longppl-reproduce"),
        "config": dataclasses.asdict(config),
        "seeds": {
            "run": config.seed,
            config.base.name: config.base.seed,
            **{e.name: e.seed for e in config.evaluators if e.enabled},
            **{m.name: m.seed for m in config.members()},
        },
    }


def stage_report(config: Population, run: RunFolder, members=None) -> dict:
    if config.analysis.plan == "third":
        from . import third_attempt

        return third_attempt.report(config, run)
    rows = []
    base_gate = run.read_json("eval", "gates", f"{config.base.name}.json")
    for member in config.members():
        row = member_row(member, run.read_json("eval", "members", f"{member.name}.json"), config.analysis)
        reason = exclusion(row, base_gate["accuracy"], config.analysis)
        row.update(excluded=reason is not None, exclusion_reason=reason)
        rows.append(row)
    analysed = [r for r in rows if not r["excluded"]]
    results = {
        **results_header(config),
        "gates": {
            spec.name: _without_outputs(run.read_json("eval", "gates", f"{spec.name}.json"))
            for spec in gate_specs(config)
        },
        "calibration": run.read_json("eval", "calibration.json"),
        "members": rows,
        "statistics": {
            "analysed": statistics_of(analysed, config.analysis),
            "all": statistics_of(rows, config.analysis),
        },
        # secondary: no success claim rests on these
        "secondary_statistics": {
            "needle": statistics_of(analysed, config.analysis, benchmark="needle"),
            "log_likelihood": statistics_of(analysed, config.analysis, benchmark="mean_log_likelihood", share=False),
            **{
                f"longppl:{e.name}": statistics_of(analysed, config.analysis, measure=f"longppl:{e.name}")
                for e in config.evaluators[1:]
                if e.enabled
            },
        },
        "answer_tokens": with_wilson_intervals(run.read_json("eval", "answer_tokens.json"), config.analysis.level),
        "timings": run.timings(),
    }
    results["sensitivity"] = sensitivity_statistics(analysed, config.analysis)
    results["verdict"] = verdict(results["statistics"]["analysed"], config.analysis)
    results["figures"] = draw_figure(run, analysed)
    return run.write_report(results, format_report(results))


def with_wilson_intervals(record: dict, level: float) -> dict:
    """The answer-token record with Wilson intervals of each rule's recall (over the answer tokens)
    and specificity (over the others), from the counts behind them."""
    from .statistics import wilson_interval

    for found in record["by_alpha"].values():
        for rule in ("lsd", "lsd+lcl"):
            for rate, total in (("recall", found["n_answer"]), ("specificity", found["n_other"])):
                value = found[rule][rate]
                if total and finite(value):
                    found[rule][f"{rate}_interval"] = wilson_interval(round(value * total), total, level)
    return record


def _without_outputs(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "outputs"}


def draw_figure(run: RunFolder, rows: list[dict]) -> list[str]:
    """The Figure 1(b) scatter of the analysed members (none without matplotlib or with < 2 members)."""
    rows = [r for r in rows if finite(r["longppl"]) and finite(r["ppl"])]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    if len(rows) < 2:
        return []
    from longppl.commandline.figures import correlation_scatter

    path = run.path("figures", "correlation.png")
    names = [r["member"] for r in rows]
    correlation_scatter(
        path,
        names,
        [r["longppl"] for r in rows],
        [r["ppl"] for r in rows],
        [r["primary_accuracy"] for r in rows],
        "primary lines accuracy",
    )
    return [os.path.relpath(path, run.root)]


def _pair(bounds) -> str:
    return f"[{fmt(bounds[0])}, {fmt(bounds[1])}]" if bounds else "[n/a]"


def _interval(found: dict) -> str:
    return f"{fmt(found['value'], 2)} [{fmt(found['low'], 2)}, {fmt(found['high'], 2)}]"


def format_report(results: dict) -> str:
    """``report.md``: the members' table, exclusions, the statistics, the answer tokens, wall times."""
    out = ["# LongPPL over a population of context extensions", "", "```", results["command"], "```", ""]
    out += [f"Calibrated alpha: **{results['calibration']['alpha']}**.", ""]
    out += ["PPL and LongPPL with their bootstrap intervals over documents; LongPPL (K2): the secondary window.", ""]
    out += [
        "| member | method | steps | seed | acc512 | primary acc | needle | PPL | LongPPL | LongPPL (K2) | key tokens | excluded |"
    ]
    out += ["|---" * 12 + "|"]
    for r in results["members"]:
        out.append(
            f"| {r['member']} | {r['method']} | {r['steps']} | {r['seed']} | {fmt(r['acc512'])} | "
            f"{fmt(r['primary_accuracy'])} | {fmt(r['needle'])} | {_interval(r['intervals']['ppl'])} | "
            f"{_interval(r['intervals']['longppl'])} | "
            f"{fmt(r['longppl_secondary'], 2)} | {r['key_tokens']:.0f} | {r['exclusion_reason'] or ''} |"
        )
    sections = [(f"{label} members, primary accuracy", found) for label, found in results["statistics"].items()]
    sections += [(f"secondary: {label}", found) for label, found in results["secondary_statistics"].items()]
    for label, found in sections:
        out += ["", f"## Statistics ({label})", ""]
        if "skipped" in found:
            out.append(f"Skipped: {found['skipped']}.")
            continue
        out += ["| correlation | LongPPL | PPL | LongPPL - PPL (p) |", "|---|---|---|---|"]
        for method in ("pearson", "spearman"):
            for suffix, label_ in (("", "members"), ("_by_method", "clusters: methods")):
                lp, p, d = (found[method][k + suffix] for k in ("longppl", "ppl", "difference"))
                out.append(
                    f"| {method} ({label_}) | {fmt(lp['value'])} [{fmt(lp['low'])}, {fmt(lp['high'])}] | "
                    f"{fmt(p['value'])} [{fmt(p['low'])}, {fmt(p['high'])}] | {fmt(d['value'])} ({fmt(d['p_two_sided'])}) |"
                )
        w, partial = found["williams_t"], found["partial_given_acc512"]
        out += [
            "",
            f"Williams' t {fmt(w['t'])} (p {fmt(w['p_two_sided'])}); partial r given acc512 "
            f"{fmt(partial['value'])} [{fmt(partial['low'])}, {fmt(partial['high'])}].",
        ]
        reasons = "; ".join(found["inconclusive_reasons"]) or "no rule applies"
        out.append(f"Inconclusive: {found['inconclusive']} ({reasons}).")
    out += ["", "## Sensitivity (analysed members, primary accuracy)", ""]
    out += ["| measure | Pearson | Spearman |", "|---|---|---|"]
    for name, found in results["sensitivity"].items():
        out.append(f"| {name} | {_interval(found['pearson'])} | {_interval(found['spearman'])} |")
    decided = results["verdict"]
    out += ["", f"## Outcome by the analysis plan: **{decided['outcome']}**", ""]
    out += [f"- {c['condition']}: {'holds' if c['holds'] else 'does not hold'}" for c in decided["conditions"]]
    out += [f"- inconclusive: {reason}" for reason in decided["reasons"]]
    answer = results["answer_tokens"]
    out += [
        "",
        f"## Answer tokens (evaluator {answer['evaluator']}, {answer['answer_tokens']} of {answer['tokens']} tokens)",
        "",
    ]
    for alpha, found in answer["by_alpha"].items():
        for rule in ("lsd", "lsd+lcl"):
            got = found[rule]
            recall, specificity = got.get("recall_interval"), got.get("specificity_interval")
            out.append(
                f"- alpha {alpha}, {rule}: balanced accuracy {fmt(got['balanced_accuracy'])}; recall "
                f"{fmt(got['recall'])} {_pair(recall)}, specificity {fmt(got['specificity'])} {_pair(specificity)} "
                f"({found['n_answer']} answer, {found['n_other']} other tokens)"
            )
    return "\n".join(out + closing_sections(results)) + "\n"


# ------------------------------------------------------------------ export


def stage_export(config: Population, run: RunFolder, members=None, export_dir: str | None = None) -> None:
    """B and E1 in bf16 with shards of at most 15 MB (plus the tokenizer) into ``export_dir``."""
    if not export_dir:
        raise ValueError("The 'export' stage needs --export-dir (a folder for the exported models).")
    import torch

    from longppl.atomic_files import replace_directory_atomically

    for spec in (config.base, config.evaluators[0]):
        target = os.path.join(os.path.abspath(export_dir), spec.name)
        if os.path.exists(target):
            if os.path.isfile(os.path.join(target, "exported.json")):
                run.log(f"export: {target} exists, kept")
                continue
            raise ValueError(f"--export-dir: {target} exists and was not written by an export; give another folder.")
        model, tokenizer = load_member(model_folder(run, spec.name), "cpu")
        model = model.to(torch.bfloat16)

        def write(tmp: str, model=model, tokenizer=tokenizer, spec=spec) -> None:
            model.save_pretrained(tmp, max_shard_size="15MB")
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, "exported.json"), "w", encoding="utf-8") as handle:
                json.dump({"model": spec.name, "seed": spec.seed, "dtype": "bfloat16"}, handle)

        os.makedirs(os.path.dirname(target), exist_ok=True)
        replace_directory_atomically(target, write)
        run.log(f"export: {spec.name} -> {target}")


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
        return globals()[f"stage_{stage}"](config, run, members, **extra)

    return run.run_stages(args.stages, run_stage)


def cli(argv=None) -> int:
    """The ``longppl-reproduce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
