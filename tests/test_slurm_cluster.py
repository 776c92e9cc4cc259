"""The workflow on a real SLURM cluster: one node on this machine (munged, slurmctld, slurmd as
root, no systemd, no accounting daemon), driven through profiles/slurm with the local overrides of
profiles/slurm-test.

What runs there is the smoke config's recall branch (configs/smoke.yaml with
tests/data/slurm_smoke.yaml over it): generate_recall -> pretrain (two torchrun processes, gloo,
inside the SLURM job) -> recall -> summarize_recall, summarize_trajectory. It is the smallest part
of the smoke DAG that has a data, a training, an evaluation and a reporting rule and needs no
download; the text branch adds the PyPI download and tokenizer training and nothing SLURM-specific.
Mid-run the test scancels the pretraining job: the profile's retries resubmit it, the retry
resumes from results/checkpoints/<run>/, and the outputs are byte-identical to an uninterrupted
run of the same targets on the local executor. About 2.5 minutes on 2 cores (the reference run
about 35 s, the SLURM run about 2 minutes, most of it Snakemake starting in each job and the
plugin's status-check interval).

Needs root and apt (it installs slurmctld, slurmd, slurm-client and munge when they are missing);
skipped otherwise. The configuration goes to /etc/slurm/slurm.conf (the jobstep executor drops
SLURM_CONF before its nested srun); the daemons are stopped by their pid files, whatever happens.
"""

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from system_packages import apt_install_or_skip  # noqa: E402
from test_workflow import REPO, SNAKEMAKE, snakemake, workdir  # noqa: E402

sys.path.insert(0, str(REPO))
from dimattn import paths  # noqa: E402  (no torch)

pytestmark = pytest.mark.workflow

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol"]
CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# written by tests/test_slurm_cluster.py; removed when it ends"
PARTITION = "debug"  # profiles/slurm-test's default slurm_partition
PORTS = (6817, 6818)  # slurmctld, slurmd (SLURM's defaults)

OVERLAY = REPO / "tests" / "data" / "slurm_smoke.yaml"
CONFIG_ARGS = ["--configfile", "configs/smoke.yaml", str(OVERLAY), "--replace-workflow-config"]
RUN = "recall-vanilla"
TARGETS = [paths.summary("recall"), paths.summary("dar_trajectory")]
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+?)\)\.?$", re.M)


# --- the cluster -----------------------------------------------------------------------------


