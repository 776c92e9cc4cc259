"""Seed 000 (DAR, distance-aware attention reduction): its Tables 1-4 and Figure 3, ours beside the paper's.

* ``dar_perplexity.tex``/``.png``: Table 1, perplexity relative to Vanilla per d_down/d
  (from the ``dar_perplexity`` summary);
* ``dar_scales.tex``: Table 2, DAR at d_down = d/4 at each width (``dar_perplexity``);
* ``dar_window.tex``/``.png``: Table 3, DAR per window w, which the paper gives only in words
  (``dar_perplexity`` and ``recall``);
* ``dar_downstream.tex``: Table 4, lm-eval scores relative to the d_down = d run (``lm_eval``);
* ``dar_trajectory.png``: Figure 3, relative validation perplexity along training
  (``dar_trajectory``), in its own module (dimattn.reporting.dar_trajectory).

Our models are far smaller than the paper's (Pythia-70M, d = 512), so paper numbers are matched
by the ratio d_down/d, and every table prints both dimensions. Which runs each output shows is
``selection``'s call; each function raises ``selection.NoRuns`` when its summaries hold none.
Replicates of a setting (training seeds) are shown as their mean and min-max range
(``replicates``), and a comparison the paper makes is marked where it lies within that spread.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from fractions import Fraction
from itertools import zip_longest
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from dimattn.model import variants
from . import latex, paper, plots, replicates, selection
from .latex import DAGGER, DDAGGER, MISSING, SpreadCells, Tex, fmt, fmt_fraction, fraction, integer, na
from .lm_eval import lower_is_better, metric_label
from .plots import VARIANT_COLORS, CHANCE_COLOR
from .replicates import Spread, count_seeds, rel_to_vanilla, relative, seed_counts, settings, spread
from .selection import NoRuns, frame_scales, records, rows_of, scale_label

Frames = dict[str, pd.DataFrame]


def _ratio(row) -> Fraction | None:
    return Fraction(1) if row["attention"] == "vanilla" else fraction(row["d_down"], row["hidden_size"])


def _ppl_settings(ppl: pd.DataFrame) -> pd.DataFrame:
    """The perplexity summary, one row per setting and corpus (``replicates.settings``)."""
    return settings(ppl, ["ppl", "rel_to_vanilla"], ["corpus", "split"])


def _table1_rows(ppl: pd.DataFrame) -> pd.DataFrame:
    """Table 1's rows of every perplexity scale (``selection.table1``)."""
    kept = [rows_of(rows, selection.table1(records(rows))) for _, rows in frame_scales(ppl)]
    kept = [rows for rows in kept if not rows.empty]
    return pd.concat(kept) if kept else ppl.iloc[:0]


def _windows_text(df: pd.DataFrame) -> str:
    windows = sorted({int(w) for w in df.loc[df["attention"] == "dar", "window"].dropna()})
    return ", ".join(map(str, windows)) or MISSING


def _group_label(scale: dict, several_d: bool) -> str:
    label = scale_label(scale)
    return f"{label}, d = {scale['hidden_size']}" if several_d else label


def _table2_note(reference_dir: Path) -> str:
    ref = paper.dar_table2(reference_dir)
    if not ref:
        return ""
    parts = ", ".join(f"{latex.escape(r['text'])} at d = {r['d_model']} ({latex.escape(r['model'])})" for r in ref)
    return Tex(rf"At d\textsubscript{{down}} = d/4 the paper's Table 2 gives Rel.\ {parts}.")


# ----------------------------------------------------------------------------- Table 1


