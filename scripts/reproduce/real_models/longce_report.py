"""The statistics and decisions of "LongCE from a real start" (docs/reproduction.md, its analysis plan:
"Arms", "Outcomes", "Void rule, statistics and decisions"), from the device phases' records alone
(``longce_start``'s ``<run>/records/longce_*.jsonl``).

- :func:`start_rows`: one row per run (start x arm x seed) with its outcomes at the primary
  checkpoint (the last), its primary outcome at every checkpoint, its compute and the plan's void
  rule (not applied to a start that failed the gate); the start model's row the same way.
- :func:`analyse`: per start the paired t intervals across seeds
  (``common.arm_comparison.analyse_arms``, the three-setting study's mechanism too, with
  this plan's pairs, outcomes and no arm-level void), every arm against the start model, Holm's
  correction over the four decided contrasts (:func:`holm_family`) and the compute per arm; the
  pooled means over the starts (``pool_clusters``); the decisions (:func:`decide`); beside them the
  exploratory case-resampled intervals (``longce_cases``), which decide nothing.
- :func:`format_report`: ``longce_report.md``.

Everything here is pure: records in, numbers out, so the tests can craft them.
"""

from __future__ import annotations

from ..common import arm_comparison as shared
from ..common.arm_comparison import answer_text, excludes_zero_positive, interval_text, lies_above, mirrored, pair_name
from ..common.report_text import fmt, spread
from ..common.run_folder import finite
from ..common.statistics import holm
from .analysis import mean_over_lengths
from .longce_cases import case_resampled, holds_under_both

#: The outcomes per run (the first is the primary one), with their report labels and decimals.
OUTCOMES = {
    "primary_accuracy": ("primary", 3),
    "lines_beyond": ("lines beyond", 3),
    "recall": ("passage recall beyond", 3),
    "needle": ("needle beyond", 3),
    "lines_within": ("lines within K", 3),
    "ppl": ("PPL", 2),
    "longppl": ("LongPPL", 2),
}
#: The outcomes a void run leaves (the plan: "It leaves the accuracy comparisons"); PPL and LongPPL
#: keep every run.
ACCURACY = ("primary_accuracy", "lines_beyond", "recall", "needle", "lines_within")
#: The task-set name prefixes of the accuracies (``longce_start.task_sets``), each averaged over its lengths.
TASK_PREFIXES = {"lines_beyond": "lines-beyond", "recall": "recall", "needle": "needle", "lines_within": "lines-within"}
#: The start record's ``primary`` (the gate's outcome) -> the outcome that is primary for that start.
PRIMARY_OF_GATE = {"lines-beyond": "lines_beyond", "recall": "recall"}
#: The four decided contrasts, tested together with Holm's correction per start.
DECIDED_PAIRS = (("self", "ce"), ("frozen", "ce"), ("frozen", "shuffled"), ("self", "ce-fresh"))
#: Reported, not in the Holm family: ``self - frozen`` (mirrored for "frozen matches self"),
#: ``shuffled - ce`` (the weights' distribution) and ``ce-fresh - ce`` (the plan's "arm - ce" for
#: every arm).
REPORTED_PAIRS = (("self", "frozen"), ("shuffled", "ce"), ("ce-fresh", "ce"))
PAIRS = DECIDED_PAIRS + REPORTED_PAIRS
#: The exploratory case-resampled interval's contrasts: the four decided, ``self - frozen`` and
#: ``shuffled - ce`` (docs/reproduction.md, the study's deviations).
CASE_PAIRS = DECIDED_PAIRS + (("self", "frozen"), ("shuffled", "ce"))
#: The outcomes pooled over the starts: the primary one (decided) and the held-out task (reported).
POOLED_MEASURES = ("primary_accuracy", "recall")
#: "Frozen matches self": ``frozen - self``'s unadjusted interval above minus this.
MARGIN = 0.03
#: Holm's family-wise level.
ALPHA = 0.05

CLAIM_REPRODUCED = "reproduced"
CLAIM_SETTING_DEPENDENT = "setting-dependent"
CLAIM_NOT_REPRODUCED = "not reproduced"


def _defined(value) -> float | None:
    return float(value) if finite(value) else None


