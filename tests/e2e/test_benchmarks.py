"""benchmarks/: the host line and the host's bf16 peak beside each timing (benchmarks/_host.py),
and benchmarks/training.py's profile of a step, at the smoke config's sizes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST_FIELDS = {"cpu_model", "cpus", "torch", "cpu_capability", "cpu_flags", "bf16_native", "peak_threads", "peak_n",
               "host_fp32_peak_gflops", "host_bf16_peak_gflops"}
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_vnni
processor\t: 1
model name\t: another
"""


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def training_run():
    """(stdout records, stderr records) of benchmarks/training.py at the smoke config's tiny
    scale, one repeat, in a process of its own (it sets torch's threads)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "training.py"), "--config", str(REPO / "configs" / "smoke.yaml"),
           "--repeats", "1", "--peak-n", "128", "--peak-loops", "1", "--profile-steps", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return _json_lines(run.stdout), _json_lines(run.stderr)


def test_the_host_line_names_the_cpu_its_features_and_its_peaks(training_run):
    from dimattn.pretraining.precision import BF16_CPU_FLAGS

    _, err = training_run
    (host,) = [r for r in err if r.get("name") == "host"]
    assert HOST_FIELDS <= set(host)
    assert host["cpu_model"] and host["cpu_capability"] and host["peak_threads"] == 1
    assert host["host_fp32_peak_gflops"] > 0 and host["host_bf16_peak_gflops"] > 0
    assert host["bf16_native"] == bool(set(BF16_CPU_FLAGS) & set(host["cpu_flags"]))


def test_every_training_record_carries_the_host_bf16_peak(training_run):
    from dimattn.pretraining.precision import resolve_precision

    out, err = training_run
    (host,) = [r for r in err if r.get("name") == "host"]
    precision = resolve_precision("auto", "cpu")  # the smoke config leaves training.precision at auto
    names = [r["name"] for r in out]
    assert names == ["matmul_peak_fp32", "matmul_peak_bf16", *(f"train_step_{v}_{p}" for v in ("vanilla", "dar")
                     for p in ("fp32", "bf16")), "dar_over_vanilla_fp32", "dar_over_vanilla_bf16",
                     "bf16_over_fp32_vanilla", "bf16_over_fp32_dar", f"profile_vanilla_{precision}",
                     f"profile_dar_{precision}"]
    assert all(r["host_bf16_peak_gflops"] == host["host_bf16_peak_gflops"] > 0 for r in out)
    steps = [r for r in out if r["name"].startswith("train_step_")]
    assert all(r["step_s"] > 0 and 0 < r["mfu"] for r in steps)  # the fields the README reads, kept


def test_the_profile_splits_a_step_into_operators_and_groups(training_run):
    bench = _load("training")
    out, _ = training_run
    profiles = {r["name"].split("_")[1]: r for r in out if r["name"].startswith("profile_")}
    assert set(profiles) == {"vanilla", "dar"}
    for variant, r in profiles.items():
        top, groups = r["top"], r["groups"]
        assert r["profile_steps"] == 2 and r["profiled_step_s"] > 0 and r["step_s"] > 0
        assert 0 < len(top) <= bench.TOP_OPS and len({(t["op"], t["group"]) for t in top}) == len(top)
        assert {t["group"] for t in top} <= set(bench.GROUPS) - {"python"}
        # the LM head's matmuls count in the loss, the layers' in matmul
        assert {"loss", "matmul"} <= {t["group"] for t in top if t["op"] == "aten::mm"}, variant
        assert [t["self_ms"] for t in top] == sorted((t["self_ms"] for t in top), reverse=True)
        assert all(0 <= t["share"] <= 1 and t["self_ms"] >= 0 and t["calls"] >= 1 for t in top)
        assert sum(t["share"] for t in top) <= 1 + 1e-3  # rounding
        assert set(groups) == set(bench.GROUPS) and all(0 <= s <= 1 for s in groups.values())
        assert sum(groups.values()) == pytest.approx(1, abs=0.01)  # every op's self time in one group
        # every region and kind the step runs shows up: a renamed op would leave its group at 0
        assert all(groups[g] > 0 for g in ("loss", "attention", "optimizer", "matmul", "elementwise")), variant
        assert not any(t["op"].startswith("ProfilerStep") for t in top)


def test_an_op_counts_in_its_region_else_in_its_kind():
    bench = _load("training")

    def tree(*names):  # innermost last
        parent = None
        for name in names:
            parent = SimpleNamespace(name=name, cpu_parent=parent)
        return parent

    step = "ProfilerStep#3"
    expected = [  # (an event and its enclosing ones, outermost first; its group)
        ((step,), "python"),
        (("ProfilerStep*",), "python"),  # torch 2.13's name for every step
        ((step, "_LMHeadLoss", "aten::mm"), "loss"),
        ((step, "autograd::engine::evaluate_function: _LMHeadLossBackward", "aten::mul"), "loss"),
        ((step, "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"),
         "attention"),
        (("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0",), "attention"),
        ((step, "_JointAttention", "aten::bmm"), "attention"),
        ((step, "Optimizer.step#AdamW.step", "aten::_fused_adamw_"), "optimizer"),
        ((step, "aten::_foreach_norm"), "optimizer"),
        ((step, "aten::linear", "aten::addmm"), "matmul"),
        ((step, "aten::mm"), "matmul"),
        ((step, "aten::to", "aten::_to_copy"), "copies"),
        ((step, "aten::copy_"), "copies"),
        ((step, "aten::gelu_backward"), "elementwise"),
        ((step, "aten::native_layer_norm_backward"), "elementwise"),
        ((step, "aten::add_"), "elementwise"),
        ((step, "aten::embedding_dense_backward"), "other"),
        ((step, "aten::empty"), "other"),
    ]
    assert [(names, bench.group_of(tree(*names))) for names, _ in expected] == expected


def test_cpuinfo_reads_the_first_model_name_and_the_bf16_flags():
    host = _load("_host")
    assert host.cpuinfo(XEON) == ("Intel(R) Xeon(R) Platinum 8480+",
                                  ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"])
    assert host.cpuinfo("flags : avx avx2 fma\nmodel name : AMD EPYC\n") == ("AMD EPYC", ["avx2"])


def test_fit_and_key_matching_stamp_their_lines(tmp_path, capsys):
    """The scripts tests run in-process: the host line once on stderr, stdout their own records."""
    _load("fit").main(["--capture", str(tmp_path / "none.safetensors"), "--objectives", "kl", "--steps", "2",
                       "--layers", "1", "--sequences", "2", "--seq-len", "16", "--head-dim", "8", "--repeats", "1"])
    _load("key_matching").main(["drill", "--steps", "1", "--layers", "1", "--hidden", "16", "--batch", "4",
                                "--test-examples", "4"])
    captured = capsys.readouterr()
    hosts = _json_lines(captured.err)
    assert [r["name"] for r in hosts] == ["host", "host"] and HOST_FIELDS <= set(hosts[0])
    fit, drill = _json_lines(captured.out)
    assert fit["name"].startswith("fit_kl_") and "step" in drill
    assert fit["host_bf16_peak_gflops"] == drill["host_bf16_peak_gflops"] == hosts[0]["host_bf16_peak_gflops"] > 0


def test_dag_times_sums_each_rule_and_stamps_the_host(tmp_path, capsys, monkeypatch):
    """--dag-times: Snakemake's benchmark files summed per rule (the folder they lie in), largest
    first, a total, each line with the host's bf16 peak; a job without a time (NA) is left out."""
    header = "s\th:m:s\tmax_rss\n"
    for rule, name, s in [
        ("pretrain", "a", "10.5"),
        ("pretrain", "b", "4.5"),
        ("recall", "a", "3.0"),
        ("recall", "b", "NA"),
    ]:
        (tmp_path / rule).mkdir(exist_ok=True)
        (tmp_path / rule / f"{name}.tsv").write_text(f"{header}{s}\t0:00:10\t1.0\n")
    training = _load("training")
    host = _load("_host")
    monkeypatch.setattr(host, "host", lambda: {"host_bf16_peak_gflops": 123.4})
    monkeypatch.setitem(sys.modules, "benchmarks._host", host)
    training.dag_times(tmp_path)
    out = capsys.readouterr()
    lines = _json_lines(out.out)
    assert [(r["rule"], r["wall_s"], r["jobs"]) for r in lines[:-1]] == [("pretrain", 15.0, 2), ("recall", 3.0, 1)]
    assert lines[-1]["name"] == "dag_total_seconds" and lines[-1]["wall_s"] == 18.0 and lines[-1]["jobs"] == 3
    assert all(r["host_bf16_peak_gflops"] == 123.4 for r in lines)
    assert '"name": "host"' in out.err


