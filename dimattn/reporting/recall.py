"""The multi-query associative recall probe (``recall.tex``, ``recall.png``): our own measure of
whether a model can fetch a value stored far back, which for DAR means through the bottleneck.

No paper reports these numbers. Per recall scale the table lists accuracy over all queries and
per query-to-key distance, in groups: Vanilla; DAR at the main window per d_down; Uniform; DAR at
other windows; seed 001 baselines and DAR variants. The figure plots accuracy against d_down/d
(DAR vs. Uniform) and against distance (one run of each kind). Settings trained with several
seeds show their mean and min-max range; in the d_down and window sweeps, a row within the seed
spread of its neighbour is marked.
"""

from __future__ import annotations

import textwrap
from fractions import Fraction
from pathlib import Path

import pandas as pd
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from . import latex, plots, selection
from .baselines import setting
from .latex import DAGGER, MISSING, SpreadCells, fmt_fraction, fraction, pct
from .plots import CHANCE_COLOR, VARIANT_COLORS, VARIANT_MARKERS
from .replicates import Spread, seed_counts, settings, spread


def _distance_note(overall: pd.DataFrame) -> str:
    """Whether every query is beyond every window of the scale (then only the distant path can answer)."""
    nearest = overall["min_distance"].dropna()
    windows = overall["window"].dropna()
    if nearest.empty:
        return ""
    nearest = int(nearest.min())
    if windows.empty:
        return f"queries lie at least {nearest} tokens from their keys"
    widest = int(windows.max())
    if nearest >= widest:
        return (
            f"queries lie at least {nearest} tokens from their keys, beyond every window here (at most {widest}): "
            "DAR must answer through the bottleneck, SWA cannot reach the key in one layer"
        )
    return f"queries lie at least {nearest} tokens from their keys; windows here reach up to {widest}"


def _blocks(recall: pd.DataFrame) -> list[dict]:
    """Per recall scale: its distance bins and its runs in the groups the recall table shows."""
    if recall.empty:
        raise selection.NoRuns("no run on a synthetic recall corpus")
    recall = settings(recall, ["accuracy"], ["corpus", "split", "scope", "bin"])
    blocks = []
    for scale, rows in selection.frame_scales(recall):
        overall = rows[rows["scope"] == "overall"].drop_duplicates("run")
        dist = rows[rows["scope"] == "distance"]
        bins = (
            dist.dropna(subset=["bin"])
            .drop_duplicates("bin")
            .sort_values("bin")[["bin", "min_distance", "max_distance"]]
        )
        plain = selection.plain_mask(overall)
        main_window = selection.main_window(selection.records(overall))
        is_dar, is_uniform = overall["attention"] == "dar", overall["attention"] == "uniform"
        at_main = (overall["window"] == main_window).fillna(False).astype(bool)
        groups = [
            ("reference", overall[overall["attention"] == "vanilla"]),
            ("d_down", overall[plain & is_dar & at_main].sort_values("d_down", ascending=False)),
            ("uniform", overall[plain & is_uniform].sort_values("d_down", ascending=False)),
            ("window", overall[plain & is_dar & ~at_main].sort_values(["d_down", "window"], ascending=[False, True])),
        ]
        others = overall[~plain]
        others = others.assign(_k=[selection.kind_rank(selection.kind(r)) for _, r in others.iterrows()])
        groups.append(("baselines", others.sort_values(["_k", "window", "d_down"], kind="stable").drop(columns="_k")))
        by_bin = {(r.run, r.bin): r.accuracy_spread for r in dist.itertuples()}
        blocks.append(
            {
                "scale": scale,
                "bins": bins,
                "groups": [(name, g) for name, g in groups if not g.empty],
                "by_bin": by_bin,
                "chance": float(overall["chance"].iloc[0]) if len(overall) else None,
                "main_window": main_window,
                "overall": overall,
                "distance": dist,
                "distance_note": _distance_note(overall),
            }
        )
    return blocks


def _seed_counts(blocks: list[dict]):
    return seed_counts(*(b["overall"] for b in blocks), *(b["distance"] for b in blocks))


