"""Tidy summaries, LaTeX tables and figures, with the papers' numbers beside ours.

Results flow one way: raw outputs of the other stages (perplexity and lm-eval JSON, the
training ``metrics.csv`` of each run, DimPO fidelity CSVs) are reduced by the
``summarize_*`` functions to tidy CSVs; the ``render_*`` functions read only those CSVs
and ``reference/`` (the numbers the papers print) and write LaTeX and PNG.

Our models are far smaller than the papers' (seed 000 trains Pythia-70M with d = 512,
seed 003 projects Llama-3.1-8B heads with d = 128), so paper numbers are matched by the
ratio d_down/d (DAR) or d'/d (DimPO), and every table prints both dimensions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Iterable
from fractions import Fraction
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
    "fidelity": "dimpo_fidelity.csv",
}
DAR_SUMMARIES = ("perplexity", "trajectory", "lm_eval")
DIMPO_SUMMARIES = ("fidelity",)

REFERENCE_FILES = {
    "dar": "dar_relative_perplexity.csv",
    "dimpo": "dimpo_fidelity_llama31_8b.csv",
}
# Seed 003, Section 4: every model it projects has head dimension d = 128.
PAPER_DIMPO_HEAD_DIM = 128

RUN_COLUMNS = ["run", "variant", "d_model", "d_down", "window"]
PERPLEXITY_COLUMNS = RUN_COLUMNS + ["corpus", "ppl", "rel_to_vanilla"]
PERPLEXITY_EXTRA = ["split", "n_tokens", "loss"]
TRAJECTORY_COLUMNS = RUN_COLUMNS + ["step", "tokens", "val_loss", "val_ppl", "rel_to_vanilla"]
LM_EVAL_COLUMNS = RUN_COLUMNS + ["task", "metric", "value", "stderr"]
FIDELITY_COLUMNS = ["model", "objective", "d_prime", "head_dim", "layer", "kl", "mse"]
INT_COLUMNS = ["d_model", "d_down", "window", "step", "tokens", "n_tokens", "d_prime", "head_dim", "layer"]

VARIANT_ORDER = ["vanilla", "dar", "uniform"]
VARIANT_LABELS = {"vanilla": "Vanilla", "dar": "DAR", "uniform": "Uniform"}
VARIANT_COLORS = {"vanilla": "0.35", "dar": "#1f77b4", "uniform": "#d95f02"}
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
    return _as_int(pd.read_csv(path))


# ----------------------------------------------------------------------------- summaries


def _run_fields(record: dict) -> dict:
    """The run columns; window is dropped for variants without a local path (seed 000)."""
    variant = record["variant"]
    return {
        "run": record["run"],
        "variant": variant,
        "d_model": record["d_model"],
        "d_down": None if variant == "vanilla" else record.get("d_down"),
        "window": record.get("window") if variant == "dar" else None,
    }


def _check_one_vanilla(vanilla: pd.DataFrame, keys: list[str]) -> None:
    dup = vanilla[vanilla.duplicated(keys, keep=False)]
    if not dup.empty:
        raise ValueError(
            f"more than one vanilla run for the same {', '.join(keys)}: {sorted(dup['run'].unique())}; "
            "rel_to_vanilla needs exactly one baseline"
        )


def summarize_perplexity(eval_jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """One row per (run, corpus); rel_to_vanilla = 100 * ppl / ppl(Vanilla, same d_model, corpus)."""
    rows = []
    for path in eval_jsons:
        record = json.loads(Path(path).read_text())
        rows.append(
            _run_fields(record)
            | {
                "corpus": record["corpus"],
                "ppl": float(record["ppl"]),
                "split": record.get("split"),
                "n_tokens": record.get("n_tokens"),
                "loss": record.get("loss"),
            }
        )
    if not rows:
        raise ValueError("summarize_perplexity got no evaluation JSON files")
    df = _as_int(pd.DataFrame(rows))
    df["split"] = df["split"].fillna("")

    keys = ["d_model", "corpus", "split"]
    vanilla = df.loc[df["variant"] == "vanilla", keys + ["run", "ppl"]]
    _check_one_vanilla(vanilla, keys)
    df = df.merge(vanilla.drop(columns="run").rename(columns={"ppl": "_vanilla_ppl"}), on=keys, how="left")
    lacking = df[df["_vanilla_ppl"].isna()]
    if not lacking.empty:
        first = lacking.iloc[0]
        raise ValueError(
            f"no vanilla run for corpus {first['corpus']!r} (d_model={first['d_model']}, split={first['split']!r}); "
            f"runs {sorted(lacking['run'].unique())} need one to compute rel_to_vanilla"
        )
    df["rel_to_vanilla"] = 100.0 * df["ppl"] / df["_vanilla_ppl"]
    df = _sort_runs(df, ["corpus", "split"])[PERPLEXITY_COLUMNS + PERPLEXITY_EXTRA]
    _write_csv(df, Path(out_csv))
    return df


def _read_run_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return _run_fields(
        {
            "run": model_dir.name,
            "variant": config["attention"],
            "d_model": config["hidden_size"],
            "d_down": config.get("d_down"),
            "window": config.get("window"),
        }
    )


def summarize_trajectory(model_dirs: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Validation perplexity per evaluated step, relative to Vanilla at the same step (seed 000 Fig. 3)."""
    frames = []
    for model_dir in map(Path, model_dirs):
        fields = _read_run_config(model_dir)
        metrics = pd.read_csv(model_dir / "metrics.csv")
        metrics["val_loss"] = pd.to_numeric(metrics["val_loss"], errors="coerce")
        # A resumed run may log a step twice; the later line is the one that counts.
        metrics = metrics.dropna(subset=["val_loss"]).drop_duplicates("step", keep="last")
        frames.append(metrics[["step", "tokens", "val_loss"]].assign(**fields))
    if not frames:
        raise ValueError("summarize_trajectory got no model directories")
    df = _as_int(pd.concat(frames, ignore_index=True))
    df["val_ppl"] = np.exp(df["val_loss"])

    vanilla = df.loc[df["variant"] == "vanilla", ["d_model", "step", "run", "val_ppl"]]
    _check_one_vanilla(vanilla, ["d_model", "step"])
    missing = sorted(set(df["d_model"]) - set(vanilla["d_model"]))
    if missing:
        raise ValueError(
            f"no vanilla run with d_model={missing[0]} among the model directories; rel_to_vanilla needs one"
        )
    df = df.merge(
        vanilla.drop(columns="run").rename(columns={"val_ppl": "_vanilla_ppl"}), on=["d_model", "step"], how="left"
    )
    # Steps the vanilla run did not evaluate stay NaN rather than being matched to a neighbour.
    df["rel_to_vanilla"] = 100.0 * df["val_ppl"] / df["_vanilla_ppl"]
    df = _sort_runs(df, [], tail=["step"])[TRAJECTORY_COLUMNS]
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
        fields = _run_fields(record)
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
    """Vanilla first, then DAR and Uniform, widest bottleneck first."""
    df = df.assign(
        _v=df["variant"].map(lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER)),
        _dd=-df["d_down"].astype("Float64"),
    )
    df = df.sort_values(head + ["d_model", "_v", "_dd", "window", "run", *tail], na_position="first", kind="stable")
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