def perplexity_table(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Table 1: Rel. perplexity per d_down/d, the paper's number at the same ratio beside.

    The recall summary, when the config has recall runs, only adds a note pointing to recall.tex."""
    ppl, recall = _ppl_settings(frames["dar_perplexity"]), frames.get("recall")
    rows_all = _table1_rows(ppl)
    if not selection.compared(records(rows_all)):
        raise NoRuns("no text scale has a vanilla run beside plain DAR or Uniform runs")
    table1 = paper.dar_table1(reference_dir)
    d_per_corpus = rows_all.groupby("corpus")["hidden_size"].nunique()
    cell = SpreadCells(seed_counts(rows_all), {DAGGER: r"DAR and Uniform at the same d\textsubscript{down}/d"})
    groups = []
    for scale, rows in frame_scales(rows_all):
        rel = {(row["attention"], _ratio(row)): rel_to_vanilla(row) for _, row in rows.iterrows()}
        cells = []
        for _, row in rows.iterrows():
            ratio = _ratio(row)
            ref = table1.get((row["attention"], ratio))
            partner = {"dar": "uniform", "uniform": "dar"}.get(row["attention"])
            within = rel[row["attention"], ratio].overlaps(rel.get((partner, ratio)))
            cells.append(
                {
                    "variant": variants.VARIANTS[row["attention"]].label,
                    "window": integer(row["window"]),
                    "d_down": integer(row["hidden_size"] if row["attention"] == "vanilla" else row["d_down"]),
                    "ratio": fmt_fraction(ratio),
                    "ppl": cell(spread(row, "ppl")),
                    "rel": cell(rel[row["attention"], ratio], marks=[DAGGER] if within else []),
                    "paper": ref["text"] if ref else MISSING,
                    "paper_d_down": str(ref["d_down"]) if ref else MISSING,
                }
            )
        groups.append({"corpus": _group_label(scale, d_per_corpus[scale["corpus"]] > 1), "rows": cells})
    paper_any = next(iter(table1.values()), {})
    left_out = ppl[~ppl["run"].isin(rows_all["run"])]
    plain = selection.plain_mask(left_out)
    notes = []
    if (plain & (left_out["attention"] == "dar")).any():
        notes.append("DAR at other windows is in the window sweep (dar\\_window.tex).")
    if (~plain).any():
        notes.append("SWA, dilated, hybrid and patterned runs are in baselines.tex.")
    no_vanilla = sorted(set(ppl["hidden_size"]) - set(ppl.loc[ppl["attention"] == "vanilla", "hidden_size"]))
    if no_vanilla:
        widths = ", ".join(str(d) for d in no_vanilla)
        notes.append(f"Widths without a Vanilla run (d = {widths}) have no Rel.\\ and are left out.")
    if recall is not None and not recall.empty:
        notes.append("Runs on the synthetic recall corpus are scored by recall accuracy (recall.tex), not here.")
    return latex.render(
        "dar_perplexity.tex.j2",
        path,
        groups=groups,
        d_models=", ".join(str(d) for d in sorted(rows_all["hidden_size"].unique())),
        windows=_windows_text(rows_all),
        paper_model=paper_any.get("model", "pythia-70m"),
        paper_d=paper_any.get("d_model", 512),
        paper_window=next((p["window"] for p in table1.values() if p["window"]), 128),
        table2_note=_table2_note(reference_dir),
        sweep_note=Tex(" ".join(notes)),
        spread_note=cell.note(),
    )


def perplexity_figure(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Table 1 as a figure: a panel per text scale with a d_down sweep, the paper's curves dashed."""
    rows_all = _table1_rows(_ppl_settings(frames["dar_perplexity"])).dropna(subset=["rel_to_vanilla"])
    panels = [(s, r) for s, r in frame_scales(rows_all) if (r["attention"] != "vanilla").sum() >= 2]
    if not panels:  # no sweep anywhere: whatever single points there are
        panels = [(s, r) for s, r in frame_scales(rows_all) if (r["attention"] != "vanilla").any()]
    if not panels:
        raise NoRuns("no text scale has a vanilla run beside plain DAR or Uniform runs")
    table1 = paper.dar_table1(reference_dir)
    ncols, nrows = plots.panel_grid(len(panels))
    ratios = set(rows_all.loc[rows_all["attention"] != "vanilla"].apply(_ratio, axis=1).dropna())
    ratios |= {r for (v, r) in table1 if v != "vanilla"}

    with plots.figure(path, (5.2 * ncols + 2.6, 4.4 * nrows)) as fig:
        axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
        for ax, (scale, rows) in zip(axes.flat, panels):
            rows = rows.assign(ratio=rows.apply(_ratio, axis=1))
            ax.axhline(100, color=VARIANT_COLORS["vanilla"], lw=1.5, zorder=1)
            for attention in ("dar", "uniform"):
                ref = sorted((r, p["value"]) for (v, r), p in table1.items() if v == attention)
                if ref:
                    ax.plot(
                        [float(r) for r, _ in ref],
                        [v for _, v in ref],
                        ls="--",
                        marker="o" if attention == "dar" else "s",
                        mfc="white",
                        ms=7,
                        color=VARIANT_COLORS[attention],
                        alpha=0.8,
                        zorder=2,
                    )
                mine = rows[rows["attention"] == attention].sort_values("ratio")
                if not mine.empty:
                    plots.line(
                        ax,
                        mine["ratio"].astype(float),
                        [spread(r, "rel_to_vanilla") for _, r in mine.iterrows()],
                        ls="-",
                        lw=2.2,
                        marker="o" if attention == "dar" else "s",
                        ms=7,
                        color=VARIANT_COLORS[attention],
                        zorder=3,
                    )
            plots.log2_fraction_axis(ax, ratios, r"$d_{\mathrm{down}}/d$ (log scale)")
            window = selection.main_window(records(rows))
            title = _group_label(scale, True)
            ax.set_title(title + (f", DAR w = {window}" if window is not None else ""), fontsize=11)
        for ax in axes[:, 0]:
            ax.set_ylabel("perplexity relative to Vanilla (%)\nlower is better")
        plots.hide_unused(axes, len(panels))

        ref_any = next(iter(table1.values()), {"d_model": 512, "window": 128, "model": "pythia-70m"})
        handles = [
            Line2D([], [], color=VARIANT_COLORS["dar"], marker="o", lw=2.2, label="DAR, ours"),
            Line2D([], [], color=VARIANT_COLORS["uniform"], marker="s", lw=2.2, label="Uniform, ours"),
            Line2D([], [], color=VARIANT_COLORS["dar"], marker="o", mfc="white", ls="--", label="DAR, paper"),
            Line2D([], [], color=VARIANT_COLORS["uniform"], marker="s", mfc="white", ls="--", label="Uniform, paper"),
            Line2D([], [], color=VARIANT_COLORS["vanilla"], lw=1.5, label="Vanilla (= 100)"),
        ]
        fig.legend(handles=handles, loc="outside right center", frameon=False, fontsize=10)
        fig.suptitle(
            "Perplexity relative to Vanilla vs. bottleneck width $d_{\\mathrm{down}}/d$\n"
            f"ours: solid, filled; paper (seed 000 Table 1, {ref_any['model']}, d={ref_any['d_model']}, "
            f"w={ref_any['window']}): dashed, hollow" + plots.spread_note(seed_counts(*(r for _, r in panels))),
            fontsize=12,
        )
    return Path(path)


# ----------------------------------------------------------------------------- Table 2


def _table2_rows(ppl: pd.DataFrame) -> pd.DataFrame:
    """DAR at d_down = d/4 (the main window, plain) per text scale with a vanilla run."""
    rows = _table1_rows(ppl)
    return rows_of(rows, selection.quarter(records(rows)))


def scales_table(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Table 2: DAR at d_down = d/4 at each hidden_size, Rel. to that scale's vanilla, paper beside."""
    ppl = _ppl_settings(frames["dar_perplexity"])
    dar = _table2_rows(ppl)
    if dar.empty:
        raise NoRuns("no text scale has a vanilla run and a plain DAR run at d_down = d/4 at its main window")
    table2 = paper.dar_table2(reference_dir)
    vanilla = ppl[selection.plain_mask(ppl) & (ppl["attention"] == "vanilla")]
    cell = SpreadCells(seed_counts(dar, vanilla), {DAGGER: "the perplexities of DAR and of Vanilla of the same width"})
    vanilla = vanilla.set_index(selection.SCALE_KEYS)["ppl" + replicates.SUFFIX]
    by_d = {p["d_model"]: p for p in table2}
    exact = all(int(d) in by_d for d in dar["hidden_size"])
    groups = []
    for (corpus, split), rows in dar.groupby(["corpus", "split"], sort=False):
        rows = rows.sort_values("hidden_size")
        if exact:
            pairs = [(r, by_d[int(r["hidden_size"])]) for _, r in rows.iterrows()]
            pairs += [(None, p) for p in table2 if p["d_model"] not in set(int(d) for d in rows["hidden_size"])]
        else:
            pairs = list(zip_longest((r for _, r in rows.iterrows()), table2))
        cells = []
        for ours, theirs in pairs:
            vanilla_ppl = vanilla.get((corpus, split, ours["hidden_size"])) if ours is not None else None
            within = ours is not None and spread(ours, "ppl").overlaps(vanilla_ppl)
            cells.append(
                {
                    "d_model": integer(ours["hidden_size"]) if ours is not None else MISSING,
                    "d_down": integer(ours["d_down"]) if ours is not None else MISSING,
                    "window": integer(ours["window"]) if ours is not None else MISSING,
                    "ppl": cell(spread(ours, "ppl")) if ours is not None else MISSING,
                    "vanilla_ppl": cell(vanilla_ppl) if ours is not None else MISSING,
                    "rel": cell(spread(ours, "rel_to_vanilla"), marks=[DAGGER] if within else [])
                    if ours is not None
                    else MISSING,
                    "paper_model": theirs["model"] if theirs else MISSING,
                    "paper_d": str(theirs["d_model"]) if theirs else MISSING,
                    "paper_d_down": str(theirs["d_down"]) if theirs else MISSING,
                    "paper": theirs["text"] if theirs else MISSING,
                }
            )
        groups.append({"corpus": scale_label({"corpus": corpus, "split": split}), "rows": cells})
    return latex.render(
        "dar_scales.tex.j2",
        path,
        groups=groups,
        exact=exact,
        paper_window=next((p["window"] for p in table2 if p["window"]), 128),
        spread_note=cell.note(),
    )


# ----------------------------------------------------------------------------- Table 3


def _window_sweeps(ppl: pd.DataFrame | None, recall: pd.DataFrame | None) -> list[dict]:
    """Per scale, its plain DAR runs at the d_down of its window sweep (``selection.window_sweep``).

    Text scales give Rel. perplexity, recall scales the overall recall accuracy, each a
    ``replicates.Spread`` per window; each sweep also carries the scale's Vanilla, Uniform at the
    same d_down (every token through the bottleneck, as DAR with w = 0, which stands in for the
    w = 0 point when no DAR run has it) and, for recall, chance.
    """
    ppl = settings(ppl, ["rel_to_vanilla"], ["corpus", "split"]) if ppl is not None else None
    overall = recall[recall["scope"] == "overall"] if recall is not None else None
    overall = settings(overall, ["accuracy"], ["corpus", "split"]) if overall is not None else None
    sweeps = []
    for source, df, value in (("text", ppl, "rel_to_vanilla"), ("recall", overall, "accuracy")):
        for scale, rows in frame_scales(df):
            d_down = selection.window_sweep(records(rows.dropna(subset=[value])))
            if d_down is None:
                continue
            plain = rows[selection.plain_mask(rows)]
            dar = plain[plain["attention"] == "dar"].dropna(subset=["d_down", "window", value])
            sweep = dar[dar["d_down"] == d_down].sort_values("window")

            def one(sel):
                sel = sel.dropna(subset=[value])
                return spread(sel.iloc[0], value) if len(sel) else None

            uniform = one(plain[(plain["attention"] == "uniform") & (plain["d_down"] == d_down).fillna(False)])
            points = {int(r["window"]): spread(r, value) for _, r in sweep.iterrows()}
            # DAR at w = 0 is Uniform at the same d_down (every token through the bottleneck; the
            # weights are the same, tests/unit/test_model.py), so its w = 0 point needs no run of its own.
            if 0 not in points and uniform is not None:
                points[0] = uniform
            sweeps.append(
                {
                    "source": source,
                    "scale": scale,
                    "d_down": d_down,
                    "main_window": selection.main_window(records(rows)),
                    "points": dict(sorted(points.items())),
                    "vanilla": one(plain[plain["attention"] == "vanilla"]),
                    "uniform": uniform,
                    "chance": float(rows["chance"].iloc[0]) if source == "recall" else None,
                }
            )
    if not sweeps:
        raise NoRuns("no scale has plain DAR runs at one d_down and two or more windows")
    return sweeps


# On text every replicate is divided by its own Vanilla (by seed): Vanilla's Rel. is 100 exactly.
_TEXT_VANILLA = Spread((100.0,))


def _sweep_spreads(sweep: dict) -> list:
    """The Spreads a window sweep shows (None where it lacks a reference)."""
    return [*sweep["points"].values(), sweep["vanilla"], sweep["uniform"]]


def _best_window(sweep: dict) -> int:
    """The window with the best mean: the lowest Rel. perplexity, the highest recall accuracy."""
    sign = 1 if sweep["source"] == "text" else -1
    return min(sweep["points"], key=lambda w: (sign * sweep["points"][w].mean, w))


def window_table(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Table 3 (window sweep): Rel. perplexity and recall accuracy per w at a fixed d_down."""
    sweeps = _window_sweeps(frames.get("dar_perplexity"), frames.get("recall"))
    finding = paper.finding(reference_dir, "000 Table 3")
    windows = sorted({w for s in sweeps for w in s["points"]})
    cell = SpreadCells(
        count_seeds(x for s in sweeps for x in _sweep_spreads(s)),
        {DAGGER: "this window and the best window of its column (by mean)", DDAGGER: "this window and w = 0"},
    )

    def fmt_value(source, v, marks=()):
        return cell(v, fmt if source == "text" else latex.pct, marks)

    def marks(s, w):
        points, best = s["points"], _best_window(s)
        within_best = w != best and points[w].overlaps(points[best])
        within_0 = w != 0 and points[w].overlaps(points.get(0))
        return [m for m, on in ((DAGGER, within_best), (DDAGGER, within_0)) if on]

    columns = [
        {
            "source": s["source"],
            "corpus": scale_label(s["scale"]),
            "setting": Tex(rf"d = {s['scale']['hidden_size']}, d\textsubscript{{down}} = {s['d_down']}"),
        }
        for s in sweeps
    ]
    groups = []
    for source, head in (
        ("text", "Rel.\\ perplexity (\\%), lower is better"),
        ("recall", "recall accuracy (\\%), higher is better"),
    ):
        n = sum(1 for s in sweeps if s["source"] == source)
        if n:
            groups.append({"head": Tex(head), "span": n})
    rows = [
        {
            "label": Tex(f"w = {w}" + (r" (all distant)" if w == 0 else "")),
            "cells": [fmt_value(s["source"], s["points"].get(w), marks(s, w) if w in s["points"] else ())
                      for s in sweeps],
        }
        for w in windows
    ]
    reference_rows = [
        {
            "label": "Vanilla",
            "cells": [fmt_value(s["source"], _TEXT_VANILLA if s["source"] == "text" else s["vanilla"]) for s in sweeps],
        },
    ]
    if any(s["uniform"] is not None for s in sweeps):
        reference_rows.append(
            {
                "label": Tex(r"Uniform, same d\textsubscript{down}"),
                "cells": [fmt_value(s["source"], s["uniform"]) for s in sweeps],
            }
        )
    if any(s["source"] == "recall" for s in sweeps):
        reference_rows.append(
            {
                "label": "Chance",
                "cells": [latex.pct(s["chance"]) if s["source"] == "recall" else "" for s in sweeps],
            }
        )
    return latex.render(
        "dar_window.tex.j2",
        path,
        columns=columns,
        groups=groups,
        rows=rows,
        reference_rows=reference_rows,
        finding=finding,
        main_windows=", ".join(sorted({str(s["main_window"]) for s in sweeps if s["main_window"] is not None}))
        or MISSING,
        spread_note=cell.note(),
    )


def _window_axis(ax, windows: Iterable[int]) -> None:
    """Symmetric-log x (linear up to 1, log2 beyond), so that w = 0 sits on the axis with the rest."""
    ticks = sorted(set(int(w) for w in windows))
    ax.set_xscale("symlog", base=2, linthresh=1, linscale=0.6)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(round(x))}"))
    if ticks:
        ax.set_xlim(-0.35, max(ticks[-1], 1) * 1.45)
    ax.set_xlabel("window w (tokens kept full-dimensional; symlog scale)")


def window_figure(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Rel. perplexity (text scales) and recall accuracy (recall scales) vs. the DAR window w."""
    sweeps = _window_sweeps(frames.get("dar_perplexity"), frames.get("recall"))
    title = "DAR window sweep (analogue of seed 000 Table 3)"
    ncols, nrows = plots.panel_grid(len(sweeps))
    with plots.figure(path, (5.4 * ncols + 2.8, 4.4 * nrows)) as fig:
        axes = fig.subplots(nrows, ncols, squeeze=False)
        handles = {}
        for ax, s in zip(axes.flat, sweeps):
            text = s["source"] == "text"
            scale = 1.0 if text else 100.0
            ws = sorted(s["points"])
            h = plots.line(
                ax,
                ws,
                [s["points"][w] for w in ws],
                scale,
                color=VARIANT_COLORS["dar"],
                marker="o",
                lw=2.2,
                ms=7,
                label="DAR",
            )
            handles.setdefault("DAR", h)
            refs = [("Vanilla", _TEXT_VANILLA if text else s["vanilla"], VARIANT_COLORS["vanilla"], "-")]
            refs.append((r"Uniform, same $d_{\mathrm{down}}$", s["uniform"], VARIANT_COLORS["uniform"], "--"))
            if not text:
                refs.append(("chance", Spread((s["chance"],)), CHANCE_COLOR, ":"))
            for label, value, color, ls in refs:
                if value is None:
                    continue
                h = plots.hline(ax, value, scale, color=color, ls=ls, lw=1.6, label=label, zorder=1)
                handles.setdefault(label, h)
            if s["main_window"] is not None and s["main_window"] in s["points"]:
                ax.plot(
                    [s["main_window"]],
                    [s["points"][s["main_window"]].mean * scale],
                    marker="o",
                    ms=13,
                    mfc="none",
                    mec=VARIANT_COLORS["dar"],
                    mew=1.5,
                    ls="none",
                    zorder=4,
                )
            _window_axis(ax, ws)
            if text:
                ax.set_ylabel("perplexity relative to Vanilla (%)\nlower is better")
            else:
                ax.set_ylabel("recall accuracy (%)\nhigher is better")
                ax.set_ylim(-2, 102)
            ax.set_title(
                f"{scale_label(s['scale'])}, d = {s['scale']['hidden_size']}, "
                rf"$d_{{\mathrm{{down}}}}$ = {s['d_down']}",
                fontsize=11,
            )
        plots.hide_unused(axes, len(sweeps))
        handles["main"] = Line2D(
            [], [], marker="o", ms=13, mfc="none", mec=VARIANT_COLORS["dar"], ls="none", label="main window (Table 1)"
        )
        fig.legend(handles=list(handles.values()), loc="outside right center", frameon=False, fontsize=10)
        finding = paper.finding(reference_dir, "000 Table 3")
        fig.suptitle(
            f"{title}; w = 0 sends every token through the bottleneck"
            + ("\n" + textwrap.fill(f"paper, in words only: {finding}", 110) if finding else "")
            + plots.spread_note(count_seeds(x for s in sweeps for x in _sweep_spreads(s)), bands=True),
            fontsize=12,
        )
    return Path(path)


# ----------------------------------------------------------------------------- Table 4

# One metric per task: the paper's where reference/dar_task_context_lengths.csv names it, else
# the first of these that the task reports (a prefix matches: "rouge" finds "rouge1").
METRIC_PRIORITY = [
    "acc_norm",
    "acc",
    "exact_match",
    "pass@1",
    "pass_at_1",
    "rouge",
    "f1",
    "bleu",
    "mcc",
    "bits_per_byte",
    "byte_perplexity",
    "word_perplexity",
    "perplexity",
]


def _primary_metric(task: str, metrics: Iterable[str], paper_metrics: dict[str, str]) -> str | None:
    metrics = sorted(set(metrics))
    wanted = [paper_metrics[task]] if task in paper_metrics else []
    for want in wanted + METRIC_PRIORITY:
        if want in metrics:
            return want
        prefixed = [m for m in metrics if m.split(",")[0].startswith(want)]
        if prefixed:
            return prefixed[0]
    return metrics[0] if metrics else None


def _downstream_blocks(lm: pd.DataFrame, paper_metrics: dict[str, str]) -> list[dict]:
    """Per (hidden_size, window) with a no-bottleneck DAR run (``selection.no_bottleneck``): its plain
    DAR runs; ``ref_runs`` are the control's replicates, ``ref_run`` the name of its lowest seed."""
    dar = lm[selection.plain_mask(lm) & (lm["attention"] == "dar")].dropna(subset=["d_down", "window"])
    blocks = []
    for hidden_size, rows in dar.groupby("hidden_size", sort=False):
        refs = rows_of(rows, selection.no_bottleneck(records(rows)))
        for window in sorted(int(w) for w in refs["window"].unique()):
            at_w = rows[rows["window"] == window]
            ref_runs = refs[refs["window"] == window].sort_values("seed", kind="stable")["run"]
            ref = at_w[at_w["run"].isin(set(ref_runs))]
            tasks = list(dict.fromkeys(ref["task"]))
            metrics = {t: _primary_metric(t, ref.loc[ref["task"] == t, "metric"], paper_metrics) for t in tasks}
            blocks.append(
                {
                    "d_model": int(hidden_size),
                    "window": window,
                    "ref_run": ref_runs.iloc[0],
                    "ref_runs": set(ref_runs),
                    "rows": at_w,
                    "metrics": metrics,
                }
            )
    if not blocks:
        raise NoRuns("no plain DAR run with d_down = hidden_size (the no-bottleneck control) has lm-eval scores")
    return blocks


def downstream_table(frames: Frames, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Table 4: lm-eval scores relative to the DAR no-bottleneck run (d_down = d, same w),
    replicate by replicate (``replicates.relative``: over the control's replicate of the same seed)."""
    blocks = _downstream_blocks(frames["lm_eval"], paper.dar_task_metrics(reference_dir))
    table4, paper_d, paper_window = paper.dar_table4(reference_dir)
    tasks = list(dict.fromkeys((t, m) for b in blocks for t, m in b["metrics"].items()))
    scored = [_downstream_scores(block, tasks) for block in blocks]
    cell = SpreadCells(seed_counts(*(f for pair in scored for f in pair)))
    out_blocks = []
    for block, (by_task, runs) in zip(blocks, scored):
        rel = {(r["run"], r["task"], r["metric"]): spread(r, "rel") for _, r in by_task.iterrows()}
        ref = by_task[by_task["run"] == block["ref_run"]]  # a setting is named by its lowest seed's run
        absolute = {(r["task"], r["metric"]): spread(r, "value") for _, r in ref.iterrows()}
        out_rows = []
        for _, run in runs.sort_values("d_down", ascending=False).iterrows():
            cells = [cell(rel.get((run["run"], t, m))) for t, m in tasks]
            ratio = fraction(run["d_down"], run["hidden_size"])
            theirs = table4.get(ratio)
            out_rows.append(
                {
                    "d_down": integer(run["d_down"]),
                    "ratio": fmt_fraction(ratio),
                    "paper_d_down": str(theirs["d_down"]) if theirs else MISSING,
                    "cells": cells,
                    "rel": cell(spread(run, "rel")),
                    "paper": theirs["text"] if theirs else MISSING,
                }
            )
        out_blocks.append(
            {
                "head": Tex(
                    rf"d = {block['d_model']}, w = {block['window']}; reference run {latex.escape(block['ref_run'])}"
                ),
                "absolute": [cell(absolute.get((t, m)), lambda x: latex.fmt_sig(x, 4)) for t, m in tasks],
                "rows": out_rows,
            }
        )
    columns = [
        {
            "task": t,
            "metric": Tex(
                latex.escape(metric_label(m)) + (r" $\downarrow$" if lower_is_better(m) else r" $\uparrow$")
            ),
        }
        for t, m in tasks
    ]
    return latex.render(
        "dar_downstream.tex.j2",
        path,
        columns=columns,
        blocks=out_blocks,
        paper_d=paper_d,
        paper_window=paper_window,
        any_lower=any(lower_is_better(m) for _, m in tasks),
        any_higher=any(not lower_is_better(m) for _, m in tasks),
        spread_note=cell.note(),
    )


def _downstream_scores(block: dict, tasks: list[tuple[str, str]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A Table 4 block's scores relative to its control, replicate by replicate, aggregated per
    setting: (per (task, metric): ``value`` and ``rel``; per run: ``rel``, the mean of its
    relative scores over the table's tasks whose metric counts up)."""
    rows = block["rows"]
    rel, _ = relative(rows, "value", rows["run"].isin(block["ref_runs"]), ["task", "metric"], ["task", "metric"])
    rows = rows.assign(rel=rel)
    means = {}
    for run, mine in rows.groupby("run", sort=False):
        by_task = dict(zip(zip(mine["task"], mine["metric"]), mine["rel"]))
        ups = [by_task[t, m] for t, m in tasks if not na(by_task.get((t, m))) and not lower_is_better(m)]
        means[run] = sum(ups) / len(ups) if ups else None
    per_run = rows.drop_duplicates("run").drop(columns=["task", "metric", "value", "stderr", "rel"])
    per_run = per_run.assign(rel=per_run["run"].map(means).astype(float))
    return settings(rows, ["value", "rel"], ["task", "metric"]), settings(per_run, ["rel"])
