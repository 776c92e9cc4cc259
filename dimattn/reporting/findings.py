"""docs/findings.md: each claim of the three seeds, our numbers with their seed spread, the
paper's beside, and a verdict computed from the published summaries.

The claims are listed once, in ``reference/claims.yaml``: the seed, where in the paper, the claim
in one sentence, and which rows of which summary compare. A claim compares setting A with
setting B on one value (``better``: which way is better), in cells (``match``: the columns that
must agree, such as the corpus and d_down), pairing A's and B's rows by seed inside a cell, each
seed's value the mean of its rows there (a DimPO fit's layers). Per cell, a seed's difference favours the
claim when A is better; the verdict:

* *holds beyond the seed spread*: in every cell, every seed (two or more) favours it;
* *same direction within the spread*: every cell favours it on the mean, not every seed does
  (or a cell has one seed, so no spread);
* *holds in k of n settings*: some cells favour it on the mean, others do not;
* *does not hold*: no cell favours it;
* *not tested at this tier*: the tier's summaries hold no pair of rows for it.

A claim of ``kind: equivalent`` (A performs comparably to B) holds *within the spread* when the
seeds' differences change sign, and does not hold when every seed of every cell goes one way.
Nothing here trains or scores: the summaries of ``published/<tier>/`` are the only input.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import yaml

from . import published
from .summaries import csv_rows

HOLDS = "holds beyond the seed spread"
WITHIN = "same direction within the spread"
NOT_HELD = "does not hold"
UNTESTED = "not tested at this tier"
EQUIVALENT = "holds: the difference changes sign across seeds"
NOT_EQUIVALENT = "does not hold: every seed differs one way"
CELLS_SHOWN = 6
TIERS = ("default", "cpu-full")  # the CPU tiers a claim is read on, in the page's order
CLAIMS = "claims.yaml"  # in reference_dir


class ClaimError(ValueError):
    """A claim of reference/claims.yaml that names no summary, column or direction that exists."""


def load_claims(path: os.PathLike | str) -> list[dict]:
    path = Path(path)
    try:
        claims = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ClaimError(f"{path}: {e}") from None
    seen = set()
    for i, claim in enumerate(claims or []):
        missing = [k for k in ("id", "seed", "where", "claim", "summary", "value", "a", "b") if k not in claim]
        if missing:
            raise ClaimError(f"{path}: claim {i} lacks {missing}")
        if claim["id"] in seen:
            raise ClaimError(f"{path}: claim id {claim['id']!r} twice")
        seen.add(claim["id"])
        if claim.get("kind", "better") == "better" and claim.get("better") not in ("higher", "lower"):
            raise ClaimError(f"{path}: claim {claim['id']!r}: better must be higher or lower")
    return claims


def _select(df: pd.DataFrame, where: dict, source: str) -> pd.DataFrame:
    """Rows whose columns equal ``where``'s values ("" an empty field, ">x" / "<x" a bound)."""
    for col, want in where.items():
        if col not in df.columns:
            raise ClaimError(f"{source}: no column {col!r} (columns: {list(df.columns)})")
        text = str(want)
        if text[:1] in "<>" and len(text) > 1:
            number = pd.to_numeric(df[col], errors="coerce")
            df = df[number > float(text[1:])] if text[0] == ">" else df[number < float(text[1:])]
        else:
            df = df[df[col].fillna("") == text]
    return df


def _read(summary_dir: Path, name: str) -> pd.DataFrame | None:
    path = summary_dir / f"{name}.csv"
    if not path.exists():
        return None
    csv_rows(path)  # whole, or refused naming the file
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def summary_reader(summary_dir: os.PathLike | str):
    """A tier's summaries by name, each read (whole, or refused naming the file) once; None for
    a summary the tier does not have. The findings page and the sizing report read claims so."""
    summary_dir, frames = Path(summary_dir), {}

    def read(name: str) -> pd.DataFrame | None:
        if name not in frames:
            frames[name] = _read(summary_dir, name)
        return frames[name]
    return read


def _fmt(values: pd.Series) -> str:
    mean = values.mean()
    if len(values) < 2 or values.min() == values.max():
        return f"{mean:.4g}"
    return f"{mean:.4g} [{values.min():.4g}, {values.max():.4g}]"


def compare(df: pd.DataFrame, claim: dict) -> dict:
    """The claim's cells on one summary: per cell, A's and B's values by seed, the seeds'
    differences (positive: A better), and the verdict over the cells."""
    source = f"claim {claim['id']!r} ({claim['summary']})"
    value, match = claim["value"], list(claim.get("match", []))
    if value not in df.columns:
        raise ClaimError(f"{source}: no column {value!r}")
    df = _select(df, claim.get("only", {}), source)
    sides = {}
    for side in ("a", "b"):
        rows = _select(df, claim[side], source).copy()
        rows[value] = pd.to_numeric(rows[value], errors="coerce")
        keys = match + (["seed"] if "seed" in rows.columns else [])
        for col in keys:
            if col not in rows.columns:
                raise ClaimError(f"{source}: no column {col!r} to match on")
        # a seed's value in a cell: the mean over the rest (a fit's layers)
        sides[side] = rows.dropna(subset=[value]).groupby(keys, dropna=False)[value].mean().rename(side)
    joined = pd.concat([sides["a"], sides["b"]], axis=1)
    sign = 1 if claim.get("better", "higher") == "higher" else -1
    cells = []
    for cell, group in (joined.groupby(level=list(range(len(match))), dropna=False) if match else [((), joined)]):
        paired = group.dropna()
        if paired.empty:
            continue
        diffs = sign * (paired["a"] - paired["b"])
        cells.append({"cell": dict(zip(match, cell if isinstance(cell, tuple) else (cell,))),
                      "a": paired["a"], "b": paired["b"], "diffs": diffs})
    return {"cells": cells, "verdict": verdict(cells, claim.get("kind", "better"))}