def _missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _install_or_skip() -> None:
    if sys.platform != "linux":
        pytest.skip("a SLURM test cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("a SLURM test cluster needs root (daemons, /etc/slurm/slurm.conf, apt-get)")
    apt_install_or_skip(PACKAGES, _missing_binaries, "SLURM")


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _slurm_conf(state: Path, host: str) -> str:
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    cpus = max(2, os.cpu_count() or 1)  # the pretrain job asks 2; config_overrides lets 1 CPU pass
    return f"""{MARKER}
ClusterName=dimattn-test
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/spool/ctld
SlurmdSpoolDir={state}/spool/d
SlurmctldPidFile={state}/run/slurmctld.pid
SlurmdPidFile={state}/run/slurmd.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd.log
SlurmdParameters=config_overrides
# no systemd, no cgroups
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/builtin
ReturnToService=2
# squeue keeps finished jobs this long: the plugin's status checks (squeue, no sacct) see them
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={max(1024, total_mb - 2048)} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _alive(pid: int, name: str) -> bool:
    """Whether pid is still that daemon (not a zombie, not a recycled pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z" and name in stat.partition("(")[2].rpartition(")")[0]
    except (OSError, IndexError):
        return False


def _stop(pid_file: Path, name: str, timeout: float = 15) -> None:
    """SIGTERM the daemon of this pid file (if it is still that daemon), SIGKILL after timeout."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _alive(pid, name):
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while _alive(pid, name) and time.monotonic() < deadline:
            time.sleep(0.2)


def _kill_strays(roots: list[Path]) -> list[str]:
    """Processes this test started (cwd or command line in its scratch folders) that outlived
    their job, such as torchrun's ranks (each in a session of its own, beyond proctrack/pgid)."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if any(cwd.startswith(str(r)) or str(r) in cmdline for r in roots):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(f"{proc.name}: {cmdline[:200]}")
            except OSError:
                pass
    return killed


def _slurm(*args, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _cluster_logs(state: Path) -> str:
    return "".join(f"\n== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted((state / "log").glob("*.log")) + [state / "munge" / "munged.log"] if p.exists())  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node SLURM cluster on this machine for the module's tests; its state in a scratch
    folder, its configuration at /etc/slurm/slurm.conf while it runs."""
    _install_or_skip()
    if CONF.exists() and MARKER not in CONF.read_text(errors="replace"):
        pytest.skip(f"{CONF} exists and is not this test's: not overwriting a real cluster's configuration")
    if busy := [p for p in PORTS if _port_in_use(p)]:
        pytest.skip(f"ports {busy} are in use: another SLURM runs on this machine")
    state = tmp_path_factory.mktemp("slurm")
    for d in ("munge", "log", "spool/ctld", "spool/d", "run"):
        (state / d).mkdir(parents=True)
    (state / "munge").chmod(0o700)
    host = socket.gethostname().split(".")[0]
    munge = state / "munge"
    daemons = [(state / "run" / "slurmd.pid", "slurmd"), (state / "run" / "slurmctld.pid", "slurmctld"),
               (munge / "munged.pid", "munged")]  # fmt: skip
    roots = [state]
    try:
        def start(*cmd):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout}{out.stderr}{_cluster_logs(state)}")

        start("mungekey", "--create", "--force", f"--keyfile={munge}/munge.key")
        (munge / "munge.key").chmod(0o400)
        start("munged", "--force", f"--key-file={munge}/munge.key", f"--socket={munge}/munge.socket",
              f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
        CONF.parent.mkdir(parents=True, exist_ok=True)
        CONF.write_text(_slurm_conf(state, host))
        start("slurmctld", "-i")
        start("slurmd")
        deadline = time.monotonic() + 60
        while True:
            info = _slurm("sinfo", "--noheader", "--Node", "--format=%T")
            if info.returncode == 0 and info.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the node did not come up: sinfo says {info.stdout + info.stderr!r}{_cluster_logs(state)}")
            time.sleep(0.5)
        yield {"state": state, "host": host, "roots": roots}
    finally:
        if _alive_any(daemons[1:2]):
            jobs = _slurm("squeue", "--noheader", "--format=%i").stdout.split()
            if jobs:
                _slurm("scancel", *jobs)
                deadline = time.monotonic() + 30
                while _slurm("squeue", "--noheader", "--states=RUNNING,PENDING,COMPLETING,CONFIGURING",
                             "--format=%i").stdout.strip() and time.monotonic() < deadline:  # fmt: skip
                    time.sleep(0.5)
        for pid_file, name in daemons:
            _stop(pid_file, name)
        strays = _kill_strays(roots)
        if CONF.exists() and MARKER in CONF.read_text(errors="replace"):
            CONF.unlink()
        if strays:
            print("killed processes left behind:", *strays, sep="\n  ")


def _alive_any(daemons) -> bool:
    for pid_file, name in daemons:
        try:
            if _alive(int(pid_file.read_text().split()[0]), name):
                return True
        except (OSError, ValueError, IndexError):
            pass
    return False


# --- the runs -------------------------------------------------------------------------------


def _checksums(work: Path) -> dict[str, str]:
    """sha256 of the key outputs: the model's weights and metrics, the recall probe, the summaries."""
    files = [Path(paths.model(RUN)) / "model.safetensors", Path(paths.model(RUN)) / "metrics.csv",
             Path(paths.recall(RUN, "recall")), *(Path(t) for t in TARGETS)]  # fmt: skip
    return {str(f): hashlib.sha256((work / f).read_bytes()).hexdigest() for f in files}


def _resumed_from(log: str) -> int | None:
    """The step tqdm's first render shows: where training started (0 unless resumed)."""
    m = re.search(rf"{re.escape(RUN)}:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", log)
    return int(m.group(1)) if m else None


def _rule_of(slurm_log: str) -> str:
    """The rule of a job, from its SLURM log path (.snakemake/slurm_logs/rule_<name>/[<wildcards>/]<id>.log)."""
    return next((part.removeprefix("rule_") for part in Path(slurm_log).parts if part.startswith("rule_")), "?")


def _states(job_ids: list[str]) -> dict[str, str]:
    out = _slurm("squeue", "--noheader", "--states=all", "--format=%i|%T", "--jobs=" + ",".join(job_ids))
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same targets, uninterrupted, on the local executor."""
    work = workdir(tmp_path_factory.mktemp("reference"))
    out = snakemake("--cores", "2", *CONFIG_ARGS, *TARGETS, cwd=work, timeout=600)
    if out.returncode != 0:
        logs = "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"reference run failed:\n{out.stderr[-5000:]}\n{logs[-10000:]}")
    return work


@pytest.fixture(scope="module")
def slurm_run(cluster, tmp_path_factory, reference):
    """The targets through SLURM, the pretraining job scancelled once it has a checkpoint."""
    work = workdir(tmp_path_factory.mktemp("slurm-run"))
    cluster["roots"].append(work)
    checkpoint = work / paths.checkpoints(RUN) / "checkpoint.pt"
    output = work / "snakemake.out"
    profiles = ["--profile", str(REPO / "profiles" / "slurm"), "--profile", str(REPO / "profiles" / "slurm-test")]
    cmd = [*SNAKEMAKE, "--directory", str(work), *profiles, *CONFIG_ARGS, *TARGETS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cancelled = None
    t0 = time.perf_counter()
    with open(output, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > 900:
                    proc.send_signal(signal.SIGINT)  # Snakemake scancels its jobs
                    proc.wait(timeout=60)
                    break
                if cancelled is None and checkpoint.exists():
                    pretrain = [jid for _, jid, log in SUBMITTED.findall(output.read_text()) if _rule_of(log) == "pretrain"]
                    if pretrain:
                        _slurm("scancel", pretrain[-1])
                        cancelled = pretrain[-1]
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.perf_counter() - t0
    text = output.read_text()
    submitted = SUBMITTED.findall(text)
    job_ids = [jid for _, jid, _ in submitted]
    states = _states(job_ids) if job_ids else {}
    pretrain_log = work / paths.log("pretrain", RUN)
    resumed = _resumed_from(pretrain_log.read_text()) if pretrain_log.exists() else None
    print(f"\nSLURM run wall time: {wall:.0f} s; SLURM job ids: "
          + ", ".join(f"{jid} ({_rule_of(log)}: {states.get(jid, '?')})"
                      for _, jid, log in submitted)
          + f"; scancelled: {cancelled}; the retry resumed at step {resumed}")  # fmt: skip
    if proc.returncode != 0:
        slurm_logs = "".join(f"\n== {p}\n{p.read_text(errors='replace')[-2000:]}"
                             for p in sorted((work / ".snakemake" / "slurm_logs").rglob("*.log")))  # fmt: skip
        logs = "".join(f"\n== {p}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"SLURM run failed ({proc.returncode}):\n{text[-6000:]}\n{logs[-6000:]}\n{slurm_logs[-6000:]}"
                    f"{_cluster_logs(cluster['state'])}")
    return {"work": work, "text": text, "submitted": submitted, "states": states, "cancelled": cancelled,
            "resumed": resumed, "wall": wall}  # fmt: skip


# --- the tests ------------------------------------------------------------------------------


def test_profile_inherits_the_real_one_and_turns_conda_off():
    import yaml

    real = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    test = yaml.safe_load((REPO / "profiles/slurm-test/config.v8+.yaml").read_text())
    assert real["executor"] == "slurm" and real["retries"] >= 1 and real["rerun-incomplete"]
    assert not {"executor", "retries", "rerun-incomplete"} & set(test)  # inherited, not restated
    assert real["software-deployment-method"] == "conda" and test["software-deployment-method"] == "env-modules"
    # env-modules is a no-op only while no rule names an environment module
    rules = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    assert not [p.name for p in rules if re.search(r"^\s*envmodules\s*:", p.read_text(), re.M)]


def test_remote_jobs_plan_the_same_recall_branch():
    """Snakemake 9.27 does not pass --replace-workflow-config on to remote jobs (spawn_jobs.py
    passes --configfiles alone), so each SLURM job re-plans with config.yaml extended by the
    config files, not replaced. The byte-identical comparison holds only while that leaks
    nothing into the recall branch: the run's spec, its dataset and the recall evaluation."""
    import copy

    import yaml
    from snakemake.utils import update_config

    from dimattn import sweeps

    smoke, overlay = (yaml.safe_load(p.read_text()) for p in (REPO / "configs/smoke.yaml", OVERLAY))
    replaced = copy.deepcopy(smoke)
    update_config(replaced, overlay)
    extended = yaml.safe_load((REPO / "config.yaml").read_text())
    update_config(extended, smoke)
    update_config(extended, overlay)
    local, remote = (sweeps.plan(sweeps.validate(c)) for c in (replaced, extended))
    assert list(local.runs) == [RUN]
    a, b = local.runs[RUN], remote.runs[RUN]
    assert (a.model, a.training, a.resources, a.dataset) == (b.model, b.training, b.resources, b.dataset)
    assert local.config["datasets"][a.dataset] == remote.config["datasets"][b.dataset]
    assert local.config["evaluation"]["recall"] == remote.config["evaluation"]["recall"]


def test_jobs_ran_on_the_cluster(slurm_run):
    """Every rule of the recall branch went through sbatch and completed; pretrain ran its two
    processes with torchrun inside the SLURM job."""
    rules = [_rule_of(log) for _, _, log in slurm_run["submitted"]]
    assert set(rules) == {"generate_recall", "pretrain", "recall", "summarize_recall", "summarize_trajectory"}, rules
    done = [jid for _, jid, _ in slurm_run["submitted"] if jid != slurm_run["cancelled"]]
    assert all(slurm_run["states"].get(jid) == "COMPLETED" for jid in done), slurm_run["states"]
    log = (slurm_run["work"] / paths.log("pretrain", RUN)).read_text()
    assert re.search(r"launching: .*torch\.distributed\.run --nproc-per-node=2 --standalone -m dimattn\.training", log), log[-2000:]


def test_scancelled_pretraining_resumes_from_its_checkpoint(slurm_run):
    cancelled = slurm_run["cancelled"]
    assert cancelled, "no pretraining job was seen running with a checkpoint"
    pretrain = [jid for _, jid, log in slurm_run["submitted"] if _rule_of(log) == "pretrain"]
    assert len(pretrain) == 2 and pretrain[0] == cancelled, pretrain  # the job, then the profile's retry
    assert slurm_run["states"].get(cancelled) == "CANCELLED", slurm_run["states"]
    assert re.search(rf"SLURM-job '{cancelled}' failed, SLURM status is: 'CANCELLED'", slurm_run["text"])
    # the retry's log (the rule's log is rewritten each attempt) starts at a checkpoint mid-run
    step = slurm_run["resumed"]
    assert step is not None and 0 < step < 400 and step % 20 == 0, step  # tests/data/slurm_smoke.yaml


def test_outputs_are_those_of_an_uninterrupted_run(slurm_run, reference):
    assert _resumed_from((reference / paths.log("pretrain", RUN)).read_text()) == 0
    assert _checksums(slurm_run["work"]) == _checksums(reference)
