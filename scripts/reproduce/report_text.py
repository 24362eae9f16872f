"""What the two pipelines' ``report.md`` share: numbers as text (``n/a`` where a value is undefined)
and the closing sections, the wall times of ``timings.json`` and the figures."""

from __future__ import annotations

import os

from .run_folder import finite


def fmt(value, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, or ``n/a`` when it is undefined (``None``, NaN, infinite)."""
    return f"{value:.{digits}f}" if finite(value) else "n/a"


def closing_sections(results: dict) -> list[str]:
    """The report's last lines: wall seconds per group (``results["timings"]``, the content of
    ``timings.json``: ``{group: {name: {"seconds", "calls"}}}``), then a Markdown image per path of
    ``results["figures"]``."""
    out = ["", "## Wall time (seconds, summed over calls)", ""]
    for group, entries in results["timings"].items():
        out.append(f"- {group}: " + ", ".join(f"{name} {e['seconds']:.1f}" for name, e in entries.items()))
    return out + [f"![{os.path.basename(p)}]({p})" for p in results["figures"]]
