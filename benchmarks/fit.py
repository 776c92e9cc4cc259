"""DimPO fits: every layer of a capture in lockstep against one layer at a time, one JSON object
per line.

    python benchmarks/fit.py                      # the default config's fits, 1 thread
    python benchmarks/fit.py --objectives kl --steps 256

dimattn.dimpo.projections.fit_projections on the default run's ``tiny-vanilla`` fit capture where it
exists (--capture), else on a random one of its shape (--layers, --sequences, --heads, --seq-len,
--head-dim; random keys give flatter attention than a model's, so DimPO's listwise term costs
more there), with the default config's ``dimpo.hparams`` (its preset, n_instances and per-objective lr): once with the layers
in lockstep (dimattn.workflow.resources.FIT_LOCKSTEP_BYTES as set), once with a budget of one byte, so
that each layer goes alone. The two run back to back in every repeat; each line gives their
median wall seconds, the ratio (lockstep over one at a time) and the largest difference between
the two fits' maps, which are the same fit up to float summation order. The host line
(benchmarks/_host.py, on stderr) comes first; every line carries the host's one-thread bf16
matmul peak, ``host_bf16_peak_gflops``.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._host import announce, stamp  # noqa: E402
from dimattn.workflow import resources  # noqa: E402
from dimattn.dimpo.projections import fit_projections, lockstep_group
from dimattn.dimpo.capture_files import load_capture  # noqa: E402

DEFAULT_CAPTURE = ROOT / "results" / "dimpo" / "tiny-vanilla" / "capture_fit.safetensors"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--capture", type=Path, default=DEFAULT_CAPTURE, help="a capture_qkv file (default: the "
                    "default run's; a random capture of the shape below where it does not exist)")
    ap.add_argument("--objectives", nargs="+", default=["kl", "dimpo"])
    ap.add_argument("--d-prime", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps a fit (default: the config's epoch)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    announce()
    config = yaml.safe_load(args.config.read_text())
    if args.capture.is_file():
        (capture, _), source = load_capture(args.capture), str(args.capture)
    else:
        g = torch.Generator().manual_seed(0)
        shape = (args.sequences, args.heads, args.seq_len, args.head_dim)
        capture = {layer: {part: torch.randn(*shape, generator=g) for part in "qkv"} for layer in range(args.layers)}
        source = "random"
    first = capture[min(capture)]
    budget = resources.FIT_LOCKSTEP_BYTES
    group = lockstep_group(first, len(capture))

    def fit(objective, lockstep):
        resources.FIT_LOCKSTEP_BYTES = budget if lockstep else 1
        # resolve_settings merges per_objective; a setting is its top layer, so --steps wins
        hp = config["dimpo"]["hparams"] | ({"setting": {"steps": args.steps}} if args.steps else {})
        t0 = time.perf_counter()
        maps = fit_projections(capture, objective, args.d_prime, hp, seed=0, progress=False)
        return time.perf_counter() - t0, maps

    for objective in args.objectives:
        fit(objective, True)  # warm-up: imports (torch.optim's dynamo), allocator
        times, maps = {True: [], False: []}, {}
        for _ in range(args.repeats):
            for lockstep in (True, False):
                seconds, maps[lockstep] = fit(objective, lockstep)
                times[lockstep].append(seconds)
        diff = max(float((maps[True][layer].W - maps[False][layer].W).abs().max()) for layer in capture)
        lock, single = statistics.median(times[True]), statistics.median(times[False])
        print(json.dumps(stamp({
            "name": f"fit_{objective}_lockstep_over_one_layer_at_a_time", "ratio": round(lock / single, 4),
            "lockstep_s": round(lock, 3), "one_at_a_time_s": round(single, 3), "max_abs_W_difference": diff,
            "group": group, "capture": source, "layers": len(capture), "q": list(first["q"].shape),
            "d_prime": args.d_prime, "threads": args.threads, "repeats": args.repeats,
        })), flush=True)
    resources.FIT_LOCKSTEP_BYTES = budget


if __name__ == "__main__":
    main()
