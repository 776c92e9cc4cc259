"""Seed 003, Section 4 (Figures 2-3, Tables 4-5): projected models at work. Table 1's projections
on the last l attention layers, scored on held-out perplexity and lm-eval tasks beside the base
model (``dimpo_downstream.png``, ``dimpo_downstream.tex``), the paper's RULER 4k by share of
layers (Table 4) beside.

Scores are shown relative to the base model's (l = 0, same KV compression): value / base in
percent, 100 the base model, never inverted, so a perplexity keeps its direction (above 100 is
worse) as on the KV frontier; each axis and table group says which way is better
(dimattn.reporting.lm_eval.lower_is_better). The share of layers projected, l / N, is what the
paper's figures put on x.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dimattn.workflow.sweeps import BASE_OBJECTIVE, MAIN_STUDY, NO_KV, RULER_TASK, RULER_TASKS
from . import latex, paper, plots
from .latex import MISSING, SpreadCells, Tex, fmt
from .lm_eval import better
from .paper import OBJECTIVE_LABELS, objective_rank
from .plots import OBJECTIVE_COLORS
from .replicates import Spread, aggregate, seed_counts, spread

RECALL_TASK = "recall:"  # the recall probe's tasks in the summary: "recall:<corpus>"
SUITE_TASK = "longctx:"  # the long-context suite's (dimattn.data.longctx): "longctx:<corpus>"


def relative(df: pd.DataFrame) -> pd.DataFrame:
    """``rel``: each score in percent of the base model's score (same model, task, metric, kv),
    value / base whatever the metric's direction."""
    keys = ["model", "task", "metric", "kv"]
    base = df[df["objective"] == BASE_OBJECTIVE].set_index(keys)["value"]
    if base.empty:
        raise ValueError("the downstream summary has no base-model (l = 0) rows to compare with")
    out = df.copy()
    ref = out.set_index(keys).index.map(base.get)
    out["base"] = list(ref)
    out["rel"] = 100 * out["value"] / out["base"]
    return out


POINT = ["model", "task", "metric", "objective", "d_prime", "kv", "num_projected", "n_layers", "share"]


