"""The lm-evaluation-harness table (``lm_eval.tex``): every scored setting, each task's metrics
with their standard errors (one seed) or their mean and min-max range over seeds.

No paper column: seed 000's Table 4 reports scores of d = 2048 models relative to a
d_down = d DAR model, which ``dar.downstream_table`` sets beside ours; these are absolute scores.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import latex, selection
from .latex import MISSING, SpreadCells, Tex, integer
from .replicates import seed_counts, settings

# The one home of a score's direction: metrics where a smaller value is better, lm-eval's and
# ours (held-out "ppl", DimPO's fidelity "kl" and "mse"); every other score counts up.
LOWER_IS_BETTER = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ppl", "kl", "mse"}


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` (lm-eval's "metric,filter" or a bare name) is better."""
    return metric.split(",")[0] in LOWER_IS_BETTER


def better(metric: str) -> str:
    """What an axis or column of ``metric`` says of its direction."""
    return "lower is better" if lower_is_better(metric) else "higher is better"


def metric_label(metric: str) -> str:
    """lm-eval's "metric,filter" as "metric (filter)"."""
    name, _, filt = metric.partition(",")
    return f"{name} ({filt})" if filt else name


def table(frames: dict[str, pd.DataFrame], reference_dir: Path, path: Path) -> Path:
    """Settings x (task, metric): value ± stderr, or over several seeds the mean [min, max], in the
    summary's run order."""
    lm = frames["lm_eval"]
    if lm.empty:
        raise selection.NoRuns("no run has lm-eval scores")
    lm = settings(lm, ["value"], ["task", "metric"])
    cell = SpreadCells(seed_counts(lm))
    columns = list(dict.fromkeys(zip(lm["task"], lm["metric"])))
    tasks = [{"task": t, "span": sum(1 for c in columns if c[0] == t)} for t in dict.fromkeys(c[0] for c in columns)]
    cells = {(r.run, r.task, r.metric): r for r in lm.itertuples()}
    rows = []
    for _, run in lm.drop_duplicates("run").iterrows():
        values = []
        for task, metric in columns:
            r = cells.get((run["run"], task, metric))
            if r is None:
                values.append(MISSING)
                continue
            if r.value_spread.n > 1:
                values.append(cell(r.value_spread, lambda x: latex.fmt_sig(x, 4)))
                continue
            text = latex.escape(latex.fmt_sig(r.value, 4))
            if not pd.isna(r.stderr):
                text += rf" {{\scriptsize$\pm${latex.escape(latex.fmt_sig(r.stderr, 2))}}}"
            values.append(Tex(text))
        rows.append(
            {
                "run": run["run"],
                "variant": selection.kind_label(selection.kind(run)),
                "d_down": integer(run["d_down"]),
                "window": integer(run["window"]),
                "values": values,
            }
        )
    return latex.render(
        "lm_eval.tex.j2",
        path,
        tasks=tasks,
        metrics=[metric_label(m) for _, m in columns],
        rows=rows,
        d_models=", ".join(str(d) for d in sorted(lm["hidden_size"].unique())),
        spread_note=cell.note(),
    )
