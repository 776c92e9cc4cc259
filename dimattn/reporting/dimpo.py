"""Seed 003 (DimPO): the attention fidelity of the fitted query/key projections, ours beside the
paper's, from one summary whose ``study`` column says which report a fit feeds:

* ``table1`` (dimpo.objectives x dimpo.d_prime): Table 1 (``dimpo_fidelity.tex``, ``.png``);
* ``table6``: Table 6's KL column, DimPO's k and lambda (``dimpo_ablation.tex``);
* ``figure4a|b|c``: Appendix B Figure 4, the pair modes (``dimpo_pairs.png``);
* ``quirks``: the authors' preset against ours, one choice flipped at a time
  (``dimpo_quirks.tex``), which no paper reports.

KL divergence of the attention weights and MSE of the attention outputs, averaged over layers,
per objective and target width d'. The paper projects Llama-3.1-8B heads (d = 128), ours are
tiny, so columns are matched by the ratio d'/d and both d' are printed. Fits that differ only in
their ``seed`` (a column the fidelity summary may carry) are replicates: their mean and min-max
range are shown, and an objective within the seed spread of the one above it is marked.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from dimattn.workflow.sweeps import DEFAULT_SETTING, MAIN_STUDY, parse_setting
from . import latex, paper, plots
from .latex import DAGGER, MISSING, SpreadCells, Tex, fmt_fraction, fmt_sig
from .lm_eval import better
from .paper import DIMPO_HEAD_DIM, DIMPO_KEYS, OBJECTIVE_LABELS, objective_rank
from .plots import OBJECTIVE_COLORS
from .replicates import aggregate, seed_counts, spread

_K_RE = re.compile(r"\bk\s*[=_:]?\s*(\d+)", re.I)
_LAMBDA_RE = re.compile(r"(?:lambda|lam|λ)\s*[=_:]?\s*(\d+(?:\.\d+)?)", re.I)


def _blank(setting) -> bool:
    return setting is None or (not isinstance(setting, tuple) and pd.isna(setting)) or str(setting).strip() in (
        "", DEFAULT_SETTING
    )


def _parse_setting(setting) -> tuple[int, float] | None:
    """(k, lambda) from a setting string such as "k=64,lam=1" or "k64_lambda1"; a k_share
    ("k_share=0.015625,lam=1") as the k it is of the paper's 4,096-key lists (64)."""
    if _blank(setting):
        return None
    share = parse_setting(str(setting)).get("k_share") if "k_share=" in str(setting) else None
    lam = _LAMBDA_RE.search(str(setting))
    if share is not None:
        return (round(share * DIMPO_KEYS), float(lam.group(1))) if lam else None
    k = _K_RE.search(str(setting))
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
    if _blank(setting):
        return Tex(latex.escape(base)) if tex else base
    return Tex(f"{latex.escape(base)} ({latex.escape(setting)})") if tex else f"{base} ({setting})"


METRICS = ("kl", "mse", "kl_inference", "mse_inference", "topk_recall")


def _study(fid: pd.DataFrame, study: str) -> pd.DataFrame:
    rows = fid[fid["study"] == study] if "study" in fid else fid
    if rows.empty:
        raise ValueError(f"the DimPO fidelity summary has no fit of study {study!r}")
    return rows


