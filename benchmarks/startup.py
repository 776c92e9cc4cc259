"""What a job pays before it computes: each workflow script's imports in a fresh interpreter, one
JSON object per line.

    python benchmarks/startup.py                  # every script in workflow_scripts/, 3 repeats
    python benchmarks/startup.py --scripts pretrain score_text --repeats 5 --floors torch

A job is one process: Snakemake starts ``python`` on the script, which imports what it uses
before the first forward. This parses each script (ast: every ``import`` and ``from ... import``
in it, inside its ``with logged(snakemake):`` too, but not ``_workflow``, the job's log) and
times those imports alone in a fresh interpreter, beside the floors every job of that kind pays
whatever we write: the interpreter (``pass``), ``torch``, transformers' model classes
(``transformers.modeling_utils``, which a checkpoint's ``PreTrainedModel`` needs) and lm-eval's
task registry (``lm_eval.tasks``, which the ``hf`` model's tasks need). Every repeat times every
case once, in turn, and each line is a median, so that the ratios (``over_torch``: a script's
imports over torch's) hold where the seconds do not. ``top``: the packages whose modules took
most import time (self time, summed by package) in one more run with ``-X importtime``, so that a host where a job starts slowly
says which library it waits for.

The byte-code caches are warmed first (one import of each case), as a job finds them after the
first job of its kind (the Makefile lets the jobs write them). The host line
(benchmarks/_host.py, on stderr) comes first; every line carries the host's one-thread bf16
matmul peak, ``host_bf16_peak_gflops``.
"""

import argparse
import ast
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _host import reporter  # noqa: E402

SCRIPTS = ROOT / "workflow_scripts"
FLOORS = {"interpreter": "pass", "torch": "import torch", "transformers_models": "import transformers.modeling_utils",
          "lm_eval_tasks": "import lm_eval.tasks"}


def script_imports(path: Path) -> str:
    """The import statements of a workflow script, as one line of code to run."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a for a in node.names if a.name != "_workflow"]
            lines += [f"import {a.name}" for a in names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module != "_workflow" and not node.level:
            lines.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    return "; ".join(lines) or "pass"


def environment() -> dict:
    """The jobs' environment: byte-code written (the Makefile unexports PYTHONDONTWRITEBYTECODE),
    the hub offline, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def seconds(code: str, env: dict, *flags: str) -> tuple[float, str]:
    """Wall seconds of a fresh interpreter running ``code``, and its stderr."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{code!r} failed:\n{out.stderr[-2000:]}")
    return elapsed, out.stderr


def top_packages(importtime: str, n: int) -> list[dict]:
    """The n top-level packages whose modules took most import time in ``-X importtime`` output:
    each module's self time summed by its package, so that the shares add up (a package's
    cumulative time holds the libraries it imports)."""
    totals = {}
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, _, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if own.isdigit():
            package = name.split(".")[0]
            totals[package] = totals.get(package, 0) + int(own)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [{"package": package, "self_s": round(us / 1e6, 3)} for package, us in ranked]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scripts", nargs="*", help="workflow_scripts/ stems (default: all but _workflow)")
    ap.add_argument("--floors", nargs="*", choices=list(FLOORS), default=list(FLOORS),
                    help="which floors to time beside the scripts (interpreter and torch always)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args(argv)
    stems = args.scripts or sorted(p.stem for p in SCRIPTS.glob("*.py") if not p.stem.startswith("_"))
    missing = [s for s in stems if not (SCRIPTS / f"{s}.py").is_file()]
    if missing:
        raise SystemExit(f"no workflow script {missing} in {SCRIPTS}")
    floors = {"interpreter", "torch", *args.floors}
    cases = {k: v for k, v in FLOORS.items() if k in floors} | {s: script_imports(SCRIPTS / f"{s}.py") for s in stems}
    emit, env = reporter(), environment()
    for code in cases.values():
        seconds(code, env)  # warm-up: byte-code written, page cache filled
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, code in cases.items():
            times[name].append(seconds(code, env)[0])
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, code in cases.items():
        record = {"name": f"startup_{name}", "kind": "floor" if name in FLOORS else "script", "imports": code,
                  "median_s": round(median[name], 3), "min_s": round(min(times[name]), 3),
                  "over_torch": round(median[name] / median["torch"], 3),
                  "over_interpreter": round(median[name] / median["interpreter"], 3), "repeats": args.repeats}
        if name != "interpreter":
            record["top"] = top_packages(seconds(code, env, "-X", "importtime")[1], args.top)
        emit(record)


if __name__ == "__main__":
    main()