def table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Recall accuracy per run: overall and per query-to-key distance bin, per recall scale."""
    out = []
    blocks = _blocks(frames["recall"])
    cell = SpreadCells(
        _seed_counts(blocks),
        {DAGGER: r"this row and the row above (the next wider d\textsubscript{down}, or the next smaller window)"},
    )
    for block in blocks:
        bins = [
            {"bin": int(b.bin), "head": f"{int(b.min_distance)}--{int(b.max_distance)}"}
            for b in block["bins"].itertuples()
        ]
        chance = pct(block["chance"])
        groups = [[{"label": "Chance", "setting": "", "ratio": "", "all": chance, "bins": [chance] * len(bins)}]]
        for name, rows in block["groups"]:
            group, above = [], None
            for _, run in rows.iterrows():
                ratio = fraction(run["d_down"], run["hidden_size"])
                neighbour = name in ("d_down", "uniform") or (
                    name == "window" and above is not None and above["d_down"] == run["d_down"]
                )
                within = neighbour and above is not None and spread(run, "accuracy").overlaps(spread(above, "accuracy"))
                group.append(
                    {
                        "label": selection.kind_label(selection.kind(run)),
                        "setting": setting(run),
                        "ratio": fmt_fraction(ratio) if ratio is not None else "",
                        "all": cell(spread(run, "accuracy"), pct, [DAGGER] if within else []),
                        "bins": [cell(block["by_bin"].get((run["run"], b["bin"])), pct) for b in bins],
                    }
                )
                above = run
            groups.append(group)
        n = block["overall"]["n"].dropna()
        out.append(
            {
                "corpus": selection.scale_label(block["scale"]),
                "d_model": block["scale"]["hidden_size"],
                "bins": bins,
                "groups": groups,
                "n_queries": ", ".join(str(int(v)) for v in sorted(n.unique())) or MISSING,
                "distance_note": block["distance_note"],
            }
        )
    return latex.render("recall.tex.j2", path, blocks=out, spread_note=cell.note())


def _selected_for_distance(overall: pd.DataFrame) -> list[tuple[tuple, dict]]:
    """Vanilla, SWA, dilated, the hybrids, DAR and Uniform (plain, at the reference d_down)."""
    keep = []
    for kind, run in selection.representatives(selection.records(overall)).items():
        attention, bottleneck, every, layers = kind
        if attention in ("vanilla", "swa", "dilated") and not bottleneck and not layers:
            keep.append((kind, run))
        elif attention in ("dar", "uniform") and not (bottleneck or every or layers):
            keep.append((kind, run))
    return keep


# Line styles of the window sweep's DAR runs in the distance panel (the chosen DAR run is solid).
WINDOW_STYLES = ["--", "-.", (0, (5, 1, 1, 1)), (0, (1, 1))]


def _other_windows(overall: pd.DataFrame) -> list[dict]:
    """The plain DAR runs of the scale's window sweep (seed 000 Table 3's d_down) at the windows
    the chosen DAR run (``_selected_for_distance``) is not at, by window."""
    runs = selection.records(overall)
    d_down = selection.window_sweep(runs)
    if d_down is None:
        return []
    shown = {run["run"] for _, run in _selected_for_distance(overall)}
    sweep = [r for r in selection.plain(runs) if r["attention"] == "dar" and r["d_down"] is not None
             and int(r["d_down"]) == d_down and r["run"] not in shown]
    return sorted(sweep, key=lambda r: int(r["window"]))


def figure(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Per recall scale: accuracy vs. d_down/d (DAR vs. Uniform) and accuracy vs. query distance."""
    blocks = _blocks(frames["recall"])
    with plots.figure(path, (13.5, 4.6 * len(blocks) + 0.5)) as fig:
        axes = fig.subplots(len(blocks), 2, squeeze=False)
        for (ax_d, ax_r), block in zip(axes, blocks):
            head = f"{selection.scale_label(block['scale'])}, d = {block['scale']['hidden_size']}"
            _accuracy_by_width(ax_d, block, head)
            _accuracy_by_distance(ax_r, block, head)
        notes = [f"{selection.scale_label(b['scale'])}: {b['distance_note']}" for b in blocks if b["distance_note"]]
        fig.suptitle(
            "Multi-query associative recall: can the model fetch a value stored far back?"
            + "".join("\n" + textwrap.fill(n, 130) for n in notes)
            + plots.spread_note(_seed_counts(blocks), bands=True),
            fontsize=12,
        )
    return Path(path)