def outcomes_of(record: dict, primary: str) -> dict:
    """The outcomes of one ``longce_evaluate`` record: each accuracy the mean over its task lengths
    (``None`` when the record has no such task set), PPL and LongPPL on the books; ``primary`` (an
    outcome key, :data:`PRIMARY_OF_GATE`'s value) is copied to ``primary_accuracy``."""
    tasks, books = record.get("tasks", {}), record.get("books", {})
    found = {key: _defined(mean_over_lengths(tasks, prefix)) for key, prefix in TASK_PREFIXES.items()}
    found["ppl"], found["longppl"] = _defined(books.get("ppl")), _defined(books.get("longppl"))
    return {"primary_accuracy": found[primary], **found}


def _by_key(rows: list[dict]) -> dict:
    return {row["key"]: row for row in rows}


#: Why the void rule is not applied to a start that failed the gate.
FAILED_GATE = "the start failed the gate: its lines within K are at the floor"


def start_rows(records: dict, start: str, arms, seeds, checkpoints) -> dict:
    """A start's rows from the records.

    Args:
        records: ``{"longce_start", "longce_train", "longce_evaluate": [row, ...]}`` (each row with its
            ``key``, as ``phases.Records.rows`` reads them).
        start: its name (``s1``).
        arms, seeds: the configured arms and seeds; checkpoints: the plan's outcome steps, the first
            the void rule's, the last the primary.

    Returns:
        ``{"gate", "r", "primary", "start", "runs", "missing"}``: the gate record (or ``None``), the
        pilot's r, the primary outcome's key, the start model's row (or ``None``), one row per run
        evaluated at the primary checkpoint (``run``, ``method``, ``seed``, the outcomes there,
        ``by_step`` {step: primary}, ``step_seconds``, ``compute_seconds``, ``void``, ``void_rule``),
        and the runs not evaluated there.
    """
    begun, trained, evaluated = (
        _by_key(records.get(name, [])) for name in ("longce_start", "longce_train", "longce_evaluate")
    )
    gate = begun.get(start)
    pilot = begun.get(f"pilot/{start}")
    kind = gate["primary"] if gate else "lines-beyond"
    if kind not in PRIMARY_OF_GATE:
        raise ValueError(
            f"The gate record of {start} names primary {kind!r}; expected one of {sorted(PRIMARY_OF_GATE)}. "
            "Is longce_start.jsonl from this version of the phases?"
        )
    primary = PRIMARY_OF_GATE[kind]
    start_record = evaluated.get(f"{start}/start")
    start_row = None
    if start_record is not None:
        start_row = {"run": f"{start}/start", "method": "start", "seed": None, **outcomes_of(start_record, primary)}
    threshold = start_row["lines_within"] / 2 if start_row and finite(start_row["lines_within"]) else None
    first, last = checkpoints[0], checkpoints[-1]
    runs, missing = [], []
    for arm in arms:
        for seed in seeds:
            unit = f"{start}/{arm}-s{seed}"
            at_last = evaluated.get(f"{unit}/{last}")
            if at_last is None:
                missing.append(f"{unit} ({'not evaluated at step ' + str(last) if unit in trained else 'not trained'})")
                continue
            row = {"run": unit, "method": arm, "seed": seed, **outcomes_of(at_last, primary)}
            row["by_step"] = {
                str(c): outcomes_of(evaluated[f"{unit}/{c}"], primary)["primary_accuracy"]
                if f"{unit}/{c}" in evaluated
                else None
                for c in checkpoints
            }
            training = trained.get(unit, {})
            step_seconds = training.get("step_seconds")
            row["step_seconds"] = _defined(step_seconds.get("median")) if isinstance(step_seconds, dict) else None
            row["compute_seconds"] = _defined(training.get("compute_seconds"))
            at_first = evaluated.get(f"{unit}/{first}")
            within = outcomes_of(at_first, primary)["lines_within"] if at_first is not None else None
            rule = {"at_step": first, "lines_within": within, "threshold": threshold}
            if gate is not None and gate.get("gate_passed") is False:
                # the start's lines within K are at the floor, where half of them is a case or two:
                # the rule would void runs by chance (docs/reproduction.md, the study's deviations)
                rule["checked"] = False
                rule["why"] = FAILED_GATE
            elif threshold is None or within is None:
                rule["checked"] = False
                rule["why"] = "no start model evaluation" if threshold is None else f"not evaluated at step {first}"
            else:
                rule["checked"] = True
            row["void"] = bool(rule["checked"] and within < threshold)
            row["void_rule"] = rule
            runs.append(row)
    return {
        "gate": gate,
        "r": _defined(pilot.get("r")) if pilot else None,
        "primary": primary,
        "start": start_row,
        "runs": runs,
        "missing": missing,
    }


