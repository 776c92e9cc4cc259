"""The needle heat map of the long-context suite (``longctx_needle.png``, issue 18 item 4):
niah_single's score by needle depth (rows) and context length (columns), one panel per model,
the base model first; what long-context users look at first.

It reads the tidy ``longctx_needle`` summary (dimattn.reporting.summaries.summarize_longctx_needle)
alone. A panel is a value of ``panel`` (the run by default; a projected model's objective once
those are scored on the suite), each cell the mean score in % over the examples whose needle
falls in that depth bin, printed in the cell, with the fewest examples of any cell in the title
(a test split of 256 examples holds 32 niah_single ones, about 6 a bin).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import plots
from .latex import pct


def _base_first(df: pd.DataFrame, panel: str) -> list:
    """Panels in order: vanilla (the base) first, then the others as they come."""
    names = list(dict.fromkeys(df[panel]))
    base = [n for n in names if (df.loc[df[panel] == n, "attention"] == "vanilla").all()] if "attention" in df else []
    return base + [n for n in names if n not in base]


def needle_grid(rows: pd.DataFrame) -> pd.DataFrame:
    """One panel's cells: depth-bin labels (rows, shallow first) by seq_len (columns), scores in %."""
    labels = rows["depth_lo"].map(lambda x: pct(x, 0)) + "-" + rows["depth_hi"].map(lambda x: pct(x, 0)) + "%"
    grid = rows.assign(depth=labels).pivot_table(index="depth", columns="seq_len", values="score", aggfunc="mean")
    order = rows.drop_duplicates("depth_lo").sort_values("depth_lo").index
    return grid.reindex(labels[order].tolist())


def figure(needle: pd.DataFrame, path: Path, panel: str = "run") -> Path:
    """The heat map: a panel per value of ``panel``, depth against context length."""
    if needle.empty:
        raise ValueError("the needle heat map needs the longctx_needle summary's rows; it is empty")
    names = _base_first(needle, panel)
    ncols, nrows = plots.panel_grid(len(names))
    import seaborn as sns

    with plots.figure(path, (3.2 + 2.6 * ncols, 3.6 * nrows)) as fig:
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for ax, name in zip(axes.flat, names):
            rows = needle[needle[panel] == name]
            sns.heatmap(needle_grid(rows), ax=ax, vmin=0, vmax=100, cmap="viridis", annot=True, fmt=".0f",
                        cbar=ax is axes.flat[len(names) - 1], cbar_kws={"label": "niah_single score (%)"})  # fmt: skip
            ax.set_title(f"{name}\n(>= {int(rows['n'].min())} examples a cell)", fontsize="small")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth (share of the context)")
        plots.hide_unused(axes, len(names))
        fig.suptitle("Needle in a haystack: score by needle depth and context length")
    return Path(path)
