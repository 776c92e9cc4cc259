"""A tier's results as the repository ships them, and the check that renders only whole ones.

``published/<tier>/`` holds a complete run's tidy summaries (``summary/*.csv``), the LaTeX tables
it rendered (``tables/*.tex``) and ``manifest.json``: the commit, the date, the CPU with its
one-thread bf16 matmul peak, the jobs and job-seconds, the run's wall seconds, the merged config's
digest, and each file's sha256 and row count. ``make figures`` renders a tier's every table and
figure from it alone; :func:`verify` first refuses a file that is missing, changed, empty, cut
mid-row or not a CSV, naming it.

    python -m dimattn.reporting.published publish TIER [--workdir DIR]   # after a complete run
    python -m dimattn.reporting.published verify TIER
    python -m dimattn.reporting.published readme        # the README's table of tiers
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dimattn.workflow import paths

from dimattn.workflow import tiers
from dimattn.model.atomic import atomic_dir
from .summaries import BadSummary, csv_rows

MANIFEST = "manifest.json"
SUMMARY = "summary"
TABLES = "tables"


class PublishedError(ValueError):
    """A published tier that is not what its manifest says, or a run that cannot be published."""


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _rows(path: Path) -> int:
    if path.suffix == ".csv":
        return csv_rows(path)
    return len(path.read_text().splitlines())


def verify(published_dir: os.PathLike | str) -> dict:
    """The manifest of ``published_dir``, once every file it lists is there with its sha256 and
    row count, and no summary lies there unlisted; else a PublishedError naming the file."""
    published_dir = Path(published_dir)
    manifest_path = published_dir / MANIFEST
    if not manifest_path.is_file():
        raise PublishedError(f"{manifest_path}: missing; a published tier is made by "
                             "`python -m dimattn.reporting.published publish TIER` after a complete run")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise PublishedError(f"{manifest_path}: not a manifest ({e})") from None
    for name, meta in files.items():
        path = published_dir / name
        try:
            rows = _rows(path)
        except (BadSummary, OSError, UnicodeDecodeError) as e:
            raise PublishedError(str(e) if isinstance(e, BadSummary) else f"{path}: {e}") from None
        if sha256(path) != meta["sha256"]:
            raise PublishedError(f"{path}: its sha256 is not the one {manifest_path} lists (the file changed "
                                 f"since it was published); restore it: git checkout -- {path}")
        if rows != meta["rows"]:
            raise PublishedError(f"{path}: {rows} rows, {manifest_path} lists {meta['rows']}")
    unlisted = sorted(str(p.relative_to(published_dir)) for p in published_dir.glob(f"{SUMMARY}/*.csv")
                      if str(p.relative_to(published_dir)) not in files)
    if unlisted:
        raise PublishedError(f"{published_dir}: {', '.join(unlisted)} not in {manifest_path}")
    return manifest


def job_seconds(bench_dir: os.PathLike | str, since: float = 0.0) -> dict[str, tuple[int, float]]:
    """{rule: (jobs, summed seconds)} of the Snakemake benchmark files under ``bench_dir``
    (``<rule>/*.tsv``, column ``s``, dimattn.workflow.paths.bench) written since ``since``; also
    what benchmarks/training.py --dag-times prints."""
    bench_dir, out = Path(bench_dir), {}
    for path in sorted(bench_dir.rglob("*.tsv")):
        if path.stat().st_mtime < since:
            continue
        rows = job_seconds_of(path)
        if rows:
            rule = path.relative_to(bench_dir).parts[0]
            jobs, seconds = out.get(rule, (0, 0.0))
            out[rule] = (jobs + 1, seconds + sum(rows))
    return out


def job_seconds_of(path: os.PathLike | str) -> list[float]:
    """The seconds of each repeat in one Snakemake benchmark file (none where the job did not finish)."""
    with open(path, newline="") as f:
        return [float(r["s"]) for r in csv.DictReader(f, delimiter="\t") if r.get("s") not in (None, "", "NA")]


def _commit(repo: Path) -> tuple[str, bool]:
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout

    dirty = any(not line[3:].startswith(paths.PUBLISHED) for line in git("status", "--porcelain").splitlines())
    return git("rev-parse", "HEAD").strip(), dirty


def _bf16_peak() -> float:
    """The one-thread bf16 matmul peak, measured here by the benchmarks' host line (its one home;
    a process of its own, since it needs torch, which no rendering job does)."""
    repo = Path(__file__).resolve().parents[2]
    code = "import json; from benchmarks._host import host; print(json.dumps(host()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["host_bf16_peak_gflops"]


def publish(tier: str, workdir: os.PathLike | str = ".", dest_root: os.PathLike | str | None = None) -> Path:
    """Copy a complete run's summaries and tables from ``workdir`` to ``published/<tier>`` with
    its manifest, after rendering the tables again from the copied summaries and finding them
    byte-identical (so ``make figures`` gives the run's tables). The folder is replaced whole."""
    from . import outputs

    workdir = Path(workdir)
    repo = Path(__file__).resolve().parents[2]
    dest = Path(dest_root or repo / paths.PUBLISHED) / tier
    record = tiers.read(workdir / paths.TIER_STAMP)
    if record is None or record["tier"] != tier:
        raise PublishedError(f"{workdir / paths.TIER_STAMP}: no run of tier {tier!r} here")
    if not tiers.complete(record):
        raise PublishedError(f"{workdir / paths.TIER_STAMP}: the last run of tier {tier!r} did not finish; "
                             "run it to the end first")
    if record["cpu_model"] != tiers.cpu_model():
        raise PublishedError(f"the run was on {record['cpu_model']!r}, this host is {tiers.cpu_model()!r}: "
                             "publish on the host that ran it, so that its bf16 peak is the run's")
    summary_dir, tables_dir = workdir / paths.SUMMARY, workdir / paths.TABLES
    summaries = sorted(summary_dir.glob("*.csv"))
    if not summaries:
        raise PublishedError(f"{summary_dir}: no summary to publish")
    for path in summaries:
        csv_rows(path)
    commit, dirty = _commit(repo)
    with tempfile.TemporaryDirectory() as scratch:
        rendered = Path(scratch) / "results"
        outputs.render_existing(summary_dir, workdir / "reference", rendered)
        tables = sorted((rendered / "tables").glob("*.tex"))
        for table in tables:
            ran = tables_dir / table.name
            if not ran.is_file() or ran.read_bytes() != table.read_bytes():
                raise PublishedError(f"{ran}: not what the summaries render ({table.name} differs or is missing); "
                                     "rerun the workflow so that its tables are current")
    per_rule = job_seconds(workdir / paths.BENCH, record["invocations"][0]["started"])
    jobs, job_seconds_ = sum(j for j, _ in per_rule.values()), sum(s for _, s in per_rule.values())
    last = record["invocations"][-1]
    manifest = {
        "tier": tier,
        "commit": commit,
        "dirty": dirty,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last["finished"])),
        "cpu": {"model": record["cpu_model"], "cores": os.cpu_count(), "bf16_peak_gflops": _bf16_peak()},
        "jobs": jobs,
        "job_seconds": round(job_seconds_, 1),
        "wall_seconds": round(tiers.wall_seconds(record), 1),
        "invocations": len(record["invocations"]),
        "config_sha256": record["config_sha256"],
        "files": {},
    }
    with atomic_dir(dest) as tmp:
        for folder, files in ((SUMMARY, summaries), (TABLES, [tables_dir / t.name for t in tables])):
            (tmp / folder).mkdir()
            for path in files:
                shutil.copy2(path, tmp / folder / path.name)
                manifest["files"][f"{folder}/{path.name}"] = {"sha256": sha256(path), "rows": _rows(path)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest


# The tiers in the README's table, in order: (tier, config, command).
TIERS = (
    ("default", "config.yaml", "make run"),
    ("cpu-full", "configs/cpu-full.yaml", "make full"),
)
README_BEGIN, README_END = (
    "<!-- tiers: written by python -m dimattn.reporting.published readme -->",
    "<!-- tiers end -->",
)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def tiers_table(root: os.PathLike | str | None = None) -> str:
    """The README's table of the CPU tiers, each figure read from its published manifest."""
    root = Path(root or Path(__file__).resolve().parents[2] / paths.PUBLISHED)
    lines = [
        "| tier | config | command | published run: jobs, job-seconds, wall time | host (bf16 peak, one thread) | commit, date |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for tier, config, command in TIERS:
        if not (root / tier / MANIFEST).is_file():
            lines.append(f"| {tier} | `{config}` | `{command}` | not published yet | | |")
            continue
        m = json.loads((root / tier / MANIFEST).read_text())
        lines.append(
            f"| {tier} | `{config}` | `{command}` | {m['jobs']} jobs, {m['job_seconds']:,.0f} job-s, "
            f"{_minutes(m['wall_seconds'])} | {m['cpu']['model']}, {m['cpu']['cores']} cores "
            f"({m['cpu']['bf16_peak_gflops']:g} GFLOP/s) | `{m['commit'][:10]}`, {m['date'][:10]} |"
        )
    return "\n".join(lines) + "\n"


def readme_with_tiers(readme: str, root=None) -> str:
    """``readme`` with the block between the markers replaced by :func:`tiers_table`."""
    head, rest = readme.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{tiers_table(root)}{README_END}{tail}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["publish", "verify", "readme"])
    parser.add_argument("tier", nargs="?", help="publish, verify: the tier")
    parser.add_argument("--workdir", default=".", help="the tier's working directory (publish)")
    args = parser.parse_args(argv)
    try:
        if args.action == "readme":  # the README's table of tiers, from the manifests
            readme = Path(__file__).resolve().parents[2] / "README.md"
            readme.write_text(readme_with_tiers(readme.read_text()))
            return
        if args.action == "publish":
            dest = publish(args.tier, args.workdir)
            m = verify(dest)
            print(f"{dest}: {len(m['files'])} files, {m['jobs']} jobs, {m['wall_seconds']} s at {m['commit'][:10]}")
        else:
            m = verify(Path(paths.PUBLISHED) / args.tier)
            print(f"{paths.PUBLISHED}/{args.tier}: {len(m['files'])} files as its manifest lists")
    except (PublishedError, BadSummary) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
