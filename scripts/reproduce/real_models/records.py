"""The earlier studies' records, transcribed from their published tables, and the report that
rebuilds those tables (and the statistics the records allow) from the records alone.

The raw records of the third LongPPL attempt and of the three-setting LongCE study (each run's
``results.json``, the evaluation records) stayed on the GPU machines and are lost. What survives is
what docs/reproduction.md printed: the third attempt's table of all 85 members, its gates and
calibration grid, its primary and secondary statistics; the LongCE study's mean +- sd of every arm,
its paired differences with their intervals, the arms against the start model, the pooled figures.
:func:`transcribe` reads those tables from the page and writes them as CSV under
``docs/records/<study>/``; :func:`report` rebuilds, from those files alone, every table they hold
and the statistics they allow (the third attempt's correlations with cluster bootstraps, its
composite; the LongCE decisions by the plan's rules and the fixed-effects pooled means).

Numbers are kept as the page printed them (3 decimals for accuracies and correlations, 2 for PPL
and LongPPL in the LongCE tables, 1 for step times; U+2212 minus signs written as ``-``).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass

# ------------------------------------------------------------------ reading the page's tables

MINUS = "\u2212"


@dataclass
class Table:
    """One Markdown table of the page: the ``##`` and ``###`` headings above it, its header cells and
    its rows (cells stripped), and the exact lines it occupies (for comparisons)."""

    section: str
    subsection: str
    header: list[str]
    rows: list[list[str]]
    lines: list[str]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def markdown_tables(text: str) -> list[Table]:
    """Every table of ``text`` (a header line, a ``|---`` line, rows), in page order, with the headings
    it sits under (code blocks skipped)."""
    tables, section, subsection, fenced = [], "", "", False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            section, subsection = line[3:].strip(), ""
        elif not fenced and line.startswith("### "):
            subsection = line[4:].strip()
        elif not fenced and line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            block = lines[i:j]
            tables.append(Table(section, subsection, _cells(block[0]), [_cells(r) for r in block[2:]], block))
            i = j
            continue
        i += 1
    return tables


def find_table(tables: list[Table], section: str, subsection: str, first_cell: str, nth: int = 0) -> Table:
    """The ``nth`` table under headings starting with ``section`` / ``subsection`` whose first header
    cell is ``first_cell``."""
    found = [
        t
        for t in tables
        if t.section.startswith(section) and t.subsection.startswith(subsection) and t.header[0] == first_cell
    ]
    if len(found) <= nth:
        raise ValueError(f"No table '{first_cell}' under '{section}' / '{subsection}' in the page.")
    return found[nth]


def plain(text: str) -> str:
    """A cell's text without emphasis and code marks, ASCII minus."""
    return text.replace("**", "").replace("`", "").replace(MINUS, "-").strip()


_NUMBER = r"[+-]?\d+(?:\.\d+)?"
_INTERVAL = re.compile(rf"^({_NUMBER}) \[({_NUMBER}), ({_NUMBER})\]$")
_SPREAD = re.compile(rf"^({_NUMBER}) ± ({_NUMBER})$")


def interval(cell: str) -> tuple[str, str, str]:
    """``"x [low, high]"`` as three number strings."""
    match = _INTERVAL.match(plain(cell))
    if not match:
        raise ValueError(f"Not an interval cell: {cell!r}")
    return match.groups()


# ------------------------------------------------------------------ writing and reading records


