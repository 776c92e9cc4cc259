"""Seed 003, Section 4 (Figures 2-3, Tables 4-5): projected models at work. Table 1's projections
on the last l attention layers, scored on held-out perplexity and lm-eval tasks beside the base
model (``dimpo_downstream.png``, ``dimpo_downstream.tex``), the paper's RULER 4k by share of
layers (Table 4) beside.

Scores are shown relative to the base model's (l = 0, same KV compression), in percent, so that
100 is the base model and lower is worse for every metric: value / base for scores, base / value
for perplexities. The share of layers projected, l / N, is what the paper's figures put on x.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..sweeps import BASE_OBJECTIVE, NO_KV
from . import latex, paper, plots
from .dimpo import OBJECTIVE_LABELS, _rank
from .latex import MISSING, SpreadCells, Tex, fmt
from .plots import OBJECTIVE_COLORS
from .replicates import aggregate, seed_counts, spread

LOWER_IS_BETTER = ("ppl", "perplexity", "bits_per_byte")


def _lower_is_better(metric: str) -> bool:
    return any(metric.split(",")[0].endswith(name) for name in LOWER_IS_BETTER)


def relative(df: pd.DataFrame) -> pd.DataFrame:
    """``rel``: each score in percent of the base model's score (same model, task, metric, kv)."""
    keys = ["model", "task", "metric", "kv"]
    base = df[df["objective"] == BASE_OBJECTIVE].set_index(keys)["value"]
    if base.empty:
        raise ValueError("the downstream summary has no base-model (l = 0) rows to compare with")
    out = df.copy()
    ref = out.set_index(keys).index.map(base.get)
    out["base"] = list(ref)
    lower = out["metric"].map(_lower_is_better)
    out["rel"] = 100 * out["value"].where(~lower, out["base"]) / out["base"].where(~lower, out["value"])
    return out


POINT = ["model", "task", "metric", "objective", "d_prime", "kv", "num_projected", "n_layers", "share"]