def _means(fid: pd.DataFrame, study: str = MAIN_STUDY) -> pd.DataFrame:
    """Seed 003 Table 1 averages KL and MSE over layers; then over the seeds of a fit, if any."""
    fid = _study(fid, study).copy()
    fid["setting"] = fid["setting"].fillna("").astype(str) if "setting" in fid else ""
    if "setting_order" not in fid:
        fid["setting_order"] = 0
    fit = ["model", "head_dim", "setting_order", "objective", "setting", "d_prime"]
    metrics = [m for m in METRICS if m in fid]
    means = (
        fid.groupby(fit + (["seed"] if "seed" in fid else []), sort=False)
        .agg(**{m: (m, "mean") for m in metrics}, n_layers=("layer", "nunique"))
        .reset_index()
    )
    means = aggregate(means, metrics, fit)
    means["ratio"] = [Fraction(int(d), int(h)) for d, h in zip(means["d_prime"], means["head_dim"])]
    return means


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
        objectives = sorted(set(ours["objective"]) | set(ref["objective"]), key=lambda o: (objective_rank(o), o))
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
        # d' columns too many for one page's width continue in tabulars below (latex.split_columns).
        flat = [{"label": Tex(f"{row['objective']} {row['source']}"), "cells": row["cells"]} for rows in groups
                for row in rows]
        parts = latex.split_columns([{"title": c["ratio"], "columns": ["KL", "MSE"]} for c in columns], flat,
                                    "Objective Source")
        for i, part in enumerate(parts):
            keep = [j for _, indices in part for j in indices]
            blocks.append(
                {
                    "model": model,
                    "head_dim": int(head_dim),
                    "n_layers": ", ".join(str(n) for n in n_layers),
                    "columns": [columns[g] for g, _ in part],
                    "groups": [[row | {"cells": [row["cells"][j] for j in keep]} for row in rows] for rows in groups],
                    "continued": i > 0,
                    "last": i == len(parts) - 1,
                }
            )
    # A block's lines: its rows, the header's four, the spacing between objectives and the footnote.
    heights = [sum(len(rows) for rows in b["groups"]) + 4 + len(b["groups"]) / 2 + 2 for b in blocks]
    return latex.render(
        "dimpo_fidelity.tex.j2",
        path,
        floats=latex.page_floats(blocks, heights, " " * 900 + str(cell.note())),
        many_models=len({b["model"] for b in blocks}) > 1,
        continued=latex.CONTINUED,
        paper_model=paper_model,
        paper_head_dim=DIMPO_HEAD_DIM,
        paper_only=", ".join(
            OBJECTIVE_LABELS.get(o, o)
            for o in sorted(set(ref["objective"]) - set(means["objective"]), key=objective_rank)
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
    objectives = sorted(means["objective"].unique(), key=objective_rank)
    ref = ref[ref["objective"].isin(objectives) & ref["ratio"].isin(ratios)]
    metrics = (("kl", "KL divergence of attention weights"), ("mse", "MSE of attention outputs"))
    # ours only (the paper gives none): the share of each query's top-k keys the projection keeps,
    # k = 1/64 of the keys (DimPO's head, seed 003's 64 of 4,096), beside KL's whole distribution
    topk = "topk_recall" in means and means["topk_recall"].notna().any()
    ours_styles = ["-", "-.", (0, (5, 1, 1, 1))]
    paper_styles = ["--", ":", (0, (3, 1, 1, 1, 1, 1))]

    with plots.figure(path, ((20.0 if topk else 13.5), 4.0 * (len(models) + 1) + 0.6)) as fig:
        # Not sharex: each row labels its ticks with its own d'; the limits match anyway.
        axes = fig.subplots(len(models) + 1, 3 if topk else 2, squeeze=False)
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
            if value_col != "topk_recall":
                plots.plain_log_y(ax)
            plots.log2_fraction_axis(ax, ratios, f"$d'/d$  (in brackets: $d'$ of d={dim})", dim=dim)

        for row_axes, (model, head_dim) in zip(axes, models):
            ours = means[(means["model"] == model) & (means["head_dim"] == head_dim)]
            for ax, (metric, title) in zip(row_axes, metrics):
                draw(ax, ours, metric, ours_styles, "ours", int(head_dim))
                ax.set_title(f"{title}\nours: {model}, d={int(head_dim)}")
                ax.set_ylabel(f"{metric.upper()}, mean over layers (log)\n{better(metric)}")
            if topk:
                ax = row_axes[2]
                draw(ax, ours, "topk_recall", ours_styles, "ours", int(head_dim))
                k = ", ".join(str(int(v)) for v in sorted(frames["dimpo_fidelity"]["top_k"].dropna().unique()))
                ax.set_title(f"Top-k keys kept (k = {k}, 1/64 of the keys; higher is better)\nours: {model}, "
                             f"d={int(head_dim)}")
                ax.set_ylabel(f"share of the top-k keys, mean over layers\n{better('topk_recall')}")
        if topk:
            axes[-1][2].set_visible(False)  # the paper reports no top-k share
        for ax, (metric, title) in zip(axes[-1], metrics):
            draw(ax, ref, f"{metric}_value", paper_styles, "paper", DIMPO_HEAD_DIM)
            ax.set_title(f"{title}\npaper: {paper_model}, d={DIMPO_HEAD_DIM}")
            ax.set_ylabel(f"{metric.upper()}, mean over layers (log)\n{better(metric)}")
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
            "Attention fidelity of the query/key projection vs. width $d'/d$ (KL, MSE: lower is better), ours beside seed 003 "
            "Table 1\nthe paper's model has ~8B parameters, ours is tiny: compare ordering and trend across rows, "
            "not levels" + plots.spread_note(seed_counts(means)),
            fontsize=12,
        )
    return Path(path)


# ---- the other studies -------------------------------------------------------------------------


def _setting_label(setting: str, base: str = "") -> str:
    """A setting's row label: its overrides, "key = value", in LaTeX."""
    parts = [] if _blank(setting) else [part.replace("=", " = ", 1) for part in setting.split(",")]
    return Tex(latex.escape(", ".join(parts) or base or "dimpo.hparams as configured"))


def quirks_table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """The authors' preset against ours, one choice flipped at a time (study ``quirks``): per
    setting, KL and MSE at the train scale (as Table 1) and KL at the inference scale, per
    objective and d'. No paper reports this; the rows follow dimpo.ablations.quirks.settings."""
    means = _means(frames["dimpo_fidelity"], "quirks")
    cell = SpreadCells(seed_counts(means))
    keys = list(dict.fromkeys(zip(means["model"], means["objective"], means["d_prime"])))
    many_models = len({m for m, _, _ in keys}) > 1
    groups = [
        {"title": Tex(latex.escape(f"{model}: " if many_models else "") + latex.escape(_label(o, tex=False))
                      + rf", $d'{{=}}{int(d)}$"),
         "columns": [Tex("KL"), Tex("MSE"), Tex(r"KL$_\text{inf}$")]}
        for model, o, d in keys
    ]
    rows = []
    for (order, setting), mine in means.groupby(["setting_order", "setting"], sort=True):
        by_key = {(m.model, m.objective, m.d_prime): m for _, m in mine.iterrows()}
        cells = []
        for key in keys:
            m = by_key.get(key)
            cells += [MISSING] * 3 if m is None else [
                cell(spread(m, metric), fmt_sig) for metric in ("kl", "mse", "kl_inference")
            ]
        rows.append({"label": _setting_label(setting), "cells": cells, "space": False})
    n_layers = ", ".join(str(n) for n in sorted(means["n_layers"].unique()))
    caption = (
        "What each of the DimPO authors' choices does, measured: attention fidelity of the projections fitted "
        "with the settings of each row over dimpo.hparams (the preset named, then one choice flipped), mean over "
        f"{n_layers} layers (lower is better). KL and MSE at the training logit scale, as Table 1 scores them; "
        r"KL$_\text{inf}$ at the inference scale, what the model sees once the projection replaces its attention."
    )
    return latex.grouped_table(path, "dimpo.quirks_table", groups, rows, Tex(caption), "dimpo_quirks", "Settings",
                               cell.note())


def _table6_long_context(downstream: pd.DataFrame | None, d_primes) -> tuple[pd.DataFrame, list]:
    """Table 6's RULER column at our scale: the long-context average (dimpo_downstream: RULER, or
    the recall probe) of the projected models of study ``table6``, and of Table 1's KL and DimPO
    + KL at its d' and l, per (model, objective, setting, d'); with the [(model, probe, l)] shown."""
    from .dimpo_downstream import AVERAGE, long_context, probe_points

    if downstream is None:
        return pd.DataFrame(), []
    scores = long_context(downstream)
    scores = scores[(scores["column"] == AVERAGE) & (scores["kv"] == "none")]
    ablation = scores[scores["study"] == "table6"]
    shown = list(dict.fromkeys(zip(ablation["model"], ablation["probe"], ablation["num_projected"])))
    main = scores[(scores["study"] == MAIN_STUDY) & scores["objective"].isin(["kl", "dimpo_kl"])
                  & scores["d_prime"].isin(d_primes)]
    main = main[[(m, p, l) in shown for m, p, l in zip(main["model"], main["probe"], main["num_projected"])]]
    return probe_points(pd.concat([ablation, main], ignore_index=True)), shown


def ablation_table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 003 Table 6: DimPO per (k, lambda) (study ``table6``), with Table 1's KL and DimPO +
    KL fits at the same d' where fitted: their attention KL, and where dimpo.downstream.studies
    projects them, the long-context average of the projected model (Table 6's RULER 4k column;
    ours: the recall probe at CPU scale); the paper's at d' = 64 of both models beside."""
    fid = frames["dimpo_fidelity"]
    ours = _means(fid, "table6")
    d_primes = sorted(ours["d_prime"].unique())
    extra = []
    if (fid["study"] == MAIN_STUDY).any():
        main = _means(fid, MAIN_STUDY)
        extra = [main[main["objective"].isin(["kl", "dimpo_kl"]) & main["d_prime"].isin(d_primes)]]
    means = pd.concat([ours, *extra], ignore_index=True)
    long, shown = _table6_long_context(frames.get("dimpo_downstream"), d_primes)
    ref = paper.dimpo_table6(reference_dir)
    cell = SpreadCells(seed_counts(means, long if len(long) else None))
    models = list(dict.fromkeys(zip(means["model"], means["head_dim"])))
    groups = (
        [
            {
                "title": Tex(latex.escape(f"ours: {m}, d = {int(h)}, KL")),
                "columns": [Tex(rf"$d'{{=}}{int(d)}$") for d in d_primes],
            }
            for m, h in models
        ]
        + [
            {
                "title": Tex(latex.escape(f"ours: {m}, {probe} avg (%), ") + rf"$l{{=}}{int(l)}$"),
                "columns": [Tex(rf"$d'{{=}}{int(d)}$") for d in d_primes],
            }
            for m, probe, l in shown
        ]
        + [
            {"title": Tex(r"paper, $d'{=}64$ of $d{=}128$: KL"), "columns": [Tex("Llama-3.1-8B"), Tex("Qwen3-4B")]},
            {"title": Tex(r"paper: RULER 4k (\%)"), "columns": [Tex("Llama-3.1-8B"), Tex("Qwen3-4B")]},
        ]
    )
    rows = []
    for (objective, setting), mine in means.groupby(["objective", "setting"], sort=False):
        cells = []
        for model, _ in models:
            sel = mine[mine["model"] == model]
            by_d = {m.d_prime: m for _, m in sel.iterrows()}
            cells += [cell(spread(by_d[d], "kl"), fmt_sig) if d in by_d else MISSING for d in d_primes]
        for model, probe, l in shown:
            sel = long[(long["model"] == model) & (long["probe"] == probe) & (long["num_projected"] == l)
                       & (long["objective"] == objective) & (long["setting"] == setting)]
            by_d = {r["d_prime"]: spread(r, "value") for _, r in sel.iterrows()}
            cells += [cell(by_d[d], lambda v: f"{v:.1f}") if d in by_d else MISSING for d in d_primes]
        key = _parse_setting(setting)  # a k_share as its k of the paper's 4,096 keys
        theirs = ref[(ref["objective"] == objective) & ref["setting"].map(lambda s, key=key: s == key)]
        columns = ("llama31_8b_kl", "qwen3_4b_kl", "llama31_8b_ruler_4k", "qwen3_4b_ruler_4k")
        cells += [theirs.iloc[0][c] if len(theirs) else MISSING for c in columns]
        label = _label(objective, key) if key else Tex(
            latex.escape(OBJECTIVE_LABELS.get(objective, objective))
            + ("" if _blank(setting) else f" ({latex.escape(setting)})")
        )
        rows.append({"label": label, "cells": cells, "space": False})
    caption = (
        "Ablation of DimPO's head term: the attention KL of DimPO per top-k and head weight $\\lambda$ "
        "(seed 003 Table 6), beside the KL and DimPO + KL objectives, mean over layers "
        "(lower is better); where projected downstream, the long-context average of the model with the projection "
        "on its last $l$ layers (higher is better; ours at CPU scale: the recall probe). The paper's key lists hold "
        "4,096 keys, ours the capture's sequence length: a row set as a share of the list (k\\_share) is labelled "
        "with its k of 4,096 and keeps that share of ours."
    )
    return latex.grouped_table(path, "dimpo.ablation_table", groups, rows, Tex(caption), "dimpo_ablation",
                               "Objective", cell.note())


# Appendix B Figure 4: the study, its panel title, and the setting field on its x axis.
PAIR_PANELS = {
    "figure4a": ("(a) all pairs among k sampled keys", "num_sampled_keys"),
    "figure4b": ("(b) k distinct pairs a query, top half vs. bottom half", "num_pairs"),
    "figure4c": ("(c) rank distance k between chosen and rejected", "pair_distance"),
}


def pairs_figure(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Appendix B Figure 4 (a-c): KL and MSE, averaged over layers and every d' of the study, vs.
    the panel's k, a line per objective; error bars: min-max over fit seeds."""
    fid = frames["dimpo_fidelity"]
    panels = [(study, *PAIR_PANELS[study]) for study in PAIR_PANELS if (fid["study"] == study).any()]
    if not panels:
        raise ValueError("no Figure 4 study (figure4a, figure4b, figure4c) in the DimPO fidelity summary")
    counts = Counter()
    with plots.figure(path, (5.2 * len(panels) + 2.4, 8.0)) as fig:
        axes = fig.subplots(2, len(panels), squeeze=False)
        handles = {}
        for col, (study, title, field) in enumerate(panels):
            rows = _study(fid, study).copy()
            rows["x"] = [parse_setting(s).get(field) for s in rows["setting"]]
            if rows["x"].isna().any():
                bad = sorted(set(rows.loc[rows["x"].isna(), "setting"]))
                raise ValueError(f"dimpo.ablations.{study}: setting(s) {bad} do not set {field}")
            # Mean over layers and d' a fit seed, then the spread over seeds (Appendix B averages both).
            per_seed = rows.groupby(["objective", "x", "seed"], sort=False)[["kl", "mse"]].mean().reset_index()
            agg = aggregate(per_seed, ["kl", "mse"], ["objective", "x"])
            counts += seed_counts(agg)
            for row, (metric, name) in enumerate((("kl", "KL divergence of attention weights"),
                                                  ("mse", "MSE of attention outputs"))):
                ax = axes[row][col]
                for objective in sorted(agg["objective"].unique(), key=objective_rank):
                    sel = agg[agg["objective"] == objective].sort_values("x")
                    line = plots.line(ax, sel["x"].astype(float), [spread(r, metric) for _, r in sel.iterrows()],
                                      color=OBJECTIVE_COLORS.get(objective, "0.3"), marker="o", lw=2,
                                      label=_label(objective, tex=False))
                    handles.setdefault(_label(objective, tex=False), line)
                ax.set_xscale("log", base=2)
                ax.set_xticks(sorted(agg["x"].unique()), [str(int(x)) for x in sorted(agg["x"].unique())])
                plots.plain_log_y(ax)
                ax.set_xlabel("k")
                log = " (log)" if ax.get_yscale() == "log" else ""
                ax.set_ylabel(f"{metric.upper()}, mean over layers and d'{log}\n{better(metric)}")
                ax.set_title(f"{title}\n{name}", fontsize=10)
        fig.legend(handles=list(handles.values()), labels=list(handles), loc="outside right center", frameon=False)
        d_primes = ", ".join(
            str(int(d)) for d in sorted(fid[fid["study"].isin([p[0] for p in panels])]["d_prime"].unique())
        )
        fig.suptitle(
            "Pairwise objectives and the listwise term with more comparisons (seed 003 Appendix B, Figure 4), "
            f"ours: d' in {{{d_primes}}}" + plots.spread_note(counts),
            fontsize=11,
        )
    return Path(path)
