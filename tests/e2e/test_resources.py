"""dimattn.workflow.resources: each job's memory and runtime from its work, retries that grow both up to the
node, a first attempt beyond the node refused at planning naming the key, the estimates against
measured runs, and the SLURM profile's CPUs following the rules' threads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import update_config

from dimattn.workflow import paths, resources, sweeps

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(REPO / "Snakefile")]
RULE_FILES = sorted((REPO / "rules").glob("*.smk"))


def config(*overlays) -> dict:
    """config.yaml with each overlay (a path or a dict) merged over it, as --configfile does."""
    merged = yaml.safe_load((REPO / "config.yaml").read_text())
    for overlay in overlays:
        update_config(merged, yaml.safe_load(overlay.read_text()) if isinstance(overlay, Path) else overlay)
    return merged


def plan(*overlays):
    return sweeps.plan(sweeps.validate(config(*overlays)))


CLUSTER = sweeps.validate(config())["cluster"]


def test_retries_grow_memory_and_runtime_up_to_the_node():
    assert [resources.attempt_scaled(4000, a, 10000) for a in (1, 2, 3)] == [4000, 8000, 10000]
    assert [resources.attempt_scaled(60, a, 100) for a in (1, 2, 3)] == [60, 100, 100]


def test_every_rule_asks_memory_and_runtime_through_the_attempt_scaled_helpers():
    """No rule has a literal or an attempt lambda of its own, which would grow memory only and
    ask past the node (2 x 256 GB a node for the 2-node pretraining)."""
    helpers = r"(scaled\(\d+, \"(mem_mb|runtime)\"\)|(run|capture|fit|dimpo)_resource\(\"(mem_mb|runtime)\"\)|score_resource\(\"\w+\", \"(mem_mb|runtime)\"\))"
    asks = [(f.name, line.strip()) for f in RULE_FILES for line in f.read_text().splitlines()
            if re.match(r"\s+(mem_mb|runtime)=", line)]
    assert len(asks) > 40
    assert [a for a in asks if not re.fullmatch(rf"(mem_mb|runtime)={helpers},", a[1])] == []


def test_the_paper_scales_ask_their_floors_or_more_and_never_past_the_node():
    p = plan(REPO / "configs/paper.yaml")
    first = resources.first_attempts(p)
    for name, run in p.runs.items():
        asks = first["pretrain"][name]
        assert asks["mem_mb"] >= run.resources["mem_mb"] and asks["runtime"] >= run.resources["runtime"]
        for attempt in (1, 2, 3):
            assert resources.attempt_scaled(asks["mem_mb"], attempt, CLUSTER["node_mem_mb"]) <= CLUSTER["node_mem_mb"]


LLAMA_8B = dict(layers=32, heads=32, kv_heads=8, head_dim=128, params=8_030_261_248)  # its config.json
FLOORS = {"mem_mb": 0, "runtime": 0}


def test_a_fit_asks_one_layer_of_its_capture_and_time_that_follows_its_steps():
    """Llama-3.1-8B at the paper's capture (10 + 10 chapters of 4,096 tokens), on a GPU: one
    layer's fp32 q, k, v is 10 * 4096 * (32 + 2 * 8) * 128 * 4 B = 960 MiB, so a fit asks 3 of
    them and a process's overhead, whatever the layer count (the whole capture is 30 GiB)."""
    p = plan(REPO / "configs/paper.yaml")
    cluster, hparams = p.config["cluster"], p.dimpo["hparams"]

    def ask(shape=LLAMA_8B, n=10, d_prime=64, hp=hparams, device="cuda"):
        return resources.fit(shape, n, n, 4096, d_prime, hp, FLOORS, device, cluster)

    assert ask()["mem_mb"] == 3 * 960 + cluster["overhead_mb"]["cuda"]
    assert ask(LLAMA_8B | {"layers": 64})["mem_mb"] == ask()["mem_mb"]  # streamed: layers cost time, not memory
    assert ask(n=20)["mem_mb"] - cluster["overhead_mb"]["cuda"] == 2 * 3 * 960
    # batch 1 (the authors'): 32 layers x 10 * 4096 steps of step_ms dominate on a GPU
    steps_min = 32 * 10 * 4096 * cluster["step_ms"]["cuda"] / 1000 / 60
    assert (
        steps_min * cluster["margin"] < ask()["runtime"] < 1.2 * steps_min * cluster["margin"] + cluster["startup_min"]
    )
    assert ask(hp=hparams | {"batch_size": 64})["runtime"] < ask()["runtime"] / 4
    assert ask(device="cpu", d_prime=64)["runtime"] > ask(device="cpu", d_prime=1)["runtime"]  # FLOPs grow with d'
    # a job fits every dimpo.seeds seed in turn: three times the fitting, one start-up
    three = resources.fit(LLAMA_8B, 10, 10, 4096, 64, hparams, FLOORS, "cuda", cluster, seeds=3)
    assert three["mem_mb"] == ask()["mem_mb"]
    assert three["runtime"] - cluster["startup_min"] == pytest.approx(
        3 * (ask()["runtime"] - cluster["startup_min"]), abs=3
    )
    assert resources.fit(None, 10, 10, 4096, 64, hparams, p.dimpo["resources"], "cuda", cluster) == {
        k: p.dimpo["resources"][k] for k in ("mem_mb", "runtime")}  # shape unknown (no prefetch yet): the floor


