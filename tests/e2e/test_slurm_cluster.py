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
run of the same targets on the local executor. About 2 minutes on 2 cores: the SLURM run, most of
it Snakemake starting in each job and the plugin's status-check interval, with the reference run
(about 35 s) beside it. The cluster: tests/slurm_cluster.py.
"""

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import PROFILES, SUBMITTED, cluster, cluster_logs, rule_of, slurm, states  # noqa: E402, F401
from test_workflow import REPO, SNAKEMAKE, snakemake, workdir  # noqa: E402

sys.path.insert(0, str(REPO))
from dimattn.workflow import paths  # noqa: E402  (no torch)

pytestmark = pytest.mark.workflow

OVERLAY = REPO / "tests" / "data" / "slurm_smoke.yaml"
CONFIG_ARGS = ["--configfile", "configs/smoke.yaml", str(OVERLAY), "--replace-workflow-config"]
RUN = "recall-vanilla"
TARGETS = [paths.summary("recall"), paths.summary("dar_trajectory")]


def _checksums(work: Path) -> dict[str, str]:
    """sha256 of the key outputs: the model's weights and metrics, the recall probe, the summaries."""
    files = [Path(paths.model(RUN)) / "model.safetensors", Path(paths.model(RUN)) / "metrics.csv",
             Path(paths.recall(RUN, "recall")), *(Path(t) for t in TARGETS)]
    return {str(f): hashlib.sha256((work / f).read_bytes()).hexdigest() for f in files}


def _resumed_from(log: str) -> int | None:
    """The step tqdm's first render shows: where training started (0 unless resumed)."""
    m = re.search(rf"{re.escape(RUN)}:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", log)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The same targets, uninterrupted, on the local executor, started in the background: it runs
    while the SLURM run mostly waits on the cluster (sbatch, the plugin's status checks)."""
    work = workdir(tmp_path_factory.mktemp("reference"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(work / "snakemake.out", "w") as sink:
        proc = subprocess.Popen([*SNAKEMAKE, "--directory", str(work), "--cores", "2", *CONFIG_ARGS, *TARGETS],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=work)
    yield proc, work
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference(reference_run):
    proc, work = reference_run
    try:
        rc = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        logs = "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"reference run failed ({rc}):\n{(work / 'snakemake.out').read_text()[-5000:]}\n{logs[-10000:]}")
    return work


@pytest.fixture(scope="module")
def slurm_run(reference_run, cluster, tmp_path_factory):  # the reference starts first, beside apt and the daemons
    """The targets through SLURM, the pretraining job scancelled once it has a checkpoint."""
    work = workdir(tmp_path_factory.mktemp("slurm-run"))
    cluster["roots"].append(work)
    checkpoint = work / paths.checkpoints(RUN) / "checkpoint.pt"
    output = work / "snakemake.out"
    cmd = [*SNAKEMAKE, "--directory", str(work), *PROFILES, *CONFIG_ARGS, *TARGETS]
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
                    pretrain = [
                        jid for _, jid, log in SUBMITTED.findall(output.read_text()) if rule_of(log) == "pretrain"
                    ]
                    if pretrain:
                        slurm("scancel", pretrain[-1])
                        cancelled = pretrain[-1]
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.perf_counter() - t0
    text = output.read_text()
    submitted = SUBMITTED.findall(text)
    job_ids = [jid for _, jid, _ in submitted]
    job_states = states(job_ids) if job_ids else {}
    pretrain_log = work / paths.log("pretrain", RUN)
    resumed = _resumed_from(pretrain_log.read_text()) if pretrain_log.exists() else None
    print(f"\nSLURM run wall time: {wall:.0f} s; SLURM job ids: "
          + ", ".join(f"{jid} ({rule_of(log)}: {job_states.get(jid, '?')})"
                      for _, jid, log in submitted)
          + f"; scancelled: {cancelled}; the retry resumed at step {resumed}")
    if proc.returncode != 0:
        slurm_logs = "".join(f"\n== {p}\n{p.read_text(errors='replace')[-2000:]}"
                             for p in sorted((work / ".snakemake" / "slurm_logs").rglob("*.log")))
        logs = "".join(
            f"\n== {p}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((work / "logs").rglob("*.log"))
        )
        pytest.fail(f"SLURM run failed ({proc.returncode}):\n{text[-6000:]}\n{logs[-6000:]}\n{slurm_logs[-6000:]}"
                    f"{cluster_logs(cluster['state'])}")
    return {"work": work, "text": text, "submitted": submitted, "states": job_states, "cancelled": cancelled,
            "resumed": resumed, "wall": wall}


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

    from dimattn.workflow import sweeps

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
    rules = [rule_of(log) for _, _, log in slurm_run["submitted"]]
    assert set(rules) == {"generate_recall", "pretrain", "recall", "summarize_recall", "summarize_trajectory"}, rules
    done = [jid for _, jid, _ in slurm_run["submitted"] if jid != slurm_run["cancelled"]]
    assert all(slurm_run["states"].get(jid) == "COMPLETED" for jid in done), slurm_run["states"]
    log = (slurm_run["work"] / paths.log("pretrain", RUN)).read_text()
    assert re.search(
        r"launching: .*torch\.distributed\.run --nproc-per-node=2 --standalone -m dimattn\.pretraining\.training", log
    ), log[-2000:]


def test_scancelled_pretraining_resumes_from_its_checkpoint(slurm_run):
    cancelled = slurm_run["cancelled"]
    assert cancelled, "no pretraining job was seen running with a checkpoint"
    pretrain = [jid for _, jid, log in slurm_run["submitted"] if rule_of(log) == "pretrain"]
    assert len(pretrain) == 2 and pretrain[0] == cancelled, pretrain  # the job, then the profile's retry
    assert slurm_run["states"].get(cancelled) == "CANCELLED", slurm_run["states"]
    assert re.search(rf"SLURM-job '{cancelled}' failed, SLURM status is: 'CANCELLED'", slurm_run["text"])
    # the retry's log (the rule's log is rewritten each attempt) starts at a checkpoint mid-run
    step = slurm_run["resumed"]
    assert step is not None and 0 < step < 400 and step % 20 == 0, step  # tests/data/slurm_smoke.yaml


def test_outputs_are_those_of_an_uninterrupted_run(slurm_run, reference):
    assert _resumed_from((reference / paths.log("pretrain", RUN)).read_text()) == 0
    assert _checksums(slurm_run["work"]) == _checksums(reference)
