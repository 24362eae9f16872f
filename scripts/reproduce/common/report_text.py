"""What the report stages share: numbers as text (``n/a`` where a value is undefined), mean and sd
over seeds, and the closing sections, the wall times of ``timings.json`` and the figures."""

from __future__ import annotations

import math
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


def spread(values: list) -> dict:
    """Mean and sample standard deviation over the finite ``values`` (``n`` of them)."""
    defined = [float(v) for v in values if finite(v)]
    if not defined:
        return {"mean": None, "sd": None, "n": 0}
    mean = sum(defined) / len(defined)
    sd = math.sqrt(sum((v - mean) ** 2 for v in defined) / (len(defined) - 1)) if len(defined) > 1 else 0.0
    return {"mean": mean, "sd": sd, "n": len(defined)}
