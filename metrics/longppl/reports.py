"""Reporting evaluation results: a Markdown table on screen, and JSON and CSV files (written atomically).

A *result* is the metric's return dict (``longppl``, ``ppl``, per-text ``longppls``,
``perplexities``, ``n_key_tokens``, ``n_tokens``) under a row name, usually the model's id.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence

from .atomic_files import write_file_atomically

CSV_COLUMNS = ("model", "longppl", "ppl", "key_tokens", "tokens")


def _totals(result: dict) -> tuple[float, int]:
    """Key tokens (an int, or the total weight of the soft variant) and tokens, summed over texts."""
    return sum(result["n_key_tokens"]), int(sum(result["n_tokens"]))


def format_table(rows: Sequence[tuple[str, dict]]) -> str:
    """Markdown table: model, corpus LongPPL, PPL, key tokens and tokens (summed over texts)."""
    width = max([34] + [len(name) for name, _ in rows])
    lines = [
        f"| {'model':<{width}} | {'LongPPL':>9} | {'PPL':>9} | {'key tokens':>10} | {'tokens':>7} |",
        f"|{'-' * (width + 2)}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 9}|",
    ]
    for name, result in rows:
        key, tokens = _totals(result)
        lines.append(f"| {name:<{width}} | {result['longppl']:>9.2f} | {result['ppl']:>9.2f} | {key:>10.0f} | {tokens:>7} |")
    return "\n".join(lines)


def _json_number(value):
    """JSON has no NaN: a LongPPL without key tokens is written as null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def write_results_json(path: str, rows: Sequence[tuple[str, dict]], meta: dict) -> None:
    """``{"meta": meta, "results": [{"model": name, **result}, ...]}``; NaN becomes null."""
    payload = {
        "meta": meta,
        "results": [
            {"model": name, **{k: [_json_number(x) for x in v] if isinstance(v, list) else _json_number(v)
                               for k, v in result.items()}}
            for name, result in rows
        ],
    }
    write_file_atomically(path, lambda handle: json.dump(payload, handle, indent=1))


def write_results_csv(path: str, rows: Sequence[tuple[str, dict]]) -> None:
    """One line per model: ``CSV_COLUMNS`` (corpus values, token counts summed over texts)."""

    def write(handle):
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for name, result in rows:
            key, tokens = _totals(result)
            writer.writerow([name, result["longppl"], result["ppl"], key, tokens])

    write_file_atomically(path, write, newline="")