def holm_family(differences: dict, alpha: float = ALPHA) -> dict:
    """Holm's correction over a start's four decided contrasts (:data:`DECIDED_PAIRS`) on the primary
    outcome, from their two-sided paired t p-values.

    The family is always the plan's four: a contrast without an interval (fewer than 2 seeds) enters
    with p = 1, so the others keep the multipliers of four tests (conservative), and is marked
    ``skipped``.

    Returns:
        ``{"arm - baseline": {"p", "p_holm", "rejected", "positive", "value", "low", "high"}}``;
        ``positive`` is ``rejected`` and a mean above 0 (``None`` for a skipped contrast, which has
        ``skipped`` instead of the interval).
    """
    intervals = {
        pair_name(*pair): differences.get(pair_name(*pair), {}).get("primary_accuracy", {}) for pair in DECIDED_PAIRS
    }
    p_values = {name: iv["p_two_sided"] if "p_two_sided" in iv else 1.0 for name, iv in intervals.items()}
    found = holm(p_values, alpha)
    out = {}
    for name, iv in intervals.items():
        if "p_two_sided" not in iv:
            out[name] = {**found[name], "p": None, "positive": None, "skipped": iv.get("skipped", "not compared")}
            continue
        out[name] = {
            **found[name],
            "positive": bool(found[name]["rejected"] and iv["value"] > 0),
            "value": iv["value"],
            "low": iv["low"],
            "high": iv["high"],
        }
    return out


def compute_by_arm(records: dict, start: str, arms, seeds) -> dict:
    """Per arm of a start, over its trained seeds: mean and sd of ``compute_seconds`` (the run's seconds,
    plus for ``frozen`` and ``shuffled`` the one-off scoring of the start model's weights),
    ``scoring_seconds`` and the median step time, and the mean compute over ``ce``'s."""
    trained = _by_key(records.get("longce_train", []))
    found = {}
    for arm in arms:
        rows = [trained[f"{start}/{arm}-s{s}"] for s in seeds if f"{start}/{arm}-s{s}" in trained]
        found[arm] = {
            "compute_seconds": spread([r.get("compute_seconds") for r in rows]),
            "scoring_seconds": spread([r.get("scoring_seconds") for r in rows]),
            "step_seconds": spread([(r.get("step_seconds") or {}).get("median") for r in rows]),
            "steps": spread([r.get("steps") for r in rows]),
        }
    ce = found.get("ce", {}).get("compute_seconds", {}).get("mean")
    for entry in found.values():
        mean = entry["compute_seconds"]["mean"]
        entry["over_ce"] = mean / ce if finite(mean) and finite(ce) and ce > 0 else None
    return found


def along_fine_tuning(rows: list[dict], arms, checkpoints) -> dict:
    """Per arm, the primary outcome's mean and sd over its runs that are not void at each checkpoint
    (``{arm: {step: spread}}``)."""
    return {
        arm: {
            str(c): spread([r["by_step"][str(c)] for r in rows if r["method"] == arm and not r["void"]])
            for c in checkpoints
        }
        for arm in arms
    }


