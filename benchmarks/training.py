"""Training throughput of the default model on CPU, one JSON object per line.

    python benchmarks/training.py                    # scale "tiny" of config.yaml, 1 thread
    python benchmarks/training.py --threads 2 --repeats 9
    python benchmarks/training.py --dag-times benchmarks/snakemake   # wall seconds per rule

Every measurement runs in this one process, interleaved (each repetition times every case once,
in turn), and is a median: machine noise hits all cases alike, so the ratios hold even where the
absolute times do not. Lines:

- ``matmul_peak_{fp32,bf16}``: a square n x n matmul loop (n = --peak-n), FLOP/s: the peak the
  MFU lines divide by.
- ``train_step_{vanilla,dar}_{fp32,bf16}``: one optimizer step of training.py's loop (autocast,
  forward with the loss, backward, clipping, fused AdamW): tokens/s and MFU, the model's FLOP/s
  over the matmul peak of the same precision.
- ``dar_over_vanilla_{fp32,bf16}``: the step-time ratio; ``bf16_over_fp32_{vanilla,dar}``: the
  step time in bf16 over fp32.

FLOPs counted per step: 6 x tokens x (weights of every matmul: the Linear layers with the LM
head, not the input embedding, plus DAR's far key/value projection d_down -> 2 d), plus
attention: 12 x head_dim x heads x layers x the live (query, key) pairs of a sequence, T(T+1)/2
for vanilla and DAR alike (forward QK^T and PV, 2 FLOPs a multiply-add, backward twice the
forward). Masked or padded scores a kernel computes anyway are not counted.

``--dag-times PATH`` reads the Snakemake benchmark files under PATH (``<rule>/*.tsv``, column ``s``:
wall seconds of a job) and prints the seconds summed per rule, largest first, then the total.
"""

import argparse
import csv
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# --- Snakemake benchmark files -------------------------------------------------------------------

def rule_of(path: Path, root: Path) -> str:
    """The rule a benchmark file belongs to: the folder it lies in (dimattn.paths.bench)."""
    return path.relative_to(root).parts[0]


def dag_times(root: Path) -> None:
    seconds, jobs = defaultdict(float), defaultdict(int)
    for path in sorted(root.rglob("*.tsv")):
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f, delimiter="\t") if r.get("s") not in (None, "", "NA")]
        if not rows:
            continue
        rule = rule_of(path, root)
        seconds[rule] += sum(float(r["s"]) for r in rows)
        jobs[rule] += 1
    total = sum(seconds.values())
    for rule in sorted(seconds, key=seconds.get, reverse=True):
        emit({"name": "dag_rule_seconds", "rule": rule, "wall_s": round(seconds[rule], 3), "jobs": jobs[rule],
              "share": round(seconds[rule] / total, 4) if total else None})
    emit({"name": "dag_total_seconds", "wall_s": round(total, 3), "jobs": sum(jobs.values()), "rules": len(seconds),
          "path": str(root)})


# --- training steps ------------------------------------------------------------------------------


def default_model(config_path: Path, d_down: int | None, scale_name: str = "tiny") -> tuple[dict, dict, dict, int]:
    """(architecture, training, DAR keys, vocab) of a scale ("tiny" by default): the window of
    its first DAR sweep entry, d_down = d / 4 (seed 000's default ratio) unless given. A scale
    trained on the synthetic recall corpus takes that corpus's vocabulary."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    scale = config["pretraining"]["scales"][scale_name]
    dar = next(s for s in config["pretraining"]["sweeps"] if s["scale"] == scale_name and s["attention"] == "dar")
    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    arch = scale["architecture"]
    keys = {"window": first(dar["window"]), "d_down": d_down or arch["hidden_size"] // 4}
    vocab = config["tokenizer"]["vocab_size"]
    dataset = config["datasets"].get(scale.get("dataset", config["pretraining"]["dataset"]), {})
    if dataset.get("source") == "synthetic_recall":
        from dimattn.recall import RecallSettings

        vocab = RecallSettings.from_spec(dataset).vocab_size
    return arch, scale["training"], keys, vocab


def matmul_weights(model) -> int:
    """Multiply-adds per token of the model's parameter matmuls (see the module doc)."""
    import torch.nn as nn

    n = sum(m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear))
    config = model.config
    far_layers = sum(1 for layer in model.gpt_neox.layers if layer.attention.variant.far)
    return n + far_layers * (config.d_down or 0) * 2 * config.hidden_size


