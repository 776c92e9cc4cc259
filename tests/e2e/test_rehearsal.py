"""The dress rehearsal (configs/rehearsal.yaml over configs/paper.yaml): the paper's DAG, every
rule and every table and figure, at a size two CPUs run, against a local Hub (dimattn.testing.tiny_hub,
served by dimattn.testing.hub_server) that only the login-node rules may reach.

The environment is a user's: online, HF_ENDPOINT at the local Hub, a fresh HF_HOME. The workflow
puts every compute job offline (dimattn.workflow.resources.go_offline); the Hub logs the command line of
each process that asks it something, so the test sees that only the download rules' scripts did.

Phases: (1) the local executor makes the token files and the prefetch; (2) one job of each
resource family goes through profiles/slurm on the one-node test cluster (tests/slurm_cluster.py):
a two-process pretraining (torchrun), a capture, a fit, a scoring (perplexity) and a latency job,
with the captures they need; (3) the local executor runs the rest, in the same environment;
(4) a dry run schedules nothing. Phase 2 needs root and apt, and is skipped where there are none.

Cost: the run is 85 jobs (the paper's 5,299), about 1,600 job-seconds on this 2-core machine
(nice'd, beside other test suites: load 4-8), half of it the 11 score_projected jobs (lm-eval's
task index, MMLU's 57 subtasks, RULER's 500 generated samples a task). Measured 2026-12-02 under
that load: 21 min in all (the downloads and tokens 3 min, the SLURM phase 2.5 min, the rest 16
min); quiet, 8 min 45 s (2026-12-04). At about 3 s of imports per job before any work, the 85 jobs
alone are some 250 CPU-seconds: beyond the suite's budget, so the run and the rule-set check (a
paper dry run, about 50 s) run only with DIMATTN_REHEARSAL=1 (``make rehearsal``; marker
``rehearsal``); the planning check (about 13 s) always runs.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import PROFILES, SUBMITTED, cluster, rule_of, states  # noqa: E402, F401 (cluster: a fixture)
from test_workflow import REPO, SNAKEMAKE, workdir  # noqa: E402

sys.path.insert(0, str(REPO))
from dimattn.workflow import paths, resources, sweeps  # noqa: E402  (no torch)
from dimattn.reporting import outputs  # noqa: E402

pytestmark = pytest.mark.workflow

CONFIGS = ["--configfile", "configs/paper.yaml", "configs/rehearsal.yaml"]

# the login-node rules (localrules): the only scripts that may reach the Hub
DOWNLOAD_SCRIPTS = ("prefetch.py", "prepare_documents.py", "train_tokenizer.py")
LATENCY_MODEL = "qwen2.5-7b-instruct"
TWO_PROCESS_RUN = "pythia-160m-dar-w8-d12"
FAMILIES = {"pretrain", "capture_qkv", "fit_projection", "perplexity", "latency"}


def merged(*files) -> dict:
    """config.yaml with ``files`` merged over it, as Snakemake merges --configfile."""
    from snakemake.utils import update_config

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    for f in files:
        update_config(config, yaml.safe_load((REPO / f).read_text()))
    return config


def plan(*files):
    return sweeps.plan(sweeps.validate(merged(*files)))


def report_targets(p) -> list[str]:
    """What the Snakefile's rule all asks (rules/report.smk's REPORT_ASKS)."""
    return outputs.targets([p.runs[r].fields for r in p.reported_runs], bool(p.lm_eval_runs), p.dimpo_studies,
                           longctx=bool(p.longctx_runs))


def job_counts(*configfiles, cwd=REPO) -> dict[str, int]:
    """{rule: jobs} of a dry run (Snakemake's job stats)."""
    out = subprocess.run([*SNAKEMAKE, "-n", "--quiet", "rules", "--configfile", *configfiles], capture_output=True,
                         text=True, cwd=cwd, timeout=600, env={**os.environ, **resources.OFFLINE})
    assert out.returncode == 0, out.stderr[-3000:]
    stats = out.stdout + out.stderr
    table = stats[stats.index("job ") : stats.index("total")]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def test_the_rehearsal_plans_every_output_of_the_paper_and_only_sizes_change():
    paper, rehearsal = plan("configs/paper.yaml"), plan("configs/paper.yaml", "configs/rehearsal.yaml")
    assert report_targets(rehearsal) == report_targets(paper)
    assert rehearsal.dimpo_studies == paper.dimpo_studies
    # the same hub models and datasets, served by the tiny hub under their names
    assert {m["hub"] for m in rehearsal.dimpo["models"]} <= {m["hub"] for m in paper.dimpo["models"]}
    for name in ("pile", "booksum"):
        assert rehearsal.config["datasets"][name]["path"] == paper.config["datasets"][name]["path"]
    assert rehearsal.config["tokenizer"]["hub"] == paper.config["tokenizer"]["hub"]
    assert [t["name"] for t in rehearsal.lm_eval["tasks"]] == [t["name"] for t in paper.lm_eval["tasks"]]
    assert rehearsal.config["device"] == "cpu"


@pytest.mark.rehearsal
@pytest.mark.skipif(os.environ.get("DIMATTN_REHEARSAL") != "1", reason="a paper dry run: set DIMATTN_REHEARSAL=1")
def test_the_rehearsal_has_every_rule_of_the_paper_dag():
    paper = job_counts("configs/paper.yaml")
    rehearsal = job_counts("configs/paper.yaml", "configs/rehearsal.yaml")
    assert set(rehearsal) == set(paper)
    assert sum(rehearsal.values()) <= 100, rehearsal
    print(f"\njobs: paper {sum(paper.values())}, rehearsal {sum(rehearsal.values())}")


# --- the run ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if os.environ.get("DIMATTN_REHEARSAL") != "1":
        pytest.skip("the rehearsal: make rehearsal, or DIMATTN_REHEARSAL=1 (about 9 min on 2 cores)")
    from dimattn.testing import hub_server, tiny_hub

    root = tiny_hub.build(tmp_path_factory.mktemp("hub"))
    log = root.parent / "requests.jsonl"
    server = hub_server.serve(root, 0, log)
    yield {"root": root, "url": f"http://127.0.0.1:{server.server_port}", "log": log}
    server.shutdown()


def _snakemake(work, env, *args, timeout=2400):  # the whole DAG took 16 min on a loaded machine
    # targets before --configfile, whose list would take them as config files
    out = subprocess.run([*SNAKEMAKE, "--directory", str(work), *args, *CONFIGS], capture_output=True, text=True,
                         cwd=work, env=env, timeout=timeout)
    return out.stdout + out.stderr, out.returncode


def _fail(what, text, work):
    logs = "".join(f"\n== {p}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted((work / "logs").rglob("*.log"))
                   if re.search(r"Error|Traceback", p.read_text(errors="replace")))
    pytest.fail(f"{what} failed:\n{text[-5000:]}\n{logs[-15000:]}")


@pytest.fixture(scope="module")
def rehearsal(hub, tmp_path_factory, request):
    if os.environ.get("DIMATTN_REHEARSAL") != "1":
        pytest.skip("the rehearsal: make rehearsal, or DIMATTN_REHEARSAL=1 (about 9 min on 2 cores)")
    work = workdir(tmp_path_factory.mktemp("rehearsal"))
    user = {k: v for k, v in os.environ.items() if k not in resources.OFFLINE and not k.startswith("DIMATTN_")}
    env = {**user, "HF_ENDPOINT": hub["url"], "HF_HOME": str(work / "hf"), "NLTK_DATA": str(hub["root"] / "nltk_data")}
    p = plan("configs/paper.yaml", "configs/rehearsal.yaml")
    first = [paths.tokens(d, s) for d in ("pile",) for s in paths.SPLITS] + [paths.tokens("booksum", "test"),
             paths.prefetched()]
    slurm_targets = [
        paths.latency(LATENCY_MODEL),
        *(paths.perplexity(TWO_PROCESS_RUN, d) for d in p.perplexity_datasets),
    ]
    t0 = time.perf_counter()
    walls = {}
    text, rc = _snakemake(work, env, "--cores", "2", *first)
    walls["local, first"] = time.perf_counter() - t0
    if rc:
        _fail("the rehearsal's downloads and tokens", text, work)
    slurm = {"submitted": [], "states": {}, "skipped": None}
    try:
        cluster = request.getfixturevalue("cluster")
    except pytest.skip.Exception as e:
        slurm["skipped"] = str(e)
    else:
        cluster["roots"].append(work)
        t1 = time.perf_counter()
        proc = subprocess.Popen([*SNAKEMAKE, "--directory", str(work), *PROFILES, *slurm_targets, *CONFIGS],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
        try:
            text = proc.communicate(timeout=600)[0]
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # Snakemake scancels its jobs
            text = proc.communicate(timeout=60)[0]
        walls["slurm"] = time.perf_counter() - t1
        slurm["submitted"] = SUBMITTED.findall(text)
        slurm["states"] = states([jid for _, jid, _ in slurm["submitted"]]) if slurm["submitted"] else {}
        slurm["text"] = text
        if proc.returncode:
            _fail("the rehearsal's SLURM jobs", text, work)
    t2 = time.perf_counter()
    text, rc = _snakemake(work, env, "--cores", "2")
    walls["local, the rest"] = time.perf_counter() - t2
    if rc:
        _fail("the rehearsal", text, work)
    again, rc = _snakemake(work, env, "-n")
    wall = time.perf_counter() - t0
    print(
        f"\nrehearsal wall time: {wall:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in walls.items())}); "
        f"SLURM jobs: {', '.join(f'{jid} ({rule_of(log)})' for _, jid, log in slurm['submitted']) or slurm['skipped']}"
    )
    return {"work": work, "plan": p, "again": again, "again_rc": rc, "slurm": slurm,
            "requests": [json.loads(line) for line in hub["log"].read_text().splitlines()]}


@pytest.mark.rehearsal
def test_every_table_and_figure_of_the_paper_is_rendered(rehearsal):
    targets = report_targets(plan("configs/paper.yaml"))
    missing = [t for t in targets if not (rehearsal["work"] / t).is_file()]
    assert not missing
    assert any(t.endswith(".tex") for t in targets) and any(t.endswith(".png") for t in targets)


@pytest.mark.rehearsal
def test_a_second_run_schedules_nothing(rehearsal):
    assert rehearsal["again_rc"] == 0
    assert "Nothing to be done" in rehearsal["again"], rehearsal["again"][-3000:]


@pytest.mark.rehearsal
def test_only_the_login_node_rules_reached_the_hub(rehearsal):
    requests = rehearsal["requests"]
    clients = {r["client"] for r in requests}
    assert None not in clients, [r for r in requests if r["client"] is None][:5]
    strays = sorted(c for c in clients if not any(re.search(rf"\.{re.escape(s)}\b", c) for s in DOWNLOAD_SCRIPTS))
    assert not strays
    for script in DOWNLOAD_SCRIPTS:  # each of them did download through the Hub
        assert any(script in c for c in clients), (script, clients)
    # from_pretrained's files only: not Llama's original/ checkpoint
    assert not [r["path"] for r in requests if "/original/" in r["path"]]


@pytest.mark.rehearsal
def test_one_job_of_each_resource_family_went_through_slurm(rehearsal):
    slurm = rehearsal["slurm"]
    if slurm["skipped"]:
        pytest.skip(slurm["skipped"])
    rules = {rule_of(log) for _, _, log in slurm["submitted"]}
    assert FAMILIES <= rules, rules
    assert not set(DOWNLOAD_SCRIPTS) & {f"{r}.py" for r in rules}  # localrules: on the login node
    assert all(state == "COMPLETED" for state in slurm["states"].values()), slurm["states"]
    log = (rehearsal["work"] / paths.log("pretrain", TWO_PROCESS_RUN)).read_text()
    assert re.search(r"torch\.distributed\.run --nproc-per-node=2", log), log[-2000:]