def decide(starts: dict, pooled: dict, margin: float = MARGIN) -> dict:
    """The plan's decisions (primary outcome).

    Args:
        starts: ``{start: analysed}`` for every configured start, ``analysed`` with ``holm``
            (:func:`holm_family`) and ``differences`` (``analyse_setting``'s), or ``{"skipped": why}``.
        pooled: ``pool_settings``' dict over the starts.
        margin: the margin of "frozen matches self".

    Returns:
        ``{"claim": {"decision", "positive_starts", "compared_starts"}, "per_start": {start: {...}},
        "pooled": {...}, "margin"}``; an answer is ``None`` where there is no comparison.

    - LongCE's claim (``self - ce``, Holm-adjusted): *reproduced* if positive in every start (both),
      *setting-dependent* if in some, *not reproduced* if in none. A start without records counts as
      not positive.
    - Per start: frozen *beats CE* if ``frozen - ce`` is positive after Holm; *matches self* if
      ``frozen - self``'s unadjusted interval (``self - frozen``'s, mirrored) lies above ``-margin``;
      the weights' *information carries frozen* if ``frozen - shuffled`` is positive after Holm;
      the weights' *distribution helps by itself* if ``shuffled - ce`` is positive, tested by its
      unadjusted interval lying above 0 (a reported contrast, outside the Holm family; it is read
      on its own, whatever ``frozen - shuffled`` says); *not bought with compute* if ``self -
      ce-fresh`` is positive after Holm.
    - Pooled over the starts, the same questions on the fixed-effects mean (t on n - S degrees of
      freedom), each interval above 0 (``frozen - self``: above ``-margin``), unadjusted: the plan's
      Holm correction is per start.
    """
    per_start, positive, compared = {}, [], []
    for name, found in starts.items():
        if "skipped" in found:
            per_start[name] = {"skipped": found["skipped"]}
            continue
        tests, differences = found["holm"], found["differences"]

        def primary(pair: str, differences=differences) -> dict:
            return differences.get(pair, {}).get("primary_accuracy", {"skipped": "not run"})

        frozen_self = mirrored(primary("self - frozen"))
        per_start[name] = {
            "self_beats_ce": tests["self - ce"]["positive"],
            "frozen_beats_ce": tests["frozen - ce"]["positive"],
            "frozen_matches_self": lies_above(frozen_self, -margin),
            "frozen_minus_self": frozen_self,
            "information_carries_frozen": tests["frozen - shuffled"]["positive"],
            "distribution_helps": excludes_zero_positive(primary("shuffled - ce")),
            "not_bought_with_compute": tests["self - ce-fresh"]["positive"],
        }
        if tests["self - ce"]["positive"] is not None:
            compared.append(name)
        if tests["self - ce"]["positive"]:
            positive.append(name)
    if starts and len(positive) == len(starts):
        decision = CLAIM_REPRODUCED
    elif positive:
        decision = CLAIM_SETTING_DEPENDENT
    else:
        decision = CLAIM_NOT_REPRODUCED

    def fixed(pair: str) -> dict:
        return pooled.get(pair, {}).get("primary_accuracy", {}).get("fixed_effects", {"skipped": "not pooled"})

    frozen_self = mirrored(fixed("self - frozen"))
    return {
        "claim": {"decision": decision, "positive_starts": positive, "compared_starts": compared},
        "per_start": per_start,
        "pooled": {
            "self_beats_ce": excludes_zero_positive(fixed("self - ce")),
            "frozen_beats_ce": excludes_zero_positive(fixed("frozen - ce")),
            "frozen_matches_self": lies_above(frozen_self, -margin),
            "frozen_minus_self": frozen_self,
            "information_carries_frozen": excludes_zero_positive(fixed("frozen - shuffled")),
            "distribution_helps": excludes_zero_positive(fixed("shuffled - ce")),
            "not_bought_with_compute": excludes_zero_positive(fixed("self - ce-fresh")),
        },
        "margin": margin,
    }


def _cases(records: dict, found: dict, step: int) -> dict:
    """The exploratory case-resampled interval of each of :data:`CASE_PAIRS` (``longce_cases``),
    each with ``holds_under_both`` beside the plan's t interval."""
    evaluated = _by_key(records.get("longce_evaluate", []))
    prefix = TASK_PREFIXES[found["primary"]]
    out = case_resampled(evaluated, found["runs"], prefix, step, CASE_PAIRS)
    for name, entry in out.items():
        entry["holds_under_both"] = holds_under_both(found["differences"][name]["primary_accuracy"], entry)
    return out