def verdict(cells: list[dict], kind: str = "better") -> str:
    if not cells:
        return UNTESTED
    if kind == "equivalent":
        one_way = all(len(c["diffs"]) >= 2 and ((c["diffs"] > 0).all() or (c["diffs"] < 0).all()) for c in cells)
        return NOT_EQUIVALENT if one_way else EQUIVALENT
    beyond = [len(c["diffs"]) >= 2 and (c["diffs"] > 0).all() for c in cells]
    favours = [c["diffs"].mean() > 0 for c in cells]
    if all(beyond):
        return HOLDS
    if all(favours):
        return WITHIN
    if any(favours):
        return f"holds in {sum(favours)} of {len(cells)} settings"
    return NOT_HELD


def _paper(claim: dict, reference_dir: Path) -> str:
    spec = claim.get("paper")
    if not spec:
        return ""
    path = reference_dir / spec["file"]
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    source = f"claim {claim['id']!r} paper ({path})"
    a, b = _select(df, spec["a"], source), _select(df, spec["b"], source)
    match = spec.get("match", [])
    pairs = a.merge(b, on=match, suffixes=("_a", "_b")) if match else a.assign(k=0).merge(b.assign(k=0), on="k",
                                                                                          suffixes=("_a", "_b"))
    if pairs.empty:
        raise ClaimError(f"{source}: no pair of rows for A and B")
    shown = [f"{', '.join(f'{m} {r[m]}' for m in match)}: {r[spec['value'] + '_a']} against {r[spec['value'] + '_b']}"
             for _, r in pairs.iterrows()]
    return "; ".join(shown)


def _describe(side: dict) -> str:
    return ", ".join(f"{k} {v if v != '' else '(none)'}" for k, v in side.items())


def render(published_root: os.PathLike | str, reference_dir: os.PathLike | str, tiers=TIERS) -> str:
    """The findings page, from every claim and each tier's published summaries (checked first)."""
    published_root, reference_dir = Path(published_root), Path(reference_dir)
    claims = load_claims(reference_dir / CLAIMS)
    manifests = {}
    for tier in tiers:
        if (published_root / tier / published.MANIFEST).exists():
            manifests[tier] = published.verify(published_root / tier)
    out = ["# Findings", "",
           "Written by the workflow (`make findings`: `dimattn.reporting.findings`) from the summaries in",
           "`published/<tier>/` and the claims in `reference/claims.yaml`; do not edit. A value is the mean",
           "over seeds with its [min, max]; a difference is paired by seed (training seed for runs, fit seed",
           "for DimPO). How a verdict is computed: `dimattn/reporting/findings.py`.", ""]
    for tier in tiers:
        m = manifests.get(tier)
        out.append(f"- {tier}: " + (f"published at `{m['commit'][:10]}`, {m['date'][:10]}, {m['jobs']} jobs on "
                                    f"{m['cpu']['model']}" if m else "not published yet: every claim untested"))
    out.append("")
    readers = {tier: summary_reader(published_root / tier / "summary") for tier in manifests}
    for seed in sorted({c["seed"] for c in claims}):
        out += [f"## Seed {seed}", ""]
        for claim in (c for c in claims if c["seed"] == seed):
            out += [f"### {claim['where']}: {claim['claim']}", "",
                    f"A: {_describe(claim['a'])}; B: {_describe(claim['b'])}; `{claim['summary']}.csv`, "
                    f"{claim['value']} ({claim.get('better', 'either')} is better"
                    + (f"; only {_describe(claim['only'])}" if claim.get("only") else "") + ").", ""]
            paper = _paper(claim, reference_dir)
            if paper:
                out += [f"The paper: {paper}.", ""]
            for tier in tiers:
                if tier not in manifests:
                    out.append(f"- **{tier}**: {UNTESTED} (not published)")
                    continue
                df = readers[tier](claim["summary"])
                result = compare(df, claim) if df is not None else {"cells": [], "verdict": UNTESTED}
                out.append(f"- **{tier}**: {result['verdict']}")
                for c in result["cells"][:CELLS_SHOWN]:
                    where = ", ".join(f"{k} {v}" for k, v in c["cell"].items()) or "all"
                    seeds = len(c["diffs"])
                    out.append(f"  - {where}: A {_fmt(c['a'])}, B {_fmt(c['b'])}; A better in "
                               f"{int((c['diffs'] > 0).sum())} of {seeds} seed{'s' if seeds != 1 else ''}")
                if len(result["cells"]) > CELLS_SHOWN:
                    out.append(f"  - and {len(result['cells']) - CELLS_SHOWN} more settings")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def write(dest: os.PathLike | str, **kwargs) -> Path:
    from dimattn.model.atomic import atomic_file

    text = render(**kwargs)
    with atomic_file(Path(dest)) as tmp:
        Path(tmp).write_text(text)
    return Path(dest)