def write_csv(path: str, fields: list[str], rows: list[dict]) -> None:
    """``rows`` as CSV with ``fields`` as its columns, written to a temporary file and renamed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(buffer.getvalue())
    os.replace(tmp, path)


def read_csv(path: str) -> list[dict]:
    """The rows of a records CSV (strings, as written)."""
    if not os.path.isfile(path):
        raise ValueError(f"No records file {path}: run `transcribe` first or check the folder.")
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


THIRD = "third_attempt"
LONGCE = "longce_settings"
THIRD_RESULTS = "Third attempt: LongPPL across 16 extension configurations — results"
LONGCE_RESULTS = "LongCE beyond one setting — results"

MEMBER_FIELDS = [
    "member",
    "configuration",
    "steps",
    "seed",
    "acc512",
    "lines",
    "needle",
    "two_hop",
    "composite",
    "ppl",
    "ppl_low",
    "ppl_high",
    "longppl_E1",
    "longppl_E1_low",
    "longppl_E1_high",
    "longppl_E1b",
    "longppl_E2",
    "excluded",
]


def _third_records(tables: list[Table]) -> dict[str, tuple[list[str], list[dict]]]:
    members = []
    for cells in find_table(tables, THIRD_RESULTS, "The population", "member").rows:
        ppl, longppl = interval(cells[9]), interval(cells[10])
        values = [plain(c) for c in cells[:9]] + [*ppl, *longppl, plain(cells[11]), plain(cells[12]), cells[13]]
        members.append(dict(zip(MEMBER_FIELDS, values)))
    gates = []
    for cells in find_table(tables, THIRD_RESULTS, "Gates and calibration", "model").rows:
        accuracy, correct, total = re.match(r"(\d\.\d+) \((\d+) of (\d+)\)", cells[1]).groups()
        gates.append({"model": plain(cells[0].split("(")[0]), "accuracy": accuracy, "correct": correct, "cases": total})
    grid_table = find_table(tables, THIRD_RESULTS, "Gates and calibration", "α")
    grid = []
    for cells in grid_table.rows:
        for alpha, cell in zip(grid_table.header[1:], cells[1:]):
            null, real = re.match(r"(\d+) / (\d+)", plain(cell)).groups()
            grid.append({"evaluator": cells[0], "alpha": alpha, "null": null, "real": real})
    primary = find_table(tables, THIRD_RESULTS, "Primary statistics", "evaluator")
    published = []
    for cells in primary.rows:
        n, clusters = re.match(r"(\d+) \((\d+)\)", cells[2]).groups()
        row = {"evaluator": plain(cells[0]), "members": cells[1], "n": n, "clusters": clusters}
        for name, cell in zip(("spearman_longppl", "spearman_ppl", "spearman_difference"), cells[3:6]):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = interval(cell)
        row["williams_t"], row["williams_p"] = re.match(rf"({_NUMBER}) \(({_NUMBER})\)", plain(cells[6])).groups()
        for name, cell in zip(("pearson_longppl", "pearson_ppl", "pearson_difference"), cells[7:10]):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = interval(cell)
        published.append(row)
    parts = []
    for cells in find_table(tables, THIRD_RESULTS, "Primary statistics", "evaluator", nth=2).rows:
        row = {"evaluator": cells[0], "outcome": cells[1]}
        for name, cell in zip(("spearman_longppl", "spearman_ppl", "spearman_difference"), cells[2:5]):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = interval(cell)
        row["williams_t"], row["williams_p"] = re.match(rf"({_NUMBER}) \(({_NUMBER})\)", plain(cells[5])).groups()
        parts.append(row)
    stat_fields = list(published[0])
    return {
        "members.csv": (MEMBER_FIELDS, members),
        "gates.csv": (["model", "accuracy", "correct", "cases"], gates),
        "calibration_grid.csv": (["evaluator", "alpha", "null", "real"], grid),
        "published_statistics.csv": (stat_fields, published),
        "published_secondary.csv": (list(parts[0]), parts),
    }


# the LongCE tables' columns: a header label -> the outcome's key
_OUTCOME_OF_LABEL = [
    (re.compile(r"^primary$"), "primary"),
    (re.compile(r"^beyond \d+$"), "beyond_start"),
    (re.compile(r"^passage recall$"), "passage_recall"),
    (re.compile(r"^accuracy at \d+$"), "start_length_accuracy"),
    (re.compile(r"^needle \(\d+\)$"), "needle"),
    (re.compile(r"^PPL$"), "ppl"),
    (re.compile(r"^LongPPL \(\w+\)$"), "longppl"),
    (re.compile(r"^step ms$"), "step_ms"),
]


def _outcome(label: str) -> str:
    for pattern, key in _OUTCOME_OF_LABEL:
        if pattern.match(label):
            return key
    raise ValueError(f"Unknown column {label!r} of a LongCE table.")


def _arm(label: str) -> str:
    label = plain(label)
    return "start" if label == "start model" else label.split(" ")[0]


_SETTING = re.compile(r"^Setting \((\w)\): .*?(\d+) → (\d+), outside evaluator (\w+)$")
_AGAINST = re.compile(rf"`([\w-]+)` ({_NUMBER}) \[({_NUMBER}), ({_NUMBER})\]")


def _against_start(text: str, subsection: str) -> list[dict]:
    """The "Against the start model (primary): ..." paragraph of a setting's section."""
    start = text.index(f"### {subsection}")
    paragraph = text[text.index("Against the start model (primary):", start) :].split("\n\n")[0]
    found = _AGAINST.findall(" ".join(paragraph.split()).replace(MINUS, "-"))
    return [{"arm": arm, "mean": mean, "low": low, "high": high} for arm, mean, low, high in found]