def analyse(records: dict, starts, arms, seeds, checkpoints, level: float = 0.95, alpha: float = ALPHA) -> dict:
    """The study's statistics and decisions from its records.

    Args:
        records: ``{"longce_start", "longce_weights", "longce_train", "longce_evaluate": [row, ...]}``.
        starts, arms, seeds: the configured names (``longce_start.PLAN``'s); checkpoints: the plan's
            outcome steps (the first the void rule's, the last the primary).
        level: the intervals' coverage; alpha: Holm's family-wise level.

    Returns:
        ``{"level", "alpha", "arms", "seeds", "checkpoints", "starts": {start: ...},
        "pooled", "decisions"}``; a start is :func:`start_rows`' dict plus ``analyse_setting``'s
        (``void``, ``summary``, ``differences``, ``against_start``), ``holm``, ``along`` and
        ``compute`` and ``cases`` (the exploratory case-resampled intervals, :func:`_cases`), or
        ``{"skipped": why, "gate", "r"}`` when the records hold no evaluation of it.
    """
    analysed = {}
    for start in starts:
        found = start_rows(records, start, arms, seeds, checkpoints)
        if found["gate"] is None:
            analysed[start] = {
                "skipped": f"no gate record of {start}: its 'longce-start' phase has not run",
                "gate": None,
                "r": None,
            }
            continue
        if found["start"] is None and not found["runs"]:
            why = f"no evaluation of {start}'s start model or of any run at step {checkpoints[-1]}"
            analysed[start] = {"skipped": why, "gate": found["gate"], "r": found["r"]}
            continue
        found.update(
            shared.analyse_arms(
                found["runs"],
                found["start"],
                list(arms),
                len(seeds),
                level,
                pairs=PAIRS,
                outcomes=OUTCOMES,
                accuracy=ACCURACY,
                arm_void_rule=False,
            )
        )
        found["holm"] = holm_family(found["differences"], alpha)
        found["along"] = along_fine_tuning(found["runs"], arms, checkpoints)
        found["compute"] = compute_by_arm(records, start, arms, seeds)
        found["cases"] = _cases(records, found, checkpoints[-1])
        analysed[start] = found
    usable = {name: found for name, found in analysed.items() if "skipped" not in found}
    pooled = shared.pool_clusters(usable, level, pairs=PAIRS, measures=POOLED_MEASURES)
    return {
        "level": level,
        "alpha": alpha,
        "arms": list(arms),
        "seeds": list(seeds),
        "checkpoints": list(checkpoints),
        # a run enters once evaluated at the last checkpoint; until all have, the decisions are provisional
        "runs": {
            "planned": len(starts) * len(arms) * len(seeds),
            "entered": sum(len(found.get("runs", [])) for found in analysed.values()),
        },
        "starts": analysed,
        "pooled": pooled,
        "decisions": decide(analysed, pooled),
    }


# ------------------------------------------------------------------ longce_report.md


def _p(value) -> str:
    if value is None or not finite(value):
        return "n/a"
    return f"{value:.4f}" if value >= 1e-4 else f"{value:.1e}"


def _holm_text(test: dict) -> str:
    if "skipped" in test:
        return f"n/a ({test['skipped']})"
    return f"{interval_text(test)}, p {_p(test['p'])}, Holm p {_p(test['p_holm'])}"