# ----------------------------------------------------------------------------- DAR


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


def _dar_ratio(row) -> Fraction | None:
    return Fraction(1) if row["variant"] == "vanilla" else _fraction(row["d_down"], row["d_model"])


def _dar_table2_note(reference_dir: Path) -> str:
    ref = _read_reference(reference_dir, "dar")
    ref = ref[ref["source"] == "Table 2"]
    if ref.empty:
        return ""
    parts = ", ".join(
        f"{latex_escape(r.rel_ppl_pct)} at d = {latex_escape(r.d_model)} ({latex_escape(r.model)})"
        for r in ref.itertuples()
    )
    return Tex(rf"At d\textsubscript{{down}} = d/4 the paper's Table 2 gives Rel.\ {parts}.")


def _main_window(ppl: pd.DataFrame):
    """The window most DAR runs share (the largest on a tie): the sweep's default, set beside Table 1."""
    windows = ppl.loc[ppl["variant"] == "dar"].drop_duplicates("run")["window"].dropna()
    if windows.empty:
        return None
    counts = windows.value_counts()
    return max(counts[counts == counts.max()].index)


def render_dar_perplexity_table(ppl: pd.DataFrame, reference_dir: Path, path: Path) -> Path:
    paper = _dar_paper_table1(reference_dir)
    main_window = _main_window(ppl)
    groups = []
    for (corpus, split), rows in ppl.groupby(["corpus", "split"], sort=False, dropna=False):
        cells = []
        for _, row in rows.iterrows():
            ratio = _dar_ratio(row)
            ref = paper.get((row["variant"], ratio))
            if row["variant"] == "dar" and (pd.isna(row["window"]) or row["window"] != main_window):
                ref = None  # the paper's Table 1 is at one window; its window sweep is only in words
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
        groups.append({"corpus": corpus if not split else f"{corpus} ({split})", "rows": cells})
    paper_any = next(iter(paper.values()), {})
    d_models = ", ".join(str(d) for d in sorted(ppl["d_model"].unique()))
    windows = ", ".join(str(w) for w in sorted(ppl["window"].dropna().unique()))
    return _render_tex(
        "dar_perplexity.tex.j2",
        path,
        groups=groups,
        d_models=d_models,
        windows=windows or MISSING,
        paper_model=paper_any.get("model", "pythia-70m"),
        paper_d=paper_any.get("d_model", 512),
        paper_window=next((p["window"] for p in paper.values() if p["window"]), 128),
        table2_note=_dar_table2_note(reference_dir),
        sweep_note=(
            f"DAR rows at windows other than w = {main_window} (a sweep like seed 000 Table 3, which the paper "
            "reports only in words) have no paper number."
            if ppl.loc[ppl["variant"] == "dar", "window"].nunique() > 1
            else ""
        ),
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


def render_dar_perplexity_figure(ppl: pd.DataFrame, reference_dir: Path, path: Path) -> Path:
    paper = _dar_paper_table1(reference_dir)
    ppl = ppl.assign(ratio=[_dar_ratio(r) for _, r in ppl.iterrows()])
    corpora = list(dict.fromkeys(ppl["corpus"]))
    ncols = min(len(corpora), 3)
    nrows = math.ceil(len(corpora) / ncols)
    ratios = set(ppl.loc[ppl["variant"] != "vanilla", "ratio"].dropna()) | {r for (v, r) in paper if v != "vanilla"}
    show_window = ppl.loc[ppl["variant"] == "dar", "window"].nunique() > 1

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(5.2 * ncols + 2.6, 4.4 * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
        for ax, corpus in zip(axes.flat, corpora):
            ours = ppl[(ppl["corpus"] == corpus) & (ppl["variant"] != "vanilla")]
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
                for window, rows in ours[ours["variant"] == variant].groupby("window", dropna=False):
                    rows = rows.sort_values("ratio")
                    ax.plot(
                        rows["ratio"].astype(float),
                        rows["rel_to_vanilla"],
                        ls="-",
                        lw=2.2,
                        marker="o" if variant == "dar" else "s",
                        ms=7,
                        color=VARIANT_COLORS[variant],
                        zorder=3,
                    )
                    if show_window and variant == "dar":
                        last = rows.iloc[-1]
                        ax.annotate(
                            f"w={int(window)}",
                            (float(last["ratio"]), last["rel_to_vanilla"]),
                            xytext=(6, 0),
                            textcoords="offset points",
                            fontsize=9,
                            va="center",
                        )
            _log2_fraction_axis(ax, ratios, r"$d_{\mathrm{down}}/d$ (log scale)")
            ax.set_title(f"corpus: {corpus}")
        for ax in axes[:, 0]:
            ax.set_ylabel("perplexity relative to Vanilla (%)\nlower is better")
        for ax in list(axes.flat)[len(corpora) :]:
            ax.set_visible(False)

        d_ours = ", ".join(str(d) for d in sorted(ppl["d_model"].unique()))
        windows = ", ".join(str(w) for w in sorted(ppl["window"].dropna().unique()))
        ref_any = next(iter(paper.values()), {"d_model": 512, "window": 128, "model": "pythia-70m"})
        handles = [
            Line2D(
                [], [], color=VARIANT_COLORS["dar"], marker="o", lw=2.2, label=f"DAR, ours (d={d_ours}, w={windows})"
            ),
            Line2D([], [], color=VARIANT_COLORS["uniform"], marker="s", lw=2.2, label=f"Uniform, ours (d={d_ours})"),
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


def _run_label(row) -> str:
    label = VARIANT_LABELS.get(row["variant"], row["variant"])
    if row["variant"] != "vanilla":
        label += f" $d_{{\\mathrm{{down}}}}$={int(row['d_down'])} ({_fmt_fraction(_fraction(row['d_down'], row['d_model']))})"
    if row["variant"] == "dar" and not pd.isna(row["window"]):
        label += f", w={int(row['window'])}"
    return label


def _tokens_formatter(x, _):
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def render_dar_trajectory_figure(traj: pd.DataFrame, path: Path) -> Path:
    traj = traj.dropna(subset=["rel_to_vanilla"])
    d_models = sorted(traj["d_model"].unique())
    runs = traj[traj["variant"] != "vanilla"].drop_duplicates("run")
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=(7.0 * len(d_models) + 3.2, 4.8), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(d_models), squeeze=False, sharey=True)[0]
        for ax, d_model in zip(axes, d_models):
            ax.axhline(100, color=VARIANT_COLORS["vanilla"], lw=1.5, label="Vanilla (= 100)")
            these = runs[runs["d_model"] == d_model]
            for variant, marker, cmap in (("dar", "o", "Blues"), ("uniform", "s", "Oranges")):
                group = these[these["variant"] == variant].sort_values(["d_down", "window"], ascending=False)
                # Narrower bottleneck, darker line: the gap to Vanilla should grow with the colour.
                shades = sns.color_palette(cmap, len(group) + 2)[2:]
                for shade, (_, run) in zip(shades, group.iterrows()):
                    rows = traj[traj["run"] == run["run"]].sort_values("tokens")
                    ax.plot(
                        rows["tokens"],
                        rows["rel_to_vanilla"],
                        color=shade,
                        lw=2,
                        marker=marker,
                        ms=4,
                        ls="-" if variant == "dar" else "--",
                        label=_run_label(run),
                    )
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens_formatter))
            ax.set_xlabel("training tokens")
            ax.set_title(f"d = {d_model}")
        # Outside the axes: early in training the curves fill every corner.
        handles = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        fig.legend(handles.values(), handles.keys(), loc="outside right center", frameon=False, fontsize=10)
        axes[0].set_ylabel("validation perplexity\nrelative to Vanilla (%)")
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
                "variant": VARIANT_LABELS.get(run["variant"], run["variant"]),
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


