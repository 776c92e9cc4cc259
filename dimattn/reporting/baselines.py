"""Seed 001 (sliding-window attention): its SWA, dilated and "Combined Sliding + Full" (hybrid)
attention beside Vanilla, DAR, Uniform and the DAR variants (``baselines.tex``).

Seed 001 prints no numbers to set beside these, so the table has no paper column; it quotes the
paper's argument instead. Per scale (a text corpus: Rel. perplexity; the recall corpus: accuracy
over all queries and over the farthest ones) it shows one run of each kind
(``selection.representatives``): the mean over its seeds, with their min-max range and a mark
where it lies within the seed spread of Vanilla's.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import latex, paper, selection
from .latex import DAGGER, MISSING, SpreadCells, Tex, fmt, na, pct
from .replicates import count_seeds, rel_to_vanilla, settings, spread


def setting(run, tex: bool = True) -> str:
    """The numbers that tell runs of one kind apart: "w=32, r=4", "w=32, d_down=16" (LaTeX or mathtext)."""
    d_down = r"d\textsubscript{down}" if tex else r"$d_{\mathrm{down}}$"
    parts = []
    if not na(run["window"]):
        parts.append(f"w={int(run['window'])}")
    if not na(run["dilation"]):
        parts.append(f"r={int(run['dilation'])}")
    if not na(run["d_down"]):
        parts.append(f"{d_down}={int(run['d_down'])}")
    text = ", ".join(parts) or MISSING
    return Tex(text) if tex else text


def _far_bin(recall: pd.DataFrame | None) -> pd.DataFrame:
    """Per (run, corpus, split) the accuracy of the farthest distance bin that has queries."""
    if recall is None:
        return pd.DataFrame(columns=["run", "corpus", "split", "accuracy_spread", "min_distance"])
    rows = recall[(recall["scope"] == "distance") & (recall["n"] > 0).fillna(False)].dropna(subset=["bin"])
    rows = rows.sort_values("bin").drop_duplicates(["run", "corpus", "split"], keep="last")
    return rows[["run", "corpus", "split", "accuracy_spread", "min_distance"]]


def _columns(ppl: pd.DataFrame | None, recall: pd.DataFrame | None) -> list[dict]:
    """Per scale with at least one seed 001 baseline or DAR variant: its setting of each kind."""
    if ppl is not None:
        ppl = settings(ppl, ["ppl", "rel_to_vanilla"], ["corpus", "split"])
    if recall is not None:
        recall = settings(recall, ["accuracy"], ["corpus", "split", "scope", "bin"])
    columns = []
    far = _far_bin(recall).set_index(["run", "corpus", "split"])
    overall = recall[recall["scope"] == "overall"] if recall is not None else None
    for source, df in (("text", ppl), ("recall", overall)):
        for scale, rows in selection.frame_scales(df):
            reps = selection.representatives(selection.records(rows))
            if not any(selection.is_baseline(k) for k in reps):
                continue
            col = {"source": source, "scale": scale, "reps": reps}
            if source == "recall":
                keys = [(r["run"], scale["corpus"], scale["split"]) for r in reps.values()]
                col["far"] = {k[0]: far["accuracy_spread"].get(k) for k in keys}
                lows = [far["min_distance"].get(k) for k in keys if k in far.index]
                col["far_from"] = int(max(lows)) if lows else None
            columns.append(col)
    if not columns:
        raise selection.NoRuns("no SWA, dilated, hybrid or patterned DAR run")
    return columns


def _values(column: dict, run: dict) -> list[tuple]:
    """The numbers a column shows of a run, each as (shown, compared with Vanilla's, format):
    on text Rel. perplexity, compared by perplexity; on recall both accuracies."""
    if column["source"] == "text":
        return [(rel_to_vanilla(run), spread(run, "ppl"), fmt)]
    far = column["far"].get(run["run"])
    return [(spread(run, "accuracy"), spread(run, "accuracy"), pct), (far, far, pct)]


def table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Seed 001's SWA, dilated and SWA + full attention beside Vanilla, DAR and the DAR variants."""
    columns = _columns(frames.get("dar_perplexity"), frames.get("recall"))
    kinds = sorted({k for c in columns for k in c["reps"]}, key=selection.kind_rank)
    counts = count_seeds(v[0] for c in columns for run in c["reps"].values() for v in _values(c, run))
    cell = SpreadCells(counts, {DAGGER: "this attention and Vanilla in the same column (on text: their perplexities)"})
    rows = []
    for kind in kinds:
        cells = []
        for c in columns:
            run = c["reps"].get(kind)
            if run is None:
                cells += [MISSING] * (2 if c["source"] == "text" else 3)
                continue
            vanilla = next((r for k, r in c["reps"].items() if k[0] == "vanilla" and k != kind), None)
            theirs = _values(c, vanilla) if vanilla is not None else []
            cells.append(setting(run))
            for i, (shown, compared, number) in enumerate(_values(c, run)):
                within = bool(theirs) and compared is not None and compared.overlaps(theirs[i][1])
                cells.append(cell(shown, number, [DAGGER] if within else []))
        rows.append({"label": selection.kind_label(kind), "cells": cells, "baseline": selection.is_baseline(kind)})
    heads, subheads = [], []
    for c in columns:
        width = 2 if c["source"] == "text" else 3
        heads.append({"text": f"{selection.scale_label(c['scale'])}, d = {c['scale']['hidden_size']}", "span": width})
        if c["source"] == "text":
            subheads += ["setting", Tex(r"Rel.\ PPL (\%) $\downarrow$")]
        else:
            far = f"d $\\geq$ {c['far_from']}" if c["far_from"] is not None else "farthest"
            subheads += ["setting", Tex(r"acc.\ (\%) $\uparrow$"), Tex(rf"acc., {far} (\%)")]
    n_columns = 1 + sum(h["span"] for h in heads)
    return latex.render(
        "baselines.tex.j2",
        path,
        heads=heads,
        subheads=subheads,
        rows=rows,
        n_columns=n_columns,
        finding=paper.finding(reference_dir, "001 Overview"),
        has_text=any(c["source"] == "text" for c in columns),
        has_recall=any(c["source"] == "recall" for c in columns),
        spread_note=cell.note(),
    )
