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
- ``profile_{vanilla,dar}_{precision}``: where a step's time goes, in the precision training.py
  takes (the scale's ``training.precision``, "auto" by default, resolved on this CPU; or
  --profile-precision): torch.profiler over --profile-steps steps after one profiled warm-up
  step (--no-profile skips it). ``top``: the operators of most self CPU time, each in its
  group, ms a step and share of the profiled step; ``groups``: every op's self time in one
  group, the shares summing to 1: ``loss``, ``attention`` and ``optimizer`` by the region an
  op runs in (the LM-head loss's autograd function forward and backward, the attention
  kernels, AdamW and clipping), then ``matmul``, ``copies`` (to/_to_copy/copy_: autocast's
  weight casts), ``elementwise`` (pointwise ops, norms, reductions) by the op's own name,
  ``other``, and ``python`` (time in no op).

The host line (benchmarks/_host.py, on stderr) comes first; every record carries the host's
one-thread bf16 matmul peak, ``host_bf16_peak_gflops``.

FLOPs counted per step: 6 x tokens x (weights of every matmul: the Linear layers with the LM
head, not the input embedding, plus DAR's far key/value projection d_down -> 2 d), plus
attention: 12 x head_dim x heads x layers x the live (query, key) pairs of a sequence, T(T+1)/2
for vanilla and DAR alike (forward QK^T and PV, 2 FLOPs a multiply-add, backward twice the
forward). Masked or padded scores a kernel computes anyway are not counted.

``--dag-times PATH`` reads the Snakemake benchmark files under PATH (``<rule>/*.tsv``, column ``s``:
wall seconds of a job) and prints the seconds summed per rule, largest first, then the total.
"""

import argparse
import json
import re
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

def dag_times(root: Path) -> None:
    """Job-seconds per rule of a finished run, each line with this host's bf16 peak: run it on the
    host that ran the DAG."""
    from benchmarks._host import reporter

    from dimattn.reporting.published import job_seconds

    emit = reporter()
    per_rule = job_seconds(root)
    seconds = {rule: s for rule, (_, s) in per_rule.items()}
    jobs = {rule: j for rule, (j, _) in per_rule.items()}
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
    trained on a synthetic corpus (recall, the long-context suite) takes its vocabulary."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    scale = config["pretraining"]["scales"][scale_name]
    sweeps = config["pretraining"]["sweeps"]
    # a scale with no DAR run (the suite's): w = a quarter of the example, as cpu-full's suite DAR
    dar = next((s for s in sweeps if s["scale"] == scale_name and s["attention"] == "dar"),
               {"window": scale["training"]["seq_len"] // 4})
    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    arch = scale["architecture"]
    keys = {"window": first(dar["window"]), "d_down": d_down or arch["hidden_size"] // 4}
    vocab = config["tokenizer"]["vocab_size"]
    dataset = config["datasets"].get(scale.get("dataset", config["pretraining"]["dataset"]), {})
    if dataset.get("source") == "synthetic_recall":
        from dimattn.data.recall import RecallSettings

        vocab = RecallSettings.from_spec(dataset).vocab_size
    elif dataset.get("source") == "synthetic_longctx":
        from dimattn.data.longctx import LongContextSettings

        vocab = LongContextSettings.from_spec(dataset).vocab_size
    return arch, scale["training"], keys, vocab


def corpus_batch(config_path: Path, scale_name: str, batch: int, vocab: int, seq_len: int):
    """(x, labels) of one training batch as the scale's corpus gives it: random tokens labelled
    everywhere for text; the generator's own examples, labelled on the answers only, for the
    synthetic corpora (dimattn.data.recall, dimattn.data.longctx), whose head then sees 1 row in 8."""
    import numpy as np
    import torch
    import yaml

    config = yaml.safe_load(config_path.read_text())
    scale = config["pretraining"]["scales"][scale_name]
    spec = config["datasets"].get(scale.get("dataset", config["pretraining"]["dataset"]), {})
    rng = np.random.default_rng(0)
    if spec.get("source") == "synthetic_longctx":
        from dimattn.data.longctx import LongContextSettings, generate_split

        x, mask = generate_split(LongContextSettings.from_spec(spec), "train", batch, rng)
    elif spec.get("source") == "synthetic_recall":
        from dimattn.data.recall import RecallSettings, find_queries, generate_examples

        settings = RecallSettings.from_spec(spec)
        x, mask = generate_examples(settings, batch, rng), None
        if settings.answer_loss:
            queries = find_queries(x, settings.layout())
            mask = np.zeros(x.shape, dtype=np.uint8)
            mask[queries[:, 0], queries[:, 1] + 1] = 1
    else:
        x = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        return x, x
    x = torch.from_numpy(np.ascontiguousarray(x[:, :seq_len]))
    return x, (x if mask is None else x.masked_fill(torch.from_numpy(mask[:, :seq_len]) == 0, -100))


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


# --- where a step's time goes --------------------------------------------------------------------

# Regions, matched on an op's name or an enclosing one's, innermost first: the LM head's loss is
# an autograd function (dimattn.model.modeling_dimattn.lm_head_loss) whose matmuls and softmax would
# otherwise count as matmul and elementwise; so are the blocked attention kernels (_JointAttention:
# vanilla's and DAR's on CPU).
REGIONS = {
    "loss": re.compile(r"_LMHeadLoss|cross_entropy|log_softmax|nll_loss", re.I),
    "attention": re.compile(r"scaled_?dot_?product|flash_?attention|efficient_attention|flex_attention"
                            r"|_JointAttention|_MergedAttention", re.I),
    "optimizer": re.compile(r"^Optimizer\.|adamw|_foreach_|clip_grad", re.I),
}
# Kinds, matched on the op's own name where no region holds it.
KINDS = {
    "matmul": re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation|mv|dot)$"),
    "copies": re.compile(r"^aten::(to|_to_copy|copy_)$"),
    "elementwise": re.compile(
        r"^aten::_?(add|sub|rsub|mul|div|neg|exp|log|pow|sqrt|rsqrt|tanh|sigmoid|gelu|silu|relu|threshold|where"
        r"|masked_fill|clamp|fill|zero|cat|stack|sum|mean|native_layer_norm|layer_norm|native_dropout|dropout"
        r"|softmax|cos|sin|abs|sign|lerp|addcmul|addcdiv|maximum|minimum|eq|ne|lt|gt|le|ge|square|reciprocal)"
        r"(_backward\w*|_data|_)?$"),
}
GROUPS = (*REGIONS, *KINDS, "other", "python")
TOP_OPS = 12


def group_of(event) -> str:
    """The group of an event's self time (see REGIONS, KINDS)."""
    if event.name.startswith("ProfilerStep"):
        return "python"  # the step's own time in no op: Python, the autograd engine's loop
    node = event
    while node is not None:
        for group, pattern in REGIONS.items():
            if pattern.search(node.name):
                return group
        node = node.cpu_parent
    return next((kind for kind, pattern in KINDS.items() if pattern.match(event.name)), "other")


def profile_step(step, steps: int) -> dict:
    """One profiled warm-up step, then ``steps`` steps: the mean profiled step, the top operators
    by self CPU time and the groups' shares (module doc)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    once = schedule(wait=0, warmup=1, active=steps, repeat=1)  # repeat=1: no second cycle clears the events
    with profile(activities=[ProfilerActivity.CPU], schedule=once) as prof:
        for _ in range(steps + 1):
            step()
            prof.step()
    events = prof.events()
    step_us = sum(e.cpu_time_total for e in events if e.name.startswith("ProfilerStep")) / steps
    # an op apart in each group: the LM head's aten::mm (loss) is not the layers' (matmul)
    by_op, calls, groups = defaultdict(float), defaultdict(int), dict.fromkeys(GROUPS, 0.0)
    for e in events:
        key = e.name, group_of(e)
        by_op[key] += e.self_cpu_time_total
        calls[key] += 1
        groups[key[1]] += e.self_cpu_time_total
    ops = sorted((key for key in by_op if key[1] != "python"), key=by_op.get, reverse=True)
    share = lambda us: round(us / steps / step_us, 4)  # noqa: E731
    top = [{"op": op, "group": group, "self_ms": round(by_op[op, group] / steps / 1e3, 3),
            "share": share(by_op[op, group]), "calls": calls[op, group] // steps} for op, group in ops[:TOP_OPS]]
    return {"profiled_step_s": round(step_us / 1e6, 5), "profile_steps": steps, "top": top,
            "groups": {group: share(us) for group, us in groups.items()}}


def bench_training(args) -> None:
    import torch

    from benchmarks._host import reporter
    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.model import modeling_dimattn as modeling
    from dimattn.pretraining.precision import autocast, bf16_supported, resolve_precision
    from dimattn.pretraining.training import TrainConfig, configure_optimizer, keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as training.py does on CPU
    arch, train, dar, vocab = default_model(args.config, args.d_down, args.scale)
    # the scale's recipe, the schema's defaults where it sets none
    cfg = TrainConfig.from_dict(
        {k: train[k] for k in ("seq_len", "batch_size", "max_steps", "lr", "precision") if k in train}
    )
    # resolved first, so that a wrong name fails before the timings
    profiled = resolve_precision(args.profile_precision or cfg.precision, "cpu")
    emit = reporter()
    seq_len, batch = cfg.seq_len, cfg.batch_size
    x, labels = corpus_batch(args.config, args.scale, batch, vocab, seq_len)
    answers_only = bool((labels == -100).any())

    cases, flops = {}, {}
    for variant, extra in {"vanilla": {"attention": "vanilla"}, "dar": {"attention": "dar", **dar}}.items():
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            config = DimAttnConfig(vocab_size=vocab, max_position_embeddings=seq_len, **arch, **extra)
            model = DimAttnForCausalLM(config)
            model.train()
            optimizer = configure_optimizer(model, cfg)

            def step(model=model, optimizer=optimizer, precision=precision, skip=True):
                modeling.SKIP_UNLABELLED = skip
                with autocast("cpu", precision):
                    loss = model(x, labels=labels, return_logits=False).loss  # as training.py asks
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                modeling.SKIP_UNLABELLED = True

            cases[f"{variant}_{precision}"] = step
            flops[f"{variant}_{precision}"] = step_flops(model, batch, seq_len)
            if answers_only and precision == "fp32":  # the lever: the head on every row, as before
                cases[f"{variant}_fp32_all_rows"] = lambda step=step: step(skip=False)

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
        emit(
            {
                "name": f"train_step_{name}",
                "tokens_per_s": round(batch * seq_len / wall[name], 1),
                "step_s": round(wall[name], 5),
                "cpu_s": round(cpu[name], 5),
                "gflop_per_step": round(flops[name] / 1e9, 3),
                "model_gflops": round(achieved / 1e9, 1),
                "mfu": round(achieved / peak[precision], 4),
                "mfu_of": f"matmul_peak_{precision}",
                "batch": [batch, seq_len],
                "scale": args.scale,
                "model": {**arch, "vocab": vocab, **(dar if name.startswith("dar") else {})},
                **common,
            }
        )
    for precision in ("fp32", "bf16"):
        dar, vanilla = f"dar_{precision}", f"vanilla_{precision}"
        emit({"name": f"dar_over_vanilla_{precision}", "ratio": round(wall[dar] / wall[vanilla], 4),
              "cpu_ratio": round(cpu[dar] / cpu[vanilla], 4), **common})
    for variant in ("vanilla", "dar"):
        if f"{variant}_fp32_all_rows" in wall:  # answer-only corpus: labelled rows / all rows
            emit({"name": f"answer_rows_over_all_rows_{variant}_fp32",
                  "ratio": round(wall[f"{variant}_fp32"] / wall[f"{variant}_fp32_all_rows"], 4),
                  "labelled_share": round(float((labels != -100).float().mean()), 4), **common})
    for variant in ("vanilla", "dar"):
        emit({"name": f"bf16_over_fp32_{variant}", "ratio": round(wall[f"{variant}_bf16"] / wall[f"{variant}_fp32"], 4),
              "bf16_native": bf16_supported("cpu"), **common})
    if args.no_profile:
        return
    for variant in ("vanilla", "dar"):  # after the timings, which the profiler would slow
        name = f"{variant}_{profiled}"
        emit({"name": f"profile_{name}", "step_s": round(wall[name], 5), "precision": profiled,
              **profile_step(cases[name], args.profile_steps), **common})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--scale", default="tiny", help="a scale of the config's pretraining.scales")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tiny scale trains on 1)")
    parser.add_argument("--d-down", type=int, default=None, help="DAR bottleneck width (default: hidden_size / 4)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peak-n", type=int, default=1024, help="side of the square matmul of the peak")
    parser.add_argument("--peak-loops", type=int, default=4, help="matmuls per timed peak measurement")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps a variant, after one warm-up")
    parser.add_argument("--profile-precision", default=None, help="auto, fp32 or bf16: the profiled steps' "
                        "(default: the scale's training.precision, or auto)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
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