def decision_lines(results: dict) -> list[str]:
    """The decisions in words, one bullet each, with the intervals and p-values they rest on."""
    decisions, starts = results["decisions"], results["starts"]
    claim = decisions["claim"]
    absent = [name for name, found in starts.items() if "skipped" in found]
    # until every start is in, say whose records the decision rests on: a start not run counts as
    # not positive, so the claim reads "setting-dependent" at best
    present = ", ".join(n for n in starts if n not in absent) or "no start"
    scope = f" (on the records of {present}: {', '.join(absent)} not in them)"
    runs = results["runs"]
    out = []
    if runs["entered"] < runs["planned"]:
        out.append(
            f"- **Provisional: {runs['entered']} of the {runs['planned']} planned runs are in the records** (a run "
            f"enters once evaluated at step {results['checkpoints'][-1]}). The decisions below are the plan's rules "
            "applied to these runs alone; the study's decision is theirs once every run is in."
        )
    out += [
        f"- **LongCE's claim (`self − ce`, primary, Holm-adjusted): {claim['decision']}{scope if absent else ''}.** "
        "Starts where it is "
        f"positive after Holm: {', '.join(claim['positive_starts']) or 'none'} (of "
        f"{', '.join(claim['compared_starts']) or 'none'} with a comparison; the plan's starts: {', '.join(starts)})."
    ]
    for name, found in starts.items():
        answers = decisions["per_start"][name]
        if "skipped" in found:
            out.append(f"- **Start {name}:** skipped: {found['skipped']}.")
            continue
        tests, differences = found["holm"], found["differences"]
        out.append(
            f"- **Start {name}** (primary: {OUTCOMES[found['primary']][0]}): `self − ce` "
            f"{_holm_text(tests['self - ce'])}. Frozen beats CE: {answer_text(answers['frozen_beats_ce'])} "
            f"(`frozen − ce` {_holm_text(tests['frozen - ce'])}); frozen matches `self`: "
            f"{answer_text(answers['frozen_matches_self'])} (`frozen − self` "
            f"{interval_text(answers['frozen_minus_self'])}, "
            f"unadjusted, margin −{decisions['margin']:g}); the weights' information carries frozen: "
            f"{answer_text(answers['information_carries_frozen'])} (`frozen − shuffled` "
            f"{_holm_text(tests['frozen - shuffled'])}); the weights' distribution helps by itself: "
            f"{answer_text(answers['distribution_helps'])} (`shuffled − ce` "
            f"{interval_text(differences.get('shuffled - ce', {}).get('primary_accuracy', {}))}, unadjusted); "
            f"not bought with compute: {answer_text(answers['not_bought_with_compute'])} (`self − ce-fresh` "
            f"{_holm_text(tests['self - ce-fresh'])})."
        )
    pooled, answers = results["pooled"], decisions["pooled"]

    def fixed(pair: str) -> str:
        item = pooled.get(pair, {}).get("primary_accuracy", {})
        effects = item.get("fixed_effects", {"skipped": "not pooled"})
        if "low" not in effects:
            return f"n/a ({effects['skipped']})"
        return f"{interval_text(effects)} ({effects['df']} df)"

    out.append(
        "- **Pooled over the starts (fixed effects, unadjusted):** "
        f"`self − ce` {fixed('self - ce')}: {answer_text(answers['self_beats_ce'])}; "
        f"frozen beats CE {answer_text(answers['frozen_beats_ce'])} ({fixed('frozen - ce')}); "
        f"frozen matches `self` {answer_text(answers['frozen_matches_self'])} "
        f"(`frozen − self` {interval_text(answers['frozen_minus_self'])}); "
        f"information carries frozen {answer_text(answers['information_carries_frozen'])} ({fixed('frozen - shuffled')}); "
        f"distribution helps {answer_text(answers['distribution_helps'])} ({fixed('shuffled - ce')}); "
        f"not bought with compute {answer_text(answers['not_bought_with_compute'])} ({fixed('self - ce-fresh')})."
    )
    held_out = "; ".join(
        f"{name} {interval_text(found['differences'].get('self - ce', {}).get('recall', {}))}"
        for name, found in starts.items()
        if "skipped" not in found
    )
    out.append(f"- **Held-out task (passage recall, `self − ce`; reported, not decided):** {held_out or 'n/a'}.")
    return out


def _gate_table(results: dict) -> list[str]:
    out = ["| start | gate set | gate accuracy | gate | primary outcome | r (pilot) |", "|---|---|---:|---|---|---:|"]
    for name, found in results["starts"].items():
        gate = found.get("gate")
        if gate is None:
            out.append(f"| {name} | n/a | n/a | not run | n/a | {fmt(found.get('r'))} |")
            continue
        passed = "passed" if gate["gate_passed"] else "**failed**: recall is primary"
        out.append(
            f"| {name} | {gate.get('gate_set', 'n/a')} | {fmt(gate['gate_accuracy'])} | {passed} | "
            f"{gate['primary']} | {fmt(found.get('r'))} |"
        )
    return out


