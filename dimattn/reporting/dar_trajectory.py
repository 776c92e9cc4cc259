"""Seed 000 Figure 3: validation perplexity relative to Vanilla along training (``dar_trajectory.png``
from the ``dar_trajectory`` summary), each run beside the Vanilla of its width and seed."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter

from . import plots, selection
from .latex import fmt_fraction, fraction, na
from .plots import VARIANT_COLORS
from .replicates import seed_counts, settings, spread
from .selection import NoRuns, frame_scales, records, rows_of

Frames = dict[str, pd.DataFrame]

def _run_label(row) -> str:
    label = selection.kind_label(selection.kind(row))
    if not na(row["d_down"]):
        label += (
            f" $d_{{\\mathrm{{down}}}}$={int(row['d_down'])} "
            f"({fmt_fraction(fraction(row['d_down'], row['hidden_size']))})"
        )
    if row["attention"] == "dar" and not na(row["window"]):
        label += f", w={int(row['window'])}"
    return label


def _tokens_formatter(x, _):
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def trajectory_runs(traj: pd.DataFrame) -> pd.DataFrame:
    """Table 1's runs per (dataset, hidden_size): plain Vanilla, Uniform, and DAR at the main window."""
    kept = [
        rows_of(rows, selection.table1(records(rows)))
        for _, rows in frame_scales(traj, selection.RUN_SCALE_KEYS)
    ]
    kept = [rows for rows in kept if not rows.empty]
    return pd.concat(kept) if kept else traj.iloc[:0]


def trajectory_figure(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Figure 3: validation perplexity relative to Vanilla along training, Table 1's runs only."""
    traj = trajectory_runs(frames["dar_trajectory"].dropna(subset=["rel_to_vanilla"]))
    traj = settings(traj, ["rel_to_vanilla"], ["dataset", "step"])
    runs = traj[traj["attention"] != "vanilla"].drop_duplicates("run")
    # The fullest sweeps first, wider models first on a tie.
    sizes = runs.groupby(["dataset", "hidden_size"], sort=False)["run"].nunique()
    panels = sorted(sizes.index, key=lambda k: (-sizes[k], -int(k[1]), str(k[0])))
    if not panels:
        raise NoRuns("no plain DAR or Uniform run has a vanilla run of its dataset and width")
    ncols, nrows = plots.panel_grid(len(panels), 2)
    with plots.figure(path, (7.0 * ncols + 3.2, 4.8 * nrows)) as fig:
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for ax, (dataset, hidden_size) in zip(axes.flat, panels):
            ax.axhline(100, color=VARIANT_COLORS["vanilla"], lw=1.5, label="Vanilla (= 100)")
            these = runs[(runs["dataset"] == dataset) & (runs["hidden_size"] == hidden_size)]
            for attention, marker, cmap in (("dar", "o", "Blues"), ("uniform", "s", "Oranges")):
                group = these[these["attention"] == attention].sort_values(["d_down", "window"], ascending=False)
                # Narrower bottleneck, darker line: the gap to Vanilla should grow with the colour.
                shades = sns.color_palette(cmap, len(group) + 2)[2:]
                for shade, (_, run) in zip(shades, group.iterrows()):
                    rows = traj[traj["run"] == run["run"]].sort_values("tokens")
                    plots.line(
                        ax,
                        rows["tokens"].astype(float),
                        [spread(r, "rel_to_vanilla") for _, r in rows.iterrows()],
                        color=shade,
                        lw=2,
                        marker=marker,
                        ms=4,
                        ls="-" if attention == "dar" else "--",
                        label=_run_label(run),
                    )
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens_formatter))
            ax.set_xlabel("training tokens")
            ax.set_title(f"{dataset}, d = {hidden_size}" if dataset else f"d = {hidden_size}")
            ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
        plots.hide_unused(axes, len(panels))
        for ax in axes[:, 0]:
            ax.set_ylabel("validation perplexity relative to Vanilla (%)\nlower is better")
        fig.suptitle(
            "Validation perplexity relative to Vanilla during training (analogue of seed 000 Figure 3)\n"
            "100 = Vanilla at the same step; below 100 beats it"
            + plots.spread_note(seed_counts(traj[traj["attention"] != "vanilla"])),
            fontsize=12,
        )
    return Path(path)
