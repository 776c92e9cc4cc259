"""benchmarks/gpu.py, the GPU readiness script, at its CPU shapes (--device cpu --small): every
section prints its line with its fields, the FlexAttention checks pass, the CUDA-only parts say
they were skipped, and a failing check makes the exit status non-zero."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--threads", "1", *args],
                            capture_output=True, text=True, env=env, timeout=300)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result, lines


@pytest.fixture(scope="module")
def small_run():
    return run()


def by_name(lines, name):
    return [line for line in lines if line["name"] == name]


def test_every_section_prints_its_line(small_run):
    result, lines = small_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert not by_name(lines, "error")
    (peak,) = by_name(lines, "matmul_peak")
    assert peak["tflops"] > 0 and peak["h200_constant_tflops"] == 790.0
    steps = {line["variant"]: line for line in by_name(lines, "train_step")}
    assert set(steps) == {"vanilla", "dar"}
    for step in steps.values():
        # MFU of the measured peak: on a CPU without a bf16 path both are emulated and, with two
        # test workers on two cores, the step can outrun a contended peak, so no ceiling of 1 here
        assert step["tokens_per_s"] > 0 and step["mfu"] > 0 and step["compiled"] is False
        assert step["mfu"] == pytest.approx(step["model_tflops"] * 1e12 / peak["flop_per_s"])
        assert step["model_tflops"] * 1e12 == pytest.approx(step["flop_per_step"] / step["step_s"], rel=1e-3)
        assert step["flop_per_step"] > 0 and step["batch"] == [2, 32]
    assert by_name(lines, "train_dar_over_vanilla")[0]["ratio"] > 0
    (fit,) = by_name(lines, "fit_step")
    assert fit["objective"] == "dimpo" and fit["instances_per_s"] > 0 and fit["batch_size"] == 1
    assert fit["capture_shape"]["keys"] == fit["keys_per_instance"]
    (capture,) = by_name(lines, "capture")
    # one float32 copy of q (N, H, T, d), k and v (N, H_kv, T, d) of each of the 2 layers
    n, t, heads, kv_heads, d = capture["sequences"], capture["seq_len"], 4, 2, 16
    assert capture["captured_bytes"] == 2 * 4 * n * t * d * (heads + 2 * kv_heads)
    assert capture["host_peak_rss_bytes"] >= capture["host_rss_before_bytes"] > 0
    assert capture["host_peak_increase_bytes"] == capture["host_peak_rss_bytes"] - capture["host_rss_before_bytes"]
    assert "gpu_peak_bytes" not in capture  # CUDA only
    (pretrain,) = by_name(lines, "pretrain")  # the pretrain rule's loop, exported, then scored through its cache
    assert pretrain["variant"] == "vanilla" and pretrain["passed"] and pretrain["graph_breaks"] == 0
    assert pretrain["val_loss_last"] <= pretrain["train_loss_first"] / 2
    assert pretrain["recall_accuracy"] >= 2 * pretrain["chance"] == 2 / 16
    assert all(step["graph_breaks"] == 0 for step in by_name(lines, "train_warmup"))
    assert [line["section"] for line in by_name(lines, "section_done")] == ["kernels", "kernel_speed", "train", "fit",
                                                                            "capture", "pretrain"]
    assert by_name(lines, "summary") == [{**by_name(lines, "summary")[0], "passed": True, "failed": []}]


def test_flex_kernels_pass_against_the_cpu_reference(small_run):
    _, lines = small_run
    checks = by_name(lines, "kernel_check")
    assert {(c["pattern"], c["shape"]["T"]) for c in checks} == {(p, t) for p in ("dar", "swa", "dilated")
                                                                for t in (150, 64)}  # 150: not a multiple of 128
    for check in checks:
        assert check["passed"] and check["dtype"] == "bfloat16" and check["kernel"] == "flex"
        err = check["errors"]["out"]
        assert err["finite"] and 0 < err["rel_norm"] <= check["tolerance"]["rel_norm"]
        assert err["max_abs"] > 0  # bf16 against float64: never exactly equal
    skipped = {(line["section"], line["what"]) for line in by_name(lines, "skipped")}
    assert skipped == {("kernels", "FlexAttention backward (gradients)"), ("train", "torch.compile"),
                       ("capture", "peak GPU memory"), ("kernel_speed", "FlexAttention backward timing")}


def test_kernel_speed_reports_live_pairs_blocks_and_where_the_mask_is_built(small_run):
    """Each kernel_speed line puts its time beside what can make time follow the live pairs: the
    live-pair ratio (checked against the patterns' definitions, counted here row by row), the
    BlockMask's block counts adding up to its grid and matching its sparsity, the mask cached
    outside the timed calls, and whether the compiled kernel ran (never off CUDA)."""
    _, lines = small_run
    speed = by_name(lines, "kernel_speed")
    assert {(s["pattern"], s["window"]) for s in speed} == {
        (p, w) for p in ("dar", "swa", "dilated") for w in (128, 256)
    }
    for s in speed:
        T, w = s["shape"]["T"], s["window"]
        causal = T * (T + 1) / 2
        # seed 001: a query sees its w most recent keys; dilated adds every 4th key beyond the window.
        # DAR (seed 000): one key per earlier position, full inside the window and bottlenecked beyond
        live = {"swa": sum(min(i + 1, w) for i in range(T)),
                "dilated": sum(min(i + 1, w) + max(0, (i - w) // 4 + 1) for i in range(T)),
                "dar": causal}[s["pattern"]]
        assert s["live_pair_ratio"] == pytest.approx(live / causal, abs=1e-6)
        assert s["full_blocks"] + s["partial_blocks"] + s["empty_blocks"] == s["total_blocks"]
        assert s["total_blocks"] == s["q_blocks"] * s["kv_blocks"]
        assert s["sparsity"] == pytest.approx(s["empty_blocks"] / s["total_blocks"], abs=1e-6)
        assert s["mask_cached"] and not s["mask_built_in_timed_call"] and s["mask_build_s"] > 0
        assert s["compiled"] is False and s["timed"] == "forward"
        assert s["time_ratio_over_sdpa"] > 0 and s["flex_prebuilt_mask_ms"] > 0
    by_key = {(s["pattern"], s["window"]): s for s in speed}
    # a wider window keeps more of the causal triangle: more live pairs and no fewer computed blocks
    assert by_key["swa", 256]["live_pair_ratio"] > by_key["swa", 128]["live_pair_ratio"]
    assert by_key["swa", 256]["computed_blocks_over_causal"] >= by_key["swa", 128]["computed_blocks_over_causal"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_failing_check_fails_the_run(monkeypatch, capsys):
    """The same script in-process with a tolerance no bf16 kernel meets: exit status 1, named."""
    sys.path.insert(0, str(ROOT))
    import benchmarks.gpu as gpu

    monkeypatch.setattr(gpu, "TOLERANCE", {"rel_norm": 1e-9, "max_rel": 1e-9})
    monkeypatch.setattr(gpu, "KERNEL_SHAPES", {"small": [(1, 1, 9, 8, 3)]})
    monkeypatch.setattr(gpu, "failures", [])
    monkeypatch.setattr(gpu, "keep_freed_memory", lambda: None)  # leave the test process's allocator alone
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--device", "cpu", "--small", "--only", "kernels"])
    assert exit_info.value.code == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summary = by_name(lines, "summary")[0]
    assert not summary["passed"] and summary["failed"] == ["flex_dar_T9", "flex_swa_T9", "flex_dilated_T9"]


def test_the_gradient_checks_run_where_the_kernel_has_a_backward(monkeypatch, capsys):
    """FlexAttention has no backward on CPU, so the CUDA run's gradient checks are exercised here
    with the blocked kernel in its place: every input's gradient is compared and passes."""
    sys.path.insert(0, str(ROOT))
    import benchmarks.gpu as gpu

    monkeypatch.setattr(gpu, "KERNEL", "blocked")
    monkeypatch.setattr(gpu, "failures", [])
    monkeypatch.setattr(gpu, "keep_freed_memory", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--device", "cpu", "--small", "--only", "kernels"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert exit_info.value.code == 0, by_name(lines, "summary")
    assert not by_name(lines, "skipped")
    checks = by_name(lines, "kernel_check")
    assert len(checks) == 6
    for check in checks:
        expected = {"out", "grad_q", "grad_k", "grad_v"} | (
            {"grad_k_far", "grad_v_far"} if check["pattern"] == "dar" else set()
        )
        assert check["gradients"] and set(check["errors"]) == expected and check["passed"]
        assert all(0 < err["rel_norm"] <= gpu.TOLERANCE["rel_norm"] for err in check["errors"].values())