def _longce_records(tables: list[Table], text: str) -> dict[str, tuple[list[str], list[dict]]]:
    settings, arms, differences, against = [], [], [], []
    subsections = sorted(
        {t.subsection for t in tables if t.section.startswith(LONGCE_RESULTS) and _SETTING.match(t.subsection)}
    )
    for subsection in subsections:
        letter, start_length, length, evaluator = _SETTING.match(subsection).groups()
        arm_table = find_table(tables, LONGCE_RESULTS, subsection, "arm")
        outcomes = [_outcome(label) for label in arm_table.header[1:]]
        needle = next((re.search(r"\d+", lab).group() for lab in arm_table.header if lab.startswith("needle")), "")
        settings.append(
            {
                "setting": letter,
                "start_length": start_length,
                "length": length,
                "evaluator": evaluator,
                "needle_length": needle,
                "outcomes": " ".join(outcomes),
                "cache_label": plain(next(r[0] for r in arm_table.rows if "cache" in r[0])),
            }
        )
        for cells in arm_table.rows:
            for outcome, cell in zip(outcomes, cells[1:]):
                cell = plain(cell)
                spread = _SPREAD.match(cell)
                mean, sd = spread.groups() if spread else (cell, "")
                arms.append({"setting": letter, "arm": _arm(cells[0]), "outcome": outcome, "mean": mean, "sd": sd})
        diff_table = find_table(tables, LONGCE_RESULTS, subsection, "difference")
        diff_outcomes = [_outcome(label) for label in diff_table.header[1:]]
        for cells in diff_table.rows:
            for outcome, cell in zip(diff_outcomes, cells[1:]):
                value, low, high = interval(cell) if plain(cell) != "n/a" else ("n/a", "", "")
                differences.append(
                    {
                        "setting": letter,
                        "difference": plain(cells[0]),
                        "outcome": outcome,
                        "mean": value,
                        "low": low,
                        "high": high,
                    }
                )
        against += [{"setting": letter, **row} for row in _against_start(text, subsection)]
    pooled = []
    for cells in find_table(tables, LONGCE_RESULTS, "Pooled over the three settings", "difference").rows:
        mu, fixed = interval(cells[2]), interval(cells[4])
        pooled.append(
            {
                "difference": plain(cells[0]),
                "outcome": _outcome(plain(cells[1])),
                "random_intercept": mu[0],
                "random_intercept_low": mu[1],
                "random_intercept_high": mu[2],
                "tau2": cells[3],
                "fixed_effects": fixed[0],
                "fixed_effects_low": fixed[1],
                "fixed_effects_high": fixed[2],
            }
        )
    return {
        "settings.csv": (list(settings[0]), settings),
        "arms.csv": (["setting", "arm", "outcome", "mean", "sd"], arms),
        "differences.csv": (["setting", "difference", "outcome", "mean", "low", "high"], differences),
        "against_start.csv": (["setting", "arm", "mean", "low", "high"], against),
        "published_pooled.csv": (list(pooled[0]), pooled),
    }