def test_startup_reads_each_scripts_imports_and_ranks_packages_by_their_own_time(tmp_path):
    startup = _load("startup")
    script = tmp_path / "job.py"
    script.write_text("from pathlib import Path\n\nfrom _workflow import logged\n\nwith logged(snakemake):\n"
                      "    import json, csv\n    from dimattn.workflow import paths\n    from . import local\n")
    assert startup.script_imports(script) == "from pathlib import Path; import json; import csv; from dimattn.workflow import paths"
    log = ("import time: self [us] | cumulative | imported package\n"
           "import time:    900000 |     900000 |     torch._C\n"
           "import time:    100000 |    1000000 |   torch\n"
           "import time:    300000 |     300000 |     transformers.utils\n"
           "import time:    200000 |    1500000 |   transformers\n"
           "import time:     50000 |    1550000 | dimattn.model\n")
    # self times summed by package: dimattn's cumulative 1.55 s holds the others' and counts 0.05
    assert startup.top_packages(log, 3) == [{"package": "torch", "self_s": 1.0}, {"package": "transformers", "self_s": 0.5},
                                            {"package": "dimattn", "self_s": 0.05}]
    # every script of the workflow parses, and a job's imports name dimattn's module for its work
    for path in startup.SCRIPTS.glob("[!_]*.py"):
        assert "_workflow" not in startup.script_imports(path), path


def test_startup_times_a_script_beside_the_floors_and_stamps_its_lines(capsys, monkeypatch):
    monkeypatch.setenv("DIMATTN_BENCH_RECORD", "0")
    _load("startup").main(["--scripts", "summarize", "--floors", "--repeats", "1", "--top", "3"])
    lines = {r["name"]: r for r in _json_lines(capsys.readouterr().out)}
    assert set(lines) == {"startup_interpreter", "startup_torch", "startup_summarize"}
    summarize, torch_ = lines["startup_summarize"], lines["startup_torch"]
    assert summarize["imports"].endswith("from dimattn.reporting import summaries") and summarize["kind"] == "script"
    assert summarize["over_torch"] == round(summarize["median_s"] / torch_["median_s"], 3)
    assert lines["startup_interpreter"]["median_s"] < torch_["median_s"]  # torch is no free import anywhere
    assert [t["package"] for t in torch_["top"]][0] == "torch" and len(summarize["top"]) == 3
    assert all("host_bf16_peak_gflops" in r for r in lines.values())