def _accuracy_by_width(ax, block: dict, head: str) -> None:
    """Left panel: DAR at the main window and Uniform per d_down/d, Vanilla and chance as lines."""
    overall, scale = block["overall"], block["scale"]
    plain = overall[selection.plain_mask(overall)]
    main = (plain["window"] == block["main_window"]).fillna(False).astype(bool)
    sweeps = [
        ("dar", plain[(plain["attention"] == "dar") & main], f"DAR, w = {block['main_window']}", "o"),
        ("uniform", plain[plain["attention"] == "uniform"], "Uniform", "s"),
    ]
    ratios = set()
    for attention, rows, label, marker in sweeps:
        rows = rows.dropna(subset=["d_down"]).assign(
            ratio=lambda r: r["d_down"].astype(float) / r["hidden_size"].astype(float)
        )
        rows = rows.sort_values("ratio")
        if rows.empty:
            continue
        ratios |= {Fraction(int(d), int(m)) for d, m in zip(rows["d_down"], rows["hidden_size"])}
        plots.line(
            ax,
            rows["ratio"],
            [spread(r, "accuracy") for _, r in rows.iterrows()],
            100,
            color=VARIANT_COLORS[attention],
            marker=marker,
            lw=2.2,
            ms=7,
            label=label,
        )
    vanilla = overall[overall["attention"] == "vanilla"]
    if len(vanilla):
        vanilla = spread(vanilla.iloc[0], "accuracy")
        plots.hline(ax, vanilla, 100, color=VARIANT_COLORS["vanilla"], lw=1.6, label="Vanilla")
    if block["chance"] is not None:
        ax.axhline(100 * block["chance"], color=CHANCE_COLOR, ls=":", lw=1.6, label="chance")
    if ratios:
        plots.log2_fraction_axis(
            ax, ratios, r"$d_{\mathrm{down}}/d$  (in brackets: $d_{\mathrm{down}}$)", dim=int(scale["hidden_size"])
        )
    else:
        ax.text(
            0.5, 0.5, "no DAR or Uniform d_down sweep", ha="center", va="center", transform=ax.transAxes, color="0.4"
        )
        ax.set_xticks([])
    ax.set_ylim(-2, 102)
    ax.set_ylabel("recall accuracy (%)\nhigher is better")
    ax.set_title(f"{head}: accuracy vs. bottleneck width", fontsize=11)
    ax.legend(loc="best", fontsize=9, frameon=True)


def _accuracy_by_distance(ax, block: dict, head: str) -> None:
    """Right panel: accuracy per distance bin of one run of each kind (``_selected_for_distance``),
    and of DAR at the other windows of its window sweep (``_other_windows``)."""
    bins = block["bins"]
    mids = [(int(b.min_distance) + int(b.max_distance)) / 2 for b in bins.itertuples()]
    for kind, run in _selected_for_distance(block["overall"]):
        ys = [block["by_bin"].get((run["run"], int(b.bin))) or Spread(()) for b in bins.itertuples()]
        attention = kind[0]
        plots.line(
            ax,
            mids,
            ys,
            100,
            color=plots.kind_color(kind),
            marker=VARIANT_MARKERS.get(attention, "o"),
            lw=2.0,
            ms=6,
            ls="--" if kind[2] else "-",
            label=f"{selection.kind_label(kind)} ({setting(run, tex=False)})" if attention != "vanilla" else "Vanilla",
        )
    # The window sweep asks this panel's question too: how far a full-dimensional key must reach.
    for i, run in enumerate(_other_windows(block["overall"])):
        ys = [block["by_bin"].get((run["run"], int(b.bin))) or Spread(()) for b in bins.itertuples()]
        plots.line(ax, mids, ys, 100, color=VARIANT_COLORS["dar"], marker=VARIANT_MARKERS.get("dar", "o"), lw=1.6,
                   ms=5, ls=WINDOW_STYLES[i % len(WINDOW_STYLES)], alpha=0.75,
                   label=f"DAR ({setting(run, tex=False)})")
    if block["chance"] is not None:
        ax.axhline(100 * block["chance"], color=CHANCE_COLOR, ls=":", lw=1.6, label="chance")
    ax.xaxis.set_major_locator(FixedLocator(mids))
    ax.xaxis.set_minor_locator(NullLocator())
    labels = [f"{int(b.min_distance)}–{int(b.max_distance)}" for b in bins.itertuples()]
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda x, pos, labels=labels: labels[pos] if pos is not None and pos < len(labels) else "")
    )
    ax.set_ylim(-2, 102)
    ax.set_xlabel("query-to-key distance (tokens)")
    ax.set_ylabel("recall accuracy (%)\nhigher is better")
    ax.set_title(f"{head}: accuracy by query distance", fontsize=11)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9, frameon=False)
