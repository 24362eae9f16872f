"""Reporting evaluation results: a Markdown table on screen, and JSON and CSV files (written atomically).

A *result* is the metric's return dict (``longppl``, ``ppl``, per-text ``longppls``,
``perplexities``, ``n_key_tokens``, ``n_tokens``) under a row name, usually the model's id.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Sequence

from ..atomic_files import cannot_create, write_file_atomically
from ..settings import KeyTokenRule

CSV_COLUMNS = ("model", "longppl", "ppl", "key_tokens", "tokens")

#: The marker of a results folder, like a key-token cache's ``longppl_checksums.json``: the files a
#: command wrote there (``{"command": ..., "files": [names]}``). A folder holding it is the command's
#: own, which a later run may write into; other folders with files are never written into.
OUTPUTS_FILE = "longppl_outputs.json"


def _totals(result: dict) -> tuple[float, int]:
    """Key tokens (an int, or the total weight of the soft variant) and tokens, summed over texts."""
    return sum(result["n_key_tokens"]), int(sum(result["n_tokens"]))


def format_table(rows: Sequence[tuple[str, dict]], soft: bool = False) -> str:
    """Markdown table: model, corpus LongPPL, PPL, key tokens and tokens (summed over texts). With
    ``soft`` every token carries a weight ``min(exp(LSD), gamma)``, which can sum past the token
    count: that column is the total "key weight"."""
    width = max([34] + [len(name) for name, _ in rows])
    key_column = "key weight" if soft else "key tokens"
    lines = [
        f"| {'model':<{width}} | {'LongPPL':>9} | {'PPL':>9} | {key_column:>10} | {'tokens':>7} |",
        f"|{'-' * (width + 2)}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 9}|",
    ]
    for name, result in rows:
        key, tokens = _totals(result)
        lines.append(
            f"| {name:<{width}} | {result['longppl']:>9.2f} | {result['ppl']:>9.2f} | {key:>10.0f} | {tokens:>7} |"
        )
    return "\n".join(lines)


def _json_number(value):
    """JSON has no NaN: a LongPPL without key tokens is written as null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def write_results_json(path: str, rows: Sequence[tuple[str, dict]], meta: dict) -> None:
    """``{"meta": meta, "results": [{"model": name, **result}, ...]}``; NaN becomes null."""
    payload = {
        "meta": meta,
        "results": [
            {
                "model": name,
                **{
                    k: [_json_number(x) for x in v] if isinstance(v, list) else _json_number(v)
                    for k, v in result.items()
                },
            }
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


def explain_missing_key_tokens(
    evaluator_scores: Sequence,
    rule: KeyTokenRule,
    trunc_len: int | None = None,
) -> str:
    """Why a corpus has no key tokens, and what to try, as one sentence for a warning.

    Args:
        evaluator_scores: per text, the evaluator's scores (``lp_long``, ``lp_short`` ``[n]``,
            ``lp_short`` NaN for the first K tokens), e.g. ``KeyTokenCache.scores(row)``.
        rule: the key-token rule that found none.
        trunc_len: K, to name it in the message (``None``: not named).

    Tells apart three causes: no token has a short-context score (every text is at most K evaluator
    tokens long), no scored token passes the rule (alpha / beta too strict: the largest LSD is
    given), and key tokens of the evaluator that no evaluated model's token covers.
    """
    import numpy as np

    from ..rules.key_tokens import key_token_mask, long_short_difference

    alpha, use_lcl = rule.alpha, rule.use_lcl
    k = f"K={trunc_len}" if trunc_len is not None else "K"
    lsd = [long_short_difference(s.lp_long, s.lp_short) for s in evaluator_scores]
    scored = sum(int((~np.isnan(x)).sum()) for x in lsd)
    if scored == 0:
        return (
            f"none of the {len(lsd)} texts is longer than {k} evaluator tokens, so no token has a "
            f"short-context score (LSD) to be a key token. Use longer texts, or score the cache with a "
            f"smaller --trunc-len (longppl-score)."
        )
    keys = sum(int(key_token_mask(s.lp_long, s.lp_short, rule).sum()) for s in evaluator_scores)
    if keys == 0:
        largest = max(float(np.nanmax(x)) for x in lsd if not np.isnan(x).all())
        above = sum(int((x > alpha).sum()) for x in lsd)
        return (
            f"none of the {scored} evaluator tokens with a short-context score meets the key-token rule "
            f"{rule.key_condition()} (largest LSD {largest:.2f}; {above} tokens have LSD > {alpha:g}): alpha/beta are too "
            f"strict for this corpus and evaluator. Try a lower --alpha"
            + (" or --beta, or --no-lcl" if use_lcl else "")
            + "; longppl-visualize --histogram shows the LSD distribution."
        )
    return (
        f"the evaluator has {keys} key tokens, but no token of the evaluated model lies within their "
        f"character spans (tokenizers that split the text very differently). Check the model's tokenizer "
        f"on these texts, or try --add-special-tokens if the model needs them."
    )


def _listed_outputs(folder: str) -> list[str] | None:
    """The file names ``OUTPUTS_FILE`` in ``folder`` lists, or ``None`` (no such readable marker). Only
    plain names count: the list never leads a removal out of the folder."""
    try:
        with open(os.path.join(folder, OUTPUTS_FILE), encoding="utf-8") as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, list):
        return None
    return [
        name
        for name in files
        if isinstance(name, str) and name not in ("", ".", "..", OUTPUTS_FILE) and os.path.basename(name) == name
    ]


def check_results_folder(folder: str, argument: str) -> None:
    """Refuse, with a ``ValueError`` naming ``argument``, a results folder a command must not write into:
    one that cannot be created (under a file, through a loop of links, not writable), or an existing
    folder with files but without ``OUTPUTS_FILE`` (the user's own files, which the results would
    overwrite). A missing or empty folder, or one holding a command's earlier results, is fine.
    Called before any model is loaded."""
    problem = cannot_create(folder, folder=True)
    if problem is not None:
        raise ValueError(f"{argument} {folder!r} {problem}; pass a folder for results (created if missing).")
    if os.path.isdir(folder) and os.listdir(folder) and _listed_outputs(folder) is None:
        shown = sorted(os.listdir(folder))
        raise ValueError(
            f"{argument} {folder!r} holds files this command did not write ({', '.join(shown[:5])}"
            f"{', …' if len(shown) > 5 else ''}) and the results would overwrite them: choose a new or empty "
            f"folder (a folder of this command's earlier results, marked by its {OUTPUTS_FILE}, is reused)."
        )


def write_outputs(folder: str, command: str, writers: dict[str, Callable[[str], None]]) -> list[str]:
    """Write a command's result files into ``folder`` (checked by :func:`check_results_folder`) and mark
    it as theirs; returns their paths.

    ``writers``: ``{file name: write(path)}``, called in order (each writes atomically). Files an earlier
    run listed in ``OUTPUTS_FILE`` that this run does not write (an old ``correlation.png``) are removed,
    so the folder holds this run's results only; nothing else in the folder is touched. The marker lists
    every file of both runs while they are written, so an interrupted run leaves no file unlisted.
    """
    os.makedirs(folder, exist_ok=True)
    before = _listed_outputs(folder) or []
    names = list(writers)

    def mark(files: list[str]) -> None:
        payload = {"command": command, "files": files}
        write_file_atomically(os.path.join(folder, OUTPUTS_FILE), lambda handle: json.dump(payload, handle, indent=1))

    mark(sorted(set(before) | set(names)))
    for name, write in writers.items():
        write(os.path.join(folder, name))
    for name in sorted(set(before) - set(names)):
        stale = os.path.join(folder, name)
        if os.path.isfile(stale) or os.path.islink(stale):
            os.remove(stale)
    mark(names)
    return [os.path.join(folder, name) for name in names]
