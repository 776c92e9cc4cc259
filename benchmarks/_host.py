"""The host a benchmark runs on, as one dict, and its bf16 peak beside each timing.

    announce()             # measures the host, once a process; prints {"name": "host", ...} to stderr
    stamp(record)          # record | {"host_bf16_peak_gflops": ...}
    emit = reporter()      # announce(), then emit(record) prints stamp(record) on stdout

A timing only compares with another run's next to the host that made it: the same script is
matmul-bound on one CPU and bound by the LM head's softmax or by elementwise passes on another
(README, "Benchmarks"). The host line holds:

- ``cpu_model``: /proc/cpuinfo's model name; ``cpus``: logical CPUs.
- ``cpu_capability``: the kernels torch dispatches to (torch.backends.cpu.get_cpu_capability(),
  which stops at "AVX512"), and ``cpu_flags``: the /proc/cpuinfo flags that decide the bf16
  matmul path (AMX, AVX512-BF16), read at run time; ``bf16_native``: what precision "auto" takes
  (dimattn.pretraining.precision.bf16_supported).
- ``host_{fp32,bf16}_peak_gflops``: the best one-thread n x n matmul (n = ``peak_n``), about a
  second in all; the per-script peaks (benchmarks/training.py's MFU lines) run at its threads.

The host line goes to stderr, so that stdout keeps one record of the script's own per line (the
tests read those); every record carries ``host_bf16_peak_gflops``.

Every stamped record is also appended to ``benchmarks/records/<script>.jsonl`` with the run's
host, commit and date (``DIMATTN_BENCH_RECORD=0`` turns it off: the tests do), and
``python benchmarks/records.py`` writes docs/benchmarks.md from those files.
"""

import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

# /proc/cpuinfo flags of the matmul paths: AVX512-BF16 and AMX run bf16 natively, AVX2 does not
FEATURE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
PEAK_N = 512
PEAK_BUDGET_S = 0.25  # timed matmuls a dtype, after a warm-up


def cpuinfo(text: str | None = None) -> tuple[str, list[str]]:
    """(model name, the FEATURE_FLAGS present) of /proc/cpuinfo's first CPU, or of ``text``."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key in ("flags", "Features") and not flags:  # Features: aarch64
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), [f for f in FEATURE_FLAGS if f in flags]


def matmul_peak(dtype: torch.dtype, n: int = PEAK_N, budget_s: float = PEAK_BUDGET_S, threads: int = 1) -> float:
    """GFLOP/s of the fastest of the n x n matmuls run on ``threads`` threads for budget_s (two at
    least: a bf16 one takes 0.2 s where the CPU has no bf16 path). The fastest, not the median: a
    peak is what the host can do, and a model step's MFU against a median can read above 1."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up: oneDNN picks and caches its kernel
        best, spent, calls = float("inf"), 0.0, 0
        while calls < 2 or spent < budget_s:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            seconds = time.perf_counter() - t0
            best, spent, calls = min(best, seconds), spent + seconds, calls + 1
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / best / 1e9


@functools.cache
def host() -> dict:
    """The host line's fields; measured once a process (tests call several benchmarks' main)."""
    from dimattn.pretraining.precision import bf16_supported

    model, flags = cpuinfo()
    return {
        "cpu_model": model, "cpus": os.cpu_count(), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": flags,
        "bf16_native": bf16_supported("cpu"), "peak_threads": 1, "peak_n": PEAK_N,
        "host_fp32_peak_gflops": round(matmul_peak(torch.float32), 1),
        "host_bf16_peak_gflops": round(matmul_peak(torch.bfloat16), 1),
    }


def announce() -> None:
    """Print the host line, on stderr."""
    print(json.dumps({"name": "host", **host()}), file=sys.stderr, flush=True)


RECORDS = Path(__file__).resolve().parent / "records"


@functools.cache
def run_meta() -> dict:
    """What every record of this process is filed under: the script, commit, date and host."""
    import subprocess

    main = getattr(sys.modules.get("__main__"), "__file__", None) or "interactive"
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True).stdout.strip())
    h = host()
    return {"script": Path(main).stem, "argv": sys.argv[1:], "commit": commit, "dirty": dirty,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
            "cpu_model": h["cpu_model"], "cpus": h["cpus"], "cpu_flags": h["cpu_flags"],
            "host_fp32_peak_gflops": h["host_fp32_peak_gflops"], "host_bf16_peak_gflops": h["host_bf16_peak_gflops"]}


def stamp(record: dict) -> dict:
    """record with the host's one-thread bf16 matmul peak beside its timings; appended, with the
    run's host, commit and date, to the script's records file."""
    stamped = {**record, "host_bf16_peak_gflops": host()["host_bf16_peak_gflops"]}
    if os.environ.get("DIMATTN_BENCH_RECORD", "1") != "0":
        meta = run_meta()
        RECORDS.mkdir(exist_ok=True)
        with open(RECORDS / f"{meta['script']}.jsonl", "a") as f:
            f.write(json.dumps({"run": meta, "record": stamped}) + "\n")
    return stamped


def reporter():
    """announce(), then emit(record): one line on stdout, stamped."""
    announce()
    return lambda record: print(json.dumps(stamp(record)), flush=True)