def main_study(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of Table 1's projections (Figures 2-3, Tables 2-5), not those of an ablation
    study's (Table 6)."""
    return df[df["study"] == MAIN_STUDY]


def replicated(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`relative` scores, one row per point over the fit seeds (``rel_spread``: a Spread)."""
    return aggregate(relative(main_study(df)), ["rel", "value"], POINT)


def _panels(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(task, metric) of the figure's panels and the table's groups: the recall probe by its
    overall accuracy only (its distance bins are Tables 2-3's columns, :func:`subtask_table`),
    the suite by its average (its subtasks are)."""
    pairs = dict.fromkeys(zip(df["task"], df["metric"]))
    return [(t, m) for t, m in pairs
            if not (t.startswith(RECALL_TASK) and m != "acc") and not (t.startswith(SUITE_TASK) and m != "score")]


_METRIC_NAMES = {"ppl": "perplexity", "acc": "accuracy"}


def _metric_name(metric: str) -> str:
    """A panel's y label's metric: lm-eval's "acc,none" as "accuracy"."""
    name = metric.split(",")[0]
    return _METRIC_NAMES.get(name, name)


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
                                    ls="-" if kv == NO_KV else "--")
                handles.setdefault(label, handle)
            ax.axhline(100, color="0.6", lw=1, ls=":")
            base_value = base[base["kv"] == NO_KV]["value"]
            shown = f"{base_value.iloc[0]:.4g}" if len(base_value) else "?"
            ax.set_title(f"ours: {model}\n{task} {metric} (base {shown})", fontsize=10)
            ax.set_xlabel("layers projected (%)")
            ax.set_ylabel(f"{_metric_name(metric)}, % of the base model\n({better(metric)})")
        for ax, column in zip(axes[len(panels):], ("ruler_4k", "ruler_8k")):
            for model, sel in ref.groupby("model", sort=False):
                sel = sel.assign(share=sel["share_of_layers_pct"].astype(float), value=sel[column].astype(float))
                sel = sel.sort_values("share")
                rel = 100 * sel["value"] / sel["value"].iloc[0]
                ax.plot(sel["share"], rel, marker="s", lw=1.6, ls="--", label=model)
            ax.axhline(100, color="0.6", lw=1, ls=":")
            ax.set_title(f"paper (Table 4): RULER {column[-2:]}, DimPO d'=64", fontsize=10)
            ax.set_xlabel("layers projected (%)")
            ax.set_ylabel("RULER score, % of the base model\n(higher is better)")
            ax.legend(fontsize=8, frameon=False)
        plots.hide_unused(axes, n)
        fig.legend(handles=list(handles.values()), labels=list(handles), loc="outside right center", frameon=False)
        fig.suptitle("Projected models at work: score relative to the base model vs. share of layers projected "
                     "(seed 003, Figures 2-3)\nours: Table 1's projections on the last l layers; dashed: with KV "
                     "compression" + plots.spread_note(seed_counts(df)), fontsize=11)
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
            title += f", {better(metric)}"
            groups.append({"title": Tex(latex.escape(title)),
                           "columns": [Tex(rf"$l{{=}}{int(l)}$ ({100 * l / n_layers:.0f}\%)") for l in shares]})
            selections.append(sel[sel["objective"] != BASE_OBJECTIVE])
    keys = sorted({k for sel in selections for k in zip(sel["objective"], sel["d_prime"], sel["kv"])},
                  key=lambda k: (objective_rank(k[0]), k[1], k[2] != NO_KV, k[2]))
    body = []
    for objective, d_prime, kv in keys:
        cells = []
        for sel in selections:
            line = sel[(sel["objective"] == objective) & (sel["d_prime"] == d_prime) & (sel["kv"] == kv)]
            by_l = {r["num_projected"]: spread(r, "rel") for _, r in line.iterrows()}
            cells += [cell(by_l[l], lambda v: fmt(v, 1)) if l in by_l else MISSING for l in shares]
        body.append({"label": Tex(latex.escape(_label(objective, d_prime, kv, many_d))), "cells": cells,
                     "space": False})
    caption = (
        "Projected models at work (seed 003, Section 4): the score of the model with Table 1's projection on its "
        "last $l$ attention layers, in percent of the base model's (with the same KV compression; projected / base "
        "for every metric, so above 100 is better for a score and worse for a perplexity, as each group says), "
        "per objective. The paper's RULER results are in its Tables 2-5 "
        "(reference/dimpo\\_ruler\\_*.csv); ours are CPU-scale tasks."
    )
    return latex.grouped_table(path, "dimpo_downstream.table", groups, body, Tex(caption), "dimpo_downstream",
                               "Objective", cell.note())


# ---- long context: RULER (paper scale) and the recall probe (its CPU-scale analogue) ------------

# Seed 003 Tables 2-3 group RULER's 13 subtasks into six columns; its average is the unweighted
# mean of the 13 (Table 2's base row: (8 x 99.9 + 81.0 + 63.2 + 99.8 + 99.6 + 92.3) / 13 = 95.0).
RULER_GROUPS = {
    "NIAH": [t for t in RULER_TASKS if t.startswith("niah_")],
    "SQuAD": ["ruler_qa_squad"], "HotpotQA": ["ruler_qa_hotpot"],
    "VT": ["ruler_vt"], "CWE": ["ruler_cwe"], "FWE": ["ruler_fwe"],
}
AVERAGE = "avg"
SCORE_KEYS = ["study", "model", "objective", "setting", "d_prime", "kv", "num_projected", "n_layers", "share", "seed"]


def long_context(df: pd.DataFrame) -> pd.DataFrame:
    """Long-context scores in percent, long: one row per (study, model, objective, setting, d',
    kv, l, seed, probe, column). RULER at each length (probe "RULER 4096") gives the six columns of Tables 2-3
    and "avg", the mean of all 13 subtasks (missing unless all 13 ran); the recall probe (probe
    "recall") a column per distance bin and "avg", every query. ``order`` keeps the columns'."""
    rows = []
    ruler = df[df["task"].isin(RULER_TASKS) & df["metric"].str.fullmatch(r"\d+")]
    for (*point, length), part in ruler.groupby([*SCORE_KEYS, "metric"], sort=False, dropna=False):
        by_task = part.groupby("task")["value"].mean() * 100  # lm-eval's RULER scores are fractions
        fields = dict(zip(SCORE_KEYS, point)) | {"probe": f"RULER {length}"}
        for order, (column, tasks) in enumerate(RULER_GROUPS.items()):
            present = by_task.reindex(tasks).dropna()
            if len(present):
                rows.append(fields | {"column": column, "order": order, "value": present.mean()})
        complete = by_task.reindex(RULER_TASKS).notna().all()
        rows.append(fields | {"column": AVERAGE, "order": len(RULER_GROUPS),
                              "value": by_task.reindex(RULER_TASKS).mean() if complete else None})
    recall = df[df["task"].str.startswith(RECALL_TASK)]
    for _, r in recall.iterrows():
        metric = r["metric"]
        bins = metric.partition(",")[2]
        lo, _, hi = bins[1:].partition("-")
        column, order = (AVERAGE, 10**6) if metric == "acc" else (rf"{lo}--{hi}", int(lo))
        value = None if pd.isna(r["value"]) else 100 * r["value"]
        rows.append({k: r[k] for k in SCORE_KEYS} | {"probe": "recall", "column": column, "order": order,
                                                     "value": value})
    suite = df[df["task"].str.startswith(SUITE_TASK)]
    for (*point, task), part in suite.groupby([*SCORE_KEYS, "task"], sort=False, dropna=False):
        fields = dict(zip(SCORE_KEYS, point)) | {"probe": "suite " + task[len(SUITE_TASK):]}
        by_task = {m.partition(",")[2]: 100 * v for m, v in zip(part["metric"], part["value"]) if "," in m}
        for order, (column, tasks) in enumerate(_suite_groups(by_task).items()):
            rows.append(fields | {"column": column, "order": order, "value": np.mean([by_task[t] for t in tasks])})
        average = part.loc[part["metric"] == "score", "value"]
        rows.append(fields | {"column": AVERAGE, "order": len(RULER_GROUPS),
                              "value": 100 * average.iloc[0] if len(average) else None})
    out = pd.DataFrame(rows, columns=[*SCORE_KEYS, "probe", "column", "order", "value"]).astype({"value": float})
    models = {m: i for i, m in enumerate(dict.fromkeys(df["model"]))}  # the summary's order
    return out.sort_values("model", key=lambda s: s.map(models), kind="stable").reset_index(drop=True)


def _suite_groups(subtasks) -> dict[str, list[str]]:
    """The suite's subtasks under Tables 2-3's column of the RULER task each is modelled on
    (dimattn.workflow.vocabulary.RULER_TASK), in RULER_GROUPS' order; its one QA subtask stands for SQuAD."""
    out = {}
    for column, tasks in RULER_GROUPS.items():
        mine = [t for t in subtasks if RULER_TASK.get(t) in tasks]
        if mine:
            out["QA" if column == "SQuAD" else column] = mine
    return out


def probe_points(scores: pd.DataFrame) -> pd.DataFrame:
    """:func:`long_context` aggregated over fit seeds (``value_spread``)."""
    return aggregate(scores, ["value"], ["study", "model", "probe", "objective", "setting", "d_prime", "kv",
                                         "num_projected", "n_layers", "column", "order"])


def separating_l(points: pd.DataFrame) -> int | None:
    """The l of a (model, probe) at which the objectives' averages (no KV compression) lie furthest
    apart, the deeper one on a tie: where the paper puts its Tables 2-3 (l = 20 of 32, 24 of 36)."""
    sel = points[(points["objective"] != BASE_OBJECTIVE) & (points["kv"] == NO_KV) & (points["column"] == AVERAGE)]
    sel = sel.dropna(subset=["value"])
    if sel.empty:
        return None
    gaps = sel.groupby("num_projected")["value"].agg(lambda v: v.max() - v.min())
    return int(max(gaps.index, key=lambda l: (round(gaps[l], 9), l)))


# The paper's Tables 2-3 rows as our objectives: DimPO's default is k = 64, lambda = 1; its
# k = 0, lambda = 0 row is the listwise term alone (our dimpo_list).
_PAPER_METHODS = {("base", "", ""): BASE_OBJECTIVE, ("kl", "", ""): "kl", ("dimpo", "64", "1"): "dimpo",
                  ("dimpo", "0", "0"): "dimpo_list"}


def objective_label(objective: str) -> str:
    return "Base (l = 0)" if objective == BASE_OBJECTIVE else OBJECTIVE_LABELS.get(objective, objective)


def subtask_table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 003 Tables 2-3: the long-context probe's subtasks at one deep l per model (its
    :func:`separating_l`), a row per objective, the paper's Tables 2 (Llama-3.1-8B, l = 20) and
    3 (Qwen3-4B, l = 24) beside. Ours: RULER at paper scale, the recall probe's distance bins at
    CPU scale; scores in percent, absolute, without KV compression."""
    points = probe_points(long_context(main_study(frames["dimpo_downstream"])))
    points = points[points["kv"] == NO_KV]
    if points.empty:
        raise ValueError("the downstream summary has no long-context (RULER, recall probe or suite) scores")
    cell = SpreadCells(seed_counts(points))
    groups, lookups = [], []
    for (model, probe), part in points.groupby(["model", "probe"], sort=False):
        l_star = separating_l(part)
        shown = part[(part["objective"] == BASE_OBJECTIVE) | (part["num_projected"] == l_star)]
        columns = shown.drop_duplicates("column").sort_values("order")["column"].tolist()
        n_layers = int(part["n_layers"].dropna().iloc[0])
        title = latex.escape(f"ours: {model}, {probe}" + (" by query distance" if probe == "recall" else ""))
        title += rf", $l{{=}}{l_star}$ of {n_layers}" if l_star else ""
        groups.append({"title": Tex(title),
                       "columns": [Tex(latex.escape(c)) if c != AVERAGE else "avg" for c in columns]})
        lookups.append(({(r["objective"], r["column"]): spread(r, "value") for _, r in shown.iterrows()}, columns))
    ref = paper.read(reference_dir, "dimpo_ruler_subtasks")
    paper_columns = [*RULER_GROUPS, "RULER_avg"]
    for (source, model), part in ref.groupby(["source", "model"], sort=False):
        l = part.loc[part["method"] != "base", "num_projected"].iloc[0]
        groups.append({"title": Tex(latex.escape(f"paper ({source}): {model}, RULER 4k, ") + rf"$l{{=}}{l}$"),
                       "columns": [c if c != "RULER_avg" else "avg" for c in paper_columns]})
        table = {}
        for _, r in part.iterrows():
            objective = _PAPER_METHODS.get((r["method"], r["k"], r["lambda"]), r["method"])
            table |= {(objective, c): Spread.of([float(r[c])]) for c in paper_columns if r[c] != ""}
        lookups.append((table, paper_columns))
    objectives = sorted({o for table, _ in lookups for o, _ in table},
                        key=lambda o: (o != BASE_OBJECTIVE, objective_rank(o)))
    body = [{"label": objective_label(o), "space": False,
             "cells": [cell(table[(o, c)], lambda v: fmt(v, 1)) if (o, c) in table else MISSING
                       for table, columns in lookups for c in columns]}
            for o in objectives]
    caption = (
        "Long context with projected layers (seed 003, Tables 2-3): scores in percent per subtask at one deep "
        "$l$ per model, where the objectives lie furthest apart, and the base model ($l = 0$). Ours at CPU scale is "
        "the recall probe, its columns the query-to-key distance bins (the context prefilled, the questions decoded "
        "through the KV cache), and the long-context suite generated here in RULER's mould (its subtasks under RULER's "
        "groups, QA standing for SQuAD, and their mean); at paper scale RULER's six subtask groups and the mean of its "
        "13 subtasks. "
        "The paper's DimPO row is $k = 64$, $\\lambda = 1$; its $k = 0$, $\\lambda = 0$ row is the listwise term alone."
    )
    return latex.grouped_table(path, "dimpo_downstream.subtask_table", groups, body, Tex(caption), "dimpo_ruler",
                               "Objective", cell.note())


def kv_table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 003 Table 5: the long-context average with KV-cache compression (columns: none, KIVI
    by bits, SnapKV by budget, smallest first) and the projection on the last l layers (rows,
    l = 0 the base model); the paper's Llama-3.1-8B rows (DimPO, RULER 4k and 8k) below ours."""
    df = main_study(frames["dimpo_downstream"])
    kinds = {r["kv"]: (r["kv_method"], int(r["kv_level"])) for _, r in df.drop_duplicates("kv").iterrows()}
    points = probe_points(long_context(df))
    points = points[points["column"] == AVERAGE]
    ref = paper.read(reference_dir, "dimpo_compression")
    paper_kinds = {c: ("kivi", int(c.split("-")[1][0])) if c.startswith("kivi") else
                      ("snapkv", int(c.split("-")[1])) if c.startswith("snapkv") else (NO_KV, 0)
                   for c in ref["compression"].unique()}
    slots = []  # columns: (kind, rank within the kind)
    for kind in (NO_KV, "kivi", "snapkv"):
        ours = sorted(v for n, (k, v) in kinds.items() if k == kind)
        theirs = sorted(v for k, v in paper_kinds.values() if k == kind)
        for rank in range(max(len(ours), len(theirs))):
            name = {NO_KV: "none", "kivi": "KIVI", "snapkv": "SnapKV"}[kind]
            ours_v = f"{ours[rank]:g}" if rank < len(ours) else MISSING
            theirs_v = f"{theirs[rank]:g}" if rank < len(theirs) else MISSING
            unit = {"kivi": "bits", "snapkv": "budget"}.get(kind)
            label = name if kind == NO_KV else f"{name} ({unit} {ours_v} / {theirs_v})"
            slots.append(((kind, ours[rank] if rank < len(ours) else None,
                           theirs[rank] if rank < len(theirs) else None), label))
    cell = SpreadCells(seed_counts(points))
    body = []
    for (model, probe, objective, d_prime), part in points.groupby(["model", "probe", "objective", "d_prime"],
                                                                    sort=False):
        if objective == BASE_OBJECTIVE or (part["kv"] == NO_KV).all():
            continue  # Table 5's rows: the objectives combined with a compression
        base = points[(points["model"] == model) & (points["probe"] == probe) & (points["objective"] == BASE_OBJECTIVE)]
        for i, (l, line) in enumerate(pd.concat([base, part]).groupby("num_projected", sort=True)):
            by_kind = {kinds[r["kv"]]: spread(r, "value") for _, r in line.iterrows()}
            label = f"ours: {model}, {probe}, {objective_label(objective)}, l = {int(l)}"
            body.append({"label": Tex(latex.escape(label)), "space": i == 0,
                         "cells": [cell(by_kind[(k, v)], lambda x: fmt(x, 1)) if (k, v) in by_kind else MISSING
                                   for (k, v, _), _ in slots]})
    for length in ("ruler_4k", "ruler_8k"):
        for i, (l, line) in enumerate(ref.groupby(["model", "num_projected"], sort=False)):
            by_kind = {paper_kinds[r["compression"]]: float(r[length]) for _, r in line.iterrows()}
            label = f"paper: {l[0]}, RULER {length[-2:]}, DimPO, l = {l[1]}"
            body.append({"label": Tex(latex.escape(label)), "space": i == 0,
                         "cells": [fmt(by_kind[(k, w)], 1) if (k, w) in by_kind else MISSING
                                   for (k, _, w), _ in slots]})
    caption = (
        "Projection with KV-cache compression (seed 003, Table 5): the long-context average in percent (ours: the "
        "recall probe and the suite at CPU scale, RULER at paper scale) per compression and number of projected layers $l$. "
        "Column headings give our setting / the paper's (KIVI: bits; SnapKV: tokens kept). SnapKV and KIVI change "
        "decoding only: the prompt is prefilled at full precision, the questions decoded through the compressed cache."
    )
    groups = [{"title": "KV-cache compression", "columns": [Tex(latex.escape(label)) for _, label in slots]}]
    return latex.grouped_table(path, "dimpo_downstream.kv_table", groups, body, Tex(caption), "dimpo_kv",
                               Tex("Model, probe, objective, $l$"), cell.note())


