"""Shared matplotlib pieces: one colour and marker per variant and objective, the axes the
figures share (log2 ratio axes, plain log y), and a figure context that saves a PNG atomically.

Figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot state), in
seaborn's whitegrid style, so one figure's settings never leak into the next. A point of a
setting trained with several seeds is their mean with a min-max error bar (:func:`line`); a
reference line gets a min-max band (:func:`hline`); :func:`spread_note` says so in the title.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
from seaborn.utils import relative_luminance

from dimattn.model.atomic import atomic_file
from .latex import fmt_fraction
from .replicates import Spread, seeds_text

DPI = 150
VARIANT_COLORS = {
    "vanilla": "0.35",
    "dar": "#1f77b4",
    "uniform": "#d95f02",
    "swa": "#1b9e77",
    "dilated": "#7570b3",
    "hybrid": "#e7298a",
}
VARIANT_MARKERS = {"vanilla": "^", "dar": "o", "uniform": "s", "swa": "D", "dilated": "v"}
CHANCE_COLOR = "0.55"
_CB = sns.color_palette("colorblind")
# Fixed per objective, so a colour means the same objective in every panel and figure.
OBJECTIVE_COLORS = {
    "random": _CB[4],
    "pca": _CB[1],
    "triplet": _CB[5],
    "cpo": _CB[3],
    "simpo": _CB[6],
    "orpo": _CB[9],
    "dimpo_list": _CB[8],
    "dimpo": _CB[0],
    "dimpo_kl": _CB[7],
    "kl": _CB[2],
}


def kind_color(kind: tuple) -> str:
    """A run kind's colour (``selection.kind``): the hybrids (SWA/dilated + full layers) get their own."""
    attention, _, every, _ = kind
    if attention in ("swa", "dilated") and every:
        return VARIANT_COLORS["hybrid"]
    return VARIANT_COLORS.get(attention, "0.2")


@contextmanager
def figure(path: Path, figsize: tuple[float, float]):
    """Yield a new constrained-layout figure; when the block succeeds, save it to ``path`` as PNG."""
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig
        with atomic_file(Path(path)) as tmp:
            # no bbox_inches="tight": the constrained layout already fits the figure (the PNGs
            # lose only the tight box's 0.1 in pad), and a tight box costs a second draw
            fig.savefig(tmp, format="png", dpi=DPI)


def line(ax, x, spreads: Sequence[Spread], factor: float = 1.0, **style):
    """A line through the means of ``spreads`` (times ``factor``), with min-max error bars where
    a point has several seeds; a plain ``ax.plot`` where none has. Returns the legend handle (the
    line, or the errorbar container, which carries the label)."""
    means = [s.mean * factor for s in spreads]
    if not any(s.n > 1 for s in spreads):
        return ax.plot(x, means, **style)[0]
    # max(..., 0): the mean of equal values can round an ulp past them
    below = [max(s.mean - s.min, 0.0) * abs(factor) if s.n > 1 else 0.0 for s in spreads]
    above = [max(s.max - s.mean, 0.0) * abs(factor) if s.n > 1 else 0.0 for s in spreads]
    return ax.errorbar(x, means, yerr=[below, above], capsize=3, elinewidth=1.1, **style)


def hline(ax, spread: Spread, factor: float = 1.0, **style):
    """A horizontal reference line at the mean, with a min-max band where it has several seeds."""
    if spread.n > 1:
        color = style.get("color", "0.5")
        ax.axhspan(spread.min * factor, spread.max * factor, color=color, alpha=0.15, lw=0, zorder=0)
    return ax.axhline(spread.mean * factor, **style)


def spread_note(counts: Counter, bands: bool = False) -> str:
    """The title's line on replicates, or "" when every setting has one seed; ``bands``: the
    figure has reference lines (:func:`hline`)."""
    if not counts:
        return ""
    what = "error bars and shaded bands" if bands else "error bars"
    return f"\n{what}: min–max over {seeds_text(counts)}; points and lines at the mean"


def panel_grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    """(columns, rows) for n panels."""
    ncols = max(1, min(n, max_cols))
    return ncols, math.ceil(n / ncols)


def hide_unused(axes, n: int) -> None:
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)


def plain_log_y(ax) -> None:
    """Log y with plain numbers (0.003, not 3x10^-3); a few minor ticks labelled on short spans,
    every one on shorter spans, and a linear axis where not even two ticks would fall in range."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    decades = math.log10(high / low) if low > 0 else 3
    keep = {2, 3, 5} if decades < 1.2 else {3} if decades < 2.2 else set()

    def labelled(mantissas):
        if low <= 0:
            return 2
        exponents = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
        return sum(low <= m * 10.0**e <= high for e in exponents for m in mantissas | {1})

    if labelled(keep) < 2:
        keep = set(range(2, 10))
        if labelled(keep) < 2:
            ax.set_yscale("linear")  # matplotlib's own formatter, with its offset, reads a narrow span
            return

    def minor(y, _):
        mantissa = round(y / 10 ** math.floor(math.log10(y) + 1e-9), 6)
        return f"{y:g}" if mantissa in keep else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def log2_fraction_axis(ax, ratios: Iterable[Fraction], label: str, dim: int | None = None) -> None:
    """Log2 x axis ticked at the ratios, as fractions; with dim, each tick also gives ratio * dim."""
    ticks = sorted({float(r) for r in ratios})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())

    def tick(x, _):
        frac = Fraction(x).limit_denominator(1024)
        return fmt_fraction(frac) if dim is None else f"{fmt_fraction(frac)}\n({fmt_fraction(frac * dim)})"

    ax.xaxis.set_major_formatter(FuncFormatter(tick))
    if ticks:
        ax.set_xlim(ticks[0] / 1.35, ticks[-1] * 1.35)
    ax.set_xlabel(label)


def heatmap(ax, grid, vmin: float, vmax: float, cmap: str, fmt: str, colorbar_label: str | None = None):
    """``grid`` (a DataFrame: rows top-down, columns left to right) as cells coloured by value,
    each written on its cell in ``fmt`` in black or white by the cell's luminance, as seaborn's
    heatmap draws them; a colourbar labelled ``colorbar_label`` when given. Not sns.heatmap: it
    draws the whole figure once a call (to turn overlapping tick labels), so a figure of n panels
    draws n times; cpu-full's needle map of projections (128 panels) took 49 s so."""
    values = np.ma.masked_invalid(grid.to_numpy(dtype=float))
    mesh = ax.pcolormesh(values, cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set(xlim=(0, values.shape[1]), ylim=(values.shape[0], 0))  # the first row on top
    ax.set_xticks(np.arange(values.shape[1]) + 0.5, [str(c) for c in grid.columns])
    ax.set_yticks(np.arange(values.shape[0]) + 0.5, [str(r) for r in grid.index], va="center")
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    for (i, j), value in np.ndenumerate(values.filled(np.nan)):
        if np.isfinite(value):
            light = relative_luminance(mesh.cmap(mesh.norm(value))) > 0.408
            ax.text(j + 0.5, i + 0.5, format(value, fmt), ha="center", va="center", color="0.15" if light else "w")
    if colorbar_label is not None:
        bar = ax.figure.colorbar(mesh, ax=ax, label=colorbar_label)
        bar.outline.set_linewidth(0)
    return mesh
