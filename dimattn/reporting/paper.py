"""The papers' own numbers, read from ``reference/`` (one CSV per table, values as printed).

Seed 000 (DAR): Table 1 (relative perplexity per d_down/d at d = 512), Table 2 (d_down = d/4
across Pythia widths), Table 4 (downstream scores relative to d_down = d) and the tasks' metrics;
findings it states only in words (Table 3, Figure 3). Seed 003 (DimPO): Table 1 (attention
fidelity of Llama-3.1-8B heads, d = 128), Tables 2-3 (RULER 4k subtasks at a deep projection),
Table 4 (RULER by share of layers), Table 5 (with SnapKV and KIVI), Table 6 (ablation). Seed 001
prints no numbers we could set beside ours.
"""

from __future__ import annotations

import csv
from fractions import Fraction
from pathlib import Path

import pandas as pd

from dimattn.workflow.reference import FILES, OPTIONAL, missing  # noqa: F401 (missing: re-exported for the readers)
from dimattn.workflow.sweeps import BASE_OBJECTIVE

# The columns each file must have (its readers use them); a file may have more.
COLUMNS = {
    "dar": ("source", "model", "variant", "d_model", "d_down", "window", "rel_ppl_pct"),
    "dar_downstream": ("source", "d_model", "d_down", "window", "rel_score_pct"),
    "dar_tasks": ("source", "task", "metric"),
    "qualitative": ("source", "finding"),
    "dimpo": ("source", "model", "objective", "k", "lambda", "d_prime", "kl", "mse"),
    "dimpo_ablation": ("source", "objective", "k", "lambda", "plus_kl", "llama31_8b_kl", "qwen3_4b_kl"),
    "dimpo_ruler_by_layers": ("source", "model", "method", "k", "lambda", "d_prime", "share_of_layers_pct",
                              "ruler_4k", "ruler_8k"),
    "dimpo_ruler_subtasks": ("source", "model", "num_projected", "share_of_layers_pct", "method", "k", "lambda",
                             "NIAH", "SQuAD", "HotpotQA", "VT", "CWE", "FWE", "RULER_avg"),
    "dimpo_compression": ("source", "model", "d_prime", "compression", "num_projected", "ruler_4k", "ruler_8k"),
}
# Seed 003, Section 4: every model it projects has head dimension d = 128.
DIMPO_HEAD_DIM = 128
# Seed 003, 3.3: the key lists of its fits, the first 4,096 tokens of a chapter (k = 64 of them).
DIMPO_KEYS = 4096
# Seed 003 Table 1 row order; objectives we do not run still appear as paper-only rows.
OBJECTIVE_ORDER = ["random", "pca", "triplet", "cpo", "simpo", "orpo", "dimpo_list", "dimpo", "dimpo_kl", "kl"]
# Each objective as the tables and figures name it.
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

# The paper's wording of a metric -> lm-eval's "metric,filter".
METRIC_NAMES = {"flexible-extract exact match": "exact_match,flexible-extract"}


def objective_rank(objective: str) -> int:
    """Where an objective sorts, in every summary, table and figure: the base model (l = 0,
    dimattn.workflow.vocabulary.BASE_OBJECTIVE) first, then :data:`OBJECTIVE_ORDER`, then any other."""
    if objective == BASE_OBJECTIVE:
        return -1
    return OBJECTIVE_ORDER.index(objective) if objective in OBJECTIVE_ORDER else len(OBJECTIVE_ORDER)


class PaperFileError(ValueError):
    """A damaged file of the papers' numbers; the message names it and what is wrong."""


