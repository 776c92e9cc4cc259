"""The needle heat map of the long-context suite (``longctx_needle.png``, issue 18 item 4):
the score by the asked needle's depth (rows) and context length (columns), one panel per model
(columns of panels, the base model first) and subtask (rows of panels: niah_single, whose
needle holds the context's only value, and niah_multikey, whose asked needle sits among
distractors); what long-context users look at first.

It reads the tidy ``longctx_needle`` summary (dimattn.reporting.summaries.summarize_longctx_needle)
alone. A panel is a value of ``panel`` (the run by default; a projected model's objective once
those are scored on the suite), each cell the mean score in % over the examples whose needle
falls in that depth bin, printed in the cell, with the fewest examples of any cell in the title
(a test split of 256 examples holds 32 niah_single ones, about 6 a bin).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dimattn.workflow.sweeps import BASE_OBJECTIVE, MAIN_STUDY, NO_KV
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


def figure(needle: pd.DataFrame, path: Path, panel: str = "run", title: str = "") -> Path:
    """The heat map: a panel per value of ``panel`` (columns) and subtask (rows), depth against
    context length."""
    if needle.empty:
        raise ValueError("the needle heat map needs the longctx_needle summary's rows; it is empty")
    names, tasks = _base_first(needle, panel), list(dict.fromkeys(needle["subtask"]))
    with plots.figure(path, (3.2 + 3.0 * len(names), 3.6 * len(tasks))) as fig:
        axes = fig.subplots(len(tasks), len(names), squeeze=False)
        for r, task in enumerate(tasks):
            for c, name in enumerate(names):
                ax, rows = axes[r, c], needle[(needle[panel] == name) & (needle["subtask"] == task)]
                if rows.empty:
                    ax.set_visible(False)
                    continue
                plots.heatmap(ax, needle_grid(rows), vmin=0, vmax=100, cmap="viridis", fmt=".0f",
                              colorbar_label="score (%), higher is better" if c == len(names) - 1 else None)
                ax.set_title(f"{name}: {task}\n(>= {int(rows['n'].min())} examples a cell)", fontsize="small")
                ax.set_xlabel("context length (tokens)")
                ax.set_ylabel("needle depth (share of the context)")
        fig.suptitle(title or "Needle in a haystack: score by needle depth and context length")
    return Path(path)


def needle_figure(frames: dict, reference_dir: Path, path: Path) -> Path:
    """The registry's renderer (dimattn.reporting.outputs): the heat map of the runs on the suite."""
    return figure(frames["longctx_needle"], path)


def projected_panels(needle: pd.DataFrame, downstream: pd.DataFrame) -> pd.DataFrame:
    """The dimpo_needle rows the projections' heat map draws, with a ``panel`` label: per suite
    model, its base model (l = 0) and each objective at the model's separating l (the l of its
    Tables 2-3 at the shortest suite length: dimattn.reporting.dimpo_downstream.separating_l),
    Table 1's projections without KV compression; the cells average the fit seeds."""
    from . import dimpo_downstream as dd

    needle = needle[(needle["study"] == MAIN_STUDY) & (needle["kv"] == NO_KV)]
    points = dd.probe_points(dd.long_context(dd.main_study(downstream)))
    parts = []
    for model, rows in needle.groupby("model", sort=False):
        corpus = rows.sort_values("seq_len")["corpus"].iloc[0]
        l_star = dd.separating_l(points[(points["model"] == model) & (points["probe"] == f"suite {corpus}")])
        if l_star is None:
            raise ValueError(f"dimpo model {model!r}: no projected model on the suite to draw beside its base")
        base = rows["objective"] == BASE_OBJECTIVE
        shown = rows[base | (rows["num_projected"] == l_star)]
        label = shown["objective"].map(lambda o: dd.objective_label(o) if o == BASE_OBJECTIVE
                                       else f"{dd.objective_label(o)}, l = {l_star} of {int(rows['n_layers'].iloc[0])}")
        parts.append(shown.assign(panel=f"{model}: " + label,
                                  attention=shown["objective"].map(lambda o: "vanilla" if o == BASE_OBJECTIVE else o)))
    return pd.concat(parts, ignore_index=True) if parts else needle.assign(panel=[], attention=[])


def dimpo_needle_figure(frames: dict, reference_dir: Path, path: Path) -> Path:
    """The registry's renderer: the heat map of each suite model's projections beside its base
    (issue 18 item 4), at the depth where the objectives lie furthest apart."""
    panels = projected_panels(frames["dimpo_needle"], frames["dimpo_downstream"])
    return figure(panels, path, panel="panel",
                  title="Needle in a haystack with projected layers: score by needle depth and context length "
                        "(mean over fit seeds)")