# ---- latency (Appendix H) ------------------------------------------------------------------------


def latency_table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 003 Appendix H: per model, the base model, SnapKV and DimPO's projection (rows):
    prefill time, time per decoded token, tokens/s, KV-cache and peak memory (medians of paired
    repeats), each with its ratio to the base model's in brackets. The base model's own ratio
    (base against base) is the measurement's noise floor."""
    df = frames["dimpo_latency"]
    groups = [{"title": "", "columns": ["prefill (ms)", "decode (ms/token)", "tokens/s", "KV cache (KiB)",
                                        "peak (MiB)"]}]
    body = []
    for (model, device, dtype, prompt, new), part in df.groupby(["model", "device", "dtype", "prompt", "new"],
                                                                sort=False):
        for i, (_, r) in enumerate(part.iterrows()):
            def both(value, ratio, digits=1):
                return f"{value:.{digits}f} ({ratio:.2f})"

            label = f"{model} ({device}, {dtype}, {prompt} + {new} tokens, d' = {r['d_prime']}): {r['setting']}"
            body.append({"label": Tex(latex.escape(label)), "space": i == 0, "cells": [
                both(1e3 * r["prefill_s"], r["prefill_ratio"]), both(1e3 * r["decode_s"], r["decode_ratio"], 2),
                both(r["tokens_per_s"], 1 / r["decode_ratio"] if r["decode_ratio"] else float("nan")),
                both(r["cache_bytes"] / 1024, r["cache_ratio"]), both(r["peak_bytes"] / 2**20, r["peak_ratio"]),
            ]})
    kinds = set(df["peak_kind"])
    caption = (
        "Inference latency (seed 003, Appendix H): the base model, SnapKV (a quarter of the prompt kept), and "
        "Table 1's DimPO projection on the last half and on every layer, alone and with SnapKV; medians over "
        "paired repeats, in brackets the median ratio to the base model measured back to back (the base row's "
        "is the noise floor). Peak memory: "
        + ("CUDA's allocator peak" if kinds == {"cuda_max_allocated"} else
           "the weights plus the KV cache (a CPU process has no per-run peak)" if kinds == {"weights_plus_cache"}
           else "CUDA's allocator peak on GPU, weights plus KV cache on CPU")
        + ". The paper reports no numbers we could set beside these."
    )
    return latex.grouped_table(path, "dimpo_downstream.latency_table", groups, body, Tex(caption), "dimpo_latency",
                               Tex("Model: setting"))
