"""Figures like the paper's: LongPPL and PPL against a benchmark (Fig. 1(b)), and the distribution of
LSD values over a corpus (Fig. 4(a)). Written in the format their file name's suffix names (PNG,
JPEG, PDF, SVG, ...: :data:`FIGURE_FORMATS`).

Needs matplotlib (``pip install "longppl-hf[plots]"``). Figures are drawn on matplotlib's Agg canvas
without pyplot, so the caller's plotting backend and open figures are left alone, and saved
atomically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..atomic_files import write_file_atomically
from .correlation import least_squares_line, pearson, spearman

KEY_COLOR = "#ff7f1f"  # the paper's highlight colour for key tokens (RGB 255, 127, 31)
PPL_COLOR = "#4a6fa5"


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "Drawing PNG figures needs matplotlib: pip install matplotlib (or the 'plots' extra of longppl-hf)."
        ) from err
    return Figure(figsize=(width, height), dpi=120, layout="constrained")


#: The formats a figure is written in, by the suffix of its name (matplotlib's names): raster images
#: through Pillow, vector formats through matplotlib's own writers. A name without a suffix is PNG.
FIGURE_FORMATS = ("png", "jpg", "jpeg", "tif", "tiff", "webp", "gif", "pdf", "svg", "svgz", "eps", "ps")


def figure_format(path: str) -> str:
    """The format of the figure file ``path``, from its suffix (``lsd.jpg`` -> ``jpg``; no suffix: ``png``).

    Raises:
        ValueError: a suffix none of ``FIGURE_FORMATS`` names (a figure is never written in one format
            under another's name), naming the suffixes that work.
    """
    suffix = os.path.splitext(os.path.basename(path))[1].lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in FIGURE_FORMATS:
        raise ValueError(
            f"{path!r}: a figure cannot be written as .{suffix}; name it with one of the suffixes "
            f"{', '.join('.' + name for name in FIGURE_FORMATS)}."
        )
    return suffix


def _save(figure, path: str) -> None:
    file_format = figure_format(path)
    write_file_atomically(path, lambda handle: figure.savefig(handle, format=file_format), binary=True)


def short_model_names(models: Sequence[str]) -> list[str]:
    """Plot labels for model ids or paths: the last path component (``Qwen/Qwen2-7B`` -> ``Qwen2-7B``,
    ``/ckpt/run1/`` -> ``run1``), with as many parent components as needed to tell apart names
    whose ends collide (``a/model``, ``b/model``). Same order and length as ``models``."""
    parts = [[p for p in str(m).replace("\\", "/").split("/") if p] or [str(m)] for m in models]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashing = [i for i, label in enumerate(labels) if labels.count(label) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            return labels
        for i in clashing:
            depth[i] += 1


def correlation_figure(
    models: Sequence[str],
    longppl: Sequence[float],
    ppl: Sequence[float],
    scores: Sequence[float],
    benchmark: str = "benchmark score",
):
    """The matplotlib ``Figure`` of :func:`correlation_scatter` (Agg canvas, not saved).

    Two panels, benchmark score (y) against LongPPL (left) and PPL (right), one point per model in
    one colour, labelled with :func:`short_model_names`; a dashed least-squares line labelled with
    Pearson's r in each panel's legend (none when x is constant), Pearson and Spearman in the titles.
    All sequences are ``[n_models]``, in the same order.
    """
    labels = short_model_names(models)
    figure = _figure(10, 4.2)
    axes = figure.subplots(1, 2, sharey=True)
    for ax, values, name in ((axes[0], longppl, "LongPPL"), (axes[1], ppl, "PPL")):
        ax.scatter(values, scores, s=46, color=PPL_COLOR, edgecolor="black", linewidth=0.5, zorder=3, label="model")
        for label, x, y in zip(labels, values, scores):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        r = pearson(values, scores)
        slope, intercept = least_squares_line(values, scores)
        if np.isfinite(slope):
            ends = np.array([min(values), max(values)], dtype=np.float64)
            ax.plot(
                ends,
                slope * ends + intercept,
                color="black",
                linestyle="--",
                linewidth=1,
                zorder=2,
                label=f"least-squares fit (Pearson r = {r:.2f})",
            )
        ax.set_title(f"{name}: Pearson {r:.2f}, Spearman {spearman(values, scores):.2f}")
        ax.set_xlabel(name)
        ax.grid(alpha=0.3, zorder=0)
        ax.margins(x=0.2, y=0.1)  # room for the labels
        ax.legend(loc="best", fontsize=8)
    axes[0].set_ylabel(benchmark)
    return figure


def correlation_scatter(
    path: str,
    models: Sequence[str],
    longppl: Sequence[float],
    ppl: Sequence[float],
    scores: Sequence[float],
    benchmark: str = "benchmark score",
) -> None:
    """Write :func:`correlation_figure` to ``path``, in the format its suffix names (like the paper's
    Figure 1(b))."""
    _save(correlation_figure(models, longppl, ppl, scores, benchmark), path)


def lsd_histogram(path: str, lsd: np.ndarray, alpha: float, title: str = "LSD of the corpus tokens") -> None:
    """Histogram of LSD values (NaNs ignored) with the key-token threshold ``alpha`` marked (a bin
    edge, bars above it in the key-token colour), and the shares of tokens below 0.5, between 0.5
    and alpha, and above alpha (like the paper's Figure 4(a)); log-scaled counts."""
    lsd = np.asarray(lsd, dtype=np.float64)
    lsd = lsd[~np.isnan(lsd)]
    if lsd.size == 0:
        raise ValueError("No token has an LSD value (every text is at most trunc_len tokens long); nothing to plot.")
    # The bulk sets the range (a few outliers must not squeeze it into one bar); outliers go to the end bins.
    low, high = np.percentile(lsd, [0.1, 99.9])
    span = max(high - low, abs(alpha), 1e-3)
    low, high = min(low, alpha - 0.05 * span), max(high, alpha + 0.05 * span)
    below = max(2, int(round(60 * (alpha - low) / (high - low))))
    edges = np.concatenate([np.linspace(low, alpha, below + 1), np.linspace(alpha, high, max(2, 60 - below) + 1)[1:]])
    clipped = np.clip(lsd, low, high)
    figure = _figure(6.4, 4.2)
    ax = figure.subplots()
    ax.hist(clipped[clipped <= alpha], bins=edges, color=PPL_COLOR, label=f"LSD <= {alpha:g}")
    ax.hist(clipped[clipped > alpha], bins=edges, color=KEY_COLOR, label=f"LSD > {alpha:g} (key if LCL > beta)")
    ax.axvline(alpha, color="black", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("LSD = log P(x | long context) - log P(x | short context)")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    bands = [(f"LSD <= {alpha:g}", lsd <= alpha)]
    if alpha > 0.5:  # the paper's reading: most tokens below 0.5, few above alpha = 2
        bands = [("LSD < 0.5", lsd < 0.5), (f"0.5 <= LSD <= {alpha:g}", (lsd >= 0.5) & (lsd <= alpha))]
    bands.append((f"LSD > {alpha:g}", lsd > alpha))
    shares = "\n".join(f"{name}: {np.mean(mask):.1%}" for name, mask in bands) + f"\n{lsd.size:,} tokens"
    ax.text(
        0.98,
        0.97,
        shares,
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=9,
        bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"),
    )
    ax.legend(loc="upper left", fontsize=8)
    _save(figure, path)