def read(reference_dir: Path, key: str) -> pd.DataFrame:
    path = Path(reference_dir) / FILES[key]
    restore = "restore it from the repository's reference/ (git checkout -- reference/)"
    if not path.exists():
        raise FileNotFoundError(
            f"paper numbers {path} are missing; reference_dir should be the repository's reference/"
        )
    # Every row as wide as the header: a row cut short (a truncated file) is refused, not read
    # as empty cells, which the files use for "not given".
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if row]
    except (UnicodeDecodeError, csv.Error) as e:
        raise PaperFileError(f"paper numbers {path} are not a UTF-8 CSV ({e}); {restore}") from None
    if not rows:
        raise PaperFileError(f"paper numbers {path} are empty; {restore}")
    lacking = [c for c in COLUMNS[key] if c not in rows[0]]
    if lacking:
        raise PaperFileError(f"paper numbers {path} lack column(s) {lacking} (header {rows[0]}); {restore}")
    for line, row in enumerate(rows[1:], 2):
        if len(row) != len(rows[0]):
            raise PaperFileError(
                f"paper numbers {path}: record {line} has {len(row)} fields, the header {len(rows[0])}; {restore}"
            )
    # Strings keep the values exactly as the paper prints them (99.61, 0.079).
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def dar_table1(reference_dir: Path) -> dict[tuple[str, Fraction], dict]:
    """(attention, d_down/d) -> {"text": as printed, "value": float, ...} from seed 000 Table 1."""
    ref = read(reference_dir, "dar")
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


def dar_table2(reference_dir: Path) -> list[dict]:
    """Seed 000 Table 2 rows (DAR at d_down = d/4 per Pythia scale), smallest d first."""
    ref = read(reference_dir, "dar")
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


def dar_table4(reference_dir: Path) -> tuple[dict[Fraction, dict], int, int]:
    """Seed 000 Table 4: d_down/d -> {"text", "d_down", "d"}, and the paper's d and window."""
    ref = read(reference_dir, "dar_downstream")
    by_ratio = {
        Fraction(int(r.d_down), int(r.d_model)): {"text": r.rel_score_pct, "d_down": int(r.d_down), "d": int(r.d_model)}
        for r in ref.itertuples()
    }
    d = next(iter(by_ratio.values()), {"d": 2048})["d"]
    window = next((int(r.window) for r in ref.itertuples() if r.window), 128)
    return by_ratio, d, window


def dar_task_metrics(reference_dir: Path) -> dict[str, str]:
    """Task -> the metric seed 000 reports for it, in lm-eval's naming; {} without the file."""
    if not (Path(reference_dir) / FILES["dar_tasks"]).exists():
        return {}
    ref = read(reference_dir, "dar_tasks")
    return {r.task: METRIC_NAMES.get(r.metric, r.metric) for r in ref.itertuples()}


def finding(reference_dir: Path, source: str) -> str:
    """A finding the paper states only in words (qualitative_findings.csv), or ""."""
    if not (Path(reference_dir) / FILES["qualitative"]).exists():
        return ""
    ref = read(reference_dir, "qualitative")
    rows = ref[ref["source"] == source]
    return "; ".join(rows["finding"]) if len(rows) else ""


def dimpo_table1(reference_dir: Path) -> pd.DataFrame:
    """Seed 003 Table 1 with the ratio d'/d, the (k, lambda) setting and KL/MSE as numbers beside the text."""
    ref = read(reference_dir, "dimpo")
    ref["ratio"] = [Fraction(int(d), DIMPO_HEAD_DIM) for d in ref["d_prime"]]
    ref["setting"] = [(int(k), float(lam)) if k and lam else None for k, lam in zip(ref["k"], ref["lambda"])]
    ref["kl_value"], ref["mse_value"] = ref["kl"].astype(float), ref["mse"].astype(float)
    return ref


def dimpo_table6(reference_dir: Path) -> pd.DataFrame:
    """Seed 003 Table 6 (at d' = 64): the objective, (k, lambda) where DimPO's, and the KL
    columns of both models, as printed."""
    ref = read(reference_dir, "dimpo_ablation")
    ref["setting"] = [
        (int(k), float(lam)) if o == "dimpo" and plus == "no" else None
        for o, k, lam, plus in zip(ref["objective"], ref["k"], ref["lambda"], ref["plus_kl"])
    ]
    # Its "DimPO + KL" row is the listwise term (k = 0) plus KL: our dimpo_kl.
    ref.loc[(ref["objective"] == "dimpo") & (ref["plus_kl"] == "yes"), "objective"] = "dimpo_kl"
    return ref
