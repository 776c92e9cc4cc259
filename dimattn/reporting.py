"""Tidy summaries, LaTeX tables and figures, with the papers' numbers beside ours.

Results flow one way: raw outputs of the other stages (perplexity, recall and lm-eval JSON,
the training ``metrics.csv`` of each run, DimPO fidelity CSVs) are reduced by the
``summarize_*`` functions to tidy CSVs; the ``render_*`` functions read only those CSVs
and ``reference/`` (the numbers the papers print) and write LaTeX and PNG.

Our models are far smaller than the papers' (seed 000 trains Pythia-70M with d = 512,
seed 003 projects Llama-3.1-8B heads with d = 128), so paper numbers are matched by the
ratio d_down/d (DAR) or d'/d (DimPO), and every table prints both dimensions.

Which runs go into which DAR table is read off the run columns alone, never off run names:

* a *plain* run has a linear bottleneck (or none) and no layer pattern (``full_every``,
  ``layers``); Table 1 (``dar_perplexity``), Table 2 (``dar_scales``), the trajectory figure
  and the d_down sweeps of ``recall`` use plain runs only;
* the *main window* of a scale is the window most of its plain DAR runs share;
* a *window sweep* is a set of plain DAR runs at one d_down and at least two windows
  (``dar_window``, seed 000 Table 3);
* the *no-bottleneck* DAR run has d_down = d_model (``dar_downstream``, seed 000 Table 4);
* everything else (SWA, dilated, hybrids, sigmoid bottleneck, DAR on some layers) is a
  seed 001 baseline or a DAR variant (``baselines``).

A *scale* is a (corpus, split, d_model) of the perplexity or recall summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import textwrap
from collections.abc import Iterable
from fractions import Fraction
from itertools import zip_longest
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from .atomic import atomic_file

# Summary files, one per kind of raw output; render_all finds the groups by these names.
SUMMARY_FILES = {
    "perplexity": "dar_perplexity.csv",
    "trajectory": "dar_trajectory.csv",
    "lm_eval": "lm_eval.csv",
    "recall": "recall.csv",
    "fidelity": "dimpo_fidelity.csv",
}
DAR_SUMMARIES = ("perplexity", "trajectory", "lm_eval", "recall")
DIMPO_SUMMARIES = ("fidelity",)

REFERENCE_FILES = {
    "dar": "dar_relative_perplexity.csv",
    "dar_downstream": "dar_downstream_relative.csv",
    "dar_tasks": "dar_task_context_lengths.csv",
    "qualitative": "qualitative_findings.csv",
    "dimpo": "dimpo_fidelity_llama31_8b.csv",
}
# Seed 003, Section 4: every model it projects has head dimension d = 128.
PAPER_DIMPO_HEAD_DIM = 128

# The fields of dimattn.evaluation.run_metadata; a field a variant does not use is empty.
RUN_COLUMNS = ["run", "variant", "d_model", "d_down", "window", "dilation", "bottleneck", "full_every", "layers"]
# Added by this version; a summary written before it lacks them, and its runs are all plain.
PATTERN_COLUMNS = ["dilation", "bottleneck", "full_every", "layers"]
PERPLEXITY_COLUMNS = RUN_COLUMNS + ["corpus", "ppl", "rel_to_vanilla"]
PERPLEXITY_EXTRA = ["split", "n_tokens", "loss", "corpus_kind"]
TRAJECTORY_COLUMNS = RUN_COLUMNS + ["dataset", "step", "tokens", "val_loss", "val_ppl", "rel_to_vanilla"]
LM_EVAL_COLUMNS = RUN_COLUMNS + ["task", "metric", "value", "stderr"]
RECALL_COLUMNS = RUN_COLUMNS + [
    "corpus",
    "split",
    "scope",
    "bin",
    "min_distance",
    "max_distance",
    "accuracy",
    "n",
    "chance",
]
FIDELITY_COLUMNS = ["model", "objective", "d_prime", "head_dim", "layer", "kl", "mse"]
INT_COLUMNS = [
    "d_model",
    "d_down",
    "window",
    "dilation",
    "full_every",
    "step",
    "tokens",
    "n_tokens",
    "bin",
    "min_distance",
    "max_distance",
    "n",
    "d_prime",
    "head_dim",
    "layer",
]
STR_COLUMNS = ["run", "variant", "bottleneck", "layers", "corpus", "split", "corpus_kind", "dataset", "scope"]
# The columns a render_* function needs in each summary (PATTERN_COLUMNS may be absent).
REQUIRED_COLUMNS = {
    "perplexity": [c for c in PERPLEXITY_COLUMNS if c not in PATTERN_COLUMNS],
    "trajectory": [c for c in TRAJECTORY_COLUMNS if c not in PATTERN_COLUMNS + ["dataset", "val_loss"]],
    "lm_eval": [c for c in LM_EVAL_COLUMNS if c not in PATTERN_COLUMNS],
    "recall": [c for c in RECALL_COLUMNS if c not in PATTERN_COLUMNS],
}

BOTTLENECK_VARIANTS = ("dar", "uniform")
WINDOW_VARIANTS = ("dar", "swa", "dilated")
PLAIN_VARIANTS = ("vanilla", "dar", "uniform")
VARIANT_ORDER = ["vanilla", "dar", "uniform", "swa", "dilated"]
VARIANT_LABELS = {"vanilla": "Vanilla", "dar": "DAR", "uniform": "Uniform", "swa": "SWA", "dilated": "Dilated"}
VARIANT_COLORS = {
    "vanilla": "0.35",
    "dar": "#1f77b4",
    "uniform": "#d95f02",
    "swa": "#1b9e77",
    "dilated": "#7570b3",
    "hybrid": "#e7298a",
}
VARIANT_MARKERS = {"vanilla": "^", "dar": "o", "uniform": "s", "swa": "D", "dilated": "v"}
CHANCE_COLOR = "0.55"
# Seed 003 Table 1 row order; objectives we do not run still appear as paper-only rows.
OBJECTIVE_ORDER = ["random", "pca", "triplet", "cpo", "simpo", "orpo", "dimpo", "kl"]
OBJECTIVE_LABELS = {
    "random": "Random",
    "pca": "PCA",
    "triplet": "Triplet",
    "cpo": "CPO",
    "simpo": "SimPO",
    "orpo": "ORPO",
    "dimpo": "DimPO",
    "kl": "KL",
}
_CB = sns.color_palette("colorblind")
# Fixed per objective, so a colour means the same objective in every panel and figure.
OBJECTIVE_COLORS = {
    "random": _CB[4],
    "pca": _CB[1],
    "triplet": _CB[5],
    "cpo": _CB[3],
    "simpo": _CB[6],
    "orpo": _CB[9],
    "dimpo": _CB[0],
    "kl": _CB[2],
}

DPI = 150
TEMPLATE_DIR = Path(__file__).parent / "templates"
MISSING = "--"
NOT_RUN = "not run in this configuration"


# ----------------------------------------------------------------------------- I/O


def _atomic_write(path: Path, write) -> Path:
    """Call write(tmp_path) on a temporary file beside path, then os.replace it into place."""
    path = Path(path)
    with atomic_file(path) as tmp:
        write(tmp)
    return path


def _write_text(path: Path, text: str) -> Path:
    return _atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _write_csv(df: pd.DataFrame, path: Path) -> Path:
    return _atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))


def _save_figure(fig: Figure, path: Path) -> Path:
    return _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight"))


def _as_int(df: pd.DataFrame) -> pd.DataFrame:
    """Nullable integers, so that 32 stays 32 in a CSV even when a column has NaN."""
    for col in INT_COLUMNS:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce").round().astype("Int64")
    return df


def _read_summary(path: Path) -> pd.DataFrame:
    # Strings stay strings: layers "2.3" is not the number 2.3.
    return _as_int(pd.read_csv(path, dtype={c: "string" for c in STR_COLUMNS}))


def _prepare(df: pd.DataFrame, kind: str, source: str = "") -> pd.DataFrame:
    """A copy of a summary frame with every column the renderers use, or a ValueError naming the gap.

    PATTERN_COLUMNS (and the trajectory's dataset, the perplexity's split and corpus_kind) are
    filled in when absent: a summary written before they existed holds plain runs only.
    """
    where = f"{source}: " if source else f"the {kind} summary ({SUMMARY_FILES[kind]}): "
    missing = [c for c in REQUIRED_COLUMNS[kind] if c not in df.columns]
    if missing:
        raise ValueError(
            f"{where}missing column(s) {missing}; expected at least {REQUIRED_COLUMNS[kind]}. "
            "Regenerate the summaries with snakemake."
        )
    df = df.copy()
    for col in PATTERN_COLUMNS + ["dataset", "corpus_kind", "split"]:
        if col not in df.columns:
            df[col] = pd.NA
    for col in STR_COLUMNS:
        if col in df.columns:
            df[col] = df[col].astype("string")
    df["split"] = df["split"].fillna("")
    df["dataset"] = df["dataset"].fillna("")
    df["corpus_kind"] = df["corpus_kind"].fillna("text")
    return _as_int(df)


# ----------------------------------------------------------------------------- summaries


def _run_fields(record: dict, source: str = "") -> dict:
    """The run columns of a run_metadata record; a field its variant does not use becomes None.

    d_down is kept for dar/uniform, window for dar/swa/dilated, dilation for dilated, bottleneck
    ("linear" when unstated) for dar/uniform, full_every and layers for every variant but vanilla.
    """
    where = f"{source}: " if source else ""
    missing = [k for k in ("run", "variant", "d_model") if record.get(k) is None]
    if missing:
        raise ValueError(f"{where}run record lacks {missing}; expected the fields of run_metadata")
    variant = record["variant"]
    needs = (["d_down"] if variant in BOTTLENECK_VARIANTS else []) + (["window"] if variant in WINDOW_VARIANTS else [])
    missing = [k for k in needs if record.get(k) is None]
    if missing:
        raise ValueError(f"{where}run {record['run']!r} ({variant}) lacks {missing}")
    layers = record.get("layers")
    if isinstance(layers, (list, tuple)):
        layers = ".".join(map(str, layers))
    patterned = variant != "vanilla"
    return {
        "run": record["run"],
        "variant": variant,
        "d_model": record["d_model"],
        "d_down": record.get("d_down") if variant in BOTTLENECK_VARIANTS else None,
        "window": record.get("window") if variant in WINDOW_VARIANTS else None,
        "dilation": record.get("dilation") if variant == "dilated" else None,
        "bottleneck": (record.get("bottleneck") or "linear") if variant in BOTTLENECK_VARIANTS else None,
        "full_every": (record.get("full_every") or None) if patterned else None,
        "layers": (str(layers) if layers not in (None, "") else None) if patterned else None,
    }


def _check_one_vanilla(vanilla: pd.DataFrame, keys: list[str]) -> None:
    dup = vanilla[vanilla.duplicated(keys, keep=False)]
    if not dup.empty:
        raise ValueError(
            f"more than one vanilla run for the same {', '.join(keys)}: {sorted(dup['run'].unique())}; "
            "rel_to_vanilla needs exactly one baseline"
        )


def _relative_to_vanilla(df: pd.DataFrame, value: str, keys: list[str], scale: list[str], what: str) -> pd.DataFrame:
    """df[rel_to_vanilla] = 100 * value / value(vanilla run with the same keys).

    A scale (the ``scale`` columns, a subset of keys) without any vanilla run is allowed (seed 000
    Table 4 trains a d = 2048 scale with DAR only): its rel_to_vanilla stays empty. A scale that
    has a vanilla run for some keys but not for others is an error naming what lacks one.
    """
    vanilla = df.loc[df["variant"] == "vanilla", keys + ["run", value]]
    _check_one_vanilla(vanilla, keys)
    df = df.merge(vanilla.drop(columns="run").rename(columns={value: "_vanilla"}), on=keys, how="left")
    has_vanilla = df[scale].apply(tuple, axis=1).isin(set(vanilla[scale].apply(tuple, axis=1)))
    lacking = df[df["_vanilla"].isna() & has_vanilla]
    if what == "corpus" and not lacking.empty:
        first = lacking.iloc[0]
        raise ValueError(
            f"no vanilla run for corpus {first['corpus']!r} (d_model={first['d_model']}, split={first['split']!r}); "
            f"runs {sorted(lacking['run'].unique())} need one to compute rel_to_vanilla"
        )
    df["rel_to_vanilla"] = 100.0 * df[value] / df["_vanilla"]
    return df.drop(columns="_vanilla")


def summarize_perplexity(
    eval_jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str, synthetic: Iterable[str] = ()
) -> pd.DataFrame:
    """One row per (run, corpus); rel_to_vanilla = 100 * ppl / ppl(Vanilla, same d_model, corpus).

    synthetic: corpora that are synthetic (the recall corpus); they are marked
    corpus_kind = "synthetic" and left out of the perplexity tables (recall.csv scores them).
    """
    synthetic = set(synthetic)
    rows = []
    for path in eval_jsons:
        record = json.loads(Path(path).read_text())
        missing = [k for k in ("corpus", "ppl") if k not in record]
        if missing:
            raise ValueError(f"{path}: perplexity record lacks {missing}")
        rows.append(
            _run_fields(record, str(path))
            | {
                "corpus": record["corpus"],
                "ppl": float(record["ppl"]),
                "split": record.get("split"),
                "n_tokens": record.get("n_tokens"),
                "loss": record.get("loss"),
                "corpus_kind": "synthetic" if record["corpus"] in synthetic else "text",
            }
        )
    if not rows:
        raise ValueError("summarize_perplexity got no evaluation JSON files")
    df = _as_int(pd.DataFrame(rows))
    df["split"] = df["split"].fillna("")
    df = _relative_to_vanilla(df, "ppl", ["d_model", "corpus", "split"], ["d_model"], "corpus")
    df = _sort_runs(df, ["corpus", "split"])[PERPLEXITY_COLUMNS + PERPLEXITY_EXTRA]
    _write_csv(df, Path(out_csv))
    return df


def _read_run_config(model_dir: Path) -> dict:
    """The run columns of a trained model directory, as every evaluation JSON carries them."""
    from .runs import run_metadata  # torch-free: this runs in the report environment

    return _run_fields(run_metadata(Path(model_dir)), str(model_dir))


def summarize_trajectory(
    model_dirs: Iterable[os.PathLike | str], out_csv: os.PathLike | str, datasets: dict | None = None
) -> pd.DataFrame:
    """Validation perplexity per evaluated step, relative to Vanilla at the same step (seed 000 Fig. 3).

    datasets: run -> the dataset it trained on (RUNS[run]["dataset"]); the baseline is the
    vanilla run of the same dataset and d_model. Without it, of the same d_model.
    """
    datasets = datasets or {}
    frames = []
    for model_dir in map(Path, model_dirs):
        fields = _read_run_config(model_dir)
        metrics = pd.read_csv(model_dir / "metrics.csv")
        missing = [c for c in ("step", "tokens", "val_loss") if c not in metrics.columns]
        if missing:
            raise ValueError(f"{model_dir / 'metrics.csv'} lacks column(s) {missing}")
        metrics["val_loss"] = pd.to_numeric(metrics["val_loss"], errors="coerce")
        # A resumed run may log a step twice; the later line is the one that counts.
        metrics = metrics.dropna(subset=["val_loss"]).drop_duplicates("step", keep="last")
        fields["dataset"] = datasets.get(fields["run"], "")
        frames.append(metrics[["step", "tokens", "val_loss"]].assign(**fields))
    if not frames:
        raise ValueError("summarize_trajectory got no model directories")
    df = _as_int(pd.concat(frames, ignore_index=True))
    df["val_ppl"] = np.exp(df["val_loss"])

    scale = ["dataset", "d_model"]
    missing = sorted(
        set(map(tuple, df[scale].drop_duplicates().values))
        - set(map(tuple, df.loc[df["variant"] == "vanilla", scale].drop_duplicates().values))
    )
    if missing and not datasets:
        raise ValueError(
            f"no vanilla run with d_model={missing[0][1]} among the model directories; rel_to_vanilla needs one"
        )
    # Steps the vanilla run did not evaluate stay NaN rather than being matched to a neighbour;
    # so does a scale without a vanilla run (the config names each run's dataset, so none is lost).
    df = _relative_to_vanilla(df, "val_ppl", scale + ["step"], scale, "step")
    df = _sort_runs(df, ["dataset"], tail=["step"])[TRAJECTORY_COLUMNS]
    _write_csv(df, Path(out_csv))
    return df


def _split_metric_key(key: str) -> tuple[str, str]:
    """lm-eval keys read "metric,filter"; older versions write just "metric"."""
    name, _, filt = key.partition(",")
    return name, filt or "none"


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def summarize_lm_eval(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Long table of lm-eval's ``results``: one row per (run, task, metric) with its stderr."""
    rows = []
    for path in jsons:
        record = json.loads(Path(path).read_text())
        fields = _run_fields(record, str(path))
        if "results" not in record:
            raise ValueError(f"{path}: lm-eval record lacks 'results'")
        for task, metrics in record["results"].items():
            for key, value in metrics.items():
                # lm-eval names metrics "metric,filter"; plain keys (alias, name, sample_len) are bookkeeping
                if "," not in key:
                    continue
                name, filt = _split_metric_key(key)
                if name.endswith("_stderr") or _number(value) is None:
                    continue
                stderr_key = f"{name}_stderr,{filt}" if "," in key else f"{name}_stderr"
                stderr = _number(metrics.get(stderr_key))
                metric = name if filt == "none" else f"{name},{filt}"
                rows.append(fields | {"task": task, "metric": metric, "value": float(value), "stderr": stderr})
    if not rows:
        raise ValueError("summarize_lm_eval found no numeric metrics in its inputs")
    df = _sort_runs(_as_int(pd.DataFrame(rows)), [], tail=["task", "metric"])[LM_EVAL_COLUMNS]
    _write_csv(df, Path(out_csv))
    return df


