"""The accuracy-against-bytes frontier (``kv_frontier.png``, issue 18 item 5): every model the
project scores, a run of any attention variant or a projected model under any objective, width,
depth and KV compression, placed by the KV-cache bytes per token its own cache held (measured:
dimattn.data.recall.cache_bytes_per_token) against its quality relative to its base under the same
protocol (``rel_to_base``), one panel per probe, the Pareto front drawn through the points no
other point beats on both axes. It answers the project's question, how many dimensions attention
needs, across the three seeds in one picture.

It reads the tidy ``kv_frontier`` summary (dimattn.reporting.summaries.summarize_frontier)
alone. A point is a setting's mean over its seeds (training seeds for runs, fit seeds for
projections), with min-max bars where there are several; the front is taken over those means,
so a point on it by less than its bars is no finding at this scale.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import plots
from .lm_eval import better, lower_is_better
from .replicates import aggregate, seed_counts, spread

# What tells one point from another: the model's identity without its seed.
POINT = ["source", "probe", "family", "reference", "attention", "hidden_size", "d_down", "window", "dilation",
         "bottleneck_activation", "full_attention_every", "attention_layers", "model", "objective", "setting",
         "d_prime", "num_projected", "n_layers", "kv", "kv_method", "kv_level"]


def points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per setting and probe: value, rel_to_base and cache_bytes_per_token averaged over
    seeds (``<column>_spread`` beside), ``pareto``: on the probe's front (no point holds as few
    bytes or fewer with a quality as good or better, one of the two strictly)."""
    if df.empty:
        raise ValueError("the KV frontier needs the kv_frontier summary's rows; it is empty")
    out = aggregate(df, ["value", "rel_to_base", "cache_bytes_per_token"], [c for c in POINT if c in df.columns])
    out["pareto"] = False
    for _, part in out.groupby("probe", sort=False):
        higher = not lower_is_better(part["metric"].iloc[0])
        quality = part["rel_to_base"] if higher else -part["rel_to_base"]
        nbytes = part["cache_bytes_per_token"]
        for i in part.index:
            if pd.isna(quality[i]):
                continue
            beaten = ((nbytes <= nbytes[i]) & (quality >= quality[i]) & ((nbytes < nbytes[i]) | (quality > quality[i])))
            out.loc[i, "pareto"] = not beaten.any()
    return out


def label(row) -> str:
    """A point's short name: the variant and its sizes, or the objective, d', l and the compression."""
    if row["source"] == "run":
        parts = [row["family"]]
        for field, short in (("d_down", "d_down"), ("window", "w"), ("dilation", "dil")):
            if not pd.isna(row.get(field)):
                parts.append(f"{short}={int(row[field])}")
        return " ".join(parts)
    family = row["family"].split("+")[0]  # "kl+snapkv": the compression is named below
    parts = ["base" if row["objective"] == "base" else family]  # the base model, compressed or not
    if row["objective"] != "base":
        parts += [f"d'={int(row['d_prime'])}", f"l={int(row['num_projected'])}/{int(row['n_layers'])}"]
    if row.get("kv_method") not in (None, "none") and not pd.isna(row.get("kv_method")):
        parts.append(f"{row['kv_method']} {int(row['kv_level'])}")
    return " ".join(parts)


def _color(row) -> str:
    if row["source"] == "run":
        return plots.VARIANT_COLORS.get("hybrid" if row["family"].endswith("+full") else row["family"], "0.2")
    objective = row["family"].split("+")[0]
    return plots.OBJECTIVE_COLORS.get(objective, "0.45")


def figure(df: pd.DataFrame, path: Path) -> Path:
    """A panel per probe: x the measured cache bytes per token (log2), y quality in % of its base
    (perplexity: lower is better, the axis says so), the Pareto front as a step line, its points
    named."""
    from matplotlib.lines import Line2D

    pts = points(df)
    probes = list(dict.fromkeys(pts["probe"]))
    ncols, nrows = plots.panel_grid(len(probes), max_cols=2)
    with plots.figure(path, (6.4 * ncols, 5.0 * nrows)) as fig:
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for ax, probe in zip(axes.flat, probes):
            part = pts[pts["probe"] == probe].sort_values("cache_bytes_per_token")
            metric = part["metric"].iloc[0]
            higher = not lower_is_better(metric)
            for _, row in part.iterrows():
                marker = "o" if row["source"] == "run" else "^"
                plots.line(ax, [row["cache_bytes_per_token"]], [spread(row, "rel_to_base")], color=_color(row),
                           marker=marker, linestyle="none", markersize=7 if row["pareto"] else 5,
                           markeredgecolor="black" if row["pareto"] else "none", alpha=0.9)
            front = part[part["pareto"]]
            ax.step(front["cache_bytes_per_token"], front["rel_to_base"], where="post", color="black", lw=1,
                    alpha=0.6, label="Pareto front")
            # Front points nearly equal in bytes would write their names over one another: each
            # gets a number at the point, and the panel a key of numbered names.
            names = []
            for n, (_, row) in enumerate(front.iterrows(), 1):
                ax.annotate(str(n), (row["cache_bytes_per_token"], row["rel_to_base"]), fontsize="x-small",
                            xytext=(3, 4 if higher else -10), textcoords="offset points", weight="bold")
                names.append(f"{n} {label(row)}")
            # the key as a legend of empty handles: loc="best" keeps it off the points
            ax.legend([Line2D([], [], linestyle="none")] * len(names), names, loc="best", fontsize="x-small",
                      handlelength=0, handletextpad=0, framealpha=0.8)
            ax.axhline(100, color="0.6", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("KV-cache bytes per token (measured, model dtype)")
            ax.set_ylabel(f"{metric}, % of its base ({better(metric)})")
            ax.set_title(probe, fontsize="medium")
        plots.hide_unused(axes, len(probes))
        families = dict.fromkeys((r["family"], r["source"], _color(r)) for _, r in pts.iterrows())
        handles = [axes.flat[0].plot([], [], color=c, marker="o" if s == "run" else "^", linestyle="none",
                                     label=f"{f} ({'run' if s == 'run' else 'projected'})")[0]
                   for f, s, c in families]
        fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize="small")
        note = plots.spread_note(seed_counts(pts))
        fig.suptitle("How many bytes a token's keys and values need: quality against the measured KV cache" + note)
    return Path(path)


def frontier_figure(frames: dict, reference_dir: Path, path: Path) -> Path:
    """The registry's renderer (dimattn.reporting.outputs)."""
    return figure(frames["kv_frontier"], path)