def test_a_first_attempt_beyond_the_node_is_refused_naming_the_key():
    with pytest.raises(resources.ResourceError, match=r"config key pretraining\.scales\.pythia-1b\.resources\.mem_mb: "
                                                      r".*256000.*cluster\.node_mem_mb=200000"):
        resources.first_attempts(plan(REPO / "configs/paper.yaml", {"cluster": {"node_mem_mb": 200000}}))
    with pytest.raises(resources.ResourceError, match=r"config key dimpo\.resources\.runtime .*node_runtime_min=100"):
        resources.first_attempts(plan({"cluster": {"node_runtime_min": 100}, "dimpo": {"resources": {"runtime": 120}}}))


def test_snakemake_refuses_it_at_planning(tmp_path):
    (tmp_path / "small_node.yaml").write_text(yaml.safe_dump({"cluster": {"node_mem_mb": 1500}}))
    out = subprocess.run([*SNAKEMAKE, "-n", "--configfile", str(tmp_path / "small_node.yaml")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    message = "config key pretraining.scales.tiny.resources.mem_mb: the first attempt asks mem_mb=2000"
    assert message in out.stdout + out.stderr


def test_a_node_smaller_than_a_rule_s_own_ask_is_refused_at_planning(tmp_path):
    small = {"cluster": {"node_mem_mb": 7000}, "dimpo": {"resources": {"mem_mb": 2000}}}
    (tmp_path / "small_node.yaml").write_text(yaml.safe_dump(small))
    out = subprocess.run([*SNAKEMAKE, "-n", "--configfile", str(tmp_path / "small_node.yaml")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    assert "config key cluster.node_mem_mb: the first attempt asks mem_mb=8000" in out.stdout + out.stderr


def test_gpt_neox_parameters_count_pythia():
    # README: 70,426,624 at 70M and 405,334,016 at 410M with vocabulary 50,304 (biases and norms aside).
    assert resources.gpt_neox_parameters(512, 6, 50304) == pytest.approx(70_426_624, rel=1e-3)
    assert resources.gpt_neox_parameters(1024, 24, 50304) == pytest.approx(405_334_016, rel=1e-3)


# Measured: the default run's pretraining jobs (Snakemake benchmark TSVs, max_rss in MB and
# seconds, on 2 cores shared with other jobs, 2026-12-02): tiny-vanilla 43.6 s, 600 MB;
# recall-vanilla 61.3 s, 459 MB.
MEASURED = {"tiny-vanilla": (43.6, 600), "recall-vanilla": (61.3, 459)}


@pytest.mark.parametrize("run", sorted(MEASURED))
def test_pretrain_estimate_covers_the_measured_runs(run):
    p = plan()
    r = p.runs[run]
    floorless = {**r.resources, "mem_mb": 1, "runtime": 1}
    vocab = resources._vocab(p.config) if not r.synthetic else 1000  # the recall corpus: a few hundred tokens
    asks = resources.pretrain(r.model, r.training, floorless, vocab, "cpu", CLUSTER)
    seconds, rss = MEASURED[run]
    assert rss <= asks["mem_mb"] <= 3 * rss
    assert seconds / 60 <= asks["runtime"] <= 20 * seconds / 60  # startup_min dominates a one-minute job


LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct's config.json, the keys read
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}


def fake_hub_cache(root: Path, repo: str, config_json: dict) -> Path:
    """A Hugging Face cache holding only a model's config.json, in the hub's cache layout."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config_json))
    return root


def test_capture_estimate_of_llama_31_8b_from_its_cached_config(tmp_path):
    repo = "meta-llama/Llama-3.1-8B-Instruct"
    assert resources.hub_shape(repo, cache_dir=tmp_path) is None  # not cached: the configured values
    shape = resources.hub_shape(repo, cache_dir=fake_hub_cache(tmp_path, repo, LLAMA_31_8B))
    assert shape["params"] == pytest.approx(8.03e9, rel=0.01)  # Llama-3.1-8B's 8.03B
    floor = {"mem_mb": 64000, "runtime": 240}
    asks = resources.capture(shape, 10, 4096, "float32", floor, "cuda", CLUSTER)
    captured = 32 * 10 * 4096 * (32 + 8 + 8) * 128 * 4  # 30 GiB of fp32 q, k, v
    assert asks["mem_mb"] == -(-(captured + 4 * shape["params"]) // 2**20) + CLUSTER["overhead_mb"]["cuda"]
    assert asks["mem_mb"] > floor["mem_mb"]  # the paper's 64000 was short of the model and its capture
    assert asks["runtime"] == floor["runtime"]  # a few GPU seconds: the floor


LLAMA_8B_SHAPE = LLAMA_8B | {"vocab": 128256, "context": 131072}


def test_scoring_asks_follow_the_tasks_each_width_scores():
    """Llama-3.1-8B downstream at the paper's settings (bf16, harness batch 32, RULER batch 1 at
    4k and 8k): RULER's 13 subtasks x 2 lengths x 500 samples decode one token a step at batch 1,
    each step reading 16 GB of weights (1.29 million steps: over 8 hours with the margin); the
    d' = 4 models score the harness tasks alone."""
    p = plan(REPO / "configs/paper.yaml")
    cluster, down = p.config["cluster"], p.downstream

    def ask(d_prime, device="cuda", tasks=None):
        from dimattn.workflow.settings import downstream_tasks

        tasks = downstream_tasks(down["tasks"], d_prime) if tasks is None else tasks
        return resources.score(LLAMA_8B_SHAPE, 0, tasks, 8, None, [4096, 8192], FLOORS, device, cluster)

    base, harness = ask(0), ask(4)
    ruler = [t for t in down["tasks"] if t.get("d_prime") == [64]]
    assert len(ruler) == 13 and len(down["tasks"]) == 18
    weights = 2 * LLAMA_8B["params"]  # bfloat16
    step_s = weights / (cluster["memory_gbs"]["cuda"] * 1e9) + cluster["step_ms"]["cuda"] / 1000
    generated = sum(resources._task_work(t, 131072, [4096, 8192])[0][3] * 2 * 500 for t in ruler)
    assert generated == 1_288_000  # decoding steps: hours on one GPU
    assert base["runtime"] > cluster["margin"] * generated * step_s / 60 > 8 * 60
    assert harness["runtime"] < base["runtime"] / 5
    # memory: the weights, and the logits of a harness batch of 32 at its longest context (TruthfulQA's)
    logits = 2 * 2 * 32 * 350 * 128256
    assert base["mem_mb"] == -(-(weights + logits) // 2**20) + cluster["overhead_mb"]["cuda"]
    # perplexity alone (no task): our scorer's float32 weights, no logits of a batch
    assert ask(0, tasks=[])["mem_mb"] == -(-4 * LLAMA_8B["params"] // 2**20) + cluster["overhead_mb"]["cuda"]
    # the paper's dimpo.resources (240 minutes) would have killed every base and d' = 64 job
    assert base["runtime"] > p.dimpo["resources"]["runtime"]


def test_a_scoring_job_beyond_the_node_is_refused_naming_its_key(monkeypatch):
    monkeypatch.setattr(resources, "hub_shape", lambda repo, cache_dir=None: LLAMA_8B_SHAPE)
    p = plan(REPO / "configs/paper.yaml")
    node = p.config["cluster"] | {"node_runtime_min": 900}  # above every floor, below RULER's 963 minutes
    with pytest.raises(resources.ResourceError, match=r"config key dimpo\.downstream \(the scoring of "
                                                      r"llama-3\.1-8b-instruct\): .*runtime=963"):
        resources.scoring(p, 50304, "cuda", node)


# Measured: the default run's scoring jobs (benchmark TSVs, 2 cores shared by two jobs,
# 2026-12-01, AMD EPYC): score_text tiny-vanilla 15.4 s, 662 MB; score_projected tiny-vanilla
# base (every task) 12.7 s, 649 MB.
MEASURED_SCORING = {"score_text": (15.4, 662), "score_projected": (12.7, 649)}


@pytest.mark.parametrize("rule", sorted(MEASURED_SCORING))
def test_scoring_estimates_cover_the_measured_jobs(rule):
    p = plan()
    first = resources.first_attempts(p)
    asks = first[rule]["tiny-vanilla"]
    asks = asks(0) if rule == "score_projected" else asks
    seconds, rss = MEASURED_SCORING[rule]
    assert rss <= asks["mem_mb"] and seconds / 60 <= asks["runtime"]
    floorless = {"mem_mb": 1, "runtime": 1}
    run = p.runs["tiny-vanilla"]
    shape = resources.run_shape(run.model, resources._vocab(p.config), run.training["seq_len"])
    tasks = p.lm_eval["tasks"] if rule == "score_text" else p.downstream["tasks"]
    tokens = p.config["evaluation"]["perplexity"]["max_tokens"]
    own = {key: p.lm_eval[key] for key in ("heldout_docs", "next_line_docs")}
    estimate = resources.score(shape, tokens, tasks, 8, None, [], floorless, "cpu", CLUSTER, own)
    assert rss <= estimate["mem_mb"] <= 3 * rss
    assert seconds / 60 <= estimate["runtime"] <= CLUSTER["startup_min"] + 5 * seconds / 60  # startup_min dominates


# The capture estimate against a measured streamed capture: tests/e2e/test_capture.py, which makes
# that measurement (a subprocess of about 10 s) once for both of its checks.


def test_the_slurm_profile_leaves_cpus_to_the_rules_threads():
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    assert "cpus_per_task" not in profile["default-resources"]
    assert "cpus_per_task" not in profile["set-resources"].get("pretrain", {})


def test_a_scale_s_threads_reach_slurm_as_cpus_per_task(tmp_path, tier_dir):
    """Through profiles/slurm (conda left out: none here), --cores only to lift the dry run's cap of 1."""
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    profile.pop("software-deployment-method")
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "config.v8+.yaml").write_text(yaml.safe_dump(profile))
    p = plan(REPO / "configs/paper.yaml")
    # The pretraining jobs alone as targets: planning the whole paper DAG would add a minute.
    targets = [str(paths.model(run)) for run in p.runs]
    out = subprocess.run([*SNAKEMAKE, *targets, "-n", "--cores", "256", "--profile", str(tmp_path / "slurm"),
                          "--directory", str(tier_dir), "--configfile", "configs/paper.yaml"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    job = r"^rule pretrain:\n(?:    .*\n)*?    wildcards: run=(\S+)\n(?:    .*\n)*?    resources: (.*)"
    jobs = re.findall(job, out.stdout + out.stderr, re.M)
    asked = {run: int(re.search(r"cpus_per_task=(\d+)", res).group(1)) for run, res in jobs}
    assert len(asked) == len(p.runs)
    assert asked == {run: p.runs[run].resources["threads"] for run in asked}
    assert asked["pythia-160m-vanilla"] == 32