def step_flops(model, batch: int, seq_len: int) -> float:
    config = model.config
    live_pairs = seq_len * (seq_len + 1) / 2  # vanilla and DAR: query i sees i + 1 keys
    attention = 12 * config.hidden_size * config.num_hidden_layers * live_pairs * batch
    return 6 * batch * seq_len * matmul_weights(model) + attention


def bench_training(args) -> None:
    import torch

    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.precision import autocast, bf16_supported
    from dimattn.training import TrainConfig, configure_optimizer, keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as training.py does on CPU
    arch, train, dar, vocab = default_model(args.config, args.d_down, args.scale)
    seq_len, batch = train["seq_len"], train["batch_size"]
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch, lr=train.get("lr", 1e-3))
    x = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))

    cases, flops = {}, {}
    for variant, extra in {"vanilla": {"attention": "vanilla"}, "dar": {"attention": "dar", **dar}}.items():
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            config = DimAttnConfig(vocab_size=vocab, max_position_embeddings=seq_len, **arch, **extra)
            model = DimAttnForCausalLM(config)
            model.train()
            optimizer = configure_optimizer(model, cfg)

            def step(model=model, optimizer=optimizer, precision=precision):
                with autocast("cpu", precision):
                    loss = model(x, labels=x, return_logits=False).loss  # as training.py asks
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            cases[f"{variant}_{precision}"] = step
            flops[f"{variant}_{precision}"] = step_flops(model, batch, seq_len)

    n = args.peak_n
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        cases[f"peak_{precision}"] = lambda a=a, b=b, out=out: [torch.mm(a, b, out=out) for _ in range(args.peak_loops)]

    for fn in cases.values():  # warm-up: oneDNN primitives, allocator, optimizer state
        fn()
        fn()
    wall, cpu = defaultdict(list), defaultdict(list)
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    wall = {k: statistics.median(v) for k, v in wall.items()}
    cpu = {k: statistics.median(v) for k, v in cpu.items()}

    common = {"threads": args.threads, "repeats": args.repeats}
    peak = {}
    for precision in ("fp32", "bf16"):
        name = f"peak_{precision}"
        peak[precision] = 2 * n**3 * args.peak_loops / wall[name]
        emit({"name": f"matmul_peak_{precision}", "gflops": round(peak[precision] / 1e9, 1), "n": n,
              "cpu_gflops": round(2 * n**3 * args.peak_loops / cpu[name] / 1e9, 1), **common})
    for name in ("vanilla_fp32", "vanilla_bf16", "dar_fp32", "dar_bf16"):
        precision = name.rsplit("_", 1)[1]
        achieved = flops[name] / wall[name]
        emit({"name": f"train_step_{name}", "tokens_per_s": round(batch * seq_len / wall[name], 1),
              "step_s": round(wall[name], 5), "cpu_s": round(cpu[name], 5),
              "gflop_per_step": round(flops[name] / 1e9, 3),
              "model_gflops": round(achieved / 1e9, 1), "mfu": round(achieved / peak[precision], 4),
              "mfu_of": f"matmul_peak_{precision}", "batch": [batch, seq_len],
              "scale": args.scale, "model": {**arch, "vocab": vocab, **(dar if name.startswith("dar") else {})}, **common})
    for precision in ("fp32", "bf16"):
        dar, vanilla = f"dar_{precision}", f"vanilla_{precision}"
        emit({"name": f"dar_over_vanilla_{precision}", "ratio": round(wall[dar] / wall[vanilla], 4),
              "cpu_ratio": round(cpu[dar] / cpu[vanilla], 4), **common})
    for variant in ("vanilla", "dar"):
        emit({"name": f"bf16_over_fp32_{variant}", "ratio": round(wall[f"{variant}_bf16"] / wall[f"{variant}_fp32"], 4),
              "bf16_native": bf16_supported("cpu"), **common})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--scale", default="tiny", help="a scale of the config's pretraining.scales")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tiny scale trains on 1)")
    parser.add_argument("--d-down", type=int, default=None, help="DAR bottleneck width (default: hidden_size / 4)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peak-n", type=int, default=1024, help="side of the square matmul of the peak")
    parser.add_argument("--peak-loops", type=int, default=4, help="matmuls per timed peak measurement")
    parser.add_argument("--dag-times", type=Path, metavar="PATH",
                        help="sum the Snakemake benchmark TSVs under PATH per rule")
    args = parser.parse_args(argv)
    if args.dag_times is not None:
        if not args.dag_times.is_dir():
            parser.error(f"--dag-times: {args.dag_times} is not a folder")
        dag_times(args.dag_times)
        return
    bench_training(args)


if __name__ == "__main__":
    main()