def transcribe(page: str, records_dir: str) -> list[str]:
    """Read the tables of ``page`` (docs/reproduction.md) and write them as CSV records under
    ``records_dir/third_attempt/`` and ``records_dir/longce_settings/``. Returns the paths written."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    tables = markdown_tables(text)
    written = []
    for study, files in ((THIRD, _third_records(tables)), (LONGCE, _longce_records(tables, text))):
        for name, (fields, rows) in files.items():
            path = os.path.join(records_dir, study, name)
            write_csv(path, fields, rows)
            written.append(path)
    return written


# ------------------------------------------------------------------ rebuilding the tables


def signed(value: float, digits: int) -> str:
    """``value`` as the page prints a difference: an explicit sign (U+2212 for minus)."""
    text = f"{value:+.{digits}f}"
    return text.replace("-", MINUS)


def unsigned(value: float, digits: int) -> str:
    """``value`` as the page prints a level: a minus sign (U+2212) only."""
    return f"{value:.{digits}f}".replace("-", MINUS)


def _f(text: str) -> float:
    return float(text) if text not in ("", "n/a") else float("nan")


def member_table(members: list[dict]) -> list[str]:
    """The third attempt's population table, as the page printed it."""
    out = [
        "| member | configuration | steps | seed | acc512 | lines | needle | two-hop | composite | PPL [95%] | "
        "LongPPL E1 [95%] | LongPPL E1b | LongPPL E2 | excluded |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for m in members:
        composite = "n/a" if m["composite"] == "n/a" else unsigned(_f(m["composite"]), 3)
        cells = [m["member"], m["configuration"], m["steps"], m["seed"]]
        cells += [unsigned(_f(m[k]), 3) for k in ("acc512", "lines", "needle", "two_hop")] + [composite]
        cells.append(f"{_f(m['ppl']):.2f} [{_f(m['ppl_low']):.2f}, {_f(m['ppl_high']):.2f}]")
        cells.append(f"{_f(m['longppl_E1']):.3f} [{_f(m['longppl_E1_low']):.3f}, {_f(m['longppl_E1_high']):.3f}]")
        cells += [f"{_f(m['longppl_E1b']):.3f}", f"{_f(m['longppl_E2']):.3f}"]
        out.append("| " + " | ".join([*cells, m["excluded"]]) + " |")
    return out


def calibration_grid_table(grid: list[dict]) -> list[str]:
    """The third attempt's calibration grid: null / real key tokens per evaluator and alpha, the
    chosen alpha (the smallest with null <= 10% of real) in bold, as the page printed it."""
    alphas = list(dict.fromkeys(r["alpha"] for r in grid))
    out = ["| α | " + " | ".join(alphas) + " |", "|---" * (len(alphas) + 1) + "|"]
    for evaluator in dict.fromkeys(r["evaluator"] for r in grid):
        rows = [r for r in grid if r["evaluator"] == evaluator]
        chosen = next(r["alpha"] for r in rows if int(r["null"]) <= 0.10 * int(r["real"]))
        cells = []
        for r in rows:
            null, real = int(r["null"]), int(r["real"])
            text = f"{null} / {real}"
            if float(r["alpha"]) <= float(chosen):  # the page gives the share up to the chosen alpha and one more
                text += f" ({100 * null / real:.1f}%)"
            cells.append(f"**{text}**" if r["alpha"] == chosen else text)
        # the page gives shares only up to the first alpha past the chosen one
        past = [i for i, r in enumerate(rows) if float(r["alpha"]) > float(chosen)]
        if past:
            r = rows[past[0]]
            cells[past[0]] = f"{r['null']} / {r['real']} ({100 * int(r['null']) / int(r['real']):.1f}%)"
        out.append(f"| {evaluator} | " + " | ".join(cells) + " |")
    return out


_DIGITS = {"ppl": 2, "longppl": 2, "step_ms": 1}
_BOLD = ("self − ce", "frozen − ce", "self − ce-fresh")


def _label(outcome: str, setting: dict) -> str:
    return {
        "primary": "primary",
        "beyond_start": f"beyond {setting['start_length']}",
        "passage_recall": "passage recall",
        "start_length_accuracy": f"accuracy at {setting['start_length']}",
        "needle": f"needle ({setting['needle_length']})",
        "ppl": "PPL",
        "longppl": f"LongPPL ({setting['evaluator']})",
        "step_ms": "step ms",
    }[outcome]


def _arm_label(arm: str, setting: dict) -> str:
    if arm == "start":
        return "start model"
    if arm == "cache":
        return setting["cache_label"].replace("cache", "`cache`", 1)
    if arm == "ce-fresh":
        return "`ce-fresh` (1650 steps)"
    return f"`{arm}`"


def arms_table(setting: dict, arms: list[dict]) -> list[str]:
    """A setting's mean +- sd table (the start model: one value), as the page printed it."""
    outcomes = setting["outcomes"].split()
    out = ["| arm | " + " | ".join(_label(o, setting) for o in outcomes) + " |", "|---" * (len(outcomes) + 1) + "|"]
    rows = [r for r in arms if r["setting"] == setting["setting"]]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        cells = []
        for outcome in outcomes:
            r = next(x for x in rows if x["arm"] == arm and x["outcome"] == outcome)
            digits = _DIGITS.get(outcome, 3)
            if r["mean"] in ("", "n/a"):
                cells.append(r["mean"])
            elif r["sd"]:
                cells.append(f"{_f(r['mean']):.{digits}f} ± {_f(r['sd']):.{digits}f}")
            else:
                cells.append(f"{_f(r['mean']):.{digits}f}")
        # the page closes an empty cell (the start model's step time) as "| |"
        out.append((f"| {_arm_label(arm, setting)} | " + " | ".join(cells) + " |").replace("|  |", "| |"))
    return out


def _interval_text(mean: str, low: str, high: str, digits: int) -> str:
    if mean == "n/a":
        return "n/a"
    return f"{signed(_f(mean), digits)} [{signed(_f(low), digits)}, {signed(_f(high), digits)}]"


def differences_table(setting: dict, differences: list[dict]) -> list[str]:
    """A setting's paired differences with their t intervals, as the page printed it (the plan's
    three decided contrasts in bold, on their primary outcome)."""
    rows = [r for r in differences if r["setting"] == setting["setting"]]
    outcomes = list(dict.fromkeys(r["outcome"] for r in rows))
    out = [
        "| difference | " + " | ".join(_label(o, setting) for o in outcomes) + " |",
        "|---" * (len(outcomes) + 1) + "|",
    ]
    for name in dict.fromkeys(r["difference"] for r in rows):
        shown = name.replace("-", MINUS).replace(f"ce{MINUS}fresh", "ce-fresh")
        bold = shown in _BOLD
        cells = []
        for outcome in outcomes:
            r = next(x for x in rows if x["difference"] == name and x["outcome"] == outcome)
            text = _interval_text(r["mean"], r["low"], r["high"], _DIGITS.get(outcome, 3))
            cells.append(f"**{text}**" if bold and outcome == "primary" else text)
        label = f"**`{shown}`**" if bold else f"`{shown}`"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _difference(differences: list[dict], setting: str, name: str, outcome: str) -> dict:
    return next(
        r for r in differences if r["setting"] == setting and r["difference"] == name and r["outcome"] == outcome
    )


def decisions(settings: list[dict], differences: list[dict], pooled: list[dict]) -> dict:
    """The plan's decisions, from the per-setting intervals (and, for the claim's pooled clause, the
    published random-intercept interval, which the records cannot rebuild).

    - claim: a setting is positive when ``self - ce``'s interval lies above 0, negative when below;
      reproduced beyond one setting if the pooled interval excludes 0 and >= 2 settings are positive,
      setting-dependent if >= 1 is, else not reproduced;
    - ``frozen`` matches ``self`` when ``frozen - self``'s interval lies above -0.03 (the page gives
      ``self - frozen``: its upper bound below +0.03);
    - ``frozen`` beats CE when ``frozen - ce``'s lower bound is above 0;
    - not bought with compute when ``self - ce-fresh``'s lower bound is above 0.
    """
    letters = [s["setting"] for s in settings]

    def sign(r):
        return "positive" if _f(r["low"]) > 0 else "negative" if _f(r["high"]) < 0 else "inconclusive"

    claim = {s: sign(_difference(differences, s, "self - ce", "primary")) for s in letters}
    mu = next(p for p in pooled if p["difference"] == "self - ce" and p["outcome"] == "primary")
    pooled_excludes = _f(mu["random_intercept_low"]) > 0 or _f(mu["random_intercept_high"]) < 0
    positives = sum(v == "positive" for v in claim.values())
    if pooled_excludes and positives >= 2:
        verdict = "reproduced beyond one setting"
    elif positives >= 1:
        verdict = "setting-dependent"
    else:
        verdict = "not reproduced"
    return {
        "claim": claim,
        "claim_verdict": verdict,
        "pooled_excludes_zero": pooled_excludes,
        "frozen_matches_self": {
            s: _f(_difference(differences, s, "self - frozen", "primary")["high"]) < 0.03 for s in letters
        },
        "frozen_beats_ce": {s: _f(_difference(differences, s, "frozen - ce", "primary")["low"]) > 0 for s in letters},
        "not_bought_with_compute": {
            s: _f(_difference(differences, s, "self - ce-fresh", "primary")["low"]) > 0 for s in letters
        },
        "held_out": {s: _difference(differences, s, "self - ce", "passage_recall")["mean"] for s in letters},
    }


def decisions_table(found: dict, pooled: list[dict]) -> list[str]:
    """The plan's decisions table, as the page printed it."""
    letters = list(found["claim"])

    def every(flags: dict) -> str:
        held = sum(flags.values())
        return "in every setting" if held == len(flags) else f"{held} of {len(flags)}"

    def yes(flags: dict) -> list[str]:
        return ["yes" if flags[s] else "no" for s in letters]

    held_out = next(p for p in pooled if p["difference"] == "self - ce" and p["outcome"] == "passage_recall")
    pooled_text = _interval_text(
        held_out["random_intercept"], held_out["random_intercept_low"], held_out["random_intercept_high"], 3
    )
    rows = [
        [
            "LongCE's claim (`self − ce`, primary)",
            *[found["claim"][s] for s in letters],
            f"**{found['claim_verdict']}** (pooled interval {'excludes' if found['pooled_excludes_zero'] else 'includes'} 0)",
        ],
        [
            "`frozen` matches `self` (`frozen − self` above −0.03)",
            *yes(found["frozen_matches_self"]),
            every(found["frozen_matches_self"]),
        ],
        ["`frozen` beats CE", *yes(found["frozen_beats_ce"]), every(found["frozen_beats_ce"])],
        [
            "not bought with compute (`self − ce-fresh` > 0)",
            *yes(found["not_bought_with_compute"]),
            every(found["not_bought_with_compute"]),
        ],
        [
            "held-out task, `self − ce` (reported, not decided)",
            *[signed(_f(found["held_out"][s]), 3) for s in letters],
            f"pooled {pooled_text}",
        ],
    ]
    out = ["| question | " + " | ".join(f"({s})" for s in letters) + " | decision |", "|---" * (len(letters) + 2) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def fixed_effects_from_intervals(differences: list[dict], name: str, outcome: str, seeds: int = 4) -> dict:
    """The fixed-effects pooled mean of a paired difference over the settings, rebuilt from each
    setting's mean and t interval (``seeds`` pairs each): every setting's sd of its pairs is
    ``half-width * sqrt(seeds) / t(seeds - 1)``, their pooled variance has ``S * (seeds - 1)``
    degrees of freedom, and the mean's standard error is ``sqrt(s2 * S / seeds) / S``, as
    ``statistics.fixed_effects_mean`` computes it from the pairs. Exact up to the page's rounding."""
    from ..common import statistics

    rows = [r for r in differences if r["difference"] == name and r["outcome"] == outcome]
    t_setting = statistics.student_t_quantile(0.975, seeds - 1)
    means = [_f(r["mean"]) for r in rows]
    variances = [((_f(r["high"]) - _f(r["low"])) / 2 * math.sqrt(seeds) / t_setting) ** 2 for r in rows]
    count = len(rows)
    df = count * (seeds - 1)
    se = math.sqrt(sum(variances) / count * count / seeds) / count
    t = statistics.student_t_quantile(0.975, df)
    mean = sum(means) / count
    return {"value": mean, "low": mean - t * se, "high": mean + t * se, "df": df}


def third_statistics(members: list[dict], resamples: int = 10000, seed: int = 0) -> dict:
    """The third attempt's correlations rebuilt from the member records: the analysed members (no
    exclusion), the composite recomputed from lines, needle and two-hop (each standardised over them),
    and ``claim_statistics.correlations`` per evaluator, overall and within each step level, with the
    plan's cluster bootstrap over configurations."""
    from types import SimpleNamespace

    from ..common import claim_statistics

    rows = []
    for m in members:
        if m["excluded"]:
            continue
        rows.append(
            {
                "member": m["member"],
                "cluster": m["configuration"],
                "steps": int(m["steps"]),
                "acc512": _f(m["acc512"]),
                "primary_accuracy": _f(m["lines"]),
                "needle": _f(m["needle"]),
                "two_hop": _f(m["two_hop"]),
                "ppl": _f(m["ppl"]),
                **{f"longppl:{e}": _f(m[f"longppl_{e}"]) for e in ("E1", "E1b", "E2")},
            }
        )
    composite = claim_statistics.add_composite(rows, ("primary_accuracy", "needle", "two_hop"))
    analysis = SimpleNamespace(bootstrap={"resamples": resamples, "seed": seed, "level": 0.95})
    found = {"composite": composite, "rows": rows, "by_evaluator": {}}
    for evaluator in ("E1", "E1b", "E2"):
        measure = f"longppl:{evaluator}"
        levels = {"all analysed": rows}
        levels.update({f"{s} steps": [r for r in rows if r["steps"] == s] for s in sorted({r["steps"] for r in rows})})
        found["by_evaluator"][evaluator] = {
            level: claim_statistics.correlations(chosen, measure, "composite", analysis)
            for level, chosen in levels.items()
        }
    return found


def _corr_text(found: dict) -> str:
    return f"{signed(found['value'], 3)} [{signed(found['low'], 3)}, {signed(found['high'], 3)}]"


def third_statistics_table(found: dict) -> list[str]:
    """The primary statistics rebuilt from the member records, in the page's columns."""
    out = [
        "| evaluator | members | n (clusters) | Spearman LongPPL | Spearman PPL | difference | Williams' t (p) | "
        "Pearson LongPPL | Pearson PPL | Pearson difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for evaluator, levels in found["by_evaluator"].items():
        for level, c in levels.items():
            s, p, w = c["spearman"], c["pearson"], c["williams_t_ranks"]
            out.append(
                f"| {evaluator} | {level} | {c['n']} ({c['clusters']}) | {_corr_text(s['longppl'])} | "
                f"{_corr_text(s['ppl'])} | {_corr_text(s['difference'])} | {w['t']:.2f} ({w['p_two_sided']:.3f}) | "
                f"{_corr_text(p['longppl'])} | {_corr_text(p['ppl'])} | {_corr_text(p['difference'])} |"
            )
    return out


def report(records_dir: str, resamples: int = 10000) -> dict:
    """Every table the records hold, rebuilt from them alone, and the statistics they allow.

    Returns:
        ``{"tables": {name: [markdown lines]}, "third": third_statistics(...), "longce": {"decisions",
        "fixed_effects": {(difference, outcome): ...}}, "markdown": the whole report}``.
    """
    third_dir, longce_dir = os.path.join(records_dir, THIRD), os.path.join(records_dir, LONGCE)
    members = read_csv(os.path.join(third_dir, "members.csv"))
    grid = read_csv(os.path.join(third_dir, "calibration_grid.csv"))
    settings = read_csv(os.path.join(longce_dir, "settings.csv"))
    arms = read_csv(os.path.join(longce_dir, "arms.csv"))
    differences = read_csv(os.path.join(longce_dir, "differences.csv"))
    pooled = read_csv(os.path.join(longce_dir, "published_pooled.csv"))

    tables = {"third/members": member_table(members), "third/calibration_grid": calibration_grid_table(grid)}
    third = third_statistics(members, resamples=resamples)
    tables["third/statistics (rebuilt)"] = third_statistics_table(third)
    for s in settings:
        tables[f"longce/{s['setting']}/arms"] = arms_table(s, arms)
        tables[f"longce/{s['setting']}/differences"] = differences_table(s, differences)
    found = decisions(settings, differences, pooled)
    tables["longce/decisions"] = decisions_table(found, pooled)
    fixed = {}
    for p in pooled:
        fixed[(p["difference"], p["outcome"])] = fixed_effects_from_intervals(
            differences, p["difference"], p["outcome"]
        )
    tables["longce/fixed effects (rebuilt)"] = [
        "| difference | outcome | fixed effects [95%], rebuilt | published |",
        "|---|---|---|---|",
    ] + [
        f"| `{d.replace('-', MINUS).replace(f'ce{MINUS}fresh', 'ce-fresh')}` | {o.replace('_', ' ')} | "
        f"{signed(f['value'], 3)} [{signed(f['low'], 3)}, {signed(f['high'], 3)}] | "
        f"{_interval_text(p['fixed_effects'], p['fixed_effects_low'], p['fixed_effects_high'], 3)} |"
        for (d, o), f, p in zip(fixed, fixed.values(), pooled)
    ]
    markdown = ["# The earlier studies, rebuilt from their committed records", ""]
    markdown.append(
        "These records are transcriptions of the tables docs/reproduction.md published, not the runs' "
        "raw results.json; see docs/records/README.md for what they cannot rebuild."
    )
    for name, lines in tables.items():
        markdown += ["", f"## {name}", "", *lines]
    return {
        "tables": tables,
        "third": third,
        "longce": {"decisions": found, "fixed_effects": fixed},
        "markdown": "\n".join(markdown) + "\n",
    }