def _void_text(found: dict) -> str:
    void = [r for r in found["runs"] if r["void"]]
    unchecked = [r for r in found["runs"] if not r["void_rule"]["checked"]]
    text = "Void runs: " + (
        ", ".join(
            f"{r['run']} (lines within K {fmt(r['void_rule']['lines_within'])} at step {r['void_rule']['at_step']}, "
            f"threshold {fmt(r['void_rule']['threshold'])})"
            for r in void
        )
        or "none"
    )
    failed_gate = [r for r in unchecked if r["void_rule"]["why"] == FAILED_GATE]
    unchecked = [r for r in unchecked if r["void_rule"]["why"] != FAILED_GATE]
    if failed_gate:
        text += f"; void rule not applied to any run ({FAILED_GATE})"
    if unchecked:
        text += "; void rule not checked: " + ", ".join(f"{r['run']} ({r['void_rule']['why']})" for r in unchecked)
    return text + "."


def _run_table(found: dict, checkpoints: list) -> list[str]:
    steps = [str(c) for c in checkpoints]
    head = [
        "run",
        *[f"primary @{c}" for c in steps],
        *[OUTCOMES[k][0] for k in list(OUTCOMES)[1:]],
        "compute s",
        "void",
    ]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    if found["start"]:
        start = found["start"]
        cells = ["" for _ in steps]  # the start model has no checkpoints; its primary is a column of its own
        values = [fmt(start[k], OUTCOMES[k][1]) for k in list(OUTCOMES)[1:]]
        out.append("| start model | " + " | ".join(cells + values) + " | | |")
    for r in found["runs"]:
        cells = [fmt(r["by_step"][c]) for c in steps] + [fmt(r[k], OUTCOMES[k][1]) for k in list(OUTCOMES)[1:]]
        cells += [fmt(r["compute_seconds"], 1), "**void**" if r["void"] else ""]
        out.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    return out


def _along_table(found: dict, checkpoints: list) -> list[str]:
    steps = [str(c) for c in checkpoints]
    out = ["| arm | step 0 (start) | " + " | ".join(f"step {c}" for c in steps) + " |"]
    out.append("|---|" + "---|" * (len(steps) + 1))
    start = fmt(found["start"]["primary_accuracy"]) if found["start"] else "n/a"
    for arm, by_step in found["along"].items():
        cells = [f"{fmt(s['mean'])} ± {fmt(s['sd'])} ({s['n']})" if s["n"] else "n/a" for s in by_step.values()]
        out.append(f"| {arm} | {start} | " + " | ".join(cells) + " |")
    return out


def _holm_table(tests: dict) -> list[str]:
    out = ["| contrast | mean [95%] | p | p (Holm) | rejected | positive |", "|---|---|---:|---:|---|---|"]
    for name, test in tests.items():
        label = name.replace(" - ", " − ")
        if "skipped" in test:
            out.append(
                f"| {label} | n/a ({test['skipped']}) | n/a | {_p(test['p_holm'])} (counted with p = 1) | no | n/a |"
            )
            continue
        out.append(
            f"| {label} | {interval_text(test)} | {_p(test['p'])} | {_p(test['p_holm'])} | "
            f"{'yes' if test['rejected'] else 'no'} | {'**yes**' if test['positive'] else 'no'} |"
        )
    return out


def _compute_table(results: dict) -> list[str]:
    out = [
        "| start | arm | runs | compute s (mean ± sd) | × ce | of it, one-off scoring s | step ms (median) | steps |",
        "|---|---|---:|---|---:|---:|---|---:|",
    ]
    for name, found in results["starts"].items():
        if "skipped" in found:
            continue
        for arm, entry in found["compute"].items():
            c, s, t = entry["compute_seconds"], entry["scoring_seconds"], entry["step_seconds"]
            out.append(
                f"| {name} | {arm} | {c['n']} | {fmt(c['mean'], 1)} ± {fmt(c['sd'], 1)} | "
                f"{fmt(entry['over_ce'], 2)} | "
                f"{fmt(s['mean'], 1)} | {fmt(t['mean'] * 1e3, 1) if finite(t['mean']) else 'n/a'} | "
                f"{fmt(entry['steps']['mean'], 0)} |"
            )
    return out


