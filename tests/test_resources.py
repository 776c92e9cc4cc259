"""dimattn.resources: each job's memory and runtime from its work, retries that grow both up to the
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

from dimattn import paths, resources, sweeps

REPO = Path(__file__).resolve().parents[1]
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
    helpers = r"(scaled\(\d+, \"(mem_mb|runtime)\"\)|(run|capture|dimpo)_resource\(\"(mem_mb|runtime)\"\))"
    asks = [(f.name, line.strip()) for f in RULE_FILES for line in f.read_text().splitlines()
            if re.match(r"\s+(mem_mb|runtime)=", line)]  # fmt: skip
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


def test_a_first_attempt_beyond_the_node_is_refused_naming_the_key():
    with pytest.raises(resources.ResourceError, match=r"config key pretraining\.scales\.pythia-1b\.resources\.mem_mb: "
                                                      r".*256000.*cluster\.node_mem_mb=200000"):  # fmt: skip
        resources.first_attempts(plan(REPO / "configs/paper.yaml", {"cluster": {"node_mem_mb": 200000}}))
    with pytest.raises(resources.ResourceError, match=r"config key dimpo\.resources\.runtime .*node_runtime_min=100"):
        resources.first_attempts(plan({"cluster": {"node_runtime_min": 100}, "dimpo": {"resources": {"runtime": 120}}}))


def test_snakemake_refuses_it_at_planning(tmp_path):
    (tmp_path / "small_node.yaml").write_text(yaml.safe_dump({"cluster": {"node_mem_mb": 1500}}))
    out = subprocess.run([*SNAKEMAKE, "-n", "--configfile", str(tmp_path / "small_node.yaml")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode != 0
    message = "config key pretraining.scales.tiny.resources.mem_mb: the first attempt asks mem_mb=2000"
    assert message in out.stdout + out.stderr


def test_a_node_smaller_than_a_rule_s_own_ask_is_refused_at_planning(tmp_path):
    small = {"cluster": {"node_mem_mb": 7000}, "dimpo": {"resources": {"mem_mb": 2000}}}
    (tmp_path / "small_node.yaml").write_text(yaml.safe_dump(small))
    out = subprocess.run([*SNAKEMAKE, "-n", "--configfile", str(tmp_path / "small_node.yaml")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)  # fmt: skip
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
}  # fmt: skip


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


# The capture estimate against a measured streamed capture: tests/test_capture.py, which makes
# that measurement (a subprocess of about 10 s) once for both of its checks.


def test_the_slurm_profile_leaves_cpus_to_the_rules_threads():
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    assert "cpus_per_task" not in profile["default-resources"]
    assert "cpus_per_task" not in profile["set-resources"].get("pretrain", {})


def test_a_scale_s_threads_reach_slurm_as_cpus_per_task(tmp_path):
    """Through profiles/slurm (conda left out: none here), --cores only to lift the dry run's cap of 1."""
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    profile.pop("software-deployment-method")
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "config.v8+.yaml").write_text(yaml.safe_dump(profile))
    p = plan(REPO / "configs/paper.yaml")
    # The pretraining jobs alone as targets: planning the whole paper DAG would add a minute.
    targets = [str(paths.model(run)) for run in p.runs]
    out = subprocess.run([*SNAKEMAKE, *targets, "-n", "--cores", "256", "--profile", str(tmp_path / "slurm"),
                          "--configfile", "configs/paper.yaml"], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    job = r"^rule pretrain:\n(?:    .*\n)*?    wildcards: run=(\S+)\n(?:    .*\n)*?    resources: (.*)"
    jobs = re.findall(job, out.stdout + out.stderr, re.M)
    asked = {run: int(re.search(r"cpus_per_task=(\d+)", res).group(1)) for run, res in jobs}
    assert len(asked) == len(p.runs)
    assert asked == {run: p.runs[run].resources["threads"] for run in asked}
    assert asked["pythia-160m-vanilla"] == 32
