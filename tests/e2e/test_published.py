"""Tiers never mix (dimattn.workflow.tiers), a summary is read only whole (summaries.csv_rows), and a
published tier renders only as its manifest lists it (dimattn.reporting.published)."""

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from reporting_fixtures import REFERENCE, write_full_summaries

from dimattn.workflow import paths, tiers
from dimattn.reporting import outputs, published, summaries

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- whole CSVs only


@pytest.fixture(scope="module")
def summary_dir(tmp_path_factory):
    return write_full_summaries(tmp_path_factory.mktemp("summaries"))


def damaged(src: Path, dest: Path, how: str) -> Path:
    data = src.read_bytes()
    dest.write_bytes({"empty": b"", "binary": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe",
                      "cut": data[: len(data) - len(data.splitlines()[-1]) // 2 - 1],
                      "short_row": data + b"1,2\n"}[how])
    return dest


@pytest.mark.parametrize("how, says", [("empty", "empty"), ("binary", "not a CSV"), ("cut", "cut mid-row"),
                                       ("short_row", "fields")])
def test_a_damaged_summary_is_refused_naming_the_file(summary_dir, tmp_path, how, says):
    src = summary_dir / "dar_perplexity.csv"
    rows = summaries.csv_rows(src)
    assert rows == len(summaries.read(src, "dar_perplexity")) > 0
    bad = damaged(src, tmp_path / "dar_perplexity.csv", how)
    with pytest.raises(summaries.BadSummary, match=says) as e:
        summaries.read(bad, "dar_perplexity")
    assert str(bad) in str(e.value)


def test_figures_refuse_a_summary_cut_mid_row(summary_dir, tmp_path):
    """As a new user found: a dar_perplexity.csv cut mid-row rendered without a word."""
    copy = tmp_path / "summary"
    shutil.copytree(summary_dir, copy)
    damaged(summary_dir / "dar_perplexity.csv", copy / "dar_perplexity.csv", "cut")
    with pytest.raises(summaries.BadSummary, match="dar_perplexity.csv: cut mid-row"):
        outputs.render_existing(copy, REFERENCE, tmp_path / "results")
    assert not (tmp_path / "results" / "tables").exists() or not any((tmp_path / "results" / "tables").iterdir())


# ----------------------------------------------------------------------------- one tier a directory


def test_another_tier_is_refused_where_one_ran(tmp_path):
    stamp = tmp_path / "results" / "tier.json"
    tiers.check("cpu-full", stamp)  # nothing ran here yet
    config = {"tier": "default", "device": "cpu"}
    tiers.start(config, stamp, now=100.0)
    tiers.check("default", stamp)
    with pytest.raises(tiers.TierError, match="tier 'default', the config asks for tier 'cpu-full'"):
        tiers.check("cpu-full", stamp)


def test_the_run_record_sums_invocations_of_one_config(tmp_path):
    stamp = tmp_path / "tier.json"
    config = {"tier": "default", "device": "cpu", "figures_from": "summary"}
    tiers.start(config, stamp, now=100.0)
    tiers.finish(False, stamp, now=130.0)
    assert not tiers.complete(tiers.read(stamp))
    # a rerun of the same config (figures_from aside) continues the record
    record = tiers.start({**config, "figures_from": "published"}, stamp, now=200.0)
    assert len(record["invocations"]) == 2
    tiers.finish(True, stamp, now=260.0)
    record = tiers.read(stamp)
    assert tiers.complete(record) and tiers.wall_seconds(record) == 90.0
    # another config of the tier starts a new record
    record = tiers.start({**config, "device": "cuda"}, stamp, now=300.0)
    assert len(record["invocations"]) == 1 and record["config_sha256"] != tiers.config_sha256(config)


def test_a_killed_invocation_is_closed_from_its_log(tmp_path):
    """A run killed with no onerror (SIGKILL, a lost session) then resumed: the killed invocation
    ends at its Snakemake log's last write, so the record counts its hours."""
    import os
    from datetime import datetime

    stamp, logs = tmp_path / "tier.json", tmp_path / ".snakemake" / "log"
    logs.mkdir(parents=True)

    def log_opened(at: float, last_write: float) -> str:
        log = logs / f"{datetime.fromtimestamp(at).strftime('%Y-%m-%dT%H%M%S.%f')}.snakemake.log"
        log.write_text("jobs\n")
        os.utime(log, (last_write, last_write))
        return str(log)

    config = {"tier": "cpu-full"}
    first = log_opened(1000.0, 1000.0)
    tiers.start(config, stamp, now=1005.0, logs=[first])
    log_opened(1500.0, 1600.0)  # a `snakemake figures` between the two: opened after the first started
    os.utime(first, (4605.0, 4605.0))  # its jobs wrote the log until the kill, an hour later
    resumed = log_opened(9000.0, 9000.0)
    record = tiers.start(config, stamp, now=9002.0, logs=[resumed])
    killed = record["invocations"][0]
    assert killed == {"started": 1005.0, "finished": 4605.0, "ok": False, "closed_from_log": True}
    tiers.finish(True, stamp, now=9102.0)
    assert tiers.wall_seconds(tiers.read(stamp)) == 3600.0 + 100.0
    # a log that ends before the invocation began is an earlier run's: the invocation stays open
    assert tiers.killed_at(4700.0, logs) is None
    # with no log to read the killed invocation stays open, and uncounted
    other = tmp_path / "other.json"
    tiers.start(config, other, now=20000.0, logs=[])
    record = tiers.start(config, other, now=20100.0, logs=[])
    assert "finished" not in record["invocations"][0]


def test_a_broken_stamp_is_named(tmp_path):
    stamp = tmp_path / "tier.json"
    stamp.write_text("{not json")
    with pytest.raises(tiers.TierError, match="tier.json is not a tier record"):
        tiers.check("default", stamp)


# ----------------------------------------------------------------------------- publishing


@pytest.fixture(scope="module")
def finished(summary_dir, tmp_path_factory) -> Path:
    """A working directory as a complete run leaves it: summaries, the tables they render,
    benchmark files and the tier record."""
    work = tmp_path_factory.mktemp("finished") / "work"
    shutil.copytree(summary_dir, work / paths.SUMMARY)
    (work / "reference").symlink_to(REFERENCE)
    outputs.render_existing(work / paths.SUMMARY, REFERENCE, work / paths.RESULTS)
    tiers.start({"tier": "smoke"}, work / paths.TIER_STAMP)
    for rule, s in (("pretrain", 12.5), ("score_text", 3.0)):
        bench = work / paths.BENCH / rule / "a.tsv"
        bench.parent.mkdir(parents=True)
        bench.write_text(f"s\th:m:s\n{s}\t0:00:{int(s)}\n")
    tiers.finish(True, work / paths.TIER_STAMP)
    return work


def finished_workdir(root: Path, finished: Path) -> Path:
    return Path(shutil.copytree(finished, root / "work", symlinks=True))


def test_publish_then_verify_and_refuse_damage(finished, summary_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(published, "_bf16_peak", lambda: 123.4)  # the host line's own test measures it
    work = finished_workdir(tmp_path, finished)
    dest = published.publish("smoke", work, tmp_path / "published")
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["jobs"] == 2 and manifest["job_seconds"] == 15.5
    assert manifest["cpu"]["bf16_peak_gflops"] == 123.4 and manifest["config_sha256"] == tiers.config_sha256(
        {"tier": "smoke"}
    )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert manifest["commit"] == head
    tables = sorted(p.name for p in (work / paths.TABLES).glob("*.tex"))
    assert tables and sorted(Path(f).name for f in manifest["files"] if f.startswith("tables/")) == tables
    assert manifest["files"]["summary/dar_perplexity.csv"]["rows"] == summaries.csv_rows(
        summary_dir / "dar_perplexity.csv"
    )
    assert published.verify(dest) == manifest
    # rendering from the published summaries gives the run's tables byte for byte
    again = outputs.render_existing(dest / "summary", REFERENCE, tmp_path / "again")
    for table in (p for p in again if p.suffix == ".tex"):
        assert table.read_bytes() == (dest / "tables" / table.name).read_bytes()
    # damage: a changed value, a cut file, an unlisted summary, a missing file
    target = dest / "summary" / "dar_perplexity.csv"
    original = target.read_bytes()
    target.write_bytes(original.replace(b"6", b"7", 1))
    with pytest.raises(published.PublishedError, match="dar_perplexity.csv: its sha256"):
        published.verify(dest)
    target.write_bytes(original[:-7])
    with pytest.raises(published.PublishedError, match="dar_perplexity.csv: cut mid-row"):
        published.verify(dest)
    target.write_bytes(original)
    (dest / "summary" / "stray.csv").write_text("a\n1\n")
    with pytest.raises(published.PublishedError, match="summary/stray.csv not in"):
        published.verify(dest)
    (dest / "summary" / "stray.csv").unlink()
    target.unlink()
    with pytest.raises(published.PublishedError, match="dar_perplexity.csv: no such summary"):
        published.verify(dest)


def test_an_unfinished_or_other_tier_run_is_not_published(finished, tmp_path):
    work = finished_workdir(tmp_path, finished)
    with pytest.raises(published.PublishedError, match="no run of tier 'default'"):
        published.publish("default", work, tmp_path / "published")
    tiers.start({"tier": "smoke"}, work / paths.TIER_STAMP)  # a rerun that has not finished
    with pytest.raises(published.PublishedError, match="did not finish"):
        published.publish("smoke", work, tmp_path / "published")
    assert not (tmp_path / "published").exists()


def test_stale_tables_are_not_published(finished, tmp_path, monkeypatch):
    monkeypatch.setattr(published, "_bf16_peak", lambda: 1.0)
    work = finished_workdir(tmp_path, finished)
    table = next((work / paths.TABLES).glob("*.tex"))
    table.write_text(table.read_text() + "% edited\n")
    with pytest.raises(published.PublishedError, match=f"{table.name}: not what the summaries render"):
        published.publish("smoke", work, tmp_path / "published")


@pytest.mark.parametrize("tier", sorted(p.name for p in (REPO / paths.PUBLISHED).glob("*") if p.is_dir()))
def test_each_shipped_tier_renders_its_tables_byte_identical(tier, tmp_path):
    """What `make figures TIER=...` draws from: the shipped files as their manifest lists them,
    and the tables they render are the run's, drawn in two processes as make figures draws them."""
    dest = REPO / paths.published(tier)
    manifest = published.verify(dest)
    assert {"commit", "date", "cpu", "jobs", "job_seconds", "wall_seconds", "config_sha256"} <= set(manifest)
    written = outputs.render_existing(dest / "summary", REFERENCE, tmp_path, processes=2)
    tables = [p for p in written if p.suffix == ".tex"]
    assert sorted(p.name for p in tables) == sorted(Path(f).name for f in manifest["files"] if f.startswith("tables/"))
    for table in tables:
        assert table.read_bytes() == (dest / "tables" / table.name).read_bytes(), table.name


@pytest.mark.parametrize("goal, tier, targets, configfiles", [
    ("figures", "default", ["figures"], []),
    ("figures", "cpu-full", ["figures"], ["configs/cpu-full.yaml"]),
    ("full", "default", [], ["configs/cpu-full.yaml"]),
    ("run", "default", [], []),
])
def test_make_passes_snakemake_its_target_and_tier(goal, tier, targets, configfiles):
    """The Makefile's Snakemake command lines as Snakemake parses them: --configfile takes every word
    after it, so a target written after it was read as a config file ('figures' for TIER=cpu-full)."""
    from snakemake.cli import get_argument_parser

    shown = subprocess.run(["make", "-n", goal, f"TIER={tier}"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout
    lines = [line for line in shown.splitlines() if "/snakemake " in line]
    assert len(lines) == 1, shown
    args = get_argument_parser().parse_args(shlex.split(lines[0].split("/snakemake ", 1)[1]))
    assert sorted(args.targets or []) == targets
    assert [str(p) for p in args.configfile or []] == configfiles
