"""Seed 003 (DimPO): Table 1, the attention fidelity of the fitted query/key projections
(``dimpo_fidelity.tex``, ``dimpo_fidelity.png``), ours beside the paper's.

KL divergence of the attention weights and MSE of the attention outputs, averaged over layers,
per objective and target width d'. The paper projects Llama-3.1-8B heads (d = 128), ours are
tiny, so columns are matched by the ratio d'/d and both d' are printed. Fits that differ only in
their ``seed`` (a column the fidelity summary may carry) are replicates: their mean and min-max
range are shown, and an objective within the seed spread of the one above it is marked.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from . import latex, paper, plots
from .latex import DAGGER, MISSING, SpreadCells, Tex, fmt_fraction, fmt_sig
from .paper import DIMPO_HEAD_DIM, OBJECTIVE_ORDER
from .plots import OBJECTIVE_COLORS
from .replicates import aggregate, seed_counts, spread

OBJECTIVE_LABELS = {
    "random": "Random",
    "pca": "PCA",
    "triplet": "Triplet",
    "cpo": "CPO",
    "simpo": "SimPO",
    "orpo": "ORPO",
    "dimpo_list": "DimPO, listwise only",  # the paper's DimPO (k=0, lambda=0) row
    "dimpo": "DimPO",
    "dimpo_kl": "DimPO + KL",  # Table 6
    "kl": "KL",
}
_K_RE = re.compile(r"\bk\s*[=_:]?\s*(\d+)", re.I)
_LAMBDA_RE = re.compile(r"(?:lambda|lam|λ)\s*[=_:]?\s*(\d+(?:\.\d+)?)", re.I)


def _parse_setting(setting) -> tuple[int, float] | None:
    """(k, lambda) from a setting string such as "k=64,lambda=1" or "k64_lambda1"."""
    if setting is None or pd.isna(setting) or not str(setting).strip():
        return None
    k, lam = _K_RE.search(str(setting)), _LAMBDA_RE.search(str(setting))
    return (int(k.group(1)), float(lam.group(1))) if k and lam else None


def _label(objective: str, setting=None, tex: bool = True) -> str:
    """"DimPO (k=64, lambda=1)" in LaTeX (Tex) or in matplotlib's mathtext."""
    base = OBJECTIVE_LABELS.get(objective, objective)
    parsed = setting if isinstance(setting, tuple) else _parse_setting(setting)
    if parsed:
        k, lam = parsed
        return Tex(rf"{latex.escape(base)} ($k{{=}}{k}$, $\lambda{{=}}{lam:g}$)") if tex else (
            rf"{base} ($k$={k}, $\lambda$={lam:g})"
        )
    if setting is None or pd.isna(setting) or not str(setting).strip():
        return Tex(latex.escape(base)) if tex else base
    return Tex(f"{latex.escape(base)} ({latex.escape(setting)})") if tex else f"{base} ({setting})"


def _means(fid: pd.DataFrame) -> pd.DataFrame:
    """Seed 003 Table 1 averages KL and MSE over layers; then over the seeds of a fit, if any."""
    fid = fid.copy()
    fid["setting"] = fid["setting"].fillna("").astype(str) if "setting" in fid else ""
    fit = ["model", "head_dim", "objective", "setting", "d_prime"]
    means = (
        fid.groupby(fit + (["seed"] if "seed" in fid else []), sort=False)
        .agg(kl=("kl", "mean"), mse=("mse", "mean"), n_layers=("layer", "nunique"))
        .reset_index()
    )
    means = aggregate(means, ["kl", "mse"], fit)
    means["ratio"] = [Fraction(int(d), int(h)) for d, h in zip(means["d_prime"], means["head_dim"])]
    return means


def _rank(objective: str) -> int:
    return OBJECTIVE_ORDER.index(objective) if objective in OBJECTIVE_ORDER else len(OBJECTIVE_ORDER)