def replicated(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`relative` scores, one row per point over the fit seeds (``rel_spread``: a Spread)."""
    return aggregate(relative(df), ["rel", "value"], POINT)


def _panels(df: pd.DataFrame) -> list[tuple[str, str]]:
    return list(dict.fromkeys(zip(df["task"], df["metric"])))


def _label(objective: str, d_prime: int, kv: str, many_d: bool) -> str:
    text = OBJECTIVE_LABELS.get(objective, objective)
    if many_d:
        text += f", d'={d_prime}"
    return text if kv == NO_KV else f"{text}, {kv}"


def figure(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Score relative to the base model vs. the share of layers projected: a panel per (model,
    task, metric) of ours, a line per objective (and d', KV compression); then the paper's
    RULER 4k and 8k by share of layers (Table 4, DimPO k=64, lambda=1)."""
    df = replicated(frames["dimpo_downstream"])
    ref = paper.read(reference_dir, "dimpo_ruler_by_layers")
    panels = [(m, t, metric) for m in dict.fromkeys(df["model"]) for t, metric in _panels(df[df["model"] == m])]
    n = len(panels) + 2
    cols, rows = plots.panel_grid(n)
    many_d = df.loc[df["objective"] != BASE_OBJECTIVE, "d_prime"].nunique() > 1
    with plots.figure(path, (4.8 * cols + 2.6, 3.9 * rows + 0.8)) as fig:
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        handles = {}
        for ax, (model, task, metric) in zip(axes, panels):
            sel = df[(df["model"] == model) & (df["task"] == task) & (df["metric"] == metric)]
            base = sel[sel["objective"] == BASE_OBJECTIVE]
            for (objective, d_prime, kv), line in sel[sel["objective"] != BASE_OBJECTIVE].groupby(
                ["objective", "d_prime", "kv"], sort=False
            ):
                start = base[base["kv"] == kv]
                points = pd.concat([start, line]).sort_values("share")
                label = _label(objective, d_prime, kv, many_d)
                handle = plots.line(ax, points["share"] * 100, [spread(r, "rel") for _, r in points.iterrows()],
                                    marker="o", lw=2, color=OBJECTIVE_COLORS.get(objective, "0.3"),
                                    ls="-" if kv == NO_KV else "--")  # fmt: skip
                handles.setdefault(label, handle)
            ax.axhline(100, color="0.6", lw=1, ls=":")
            base_value = base[base["kv"] == NO_KV]["value"]
            shown = f"{base_value.iloc[0]:.4g}" if len(base_value) else "?"
            ax.set_title(f"ours: {model}\n{task} {metric} (base {shown})", fontsize=10)
            ax.set_xlabel("layers projected (%)")
            ax.set_ylabel("% of the base model")
        for ax, column in zip(axes[len(panels):], ("ruler_4k", "ruler_8k")):
            for model, sel in ref.groupby("model", sort=False):
                sel = sel.assign(share=sel["share_of_layers_pct"].astype(float), value=sel[column].astype(float))
                sel = sel.sort_values("share")
                rel = 100 * sel["value"] / sel["value"].iloc[0]
                ax.plot(sel["share"], rel, marker="s", lw=1.6, ls="--", label=model)
            ax.axhline(100, color="0.6", lw=1, ls=":")
            ax.set_title(f"paper (Table 4): RULER {column[-2:]}, DimPO d'=64", fontsize=10)
            ax.set_xlabel("layers projected (%)")
            ax.set_ylabel("% of the base model")
            ax.legend(fontsize=8, frameon=False)
        plots.hide_unused(axes, n)
        fig.legend(handles=list(handles.values()), labels=list(handles), loc="outside right center", frameon=False)
        fig.suptitle("Projected models at work: score relative to the base model vs. share of layers projected "
                     "(seed 003, Figures 2-3)\nours: Table 1's projections on the last l layers; dashed: with KV "
                     "compression" + plots.spread_note(seed_counts(df)), fontsize=11)  # fmt: skip
    return Path(path)


def table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Per task and metric, the score relative to the base model (%) per objective, d' and KV
    compression (rows) and l (columns); the base model's own score in the group title."""
    df = replicated(frames["dimpo_downstream"])
    cell = SpreadCells(seed_counts(df))
    models = list(dict.fromkeys(df["model"]))
    many_d = df.loc[df["objective"] != BASE_OBJECTIVE, "d_prime"].nunique() > 1
    shares = sorted(df.loc[df["objective"] != BASE_OBJECTIVE, "num_projected"].unique())
    groups, selections = [], []
    for model in models:
        mine = df[df["model"] == model]
        n_layers = int(mine["n_layers"].dropna().iloc[0])
        for task, metric in _panels(mine):
            sel = mine[(mine["task"] == task) & (mine["metric"] == metric)]
            base = sel[(sel["objective"] == BASE_OBJECTIVE) & (sel["kv"] == NO_KV)]["value"]
            title = f"{model}: {task} {metric}" + (f" (base {base.iloc[0]:.4g})" if len(base) else "")
            groups.append({"title": Tex(latex.escape(title)),
                           "columns": [Tex(rf"$l{{=}}{int(l)}$ ({100 * l / n_layers:.0f}\%)") for l in shares]})
            selections.append(sel[sel["objective"] != BASE_OBJECTIVE])
    keys = sorted({k for sel in selections for k in zip(sel["objective"], sel["d_prime"], sel["kv"])},
                  key=lambda k: (_rank(k[0]), k[1], k[2] != NO_KV, k[2]))  # fmt: skip
    body = []
    for objective, d_prime, kv in keys:
        cells = []
        for sel in selections:
            line = sel[(sel["objective"] == objective) & (sel["d_prime"] == d_prime) & (sel["kv"] == kv)]
            by_l = {r["num_projected"]: spread(r, "rel") for _, r in line.iterrows()}
            cells += [cell(by_l[l], lambda v: fmt(v, 1)) if l in by_l else MISSING for l in shares]
        body.append({"label": Tex(latex.escape(_label(objective, d_prime, kv, many_d))), "cells": cells,
                     "space": False})  # fmt: skip
    caption = (
        "Projected models at work (seed 003, Section 4): the score of the model with Table 1's projection on its "
        "last $l$ attention layers, in percent of the base model's (with the same KV compression; for perplexity, "
        "base / projected), per objective. The paper's RULER results are in its Tables 2-5 "
        "(reference/dimpo\\_ruler\\_*.csv); ours are CPU-scale tasks."
    )
    return latex.grouped_table(path, "dimpo_downstream.table", groups, body, Tex(caption), "dimpo_downstream",
                               "Objective", cell.note())