def _cases_table(found: dict, level: int) -> list[str]:
    out = [
        "The plan's t interval varies the seed (the data order); this one draws each length's cases again, "
        "the same draw for every run (paired), on the primary outcome at the primary step.",
        "",
        f"| contrast | seeds | t interval (seeds) | {level}% interval, cases resampled | both exclude 0 |",
        "|---|---:|---|---|---|",
    ]
    for name, entry in found["cases"].items():
        t = found["differences"][name]["primary_accuracy"]
        label = name.replace(" - ", " − ")
        if "skipped" in entry:
            out.append(f"| {label} | | {interval_text(t, 3)} | skipped: {entry['skipped']} | |")
            continue
        held = {True: "**yes**", False: "no", None: "n/a"}[entry["holds_under_both"]]
        out.append(
            f"| {label} | {len(entry['seeds'])} | {interval_text(t, 3)} | {interval_text(entry, 3)} "
            f"({entry['resamples']:,} resamples) | {held} |"
        )
    return out


def format_report(results: dict) -> str:
    """``longce_report.md``: gate and r per start, the decisions in words, per start its runs (void
    runs named), mean ± sd per arm, the primary along fine-tuning, the paired differences with their
    t intervals, the Holm table, the exploratory case-resampled intervals and the differences against
    the start model; the pooled table;
    the compute per arm."""
    level = round(results["level"] * 100)
    checkpoints = results["checkpoints"]
    out = ["# LongCE from a real start", ""]
    out.append(
        f"Seeds {', '.join(map(str, results['seeds']))}; outcomes at steps {', '.join(map(str, checkpoints))}, "
        f"step {checkpoints[-1]} primary. Intervals are paired {level}% t intervals across seeds; Holm's "
        f"correction at {results['alpha']:g} over the four decided contrasts of each start."
    )
    out += ["", "## Starts: gate and r", "", *_gate_table(results)]
    out += ["", "## Decisions by the plan", "", *decision_lines(results)]
    out += [
        "",
        f"A run is void when its lines accuracy within K (mean over the within-K lengths) at step {checkpoints[0]} "
        "is below half the start model's: void runs leave every accuracy comparison (PPL and LongPPL keep them). "
        "There is no arm-level void.",
    ]
    outcomes = list(OUTCOMES)
    for name, found in results["starts"].items():
        out += ["", f"## Start {name}", ""]
        if "skipped" in found:
            out.append(f"Skipped: {found['skipped']}.")
            continue
        out.append(f"Primary outcome: {OUTCOMES[found['primary']][0]}.")
        if found["missing"]:
            out.append(f"Not in the records: {', '.join(found['missing'])}.")
        out.append(_void_text(found))
        out += ["", "### Every run (outcomes at the primary step)", "", *_run_table(found, checkpoints)]
        out += ["", "### Mean ± sd over seeds (void runs out of the accuracy columns)", ""]
        out += shared.summary_table(found, outcomes, OUTCOMES)
        out += ["", "### Primary outcome along fine-tuning (mean ± sd over runs not void, n)", ""]
        out += _along_table(found, checkpoints)
        out += ["", f"### Paired differences across seeds, with the {level}% t interval (unadjusted)", ""]
        out += shared.difference_table(found["differences"], outcomes, OUTCOMES)
        out += ["", "### Holm over the four decided contrasts (primary outcome, two-sided paired t)", ""]
        out += _holm_table(found["holm"])
        out += ["", "### Exploratory: the cases resampled (decides nothing)", "", *_cases_table(found, level)]
        out += ["", "### Against the start model", ""]
        out.append("The start model is evaluated once: each interval is the arm's spread over seeds about its value.")
        out += ["", *shared.difference_table(found["against_start"], outcomes, OUTCOMES)]
    out += ["", "## Pooled over the starts", ""]
    out.append(
        "Per-seed paired differences: the fixed-effects mean over these starts (t on n − S degrees of freedom), "
        "decided on; the random-intercept mean (t on S − 1), reported."
    )
    out += ["", *shared.pooled_table(results["pooled"], OUTCOMES, clusters="starts")]
    out += ["", "## Compute per arm", ""]
    out.append(
        "Compute is the run's seconds; for `frozen` and `shuffled` it includes the one-off scoring of the start "
        "model's weights. `ce-fresh` runs r × the steps. The seconds are wall-clock on a GPU shared with the "
        "study's other processes, so they compare arms only as far as what ran beside them was alike."
    )
    out += ["", *_compute_table(results)]
    return "\n".join(out) + "\n"
