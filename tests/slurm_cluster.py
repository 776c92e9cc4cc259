"""A one-node SLURM cluster on this machine (munged, slurmctld, slurmd as root, no systemd, no
accounting daemon) for the tests that drive the workflow through profiles/slurm with the local
overrides of profiles/slurm-test (tests/e2e/test_slurm_cluster.py, tests/e2e/test_rehearsal.py).

Needs root and apt (it installs slurmctld, slurmd, slurm-client and munge when they are missing);
skipped otherwise. The configuration goes to /etc/slurm/slurm.conf (the jobstep executor drops
SLURM_CONF before its nested srun); the daemons are stopped by their pid files, whatever happens.
One cluster at a time on a machine (SLURM's ports, /etc/slurm): a test module that wants one
while another module's runs (another pytest-xdist worker) waits for it to end (CLUSTER_LOCK).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from system_packages import apt_install_or_skip  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROFILES = ["--profile", str(REPO / "profiles" / "slurm"), "--profile", str(REPO / "profiles" / "slurm-test")]
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "dimattn-test-slurm-cluster.lock"


PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol"]
CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# written by tests/slurm_cluster.py; removed when it ends"
PARTITION = "debug"  # profiles/slurm-test's default slurm_partition
PORTS = (6817, 6818)  # slurmctld, slurmd (SLURM's defaults)
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


def slurm(*args, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def cluster_logs(state: Path) -> str:
    return "".join(f"\n== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted((state / "log").glob("*.log")) + [state / "munge" / "munged.log"] if p.exists())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node SLURM cluster on this machine for the module's tests; its state in a scratch
    folder, its configuration at /etc/slurm/slurm.conf while it runs."""
    _install_or_skip()
    with FileLock(str(CLUSTER_LOCK)):
        yield from _cluster(tmp_path_factory)


def _cluster(tmp_path_factory):
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
               (munge / "munged.pid", "munged")]
    roots = [state]
    try:
        def start(*cmd):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout}{out.stderr}{cluster_logs(state)}")

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
            info = slurm("sinfo", "--noheader", "--Node", "--format=%T")
            if info.returncode == 0 and info.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the node did not come up: sinfo says {info.stdout + info.stderr!r}{cluster_logs(state)}")
            time.sleep(0.5)
        yield {"state": state, "host": host, "roots": roots}
    finally:
        if _alive_any(daemons[1:2]):
            jobs = slurm("squeue", "--noheader", "--format=%i").stdout.split()
            if jobs:
                slurm("scancel", *jobs)
                deadline = time.monotonic() + 30
                while slurm("squeue", "--noheader", "--states=RUNNING,PENDING,COMPLETING,CONFIGURING",
                             "--format=%i").stdout.strip() and time.monotonic() < deadline:
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


def rule_of(slurm_log: str) -> str:
    """The rule of a job, from its SLURM log path (.snakemake/slurm_logs/rule_<name>/[<wildcards>/]<id>.log)."""
    return next((part.removeprefix("rule_") for part in Path(slurm_log).parts if part.startswith("rule_")), "?")


def states(job_ids: list[str]) -> dict[str, str]:
    out = slurm("squeue", "--noheader", "--states=all", "--format=%i|%T", "--jobs=" + ",".join(job_ids))
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)