def table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 003 Table 1: per model of ours, KL and MSE per objective and d'/d, the paper's rows beside."""
    means = _means(frames["dimpo_fidelity"])
    ref = paper.dimpo_table1(reference_dir)
    paper_model = ref["model"].iloc[0] if len(ref) else "Llama-3.1-8B-Instruct"
    cell = SpreadCells(seed_counts(means), {DAGGER: "this objective and the one above it (ours)"})
    blocks = []
    for (model, head_dim), ours in means.groupby(["model", "head_dim"], sort=False):
        d_primes = sorted(ours["d_prime"].unique(), reverse=True)  # widest first, as the paper
        ratios = [Fraction(int(d), int(head_dim)) for d in d_primes]
        columns = [
            {
                "ratio": fmt_fraction(r),
                "ours": str(d),
                "paper": str(int(r * DIMPO_HEAD_DIM)) if (r * DIMPO_HEAD_DIM).denominator == 1 else MISSING,
            }
            for d, r in zip(d_primes, ratios)
        ]
        objectives = sorted(set(ours["objective"]) | set(ref["objective"]), key=lambda o: (_rank(o), o))
        groups, above = [], {}
        for objective in objectives:
            rows = []
            for setting, mine in ours[ours["objective"] == objective].groupby("setting", sort=False):
                by_ratio = {r: m for r, (_, m) in zip(mine["ratio"], mine.iterrows())}
                cells = []
                for r in ratios:
                    m = by_ratio.get(r)
                    for metric in ("kl", "mse"):
                        if m is None:
                            cells.append(MISSING)
                            continue
                        within = spread(m, metric).overlaps(above.get((r, metric)))
                        cells.append(cell(spread(m, metric), fmt_sig, [DAGGER] if within else []))
                above = {(r, metric): spread(m, metric) for r, m in by_ratio.items() for metric in ("kl", "mse")}
                rows.append({"objective": _label(objective, setting), "source": "ours", "cells": cells})
            theirs = ref[ref["objective"] == objective]
            for setting in dict.fromkeys(theirs["setting"]):
                sel = theirs[theirs["setting"].map(lambda s: s == setting)]
                by_ratio = {r: p for r, p in zip(sel["ratio"], sel.itertuples())}
                cells = []
                for r in ratios:
                    p = by_ratio.get(r)
                    cells += [p.kl if p else MISSING, p.mse if p else MISSING]
                rows.append({"objective": _label(objective, setting), "source": "paper", "cells": cells})
            groups.append(rows)
        n_layers = sorted(ours["n_layers"].unique())
        blocks.append(
            {
                "model": model,
                "head_dim": int(head_dim),
                "n_layers": ", ".join(str(n) for n in n_layers),
                "columns": columns,
                "groups": groups,
            }
        )
    return latex.render(
        "dimpo_fidelity.tex.j2",
        path,
        blocks=blocks,
        paper_model=paper_model,
        paper_head_dim=DIMPO_HEAD_DIM,
        paper_only=", ".join(
            OBJECTIVE_LABELS.get(o, o) for o in sorted(set(ref["objective"]) - set(means["objective"]), key=_rank)
        ),
        spread_note=cell.note(),
    )


def figure(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """KL and MSE vs d'/d: a row per model of ours, then the paper's row over the same ratios.

    The paper's 8B-model values sit an order of magnitude away from a tiny model's, so they get
    their own row (own y range) rather than crowding our curves; colours and x match across rows.
    """
    means = _means(frames["dimpo_fidelity"])
    ref = paper.dimpo_table1(reference_dir)
    paper_model = ref["model"].iloc[0] if len(ref) else "Llama-3.1-8B-Instruct"
    models = list(dict.fromkeys(zip(means["model"], means["head_dim"])))
    ratios = set(means["ratio"])
    objectives = sorted(means["objective"].unique(), key=_rank)
    ref = ref[ref["objective"].isin(objectives) & ref["ratio"].isin(ratios)]
    metrics = (("kl", "KL divergence of attention weights"), ("mse", "MSE of attention outputs"))
    ours_styles = ["-", "-.", (0, (5, 1, 1, 1))]
    paper_styles = ["--", ":", (0, (3, 1, 1, 1, 1, 1))]

    with plots.figure(path, (13.5, 4.0 * (len(models) + 1) + 0.6)) as fig:
        # Not sharex: each row labels its ticks with its own d'; the limits match anyway.
        axes = fig.subplots(len(models) + 1, 2, squeeze=False)
        handles, ours_labels = {}, set()

        def draw(ax, rows, value_col, styles, source, dim):
            for objective in objectives:
                color = OBJECTIVE_COLORS.get(objective, "0.3")
                mine = rows[rows["objective"] == objective]
                settings = list(dict.fromkeys(mine["setting"]))
                for i, setting in enumerate(settings):
                    sel = mine[mine["setting"].map(lambda x: x == setting)].sort_values("ratio")
                    label = _label(objective, setting, tex=False)
                    if source == "paper" and len(settings) == 1:
                        label = _label(objective, tex=False)
                    line = plots.line(
                        ax,
                        sel["ratio"].astype(float),
                        [spread(row, value_col) for _, row in sel.iterrows()],
                        color=color,
                        lw=2.2 if source == "ours" else 1.8,
                        ls=styles[i % len(styles)],
                        marker="o",
                        ms=6,
                        mfc=color if source == "ours" else "white",
                        label=label,
                    )
                    if source == "ours":
                        ours_labels.add(label)
                    elif setting is not None and label in ours_labels:
                        label = f"{label}, paper"  # a setting we ran too: the paper's line style needs its own entry
                        line.set_label(label)
                    handles.setdefault(label, line)
            plots.plain_log_y(ax)
            plots.log2_fraction_axis(ax, ratios, f"$d'/d$  (in brackets: $d'$ of d={dim})", dim=dim)

        for row_axes, (model, head_dim) in zip(axes, models):
            ours = means[(means["model"] == model) & (means["head_dim"] == head_dim)]
            for ax, (metric, title) in zip(row_axes, metrics):
                draw(ax, ours, metric, ours_styles, "ours", int(head_dim))
                ax.set_title(f"{title}\nours: {model}, d={int(head_dim)}")
                ax.set_ylabel(f"{metric.upper()}, mean over layers (log)")
        for ax, (metric, title) in zip(axes[-1], metrics):
            draw(ax, ref, f"{metric}_value", paper_styles, "paper", DIMPO_HEAD_DIM)
            ax.set_title(f"{title}\npaper: {paper_model}, d={DIMPO_HEAD_DIM}")
            ax.set_ylabel(f"{metric.upper()}, mean over layers (log)")
        legend = list(handles.values()) + [
            Line2D([], [], color="0.3", lw=2.2, marker="o", label="ours: solid, filled"),
            Line2D([], [], color="0.3", lw=1.8, ls="--", marker="o", mfc="white", label="paper: dashed, hollow"),
        ]
        fig.legend(
            handles=legend,
            labels=[h.get_label() for h in legend],
            loc="outside right center",
            frameon=False,
            fontsize=10,
        )
        fig.suptitle(
            "Attention fidelity of the query/key projection vs. width $d'/d$ (lower is better), ours beside seed 003 "
            "Table 1\nthe paper's model has ~8B parameters, ours is tiny: compare ordering and trend across rows, "
            "not levels" + plots.spread_note(seed_counts(means)),
            fontsize=12,
        )
    return Path(path)