RECALL_KEYS = ("corpus", "accuracy", "n_queries", "by_distance", "chance")
RECALL_BIN_KEYS = ("min_distance", "max_distance", "accuracy", "n")


def summarize_recall(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Tidy recall accuracy: per (run, corpus) one ``scope = overall`` row and one row per distance bin.

    Columns: the run columns, corpus, split, scope ("overall" | "distance"), bin (0-based index of
    the distance bin; empty on the overall row), min_distance and max_distance (query-to-key
    distance, inclusive; the overall row spans every bin), accuracy (fraction of queries answered
    correctly; empty for a bin without queries), n (queries), chance (1 / number of values).
    """
    rows, seen = [], {}
    for path in jsons:
        record = json.loads(Path(path).read_text())
        missing = [k for k in RECALL_KEYS if k not in record]
        if missing:
            raise ValueError(f"{path}: recall record lacks {missing}; expected {list(RECALL_KEYS)}")
        fields = _run_fields(record, str(path)) | {"corpus": record["corpus"], "split": record.get("split") or ""}
        key = (fields["run"], fields["corpus"], fields["split"])
        if key in seen:
            raise ValueError(f"run {key[0]!r} on corpus {key[1]!r} appears twice: {seen[key]} and {path}")
        seen[key] = path
        bins = record["by_distance"]
        for i, b in enumerate(bins):
            lacks = [k for k in RECALL_BIN_KEYS if k not in b]
            if lacks:
                raise ValueError(f"{path}: by_distance[{i}] lacks {lacks}; expected {list(RECALL_BIN_KEYS)}")
        chance = float(record["chance"])
        rows.append(
            fields
            | {
                "scope": "overall",
                "bin": None,
                "min_distance": min((b["min_distance"] for b in bins), default=None),
                "max_distance": max((b["max_distance"] for b in bins), default=None),
                "accuracy": float(record["accuracy"]),
                "n": record["n_queries"],
                "chance": chance,
            }
        )
        for i, b in enumerate(bins):
            rows.append(
                fields
                | {
                    "scope": "distance",
                    "bin": i,
                    "min_distance": b["min_distance"],
                    "max_distance": b["max_distance"],
                    "accuracy": None if b["accuracy"] is None else float(b["accuracy"]),
                    "n": b["n"],
                    "chance": chance,
                }
            )
    if not rows:
        raise ValueError("summarize_recall got no recall JSON files")
    df = _as_int(pd.DataFrame(rows))
    df["accuracy"] = pd.to_numeric(df["accuracy"], errors="coerce")
    df = _sort_runs(df, ["corpus", "split"], tail=["bin"])[RECALL_COLUMNS]
    _write_csv(df, Path(out_csv))
    return df


def summarize_fidelity(csvs: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Concatenate the per-(model, objective, d') fidelity CSVs; an optional ``setting`` column is kept."""
    frames = []
    for path in csvs:
        frame = pd.read_csv(path)
        missing = [c for c in FIDELITY_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{path} lacks column(s) {missing}; expected {FIDELITY_COLUMNS}")
        frames.append(frame)
    if not frames:
        raise ValueError("summarize_fidelity got no CSV files")
    df = _as_int(pd.concat(frames, ignore_index=True))
    extra = [c for c in df.columns if c not in FIDELITY_COLUMNS]
    order = {o: i for i, o in enumerate(OBJECTIVE_ORDER)}
    df = df.sort_values(
        ["model", "objective", "d_prime", "layer"],
        key=lambda s: s.map(lambda o: order.get(o, len(order))) if s.name == "objective" else s,
        kind="stable",
    )
    df = df[FIDELITY_COLUMNS + extra].reset_index(drop=True)
    _write_csv(df, Path(out_csv))
    return df


def _sort_runs(df: pd.DataFrame, head: list[str], tail: list[str] = ()) -> pd.DataFrame:
    """Vanilla first, then DAR, Uniform, SWA, dilated; plain runs before patterned ones; widest bottleneck first."""
    patterned = (
        df["bottleneck"].fillna("linear").ne("linear") | df["full_every"].notna() | df["layers"].notna()
        if "layers" in df.columns
        else False
    )
    df = df.assign(
        _v=df["variant"].map(lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER)),
        _p=patterned,
        _dd=-df["d_down"].astype("Float64"),
    )
    order = head + ["d_model", "_v", "_p", "_dd", "window", "run", *tail]
    df = df.sort_values(order, na_position="first", kind="stable")
    return df.drop(columns=[c for c in df.columns if c.startswith("_")]).reset_index(drop=True)


# ----------------------------------------------------------------------------- LaTeX


class Tex(str):
    """A string that is already LaTeX and must not be escaped again."""


_TEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_TEX_RE = re.compile("|".join(re.escape(c) for c in _TEX_SPECIALS))


def latex_escape(value) -> str:
    """Escape LaTeX specials in plain text; Tex strings pass through unchanged."""
    if isinstance(value, Tex):
        return value
    return _TEX_RE.sub(lambda m: _TEX_SPECIALS[m.group()], str(value))


def _finalize(value):
    # Every << x >> in a template is escaped unless it is Tex, so no cell can break a table.
    return "" if value is None else latex_escape(value)


_ENV: jinja2.Environment | None = None


def _env() -> jinja2.Environment:
    """LaTeX-friendly delimiters: << x >>, <% block %>, <# comment #>."""
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(
            loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
            block_start_string="<%",
            block_end_string="%>",
            variable_start_string="<<",
            variable_end_string=">>",
            comment_start_string="<#",
            comment_end_string="#>",
            finalize=_finalize,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            undefined=jinja2.StrictUndefined,
            autoescape=False,
        )
    return _ENV


def _render_tex(template: str, path: Path, **context) -> Path:
    return _write_text(path, _env().get_template(template).render(**context))


def _fmt(x, digits: int = 2) -> str:
    return MISSING if x is None or pd.isna(x) else f"{x:.{digits}f}"


def _fmt_sig(x, sig: int = 3) -> str:
    """``sig`` significant digits; very small numbers as a LaTeX power of ten."""
    if x is None or pd.isna(x):
        return MISSING
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        mantissa, exponent = f"{x:.{sig - 1}e}".split("e")
        return Tex(rf"${mantissa}\times10^{{{int(exponent)}}}$")
    decimals = sig - 1 - math.floor(math.log10(abs(x)))
    return f"{x:.{max(decimals, 0)}f}"


def _fraction(num, den) -> Fraction | None:
    if num is None or den is None or pd.isna(num) or pd.isna(den) or not den:
        return None
    return Fraction(int(num), int(den))


def _fmt_fraction(frac: Fraction | None) -> str:
    if frac is None:
        return MISSING
    return str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"


def _variant_label(variant: str) -> str:
    return VARIANT_LABELS.get(variant, variant)


def _int_or_missing(x) -> str:
    return MISSING if x is None or pd.isna(x) else str(int(x))


def _na(x) -> bool:
    return x is None or (not isinstance(x, (list, tuple, dict)) and bool(pd.isna(x)))


def _pct(x, digits: int = 1) -> str:
    """A fraction as a percentage: 0.5 -> 50.0."""
    return MISSING if _na(x) else f"{100 * x:.{digits}f}"


# ----------------------------------------------------------------------------- run selection


def _plain_mask(df: pd.DataFrame) -> pd.Series:
    """Vanilla, DAR and Uniform with a linear bottleneck and no layer pattern (seed 000's runs)."""
    linear = df["bottleneck"].isna() | (df["bottleneck"] == "linear")
    return (
        df["variant"].isin(PLAIN_VARIANTS) & linear.fillna(False) & df["full_every"].isna() & df["layers"].isna()
    ).astype(bool)


def _is_plain(row) -> bool:
    return (
        row["variant"] in PLAIN_VARIANTS
        and (_na(row["bottleneck"]) or row["bottleneck"] == "linear")
        and _na(row["full_every"])
        and _na(row["layers"])
    )


def _main_window(df: pd.DataFrame):
    """The window most plain DAR runs share (the largest on a tie): the sweep's default, set beside Table 1."""
    dar = df[_plain_mask(df) & (df["variant"] == "dar")]
    windows = dar.drop_duplicates("run")["window"].dropna()
    if windows.empty:
        return None
    counts = windows.value_counts()
    return int(max(counts[counts == counts.max()].index))


def _closest_to_quarter(d_downs, d_model: int):
    """Of several d_down, the one nearest d/4 on a log scale (the larger on a tie)."""
    return max(d_downs, key=lambda d: (-abs(math.log2(4 * int(d) / int(d_model))) if d else -math.inf, d))


def _ref_d_down(df: pd.DataFrame):
    """The d_down most DAR runs of a scale share (patterned ones included): the variants' comparison point."""
    dar = df[df["variant"] == "dar"].drop_duplicates("run")["d_down"].dropna()
    if dar.empty:
        return None
    counts = dar.value_counts()
    best = [int(d) for d in counts[counts == counts.max()].index]
    return int(_closest_to_quarter(best, int(df["d_model"].iloc[0])))


SCALE_KEYS = ["corpus", "split", "d_model"]


def _scales(df: pd.DataFrame, keys=SCALE_KEYS):
    """(key dict, rows) per scale, in the order the summary lists them."""
    if df is None or df.empty:
        return
    for key, rows in df.groupby(keys, sort=False):
        yield dict(zip(keys, key)), rows


def _text_ppl(ppl: pd.DataFrame | None, recall: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """Perplexity rows on text corpora: not a synthetic corpus, nor one that recall.csv scores."""
    if ppl is None:
        return None
    synthetic = set(recall["corpus"]) if recall is not None else set()
    return ppl[(ppl["corpus_kind"] != "synthetic") & ~ppl["corpus"].isin(synthetic)]


def _overall(recall: pd.DataFrame | None) -> pd.DataFrame | None:
    if recall is None:
        return None
    return recall[recall["scope"] == "overall"]


def _kind(row) -> tuple:
    """What a run is, up to its numbers (window, d_down, dilation): one row of the baselines table."""
    bottleneck = row["bottleneck"]
    return (
        row["variant"],
        "" if _na(bottleneck) or bottleneck == "linear" else str(bottleneck),
        0 if _na(row["full_every"]) else int(row["full_every"]),
        "" if _na(row["layers"]) else str(row["layers"]),
    )


def _kind_rank(kind: tuple) -> tuple:
    variant, bottleneck, full_every, layers = kind
    v = VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER)
    # Seed 001 first (vanilla, SWA, dilated, hybrids), then DAR and its variants, then Uniform.
    group = {"vanilla": 0, "swa": 1, "dilated": 2, "dar": 4, "uniform": 5}.get(variant, 6)
    if variant in ("swa", "dilated") and full_every:
        group = 3
    return (group, v, bool(bottleneck), bool(full_every), bool(layers), bottleneck, full_every, layers)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _kind_label(kind: tuple) -> str:
    """Plain text (no LaTeX): "SWA + full every 2nd layer", "DAR, sigmoid bottleneck", ..."""
    variant, bottleneck, full_every, layers = kind
    label = VARIANT_LABELS.get(variant, variant)
    if bottleneck:
        label += f", {bottleneck} bottleneck"
    if layers:
        label += f" on layers {', '.join(layers.split('.'))} only"
    if full_every:
        label += (
            " + full attention in every layer" if full_every == 1 else f" + full every {_ordinal(full_every)} layer"
        )
    return label


def _kind_color(kind: tuple) -> str:
    variant, _, full_every, _ = kind
    if variant in ("swa", "dilated") and full_every:
        return VARIANT_COLORS["hybrid"]
    return VARIANT_COLORS.get(variant, "0.2")


def _setting(row, tex: bool = True) -> str:
    """The numbers that tell runs of one kind apart: "w=32, r=4", "w=32, d_down=16"."""
    d_down = r"d\textsubscript{down}" if tex else r"$d_{\mathrm{down}}$"
    parts = []
    if not _na(row["window"]):
        parts.append(f"w={int(row['window'])}")
    if not _na(row["dilation"]):
        parts.append(f"r={int(row['dilation'])}")
    if not _na(row["d_down"]):
        parts.append(f"{d_down}={int(row['d_down'])}")
    text = ", ".join(parts) or MISSING
    return Tex(text) if tex else text


def _pick(rows: pd.DataFrame, main_window, ref_d_down):
    """The run of a kind to show for a scale: at the reference d_down, then nearest the main window."""

    def score(row):
        off_d = 0 if _na(row["d_down"]) or ref_d_down is None or row["d_down"] == ref_d_down else 1
        off_w = 0 if _na(row["window"]) or main_window is None else abs(int(row["window"]) - main_window)
        return (off_d, off_w, str(row["run"]))

    return min((row for _, row in rows.iterrows()), key=score)


def _representatives(scale_rows: pd.DataFrame) -> dict[tuple, pd.Series]:
    """One run per kind of a scale, ordered as the baselines table lists kinds."""
    runs = scale_rows.drop_duplicates("run")
    main_window, ref_d_down = _main_window(runs), _ref_d_down(runs)
    kinds = {}
    for _, row in runs.iterrows():
        kinds.setdefault(_kind(row), []).append(row)
    return {
        kind: _pick(pd.DataFrame(rows), main_window, ref_d_down)
        for kind, rows in sorted(kinds.items(), key=lambda kv: _kind_rank(kv[0]))
    }


def _is_baseline_kind(kind: tuple) -> bool:
    """Runs seed 000 does not have: seed 001's SWA/dilated/hybrids and the DAR variants."""
    variant, bottleneck, full_every, layers = kind
    return variant not in PLAIN_VARIANTS or bool(bottleneck or full_every or layers)


# ----------------------------------------------------------------------------- placeholders


def _render_not_run(path: Path, label: str, title: str, reason: str) -> Path:
    """A valid table saying why there is nothing to show, so a rule's output always exists."""
    return _render_tex("not_run.tex.j2", path, label=label, title=Tex(title), reason=reason)


def _placeholder_figure(path: Path, title: str, reason: str) -> Path:
    with sns.axes_style("white"):
        fig = Figure(figsize=(6.4, 2.4), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.set_axis_off()
        ax.text(0.5, 0.62, title, ha="center", va="center", fontsize=13, transform=ax.transAxes)
        ax.text(
            0.5,
            0.32,
            f"{NOT_RUN}:\n{reason}",
            ha="center",
            va="center",
            fontsize=10,
            color="0.35",
            transform=ax.transAxes,
            wrap=True,
        )
        return _save_figure(fig, path)


# ----------------------------------------------------------------------------- DAR: reference numbers


def _read_reference(reference_dir: Path, key: str) -> pd.DataFrame:
    path = Path(reference_dir) / REFERENCE_FILES[key]
    if not path.exists():
        raise FileNotFoundError(
            f"paper numbers {path} are missing; reference_dir should be the repository's reference/"
        )
    # Strings keep the values exactly as the paper prints them (99.61, 0.079).
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def _dar_paper_table1(reference_dir: Path) -> dict[tuple[str, Fraction], dict]:
    """(variant, d_down/d) -> {"text": as printed, "value": float} from seed 000 Table 1."""
    ref = _read_reference(reference_dir, "dar")
    ref = ref[ref["source"] == "Table 1"]
    out = {}
    for row in ref.itertuples():
        ratio = Fraction(1) if row.variant == "vanilla" else Fraction(int(row.d_down), int(row.d_model))
        out[(row.variant, ratio)] = {
            "text": row.rel_ppl_pct,
            "value": float(row.rel_ppl_pct),
            "d_model": int(row.d_model),
            "d_down": int(row.d_down),
            "window": int(row.window) if row.window else None,
            "model": row.model,
        }
    return out


def _dar_paper_table2(reference_dir: Path) -> list[dict]:
    """Seed 000 Table 2 rows (DAR at d_down = d/4 per Pythia scale), smallest d first."""
    ref = _read_reference(reference_dir, "dar")
    ref = ref[ref["source"] == "Table 2"]
    rows = [
        {
            "model": r.model,
            "d_model": int(r.d_model),
            "d_down": int(r.d_down),
            "window": int(r.window) if r.window else None,
            "text": r.rel_ppl_pct,
        }
        for r in ref.itertuples()
    ]
    return sorted(rows, key=lambda r: r["d_model"])


def _finding(reference_dir: Path, source: str) -> str:
    """A finding the paper states only in words (reference/qualitative_findings.csv), or ""."""
    path = Path(reference_dir) / REFERENCE_FILES["qualitative"]
    if not path.exists():
        return ""
    ref = _read_reference(reference_dir, "qualitative")
    rows = ref[ref["source"] == source]
    return "; ".join(rows["finding"]) if len(rows) else ""


def _dar_ratio(row) -> Fraction | None:
    return Fraction(1) if row["variant"] == "vanilla" else _fraction(row["d_down"], row["d_model"])


def _dar_table2_note(reference_dir: Path) -> str:
    ref = _dar_paper_table2(reference_dir)
    if not ref:
        return ""
    parts = ", ".join(f"{latex_escape(r['text'])} at d = {r['d_model']} ({latex_escape(r['model'])})" for r in ref)
    return Tex(rf"At d\textsubscript{{down}} = d/4 the paper's Table 2 gives Rel.\ {parts}.")


# ----------------------------------------------------------------------------- DAR: Table 1


def _table1_rows(ppl: pd.DataFrame | None) -> pd.DataFrame:
    """Seed 000 Table 1 rows per scale with a vanilla run: Vanilla, Uniform, and DAR at the main window,
    plain runs only (window sweeps, SWA, hybrids, sigmoid and layer subsets are other tables)."""
    if ppl is None:
        return pd.DataFrame()
    kept = []
    for _, rows in _scales(ppl):
        rows = rows[_plain_mask(rows)]
        if not (rows["variant"] == "vanilla").any():
            continue  # a scale without a baseline (seed 000 Table 4's d = 2048) has no Rel.
        window = _main_window(rows)
        kept.append(rows[(rows["variant"] != "dar") | (rows["window"] == window).fillna(False)])
    return pd.concat(kept) if kept else ppl.iloc[:0]


def _windows_text(df: pd.DataFrame) -> str:
    windows = sorted({int(w) for w in df.loc[df["variant"] == "dar", "window"].dropna()})
    return ", ".join(map(str, windows)) or MISSING


def _group_label(scale: dict, several_d: bool) -> str:
    label = scale["corpus"] if not scale["split"] else f"{scale['corpus']} ({scale['split']})"
    return f"{label}, d = {scale['d_model']}" if several_d else label


def render_dar_perplexity_table(
    ppl: pd.DataFrame, reference_dir: Path, path: Path, recall: pd.DataFrame | None = None
) -> Path:
    """Seed 000 Table 1: Rel. perplexity per d_down/d, the paper's number at the same ratio beside."""
    ppl = _prepare(ppl, "perplexity")
    recall = _prepare(recall, "recall") if recall is not None else None
    text = _text_ppl(ppl, recall)
    rows_all = _table1_rows(text)
    if rows_all.empty:
        return _render_not_run(
            path,
            "tab:dar_perplexity",
            "Perplexity relative to Vanilla (seed 000 Table 1)",
            "no text corpus has a vanilla run beside plain DAR or Uniform runs",
        )
    paper = _dar_paper_table1(reference_dir)
    d_per_corpus = rows_all.groupby("corpus")["d_model"].nunique()
    groups = []
    for scale, rows in _scales(rows_all):
        cells = []
        for _, row in rows.iterrows():
            ratio = _dar_ratio(row)
            ref = paper.get((row["variant"], ratio))
            cells.append(
                {
                    "variant": _variant_label(row["variant"]),
                    "window": _int_or_missing(row["window"]),
                    "d_down": _int_or_missing(row["d_model"] if row["variant"] == "vanilla" else row["d_down"]),
                    "ratio": _fmt_fraction(ratio),
                    "ppl": _fmt(row["ppl"]),
                    "rel": _fmt(row["rel_to_vanilla"]),
                    "paper": ref["text"] if ref else MISSING,
                    "paper_d_down": str(ref["d_down"]) if ref else MISSING,
                }
            )
        groups.append({"corpus": _group_label(scale, d_per_corpus[scale["corpus"]] > 1), "rows": cells})
    paper_any = next(iter(paper.values()), {})
    left_out = text[~text["run"].isin(rows_all["run"])]
    notes = []
    if (_plain_mask(left_out) & (left_out["variant"] == "dar")).any():
        notes.append("DAR at other windows is in the window sweep (dar\\_window.tex).")
    if (~_plain_mask(left_out)).any():
        notes.append("SWA, dilated, hybrid and patterned runs are in baselines.tex.")
    no_vanilla = sorted(set(text["d_model"]) - set(text.loc[text["variant"] == "vanilla", "d_model"]))
    if no_vanilla:
        widths = ", ".join(str(d) for d in no_vanilla)
        notes.append(f"Widths without a Vanilla run (d = {widths}) have no Rel.\\ and are left out.")
    if len(text) < len(ppl):
        notes.append("Runs on the synthetic recall corpus are scored by recall accuracy (recall.tex), not here.")
    return _render_tex(
        "dar_perplexity.tex.j2",
        path,
        groups=groups,
        d_models=", ".join(str(d) for d in sorted(rows_all["d_model"].unique())),
        windows=_windows_text(rows_all),
        paper_model=paper_any.get("model", "pythia-70m"),
        paper_d=paper_any.get("d_model", 512),
        paper_window=next((p["window"] for p in paper.values() if p["window"]), 128),
        table2_note=_dar_table2_note(reference_dir),
        sweep_note=Tex(" ".join(notes)),
    )


def _plain_log_y(ax) -> None:
    """Log y with plain numbers (0.003, not 3x10^-3); a few minor ticks labelled on short spans."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    decades = math.log10(high / low) if low > 0 else 3
    keep = {2, 3, 5} if decades < 1.2 else {3} if decades < 2.2 else set()

    def minor(y, _):
        mantissa = round(y / 10 ** math.floor(math.log10(y) + 1e-9), 6)
        return f"{y:g}" if mantissa in keep else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _log2_fraction_axis(ax, ratios: Iterable[Fraction], label: str, dim: int | None = None) -> None:
    """Log2 x axis ticked at the ratios, as fractions; with dim, each tick also gives ratio * dim."""
    ticks = sorted({float(r) for r in ratios})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())

    def tick(x, _):
        frac = Fraction(x).limit_denominator(1024)
        return _fmt_fraction(frac) if dim is None else f"{_fmt_fraction(frac)}\n({_fmt_fraction(frac * dim)})"

    ax.xaxis.set_major_formatter(FuncFormatter(tick))
    if ticks:
        ax.set_xlim(ticks[0] / 1.35, ticks[-1] * 1.35)
    ax.set_xlabel(label)


def _panel_grid(n: int, max_cols: int = 3):
    ncols = max(1, min(n, max_cols))
    return ncols, math.ceil(n / ncols)


def render_dar_perplexity_figure(
    ppl: pd.DataFrame, reference_dir: Path, path: Path, recall: pd.DataFrame | None = None
) -> Path:
    """Table 1 as a figure: a panel per text scale with a d_down sweep, the paper's curves dashed."""
    ppl = _prepare(ppl, "perplexity")
    recall = _prepare(recall, "recall") if recall is not None else None
    rows_all = _table1_rows(_text_ppl(ppl, recall))
    rows_all = rows_all.dropna(subset=["rel_to_vanilla"])
    panels = [(s, r) for s, r in _scales(rows_all) if (r["variant"] != "vanilla").sum() >= 2]
    if not panels:  # no sweep anywhere: whatever single points there are
        panels = [(s, r) for s, r in _scales(rows_all) if (r["variant"] != "vanilla").any()]
    if not panels:
        return _placeholder_figure(
            path, "Perplexity relative to Vanilla vs. $d_{\\mathrm{down}}/d$", "no plain DAR or Uniform run on text"
        )
    paper = _dar_paper_table1(reference_dir)
    ncols, nrows = _panel_grid(len(panels))
    ratios = set(rows_all.loc[rows_all["variant"] != "vanilla"].apply(_dar_ratio, axis=1).dropna())
    ratios |= {r for (v, r) in paper if v != "vanilla"}

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(5.2 * ncols + 2.6, 4.4 * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
        for ax, (scale, rows) in zip(axes.flat, panels):
            rows = rows.assign(ratio=rows.apply(_dar_ratio, axis=1))
            ax.axhline(100, color=VARIANT_COLORS["vanilla"], lw=1.5, zorder=1)
            for variant in ("dar", "uniform"):
                ref = sorted((r, p["value"]) for (v, r), p in paper.items() if v == variant)
                if ref:
                    ax.plot(
                        [float(r) for r, _ in ref],
                        [v for _, v in ref],
                        ls="--",
                        marker="o" if variant == "dar" else "s",
                        mfc="white",
                        ms=7,
                        color=VARIANT_COLORS[variant],
                        alpha=0.8,
                        zorder=2,
                    )
                mine = rows[rows["variant"] == variant].sort_values("ratio")
                if not mine.empty:
                    ax.plot(
                        mine["ratio"].astype(float),
                        mine["rel_to_vanilla"].astype(float),
                        ls="-",
                        lw=2.2,
                        marker="o" if variant == "dar" else "s",
                        ms=7,
                        color=VARIANT_COLORS[variant],
                        zorder=3,
                    )
            _log2_fraction_axis(ax, ratios, r"$d_{\mathrm{down}}/d$ (log scale)")
            window = _main_window(rows)
            title = _group_label(scale, True)
            ax.set_title(title + (f", DAR w = {window}" if window is not None else ""), fontsize=11)
        for ax in axes[:, 0]:
            ax.set_ylabel("perplexity relative to Vanilla (%)\nlower is better")
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)

        ref_any = next(iter(paper.values()), {"d_model": 512, "window": 128, "model": "pythia-70m"})
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
            f"w={ref_any['window']}): dashed, hollow",
            fontsize=12,
        )
        return _save_figure(fig, path)


# ----------------------------------------------------------------------------- DAR: Table 2


def _table2_rows(text: pd.DataFrame | None) -> pd.DataFrame:
    """DAR at d_down = d/4 (the main window, plain) per text scale with a vanilla run."""
    rows = _table1_rows(text)
    if rows.empty:
        return rows
    quarter = (rows["variant"] == "dar") & (4 * rows["d_down"] == rows["d_model"]).fillna(False)
    return rows[quarter.astype(bool)]


def render_dar_scales_table(
    ppl: pd.DataFrame, reference_dir: Path, path: Path, recall: pd.DataFrame | None = None
) -> Path:
    """Seed 000 Table 2: DAR at d_down = d/4 at each d_model, Rel. to that scale's vanilla, paper beside."""
    ppl = _prepare(ppl, "perplexity")
    recall = _prepare(recall, "recall") if recall is not None else None
    text = _text_ppl(ppl, recall)
    dar = _table2_rows(text)
    title = "DAR at d\\textsubscript{down} = d/4 across model widths (seed 000 Table 2)"
    if dar.empty:
        return _render_not_run(
            path, "tab:dar_scales", title, "no text scale has a vanilla run and a DAR run at d_down = d/4"
        )
    paper = _dar_paper_table2(reference_dir)
    vanilla = text[_plain_mask(text) & (text["variant"] == "vanilla")].set_index(SCALE_KEYS)["ppl"]
    by_d = {p["d_model"]: p for p in paper}
    exact = all(int(d) in by_d for d in dar["d_model"])
    groups = []
    for (corpus, split), rows in dar.groupby(["corpus", "split"], sort=False):
        rows = rows.sort_values("d_model")
        if exact:
            pairs = [(r, by_d[int(r["d_model"])]) for _, r in rows.iterrows()]
            pairs += [(None, p) for p in paper if p["d_model"] not in set(int(d) for d in rows["d_model"])]
        else:
            pairs = list(zip_longest((r for _, r in rows.iterrows()), paper))
        cells = []
        for ours, theirs in pairs:
            cells.append(
                {
                    "d_model": _int_or_missing(ours["d_model"]) if ours is not None else MISSING,
                    "d_down": _int_or_missing(ours["d_down"]) if ours is not None else MISSING,
                    "window": _int_or_missing(ours["window"]) if ours is not None else MISSING,
                    "ppl": _fmt(ours["ppl"]) if ours is not None else MISSING,
                    "vanilla_ppl": _fmt(vanilla.get((corpus, split, ours["d_model"]))) if ours is not None else MISSING,
                    "rel": _fmt(ours["rel_to_vanilla"]) if ours is not None else MISSING,
                    "paper_model": theirs["model"] if theirs else MISSING,
                    "paper_d": str(theirs["d_model"]) if theirs else MISSING,
                    "paper_d_down": str(theirs["d_down"]) if theirs else MISSING,
                    "paper": theirs["text"] if theirs else MISSING,
                }
            )
        groups.append({"corpus": corpus if not split else f"{corpus} ({split})", "rows": cells})
    return _render_tex(
        "dar_scales.tex.j2",
        path,
        groups=groups,
        exact=exact,
        paper_window=next((p["window"] for p in paper if p["window"]), 128),
    )


# ----------------------------------------------------------------------------- DAR: Table 3


def _window_sweeps(text: pd.DataFrame | None, overall: pd.DataFrame | None) -> list[dict]:
    """Per scale, the plain DAR runs at the d_down with the most windows (>= 2): seed 000 Table 3.

    Text scales give Rel. perplexity, recall scales the overall recall accuracy; each sweep also
    carries the scale's Vanilla, Uniform at the same d_down (every token through the bottleneck,
    as DAR with w = 0) and, for recall, chance.
    """
    sweeps = []
    for source, df, value in (("text", text, "rel_to_vanilla"), ("recall", overall, "accuracy")):
        for scale, rows in _scales(df):
            plain = rows[_plain_mask(rows)]
            dar = plain[(plain["variant"] == "dar")].dropna(subset=["d_down", "window", value])
            n_windows = dar.groupby("d_down")["window"].nunique()
            candidates = [int(d) for d, n in n_windows.items() if n >= 2]
            if not candidates:
                continue
            most = max(n_windows[d] for d in candidates)
            d_down = _closest_to_quarter([d for d in candidates if n_windows[d] == most], int(scale["d_model"]))
            sweep = dar[dar["d_down"] == d_down].sort_values("window")

            def one(sel):
                sel = sel.dropna(subset=[value])
                return float(sel[value].iloc[0]) if len(sel) else None

            sweeps.append(
                {
                    "source": source,
                    "scale": scale,
                    "d_down": d_down,
                    "main_window": _main_window(rows),
                    "points": {int(w): float(v) for w, v in zip(sweep["window"], sweep[value])},
                    "runs": {int(w): r for w, r in zip(sweep["window"], sweep["run"])},
                    "vanilla": one(plain[plain["variant"] == "vanilla"]),
                    "uniform": one(plain[(plain["variant"] == "uniform") & (plain["d_down"] == d_down).fillna(False)]),
                    "chance": float(rows["chance"].iloc[0]) if source == "recall" else None,
                }
            )
    return sweeps


def _scale_head(scale: dict) -> str:
    return scale["corpus"] if not scale["split"] else f"{scale['corpus']} ({scale['split']})"


def render_dar_window_table(
    ppl: pd.DataFrame | None, recall: pd.DataFrame | None, reference_dir: Path, path: Path
) -> Path:
    """Seed 000 Table 3 (window sweep): Rel. perplexity and recall accuracy per w at a fixed d_down."""
    ppl = _prepare(ppl, "perplexity") if ppl is not None else None
    recall = _prepare(recall, "recall") if recall is not None else None
    sweeps = _window_sweeps(_text_ppl(ppl, recall), _overall(recall))
    finding = _finding(reference_dir, "000 Table 3")
    title = "DAR window sweep at a fixed d\\textsubscript{down} (seed 000 Table 3)"
    if not sweeps:
        return _render_not_run(
            path, "tab:dar_window", title, "no scale has plain DAR runs at one d_down and two or more windows"
        )
    windows = sorted({w for s in sweeps for w in s["points"]})

    def fmt(source, v):
        return _fmt(v) if source == "text" else _pct(v)

    columns = [
        {
            "source": s["source"],
            "corpus": _scale_head(s["scale"]),
            "setting": Tex(rf"d = {s['scale']['d_model']}, d\textsubscript{{down}} = {s['d_down']}"),
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
    spans, start = [], 2
    for g in groups:
        spans.append((start, start + g["span"] - 1))
        start += g["span"]
    rows = [
        {
            "label": Tex(f"w = {w}" + (r" (all distant)" if w == 0 else "")),
            "cells": [fmt(s["source"], s["points"].get(w)) for s in sweeps],
        }
        for w in windows
    ]
    reference_rows = [
        {
            "label": "Vanilla",
            "cells": [fmt(s["source"], 100.0 if s["source"] == "text" else s["vanilla"]) for s in sweeps],
        },
    ]
    if any(s["uniform"] is not None for s in sweeps):
        reference_rows.append(
            {
                "label": Tex(r"Uniform, same d\textsubscript{down}"),
                "cells": [fmt(s["source"], s["uniform"]) for s in sweeps],
            }
        )
    if any(s["source"] == "recall" for s in sweeps):
        reference_rows.append(
            {
                "label": "Chance",
                "cells": [fmt(s["source"], s["chance"]) if s["source"] == "recall" else "" for s in sweeps],
            }
        )
    return _render_tex(
        "dar_window.tex.j2",
        path,
        columns=columns,
        groups=groups,
        spans=spans,
        rows=rows,
        reference_rows=reference_rows,
        finding=finding,
        main_windows=", ".join(sorted({str(s["main_window"]) for s in sweeps if s["main_window"] is not None}))
        or MISSING,
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


def render_dar_window_figure(
    ppl: pd.DataFrame | None, recall: pd.DataFrame | None, reference_dir: Path, path: Path
) -> Path:
    """Rel. perplexity (text scales) and recall accuracy (recall scales) vs. the DAR window w."""
    ppl = _prepare(ppl, "perplexity") if ppl is not None else None
    recall = _prepare(recall, "recall") if recall is not None else None
    sweeps = _window_sweeps(_text_ppl(ppl, recall), _overall(recall))
    title = "DAR window sweep (analogue of seed 000 Table 3)"
    if not sweeps:
        return _placeholder_figure(path, title, "no plain DAR runs at one d_down and two or more windows")
    ncols, nrows = _panel_grid(len(sweeps))
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(5.4 * ncols + 2.8, 4.4 * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        handles = {}
        for ax, s in zip(axes.flat, sweeps):
            text = s["source"] == "text"
            scale = 1.0 if text else 100.0
            ws = sorted(s["points"])
            (h,) = ax.plot(
                ws,
                [s["points"][w] * scale for w in ws],
                color=VARIANT_COLORS["dar"],
                marker="o",
                lw=2.2,
                ms=7,
                label="DAR",
            )
            handles.setdefault("DAR", h)
            refs = [("Vanilla", 100.0 if text else s["vanilla"], VARIANT_COLORS["vanilla"], "-")]
            refs.append((r"Uniform, same $d_{\mathrm{down}}$", s["uniform"], VARIANT_COLORS["uniform"], "--"))
            if not text:
                refs.append(("chance", s["chance"], CHANCE_COLOR, ":"))
            for label, value, color, ls in refs:
                if value is None:
                    continue
                h = ax.axhline(value * scale, color=color, ls=ls, lw=1.6, label=label, zorder=1)
                handles.setdefault(label, h)
            if s["main_window"] is not None and s["main_window"] in s["points"]:
                ax.plot(
                    [s["main_window"]],
                    [s["points"][s["main_window"]] * scale],
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
                f"{_scale_head(s['scale'])}, d = {s['scale']['d_model']}, " rf"$d_{{\mathrm{{down}}}}$ = {s['d_down']}",
                fontsize=11,
            )
        for ax in list(axes.flat)[len(sweeps) :]:
            ax.set_visible(False)
        handles["main"] = Line2D(
            [], [], marker="o", ms=13, mfc="none", mec=VARIANT_COLORS["dar"], ls="none", label="main window (Table 1)"
        )
        fig.legend(handles=list(handles.values()), loc="outside right center", frameon=False, fontsize=10)
        finding = _finding(reference_dir, "000 Table 3")
        fig.suptitle(
            f"{title}; w = 0 sends every token through the bottleneck"
            + ("\n" + textwrap.fill(f"paper, in words only: {finding}", 110) if finding else ""),
            fontsize=12,
        )
        return _save_figure(fig, path)


# ----------------------------------------------------------------------------- DAR: Table 4

# Metrics where a smaller value is better; everything else lm-eval reports counts up.
LOWER_IS_BETTER = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}
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
# The paper's wording of a metric -> lm-eval's "metric,filter".
PAPER_METRIC_NAMES = {"flexible-extract exact match": "exact_match,flexible-extract"}


def _paper_task_metrics(reference_dir: Path) -> dict[str, str]:
    if not (Path(reference_dir) / REFERENCE_FILES["dar_tasks"]).exists():
        return {}
    ref = _read_reference(reference_dir, "dar_tasks")
    return {r.task: PAPER_METRIC_NAMES.get(r.metric, r.metric) for r in ref.itertuples()}


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


def _lower_is_better(metric: str) -> bool:
    return metric.split(",")[0] in LOWER_IS_BETTER


def _downstream_blocks(lm: pd.DataFrame | None, paper_metrics: dict[str, str]) -> list[dict]:
    """Per (d_model, window) with a plain no-bottleneck DAR run (d_down = d): its plain DAR runs."""
    if lm is None or lm.empty:
        return []
    dar = lm[_plain_mask(lm) & (lm["variant"] == "dar")].dropna(subset=["d_down", "window"])
    blocks = []
    for d_model, rows in dar.groupby("d_model", sort=False):
        refs = rows[rows["d_down"] == rows["d_model"]]
        for window in sorted(int(w) for w in refs["window"].unique()):
            at_w = rows[rows["window"] == window]
            ref_run = refs.loc[refs["window"] == window, "run"].iloc[0]
            ref = at_w[at_w["run"] == ref_run]
            tasks = list(dict.fromkeys(ref["task"]))
            metrics = {t: _primary_metric(t, ref.loc[ref["task"] == t, "metric"], paper_metrics) for t in tasks}
            blocks.append(
                {"d_model": int(d_model), "window": window, "ref_run": ref_run, "rows": at_w, "metrics": metrics}
            )
    return blocks


def render_dar_downstream_table(lm: pd.DataFrame, reference_dir: Path, path: Path) -> Path:
    """Seed 000 Table 4: lm-eval scores relative to the DAR no-bottleneck run (d_down = d, same w)."""
    lm = _prepare(lm, "lm_eval")
    paper_metrics = _paper_task_metrics(reference_dir)
    blocks = _downstream_blocks(lm, paper_metrics)
    title = "Downstream scores relative to the DAR no-bottleneck run (seed 000 Table 4)"
    if not blocks:
        return _render_not_run(
            path,
            "tab:dar_downstream",
            title,
            "no DAR run with d_down = d_model (the no-bottleneck control) has lm-eval scores",
        )
    ref = _read_reference(reference_dir, "dar_downstream")
    paper = {
        Fraction(int(r.d_down), int(r.d_model)): {"text": r.rel_score_pct, "d_down": int(r.d_down), "d": int(r.d_model)}
        for r in ref.itertuples()
    }
    paper_d = next(iter(paper.values()), {"d": 2048})["d"]
    paper_window = next((int(r.window) for r in ref.itertuples() if r.window), 128)
    tasks = list(dict.fromkeys((t, m) for b in blocks for t, m in b["metrics"].items()))
    out_blocks = []
    for block in blocks:
        rows = block["rows"]
        values = {(r.run, r.task, r.metric): r.value for r in rows.itertuples()}
        ref_values = {t: values.get((block["ref_run"], t, m)) for t, m in tasks}
        runs = rows.drop_duplicates("run").sort_values("d_down", ascending=False)
        out_rows = []
        for _, run in runs.iterrows():
            cells, ups = [], []
            for t, m in tasks:
                v, r0 = values.get((run["run"], t, m)), ref_values[t]
                rel = 100.0 * v / r0 if v is not None and r0 not in (None, 0) and not _na(r0) else None
                cells.append(_fmt(rel))
                if rel is not None and not _lower_is_better(m):
                    ups.append(rel)
            ratio = _fraction(run["d_down"], run["d_model"])
            theirs = paper.get(ratio)
            out_rows.append(
                {
                    "d_down": _int_or_missing(run["d_down"]),
                    "ratio": _fmt_fraction(ratio),
                    "paper_d_down": str(theirs["d_down"]) if theirs else MISSING,
                    "cells": cells,
                    "rel": _fmt(sum(ups) / len(ups)) if ups else MISSING,
                    "paper": theirs["text"] if theirs else MISSING,
                }
            )
        out_blocks.append(
            {
                "head": Tex(
                    rf"d = {block['d_model']}, w = {block['window']}; reference run {latex_escape(block['ref_run'])}"
                ),
                "absolute": [_fmt_sig(ref_values[t], 4) for t, _ in tasks],
                "rows": out_rows,
            }
        )
    columns = [
        {
            "task": t,
            "metric": Tex(
                latex_escape(_metric_label(m)) + (r" $\downarrow$" if _lower_is_better(m) else r" $\uparrow$")
            ),
        }
        for t, m in tasks
    ]
    return _render_tex(
        "dar_downstream.tex.j2",
        path,
        columns=columns,
        blocks=out_blocks,
        paper_d=paper_d,
        paper_window=paper_window,
        any_lower=any(_lower_is_better(m) for _, m in tasks),
        any_higher=any(not _lower_is_better(m) for _, m in tasks),
    )


# ----------------------------------------------------------------------------- seed 001 baselines


def _far_bin(recall: pd.DataFrame | None) -> pd.DataFrame:
    """Per (run, corpus, split) the accuracy of the farthest distance bin that has queries."""
    if recall is None:
        return pd.DataFrame(columns=["run", "corpus", "split", "accuracy", "min_distance"])
    rows = recall[(recall["scope"] == "distance") & (recall["n"] > 0).fillna(False)].dropna(subset=["bin"])
    rows = rows.sort_values("bin").drop_duplicates(["run", "corpus", "split"], keep="last")
    return rows[["run", "corpus", "split", "accuracy", "min_distance"]]


def _baseline_columns(text: pd.DataFrame | None, recall: pd.DataFrame | None) -> list[dict]:
    """Per scale with at least one seed 001 baseline or DAR variant: its run of each kind."""
    columns = []
    far = _far_bin(recall).set_index(["run", "corpus", "split"])
    for source, df in (("text", text), ("recall", _overall(recall))):
        for scale, rows in _scales(df):
            reps = _representatives(rows)
            if not any(_is_baseline_kind(k) for k in reps):
                continue
            col = {"source": source, "scale": scale, "reps": reps}
            if source == "recall":
                keys = [(r["run"], scale["corpus"], scale["split"]) for r in reps.values()]
                col["far"] = {k[0]: far["accuracy"].get(k) for k in keys}
                lows = [far["min_distance"].get(k) for k in keys if k in far.index]
                col["far_from"] = int(max(lows)) if lows else None
            columns.append(col)
    return columns


def render_baselines_table(
    ppl: pd.DataFrame | None, recall: pd.DataFrame | None, reference_dir: Path, path: Path
) -> Path:
    """Seed 001's SWA, dilated and SWA + full attention beside Vanilla, DAR and the DAR variants."""
    ppl = _prepare(ppl, "perplexity") if ppl is not None else None
    recall = _prepare(recall, "recall") if recall is not None else None
    columns = _baseline_columns(_text_ppl(ppl, recall), recall)
    title = "Sliding-window, dilated and hybrid attention (seed 001) beside Vanilla and DAR"
    if not columns:
        return _render_not_run(path, "tab:baselines", title, "no SWA, dilated, hybrid or patterned DAR run")
    kinds = sorted({k for c in columns for k in c["reps"]}, key=_kind_rank)
    rows = []
    for kind in kinds:
        cells = []
        for c in columns:
            run = c["reps"].get(kind)
            if run is None:
                cells += [MISSING] * (2 if c["source"] == "text" else 3)
            elif c["source"] == "text":
                cells += [_setting(run), _fmt(run["rel_to_vanilla"])]
            else:
                cells += [_setting(run), _pct(run["accuracy"]), _pct(c["far"].get(run["run"]))]
        rows.append({"label": _kind_label(kind), "cells": cells, "baseline": _is_baseline_kind(kind)})
    heads, subheads, spans, start = [], [], [], 2
    for c in columns:
        width = 2 if c["source"] == "text" else 3
        heads.append({"text": f"{_scale_head(c['scale'])}, d = {c['scale']['d_model']}", "span": width})
        spans.append((start, start + width - 1))
        start += width
        if c["source"] == "text":
            subheads += ["setting", Tex(r"Rel.\ PPL (\%) $\downarrow$")]
        else:
            far = f"d $\\geq$ {c['far_from']}" if c["far_from"] is not None else "farthest"
            subheads += ["setting", Tex(r"acc.\ (\%) $\uparrow$"), Tex(rf"acc., {far} (\%)")]
    finding = _finding(reference_dir, "001 Overview")
    return _render_tex(
        "baselines.tex.j2",
        path,
        heads=heads,
        subheads=subheads,
        spans=spans,
        rows=rows,
        n_columns=start - 1,
        wide=start - 1 > 8,
        finding=finding,
        has_text=any(c["source"] == "text" for c in columns),
        has_recall=any(c["source"] == "recall" for c in columns),
    )


# ----------------------------------------------------------------------------- recall


def _recall_blocks(recall: pd.DataFrame) -> list[dict]:
    """Per recall scale: its distance bins and its runs in the groups the recall table shows."""
    blocks = []
    for scale, rows in _scales(recall):
        overall = rows[rows["scope"] == "overall"].drop_duplicates("run")
        dist = rows[rows["scope"] == "distance"]
        bins = (
            dist.dropna(subset=["bin"])
            .drop_duplicates("bin")
            .sort_values("bin")[["bin", "min_distance", "max_distance"]]
        )
        plain = _plain_mask(overall)
        main_window = _main_window(overall)
        is_dar, is_uniform = overall["variant"] == "dar", overall["variant"] == "uniform"
        at_main = (overall["window"] == main_window).fillna(False).astype(bool)
        groups = [
            ("reference", overall[overall["variant"] == "vanilla"]),
            ("d_down", overall[plain & is_dar & at_main].sort_values("d_down", ascending=False)),
            ("uniform", overall[plain & is_uniform].sort_values("d_down", ascending=False)),
            ("window", overall[plain & is_dar & ~at_main].sort_values(["d_down", "window"], ascending=[False, True])),
        ]
        others = overall[~plain]
        others = others.assign(_k=[_kind_rank(_kind(r)) for _, r in others.iterrows()])
        groups.append(("baselines", others.sort_values(["_k", "window", "d_down"], kind="stable").drop(columns="_k")))
        by_bin = {(r.run, r.bin): r.accuracy for r in dist.itertuples()}
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


def render_recall_table(recall: pd.DataFrame, path: Path) -> Path:
    """Recall accuracy per run: overall and per query-to-key distance bin, per recall scale."""
    recall = _prepare(recall, "recall")
    title = "Multi-query associative recall accuracy"
    if recall.empty:
        return _render_not_run(path, "tab:recall", title, "no run on a synthetic recall corpus")
    out = []
    for block in _recall_blocks(recall):
        bins = [
            {"bin": int(b.bin), "head": f"{int(b.min_distance)}--{int(b.max_distance)}"}
            for b in block["bins"].itertuples()
        ]
        chance = _pct(block["chance"])
        groups = [[{"label": "Chance", "setting": "", "ratio": "", "all": chance, "bins": [chance] * len(bins)}]]
        for _, rows in block["groups"]:
            group = []
            for _, run in rows.iterrows():
                ratio = _fraction(run["d_down"], run["d_model"])
                group.append(
                    {
                        "label": _kind_label(_kind(run)),
                        "setting": _setting(run),
                        "ratio": _fmt_fraction(ratio) if ratio is not None else "",
                        "all": _pct(run["accuracy"]),
                        "bins": [_pct(block["by_bin"].get((run["run"], b["bin"]))) for b in bins],
                    }
                )
            groups.append(group)
        n = block["overall"]["n"].dropna()
        out.append(
            {
                "corpus": _scale_head(block["scale"]),
                "d_model": block["scale"]["d_model"],
                "bins": bins,
                "groups": groups,
                "n_queries": ", ".join(str(int(v)) for v in sorted(n.unique())) or MISSING,
                "distance_note": block["distance_note"],
            }
        )
    return _render_tex("recall.tex.j2", path, blocks=out)


def _selected_for_distance(overall: pd.DataFrame) -> list[tuple[tuple, pd.Series]]:
    """Vanilla, SWA, dilated, the hybrids, DAR and Uniform (plain, at the reference d_down)."""
    reps = _representatives(overall)
    keep = []
    for kind, run in reps.items():
        variant, bottleneck, full_every, layers = kind
        if variant in ("vanilla", "swa", "dilated") and not bottleneck and not layers:
            keep.append((kind, run))
        elif variant in ("dar", "uniform") and not (bottleneck or full_every or layers):
            keep.append((kind, run))
    return keep


def render_recall_figure(recall: pd.DataFrame, path: Path) -> Path:
    """Per recall scale: accuracy vs. d_down/d (DAR vs. Uniform) and accuracy vs. query distance."""
    recall = _prepare(recall, "recall")
    title = "Multi-query associative recall"
    if recall.empty:
        return _placeholder_figure(path, title, "no run on a synthetic recall corpus")
    blocks = _recall_blocks(recall)
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(13.5, 4.6 * len(blocks) + 0.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(blocks), 2, squeeze=False)
        for (ax_d, ax_r), block in zip(axes, blocks):
            overall, scale = block["overall"], block["scale"]
            head = f"{_scale_head(scale)}, d = {scale['d_model']}"
            # Left: accuracy vs. bottleneck width.
            plain = overall[_plain_mask(overall)]
            main = (plain["window"] == block["main_window"]).fillna(False).astype(bool)
            sweeps = [
                ("dar", plain[(plain["variant"] == "dar") & main], f"DAR, w = {block['main_window']}", "o"),
                ("uniform", plain[plain["variant"] == "uniform"], "Uniform", "s"),
            ]
            ratios = set()
            for variant, rows, label, marker in sweeps:
                rows = rows.dropna(subset=["d_down"]).assign(
                    ratio=lambda r: r["d_down"].astype(float) / r["d_model"].astype(float)
                )
                rows = rows.sort_values("ratio")
                if rows.empty:
                    continue
                ratios |= {Fraction(int(d), int(m)) for d, m in zip(rows["d_down"], rows["d_model"])}
                ax_d.plot(
                    rows["ratio"],
                    100 * rows["accuracy"].astype(float),
                    color=VARIANT_COLORS[variant],
                    marker=marker,
                    lw=2.2,
                    ms=7,
                    label=label,
                )
            vanilla = overall[overall["variant"] == "vanilla"]
            if len(vanilla):
                ax_d.axhline(
                    100 * float(vanilla["accuracy"].iloc[0]), color=VARIANT_COLORS["vanilla"], lw=1.6, label="Vanilla"
                )
            if block["chance"] is not None:
                ax_d.axhline(100 * block["chance"], color=CHANCE_COLOR, ls=":", lw=1.6, label="chance")
            if ratios:
                _log2_fraction_axis(
                    ax_d,
                    ratios,
                    r"$d_{\mathrm{down}}/d$  (in brackets: $d_{\mathrm{down}}$)",
                    dim=int(scale["d_model"]),
                )
            else:
                ax_d.text(
                    0.5,
                    0.5,
                    "no DAR or Uniform d_down sweep",
                    ha="center",
                    va="center",
                    transform=ax_d.transAxes,
                    color="0.4",
                )
                ax_d.set_xticks([])
            ax_d.set_ylim(-2, 102)
            ax_d.set_ylabel("recall accuracy (%)")
            ax_d.set_title(f"{head}: accuracy vs. bottleneck width", fontsize=11)
            ax_d.legend(loc="best", fontsize=9, frameon=True)
            # Right: accuracy vs. distance for the selected runs.
            bins = block["bins"]
            mids = [(int(b.min_distance) + int(b.max_distance)) / 2 for b in bins.itertuples()]
            for kind, run in _selected_for_distance(overall):
                ys = [block["by_bin"].get((run["run"], int(b.bin))) for b in bins.itertuples()]
                ys = [np.nan if _na(y) else 100 * float(y) for y in ys]
                variant = kind[0]
                ax_r.plot(
                    mids,
                    ys,
                    color=_kind_color(kind),
                    marker=VARIANT_MARKERS.get(variant, "o"),
                    lw=2.0,
                    ms=6,
                    ls="--" if kind[2] else "-",
                    label=f"{_kind_label(kind)} ({_setting(run, tex=False)})" if variant != "vanilla" else "Vanilla",
                )
            if block["chance"] is not None:
                ax_r.axhline(100 * block["chance"], color=CHANCE_COLOR, ls=":", lw=1.6, label="chance")
            ax_r.xaxis.set_major_locator(FixedLocator(mids))
            ax_r.xaxis.set_minor_locator(NullLocator())
            labels = [f"{int(b.min_distance)}–{int(b.max_distance)}" for b in bins.itertuples()]
            ax_r.xaxis.set_major_formatter(
                FuncFormatter(
                    lambda x, pos, labels=labels: labels[pos] if pos is not None and pos < len(labels) else ""
                )
            )
            ax_r.set_ylim(-2, 102)
            ax_r.set_xlabel("query-to-key distance (tokens)")
            ax_r.set_ylabel("recall accuracy (%)")
            ax_r.set_title(f"{head}: accuracy by query distance", fontsize=11)
            ax_r.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9, frameon=False)
        notes = [f"{_scale_head(b['scale'])}: {b['distance_note']}" for b in blocks if b["distance_note"]]
        fig.suptitle(
            "Multi-query associative recall: can the model fetch a value stored far back?"
            + "".join("\n" + textwrap.fill(n, 130) for n in notes),
            fontsize=12,
        )
        return _save_figure(fig, path)


# ----------------------------------------------------------------------------- trajectory, lm-eval


def _run_label(row) -> str:
    label = _kind_label(_kind(row))
    if not _na(row["d_down"]):
        label += f" $d_{{\\mathrm{{down}}}}$={int(row['d_down'])} ({_fmt_fraction(_fraction(row['d_down'], row['d_model']))})"
    if row["variant"] == "dar" and not _na(row["window"]):
        label += f", w={int(row['window'])}"
    return label


def _tokens_formatter(x, _):
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _trajectory_runs(traj: pd.DataFrame) -> pd.DataFrame:
    """Table 1's runs per (dataset, d_model): plain Vanilla, Uniform, and DAR at the main window."""
    kept = []
    for _, rows in traj.groupby(["dataset", "d_model"], sort=False):
        rows = rows[_plain_mask(rows)]
        window = _main_window(rows)
        kept.append(rows[(rows["variant"] != "dar") | (rows["window"] == window).fillna(False)])
    return pd.concat(kept) if kept else traj.iloc[:0]


def render_dar_trajectory_figure(traj: pd.DataFrame, path: Path) -> Path:
    """Seed 000 Figure 3: validation perplexity relative to Vanilla along training, Table 1's runs only."""
    traj = _prepare(traj, "trajectory")
    traj = _trajectory_runs(traj.dropna(subset=["rel_to_vanilla"]))
    runs = traj[traj["variant"] != "vanilla"].drop_duplicates("run")
    # The fullest sweeps first, wider models first on a tie.
    sizes = runs.groupby(["dataset", "d_model"], sort=False)["run"].nunique()
    panels = sorted(sizes.index, key=lambda k: (-sizes[k], -int(k[1]), str(k[0])))
    if not panels:
        return _placeholder_figure(
            path,
            "Validation perplexity relative to Vanilla during training",
            "no plain DAR or Uniform run with a vanilla baseline",
        )
    ncols, nrows = _panel_grid(len(panels), 2)
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(7.0 * ncols + 3.2, 4.8 * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for ax, (dataset, d_model) in zip(axes.flat, panels):
            ax.axhline(100, color=VARIANT_COLORS["vanilla"], lw=1.5, label="Vanilla (= 100)")
            these = runs[(runs["dataset"] == dataset) & (runs["d_model"] == d_model)]
            for variant, marker, cmap in (("dar", "o", "Blues"), ("uniform", "s", "Oranges")):
                group = these[these["variant"] == variant].sort_values(["d_down", "window"], ascending=False)
                # Narrower bottleneck, darker line: the gap to Vanilla should grow with the colour.
                shades = sns.color_palette(cmap, len(group) + 2)[2:]
                for shade, (_, run) in zip(shades, group.iterrows()):
                    rows = traj[traj["run"] == run["run"]].sort_values("tokens")
                    ax.plot(
                        rows["tokens"].astype(float),
                        rows["rel_to_vanilla"].astype(float),
                        color=shade,
                        lw=2,
                        marker=marker,
                        ms=4,
                        ls="-" if variant == "dar" else "--",
                        label=_run_label(run),
                    )
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens_formatter))
            ax.set_xlabel("training tokens")
            ax.set_title(f"{dataset}, d = {d_model}" if dataset else f"d = {d_model}")
            ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        for ax in axes[:, 0]:
            ax.set_ylabel("validation perplexity\nrelative to Vanilla (%)")
        fig.suptitle(
            "Validation perplexity relative to Vanilla during training (analogue of seed 000 Figure 3)\n"
            "100 = Vanilla at the same step; below 100 beats it",
            fontsize=12,
        )
        return _save_figure(fig, path)


def _metric_label(metric: str) -> str:
    name, _, filt = metric.partition(",")
    return f"{name} ({filt})" if filt else name


def render_lm_eval_table(lm: pd.DataFrame, path: Path) -> Path:
    lm = _prepare(lm, "lm_eval")
    columns = list(dict.fromkeys(zip(lm["task"], lm["metric"])))
    tasks = [{"task": t, "span": sum(1 for c in columns if c[0] == t)} for t in dict.fromkeys(c[0] for c in columns)]
    cells = {(r.run, r.task, r.metric): r for r in lm.itertuples()}
    runs = lm.drop_duplicates("run")
    rows = []
    for _, run in runs.iterrows():
        values = []
        for task, metric in columns:
            r = cells.get((run["run"], task, metric))
            if r is None:
                values.append(MISSING)
                continue
            text = latex_escape(_fmt_sig(r.value, 4))
            if not pd.isna(r.stderr):
                text += rf" {{\scriptsize$\pm${latex_escape(_fmt_sig(r.stderr, 2))}}}"
            values.append(Tex(text))
        rows.append(
            {
                "run": run["run"],
                "variant": _kind_label(_kind(run)),
                "d_down": _int_or_missing(run["d_down"]),
                "window": _int_or_missing(run["window"]),
                "values": values,
            }
        )
    spans, start = [], 5
    for task in tasks:
        spans.append((start, start + task["span"] - 1))
        start += task["span"]
    return _render_tex(
        "lm_eval.tex.j2",
        path,
        tasks=tasks,
        metrics=[_metric_label(m) for _, m in columns],
        spans=spans,
        rows=rows,
        wide=len(columns) > 5,
        d_models=", ".join(str(d) for d in sorted(lm["d_model"].unique())),
    )


# ----------------------------------------------------------------------------- DAR: which outputs


def _existing(summary_dir: Path, keys: Iterable[str]) -> dict[str, Path]:
    return {k: Path(summary_dir) / SUMMARY_FILES[k] for k in keys if (Path(summary_dir) / SUMMARY_FILES[k]).exists()}


def _no_summaries(summary_dir: Path, keys: Iterable[str]) -> FileNotFoundError:
    names = ", ".join(SUMMARY_FILES[k] for k in keys)
    return FileNotFoundError(
        f"no summary CSV in {summary_dir}: expected at least one of {names}; "
        "run the workflow first (snakemake) to produce them, then regenerate the report"
    )


def _text(d: dict) -> pd.DataFrame | None:
    return _text_ppl(d.get("perplexity"), d.get("recall"))


# name -> (folder, summaries of which at least one must exist, has data?, render, placeholder reason).
# render(d, reference_dir, path) gets d = {summary key: prepared frame} for the summaries that exist.
DAR_OUTPUTS = {
    "dar_perplexity.tex": (
        "tables",
        ("perplexity",),
        lambda d: not _table1_rows(_text(d)).empty,
        lambda d, ref, p: render_dar_perplexity_table(d["perplexity"], ref, p, recall=d.get("recall")),
    ),
    "dar_perplexity.png": (
        "figures",
        ("perplexity",),
        lambda d: not _table1_rows(_text(d)).empty,
        lambda d, ref, p: render_dar_perplexity_figure(d["perplexity"], ref, p, recall=d.get("recall")),
    ),
    "dar_scales.tex": (
        "tables",
        ("perplexity",),
        lambda d: not _table2_rows(_text(d)).empty,
        lambda d, ref, p: render_dar_scales_table(d["perplexity"], ref, p, recall=d.get("recall")),
    ),
    "dar_window.tex": (
        "tables",
        ("perplexity", "recall"),
        lambda d: bool(_window_sweeps(_text(d), _overall(d.get("recall")))),
        lambda d, ref, p: render_dar_window_table(d.get("perplexity"), d.get("recall"), ref, p),
    ),
    "dar_window.png": (
        "figures",
        ("perplexity", "recall"),
        lambda d: bool(_window_sweeps(_text(d), _overall(d.get("recall")))),
        lambda d, ref, p: render_dar_window_figure(d.get("perplexity"), d.get("recall"), ref, p),
    ),
    "dar_downstream.tex": (
        "tables",
        ("lm_eval",),
        lambda d: bool(_downstream_blocks(d["lm_eval"], {})),
        lambda d, ref, p: render_dar_downstream_table(d["lm_eval"], ref, p),
    ),
    "baselines.tex": (
        "tables",
        ("perplexity", "recall"),
        lambda d: bool(_baseline_columns(_text(d), d.get("recall"))),
        lambda d, ref, p: render_baselines_table(d.get("perplexity"), d.get("recall"), ref, p),
    ),
    "recall.tex": (
        "tables",
        ("recall",),
        lambda d: not d["recall"].empty,
        lambda d, ref, p: render_recall_table(d["recall"], p),
    ),
    "recall.png": (
        "figures",
        ("recall",),
        lambda d: not d["recall"].empty,
        lambda d, ref, p: render_recall_figure(d["recall"], p),
    ),
    "dar_trajectory.png": (
        "figures",
        ("trajectory",),
        lambda d: not _trajectory_runs(d["trajectory"].dropna(subset=["rel_to_vanilla"]))
        .query("variant != 'vanilla'")
        .empty,
        lambda d, ref, p: render_dar_trajectory_figure(d["trajectory"], p),
    ),
    "lm_eval.tex": (
        "tables",
        ("lm_eval",),
        lambda d: not d["lm_eval"].empty,
        lambda d, ref, p: render_lm_eval_table(d["lm_eval"], p),
    ),
}


def render_dar(summary_dir, reference_dir, tables_dir, figures_dir, only: Iterable[str] | None = None) -> list[Path]:
    """The DAR tables and figures (DAR_OUTPUTS) from whichever DAR summaries exist.

    only=None (the ``figures`` target): every output whose summaries exist and hold the runs it
    needs. only=names (a rule's declared outputs): exactly those; one whose runs are absent is
    written as a valid "not run in this configuration" table or figure, and one whose summary
    CSV is missing is a FileNotFoundError naming it.
    """
    summary_dir, reference_dir = Path(summary_dir), Path(reference_dir)
    folders = {"tables": Path(tables_dir), "figures": Path(figures_dir)}
    found = _existing(summary_dir, DAR_SUMMARIES)
    if not found:
        raise _no_summaries(summary_dir, DAR_SUMMARIES)
    if only is not None:
        only = list(only)
        unknown = sorted(set(only) - set(DAR_OUTPUTS))
        if unknown:
            raise ValueError(f"unknown DAR output(s) {unknown}; known: {sorted(DAR_OUTPUTS)}")
    data = {key: _prepare(_read_summary(path), key, str(path)) for key, path in found.items()}
    written = []
    for name, (folder, needs, available, render) in DAR_OUTPUTS.items():
        if only is not None and name not in only:
            continue
        if not any(k in data for k in needs):
            if only is not None:
                raise FileNotFoundError(
                    f"{name} needs {' or '.join(SUMMARY_FILES[k] for k in needs)} in {summary_dir}, which is missing"
                )
            continue
        if only is None and not available(data):
            continue
        # Asked for but without the runs: each render_* writes its own placeholder.
        written.append(render(data, reference_dir, folders[folder] / name))
    return written


# ----------------------------------------------------------------------------- DimPO


_K_RE = re.compile(r"\bk\s*[=_:]?\s*(\d+)", re.I)
_LAMBDA_RE = re.compile(r"(?:lambda|lam|λ)\s*[=_:]?\s*(\d+(?:\.\d+)?)", re.I)


def _parse_setting(setting) -> tuple[int, float] | None:
    """(k, lambda) from a setting string such as "k=64,lambda=1" or "k64_lambda1"."""
    if setting is None or pd.isna(setting) or not str(setting).strip():
        return None
    k, lam = _K_RE.search(str(setting)), _LAMBDA_RE.search(str(setting))
    return (int(k.group(1)), float(lam.group(1))) if k and lam else None


def _objective_label(objective: str, setting=None) -> Tex:
    base = latex_escape(OBJECTIVE_LABELS.get(objective, objective))
    parsed = setting if isinstance(setting, tuple) else _parse_setting(setting)
    if parsed:
        k, lam = parsed
        return Tex(rf"{base} ($k{{=}}{k}$, $\lambda{{=}}{lam:g}$)")
    if setting is not None and not pd.isna(setting) and str(setting).strip():
        return Tex(f"{base} ({latex_escape(setting)})")
    return Tex(base)


def _plain_label(objective: str, setting=None) -> str:
    """The same label for matplotlib (mathtext)."""
    base = OBJECTIVE_LABELS.get(objective, objective)
    parsed = setting if isinstance(setting, tuple) else _parse_setting(setting)
    if parsed:
        return rf"{base} ($k$={parsed[0]}, $\lambda$={parsed[1]:g})"
    if setting is not None and not pd.isna(setting) and str(setting).strip():
        return f"{base} ({setting})"
    return base


def _dimpo_paper(reference_dir: Path) -> pd.DataFrame:
    ref = _read_reference(reference_dir, "dimpo")
    ref["ratio"] = [Fraction(int(d), PAPER_DIMPO_HEAD_DIM) for d in ref["d_prime"]]
    ref["setting"] = [(int(k), float(lam)) if k and lam else None for k, lam in zip(ref["k"], ref["lambda"])]
    ref["kl_value"], ref["mse_value"] = ref["kl"].astype(float), ref["mse"].astype(float)
    return ref


def _fidelity_means(fid: pd.DataFrame) -> pd.DataFrame:
    """Seed 003 Table 1 averages KL and MSE over layers."""
    fid = fid.copy()
    fid["setting"] = fid["setting"].fillna("").astype(str) if "setting" in fid else ""
    means = (
        fid.groupby(["model", "head_dim", "objective", "setting", "d_prime"], sort=False)
        .agg(kl=("kl", "mean"), mse=("mse", "mean"), n_layers=("layer", "nunique"))
        .reset_index()
    )
    means["ratio"] = [Fraction(int(d), int(h)) for d, h in zip(means["d_prime"], means["head_dim"])]
    return means


def _objective_rank(objective: str) -> int:
    return OBJECTIVE_ORDER.index(objective) if objective in OBJECTIVE_ORDER else len(OBJECTIVE_ORDER)


def render_dimpo_fidelity_table(fid: pd.DataFrame, reference_dir: Path, path: Path) -> Path:
    means = _fidelity_means(fid)
    paper = _dimpo_paper(reference_dir)
    paper_model = paper["model"].iloc[0] if len(paper) else "Llama-3.1-8B-Instruct"
    blocks = []
    for (model, head_dim), ours in means.groupby(["model", "head_dim"], sort=False):
        d_primes = sorted(ours["d_prime"].unique(), reverse=True)  # widest first, as the paper
        ratios = [Fraction(int(d), int(head_dim)) for d in d_primes]
        columns = [
            {
                "ratio": _fmt_fraction(r),
                "ours": str(d),
                "paper": str(int(r * PAPER_DIMPO_HEAD_DIM)) if (r * PAPER_DIMPO_HEAD_DIM).denominator == 1 else MISSING,
            }
            for d, r in zip(d_primes, ratios)
        ]
        objectives = sorted(set(ours["objective"]) | set(paper["objective"]), key=lambda o: (_objective_rank(o), o))
        groups = []
        for objective in objectives:
            rows = []
            for setting, mine in ours[ours["objective"] == objective].groupby("setting", sort=False):
                by_ratio = {r: m for r, m in zip(mine["ratio"], mine.itertuples())}
                cells = []
                for r in ratios:
                    m = by_ratio.get(r)
                    cells += [_fmt_sig(m.kl) if m else MISSING, _fmt_sig(m.mse) if m else MISSING]
                rows.append({"objective": _objective_label(objective, setting), "source": "ours", "cells": cells})
            theirs = paper[paper["objective"] == objective]
            for setting in dict.fromkeys(theirs["setting"]):
                sel = theirs[theirs["setting"].map(lambda s: s == setting)]
                by_ratio = {r: p for r, p in zip(sel["ratio"], sel.itertuples())}
                cells = []
                for r in ratios:
                    p = by_ratio.get(r)
                    cells += [p.kl if p else MISSING, p.mse if p else MISSING]
                rows.append({"objective": _objective_label(objective, setting), "source": "paper", "cells": cells})
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
    return _render_tex(
        "dimpo_fidelity.tex.j2",
        path,
        blocks=blocks,
        paper_model=paper_model,
        paper_head_dim=PAPER_DIMPO_HEAD_DIM,
        paper_only=", ".join(
            OBJECTIVE_LABELS.get(o, o)
            for o in sorted(set(paper["objective"]) - set(means["objective"]), key=_objective_rank)
        ),
    )


def render_dimpo_fidelity_figure(fid: pd.DataFrame, reference_dir: Path, path: Path) -> Path:
    """KL and MSE vs d'/d: a row per model of ours, then the paper's row over the same ratios.

    The paper's 8B-model values sit an order of magnitude away from a tiny model's, so they get
    their own row (own y range) rather than crowding our curves; colours and x match across rows.
    """
    means = _fidelity_means(fid)
    paper = _dimpo_paper(reference_dir)
    paper_model = paper["model"].iloc[0] if len(paper) else "Llama-3.1-8B-Instruct"
    models = list(dict.fromkeys(zip(means["model"], means["head_dim"])))
    ratios = set(means["ratio"])
    objectives = sorted(means["objective"].unique(), key=_objective_rank)
    paper = paper[paper["objective"].isin(objectives) & paper["ratio"].isin(ratios)]
    metrics = (("kl", "KL divergence of attention weights"), ("mse", "MSE of attention outputs"))
    ours_styles = ["-", "-.", (0, (5, 1, 1, 1))]
    paper_styles = ["--", ":", (0, (3, 1, 1, 1, 1, 1))]

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(13.5, 4.0 * (len(models) + 1) + 0.6), layout="constrained")
        FigureCanvasAgg(fig)
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
                    label = _plain_label(objective, setting)
                    if source == "paper" and len(settings) == 1:
                        label = _plain_label(objective)
                    (line,) = ax.plot(
                        sel["ratio"].astype(float),
                        sel[value_col],
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
            _plain_log_y(ax)
            _log2_fraction_axis(ax, ratios, f"$d'/d$  (in brackets: $d'$ of d={dim})", dim=dim)

        for row_axes, (model, head_dim) in zip(axes, models):
            ours = means[(means["model"] == model) & (means["head_dim"] == head_dim)]
            for ax, (metric, title) in zip(row_axes, metrics):
                draw(ax, ours, metric, ours_styles, "ours", int(head_dim))
                ax.set_title(f"{title}\nours: {model}, d={int(head_dim)}")
                ax.set_ylabel(f"{metric.upper()}, mean over layers (log)")
        for ax, (metric, title) in zip(axes[-1], metrics):
            draw(ax, paper, f"{metric}_value", paper_styles, "paper", PAPER_DIMPO_HEAD_DIM)
            ax.set_title(f"{title}\npaper: {paper_model}, d={PAPER_DIMPO_HEAD_DIM}")
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
            "not levels",
            fontsize=12,
        )
        return _save_figure(fig, path)


def render_dimpo(summary_dir, reference_dir, tables_dir, figures_dir) -> list[Path]:
    """dimpo_fidelity.tex and dimpo_fidelity.png from the fidelity summary."""
    summary_dir = Path(summary_dir)
    found = _existing(summary_dir, DIMPO_SUMMARIES)
    if not found:
        raise _no_summaries(summary_dir, DIMPO_SUMMARIES)
    fid = _read_summary(found["fidelity"])
    return [
        render_dimpo_fidelity_table(fid, reference_dir, Path(tables_dir) / "dimpo_fidelity.tex"),
        render_dimpo_fidelity_figure(fid, reference_dir, Path(figures_dir) / "dimpo_fidelity.png"),
    ]


# ----------------------------------------------------------------------------- all


def render_all(summary_dir, reference_dir, tables_dir, figures_dir) -> list[Path]:
    """Render every group that has a summary; FileNotFoundError if there are none at all."""
    summary_dir = Path(summary_dir)
    written = []
    if _existing(summary_dir, DAR_SUMMARIES):
        written += render_dar(summary_dir, reference_dir, tables_dir, figures_dir)
    if _existing(summary_dir, DIMPO_SUMMARIES):
        written += render_dimpo(summary_dir, reference_dir, tables_dir, figures_dir)
    if not written:
        raise _no_summaries(summary_dir, DAR_SUMMARIES + DIMPO_SUMMARIES)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate tables and figures from the summary CSVs.")
    parser.add_argument("summary_dir", type=Path)
    parser.add_argument("reference_dir", type=Path)
    parser.add_argument("tables_dir", type=Path)
    parser.add_argument("figures_dir", type=Path)
    args = parser.parse_args(argv)
    for path in render_all(args.summary_dir, args.reference_dir, args.tables_dir, args.figures_dir):
        print(path)


if __name__ == "__main__":
    main()