def _existing(summary_dir: Path, keys: Iterable[str]) -> dict[str, Path]:
    return {k: Path(summary_dir) / SUMMARY_FILES[k] for k in keys if (Path(summary_dir) / SUMMARY_FILES[k]).exists()}


def _no_summaries(summary_dir: Path, keys: Iterable[str]) -> FileNotFoundError:
    names = ", ".join(SUMMARY_FILES[k] for k in keys)
    return FileNotFoundError(
        f"no summary CSV in {summary_dir}: expected at least one of {names}; "
        "run the workflow first (snakemake) to produce them, then regenerate the report"
    )


def render_dar(summary_dir, reference_dir, tables_dir, figures_dir) -> list[Path]:
    """dar_perplexity.tex/.png, dar_trajectory.png and lm_eval.tex from whichever DAR summaries exist."""
    summary_dir, tables_dir, figures_dir = Path(summary_dir), Path(tables_dir), Path(figures_dir)
    found = _existing(summary_dir, DAR_SUMMARIES)
    if not found:
        raise _no_summaries(summary_dir, DAR_SUMMARIES)
    written = []
    if "perplexity" in found:
        ppl = _read_summary(found["perplexity"])
        ppl["split"] = ppl["split"].fillna("") if "split" in ppl else ""
        written.append(render_dar_perplexity_table(ppl, reference_dir, tables_dir / "dar_perplexity.tex"))
        written.append(render_dar_perplexity_figure(ppl, reference_dir, figures_dir / "dar_perplexity.png"))
    if "trajectory" in found:
        written.append(
            render_dar_trajectory_figure(_read_summary(found["trajectory"]), figures_dir / "dar_trajectory.png")
        )
    if "lm_eval" in found:
        written.append(render_lm_eval_table(_read_summary(found["lm_eval"]), tables_dir / "lm_eval.tex"))
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
