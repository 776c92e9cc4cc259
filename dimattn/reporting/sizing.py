"""What cutting a seed costs a tier's verdicts, read from a complete run: every claim of
reference/claims.yaml recomputed on each subset of the seeds the run made, and the job-seconds
those seeds' jobs took.

A tier with fewer seeds makes, seed for seed, the runs this one made (a run's seed sets its
initialisation and data order, nothing else), so its verdicts are those of the subset: no new
training is needed to know what the cut costs in spread, only the summaries of the run that made
every seed. What a cut saves is read from the run's Snakemake benchmarks: a training replicate's
jobs carry its seed in the run's name (``tiny-dar-w32-d16-s2``; seed 0 has no suffix,
dimattn.workflow.sweeps), while a fit's seeds share one job (bundled), so its saving is the
job's seconds times the share of its seeds cut, an estimate the page says is one.

    python -m dimattn.reporting.sizing TIER [--keep N] [--workdir DIR]

prints a Markdown page: per claim, the verdict on all seeds and on each kept subset.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from dimattn.workflow import paths

from . import findings, published

TRAINING_SEED = re.compile(r"-s(\d+)(?=[_.]|$)")  # the run name's replicate suffix
# Rules whose one job holds every fit seed of a (model, objective, setting, d'): the fit seeds'
# share of them is what a fit-seed cut saves.
FIT_RULES = ("fit_projection", "project_model", "score_projected")


def seeds_of(result: dict) -> list[str]:
    """The seeds that pair in at least one of a comparison's cells."""
    out = set()
    for cell in result["cells"]:
        out |= {key[-1] if isinstance(key, tuple) else key for key in cell["diffs"].index}
    return sorted(out, key=lambda s: (len(str(s)), str(s)))


def subset_verdicts(df: pd.DataFrame, claim: dict, keep: int | None = None) -> dict:
    """The claim's verdict on every seed, and on each subset of ``keep`` of them (default: one
    fewer), as {"seeds": [...], "all": verdict, "subsets": {(seed, ...): verdict}}."""
    full = findings.compare(df, claim)
    seeds = seeds_of(full) if "seed" in df.columns else []  # no seed column: the cells' keys are no seeds
    keep = len(seeds) - 1 if keep is None else keep
    subsets = {}
    if 1 <= keep < len(seeds):
        for kept in itertools.combinations(seeds, keep):
            subsets[kept] = findings.compare(df[df["seed"].isin(kept)], claim)["verdict"]
    return {"seeds": seeds, "all": full["verdict"], "subsets": subsets}


def seed_seconds(bench_dir: Path) -> dict:
    """{"training": {seed: job-seconds}, "fit": job-seconds of the fit-seed-bundled rules}, from
    the Snakemake benchmark files of a run (``<rule>/<job>.tsv``, column ``s``)."""
    training, fit = Counter(), 0.0
    for path in sorted(bench_dir.glob("*/*.tsv")):
        seconds = sum(published.job_seconds_of(path))
        rule = path.parent.name
        if rule in FIT_RULES:
            fit += seconds
        match = TRAINING_SEED.search(path.stem)
        training[match.group(1) if match else "0"] += seconds
    return {"training": dict(training), "fit": fit}


def render(tier: str, published_root: Path, reference_dir: Path, workdir: Path | None = None,
           keep: int | None = None) -> str:
    manifest = published.verify(published_root / tier)
    claims = findings.load_claims(reference_dir / findings.CLAIMS)
    out = [f"# What a seed cut costs {tier}", "",
           f"From `published/{tier}/` (`{manifest['commit'][:10]}`, {manifest['date'][:10]}, {manifest['jobs']} jobs, "
           f"{manifest['job_seconds']:,.0f} job-s on {manifest['cpu']['model']}); "
           "`python -m dimattn.reporting.sizing`. Per claim: its verdict on every seed, then on each subset kept "
           "(the runs a tier with fewer seeds makes).", "",
           "| claim | seeds | all seeds | kept subsets: verdict (how many) |", "| --- | --- | --- | --- |"]
    read = findings.summary_reader(published_root / tier / "summary")
    changed = 0
    for claim in claims:
        df = read(claim["summary"])
        if df is None:
            out.append(f"| {claim['id']} | | {findings.UNTESTED} | |")
            continue
        result = subset_verdicts(df, claim, keep)
        tally = Counter(result["subsets"].values())
        changed += any(v != result["all"] for v in result["subsets"].values())
        shown = "; ".join(f"{v} ({n})" for v, n in tally.most_common()) or "no subset (fewer than two seeds)"
        out.append(f"| {claim['id']} | {len(result['seeds'])} | {result['all']} | {shown} |")
    out += ["", f"{changed} of {len(claims)} claims change verdict in some kept subset.", ""]
    bench = (workdir or Path(".")) / paths.BENCH
    if bench.is_dir():
        cost = seed_seconds(bench)
        total = sum(cost["training"].values())
        out += [f"Job-seconds by training seed (jobs named for a replicate), of {total:,.0f} in `{bench}`:", ""]
        out += [f"- seed {s}{' (with every job of no replicate: data, scoring of the bases)' if s == '0' else ''}: "
                f"{v:,.0f} ({v / total:.0%})" for s, v in sorted(cost["training"].items())]
        out += [f"- of all seeds, the fit-bundled rules ({', '.join(FIT_RULES)}): {cost['fit']:,.0f} "
                f"({cost['fit'] / total:.0%}); a cut of one fit seed in n saves about 1/n of it (an estimate: one "
                "job holds every fit seed)", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tier")
    parser.add_argument("--keep", type=int, help="seeds kept in each subset (default: one fewer than the run's)")
    parser.add_argument("--workdir", type=Path, help="the tier's working directory, for its benchmarks' seconds")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    try:
        print(render(args.tier, repo / paths.PUBLISHED, repo / "reference", args.workdir, args.keep))
    except (published.PublishedError, findings.ClaimError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
