"""Side-by-side benchmarks of the attention kernels, one JSON object per line.

    python benchmarks/attention.py                  # CPU suite (a)-(e), 2 threads
    python benchmarks/attention.py --only a,b       # a subset
    python benchmarks/attention.py --suite gpu      # Pythia-70M shapes on CUDA: tokens/s, MFU

Every line is ``{"name": ..., "ratio": ..., ...}``: a ratio of two measurements taken in the
same process, interleaved, so that machine noise hits both sides alike. Times are medians. The
host line (benchmarks/_host.py, on stderr) comes first; every line carries the host's one-thread
bf16 matmul peak, ``host_bf16_peak_gflops``.

(a) DAR attention forward+backward / vanilla causal SDPA, B=4 H=8 T=2048 D=64 w=128
    (target <= 1.2; the FLOP ratio is printed beside it).
(b) sliding-window forward at T=8192 / T=2048, w=256 (linear: ~4), beside full causal (~16);
    swa_over_causal_8192: the window's time over full causal SDPA's at T=8192 (target <= 0.10;
    FLOP ratio 0.0615).
(c) one DAR training step / one vanilla step on the default config's model, in float32 and
    under bf16 autocast (fused AdamW, as dimattn.pretraining.training runs it); benchmarks/training.py has
    the throughput and MFU of these steps.
(d) DAR cache bytes / vanilla KV-cache bytes after a 4096-token prompt.
(e) DAR's blocked kernel (forward+backward) in bfloat16 / in float32, at the default model's
    attention shape and at (a)'s (target <= 1: bf16 at least as fast).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._host import announce, stamp  # noqa: E402
from dimattn import DimAttnConfig, DimAttnForCausalLM  # noqa: E402
from dimattn.model.attention import dar_attention, sliding_window_attention  # noqa: E402
from dimattn.model.modeling_dimattn import kv_cache_nbytes  # noqa: E402
from dimattn.pretraining.training import keep_freed_memory  # noqa: E402

H200_BF16_FLOPS = 790e12  # measured dense bf16 matmul peak of the lent H200 (device README)


def emit(record: dict) -> None:
    print(json.dumps(stamp(record)), flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device=torch.device("cpu")) -> dict:
    """Median seconds of each callable, run in turn ``repeats`` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _qkv(n, B, H, T, D, grad=False, device="cpu", dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(B, H, T, D, generator=g, device=device, dtype=dtype).requires_grad_(grad) for _ in range(n)]


def bench_dar_vs_sdpa(repeats):
    B, H, T, D, w = 4, 8, 2048, 64, 128
    q, k, v, kf, vf = _qkv(5, B, H, T, D, grad=True)

    def vanilla():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def dar():
        dar_attention(q, k, v, kf, vf, w, kernel="blocked").sum().backward()

    t = interleaved({"vanilla": vanilla, "dar": dar}, repeats)
    # Useful score entries: causal has T(T+1)/2; DAR the same live entries plus none wasted,
    # but its band is computed in blocks: T * (w + b) entries for the near path.
    causal = T * (T + 1) / 2
    band_block = min(64, max(16, w // 2))
    dar_entries = (T - w) * (T - w + 1) / 2 + T * (w + band_block)
    emit({"name": "a_dar_fwd_bwd_over_sdpa", "ratio": t["dar"] / t["vanilla"], "target": "<= 1.2",
          "flop_ratio": dar_entries / causal, "dar_s": t["dar"], "sdpa_s": t["vanilla"],
          "shape": dict(B=B, H=H, T=T, D=D, window=w), "threads": torch.get_num_threads()})


def bench_swa_scaling(repeats):
    B, H, D, w = 1, 8, 64, 256
    inputs = {T: _qkv(3, B, H, T, D) for T in (2048, 8192)}

    def swa(T):
        return lambda: sliding_window_attention(*inputs[T], w, kernel="blocked")

    def causal(T):
        return lambda: F.scaled_dot_product_attention(*inputs[T], is_causal=True)

    with torch.no_grad():
        t = interleaved({"swa_2048": swa(2048), "swa_8192": swa(8192),
                         "causal_2048": causal(2048), "causal_8192": causal(8192)}, repeats)
    emit(
        {
            "name": "b_swa_forward_T8192_over_T2048",
            "ratio": t["swa_8192"] / t["swa_2048"],
            "target": "~4 (linear)",
            "causal_ratio": t["causal_8192"] / t["causal_2048"],
            # the window's share of full causal attention's time at T 8192 (target <= 0.10)
            "swa_over_causal_8192": t["swa_8192"] / t["causal_8192"],
            "swa_over_causal_8192_flop_ratio": (8192 * w - w * (w - 1) / 2) / (8192 * 8193 / 2),
            "swa_s": [t["swa_2048"], t["swa_8192"]],
            "causal_s": [t["causal_2048"], t["causal_8192"]],
            "shape": dict(B=B, H=H, D=D, window=w),
        }
    )


def _default_scale(config_path: Path):
    config = yaml.safe_load(config_path.read_text())
    scale = config["pretraining"]["scales"]["tiny"]
    dar = next(s for s in config["pretraining"]["sweeps"] if s["scale"] == "tiny" and s["attention"] == "dar")
    first = lambda x: x[0] if isinstance(x, list) else x  # noqa: E731
    return scale, first(dar["window"]), first(dar["d_down"]), config["tokenizer"]["vocab_size"]


def bench_train_step(repeats, config_path: Path):
    scale, window, d_down, vocab = _default_scale(config_path)
    arch, train = scale["architecture"], scale["training"]
    T, B = train["seq_len"], train["batch_size"]
    models = {}
    for name, extra in {"vanilla": dict(attention="vanilla"),
                        "dar": dict(attention="dar", window=window, d_down=d_down)}.items():
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = DimAttnForCausalLM(DimAttnConfig(vocab_size=vocab, max_position_embeddings=T, **arch, **extra))
            models[name, precision] = (model.train(), torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    x = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0))

    def step(name, precision):
        def run():
            model, opt = models[name, precision]
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                loss = model(x, labels=x, return_logits=False).loss  # as training.py asks
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    t = interleaved({key: step(*key) for key in models}, repeats)
    for precision, suffix in (("fp32", ""), ("bf16", "_bf16")):
        dar, vanilla = t["dar", precision], t["vanilla", precision]
        emit({"name": f"c_dar_train_step_over_vanilla{suffix}", "ratio": dar / vanilla, "dar_s": dar,
              "vanilla_s": vanilla, "precision": precision,
              "model": {**arch, "window": window, "d_down": d_down, "vocab": vocab}, "batch": [B, T]})


def bench_bf16_kernel(repeats, config_path: Path):
    """DAR's blocked kernel, forward and backward, bf16 / fp32 on the same inputs."""
    scale, window, _, _ = _default_scale(config_path)
    arch = scale["architecture"]
    heads = arch["num_attention_heads"]
    shapes = {
        "default": (scale["training"]["batch_size"], heads, scale["training"]["seq_len"],
                    arch["hidden_size"] // heads, window),
        "a": (4, 8, 2048, 64, 128),
    }
    for label, (B, H, T, D, w) in shapes.items():
        inputs = {dtype: _qkv(5, B, H, T, D, grad=True, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}

        def run(dtype):
            return lambda: dar_attention(*inputs[dtype], w, kernel="blocked").sum().backward()

        t = interleaved({"fp32": run(torch.float32), "bf16": run(torch.bfloat16)}, repeats if T <= 512 else 3)
        emit({"name": f"e_dar_kernel_bf16_over_fp32_{label}", "ratio": t["bf16"] / t["fp32"], "target": "<= 1",
              "bf16_s": t["bf16"], "fp32_s": t["fp32"], "shape": dict(B=B, H=H, T=T, D=D, window=w)})


@torch.no_grad()
def _prefilled_cache(model, T, chunk=512):
    x = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    cache = None
    for start in range(0, T, chunk):
        out = model(x[:, start : start + chunk], cache=cache, use_cache=True)
        cache = out.cache
    return cache


def bench_cache_bytes(config_path: Path, T=4096):
    """Bytes are a property of the shapes, so the weights are left at their initialisation."""
    scale, window, d_down, vocab = _default_scale(config_path)
    shapes = {
        "default": (scale["architecture"], window, d_down, vocab),
        "pythia-70m": (dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8), 128, 128, 50304),
    }
    for label, (arch, w, dd, vocab) in shapes.items():
        nbytes = {}
        for name, extra in {
            "vanilla": dict(attention="vanilla"),
            "dar": dict(attention="dar", window=w, d_down=dd),
        }.items():
            torch.manual_seed(0)
            model = DimAttnForCausalLM(DimAttnConfig(vocab_size=vocab, max_position_embeddings=T, **arch, **extra))
            nbytes[name] = kv_cache_nbytes(_prefilled_cache(model.eval(), T))
        d = arch["hidden_size"]
        expected = (T * dd + (w - 1) * 2 * d) / (T * 2 * d)  # per layer, positions aside
        emit({"name": f"d_dar_cache_bytes_over_vanilla_{label}", "ratio": nbytes["dar"] / nbytes["vanilla"],
              "dar_bytes": nbytes["dar"], "vanilla_bytes": nbytes["vanilla"], "tokens": T,
              "expected_ratio": expected, "model": {**arch, "window": w, "d_down": dd}})


def bench_gpu(repeats, steps_per_measure=5):
    """Pythia-70M shapes, bf16 autocast, torch.compile, FlexAttention: tokens/s, MFU, DAR/vanilla."""
    device = torch.device("cuda")
    T, B, vocab = 2048, 16, 50304
    arch = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8)
    results = {}
    for name, extra in {"vanilla": dict(attention="vanilla"),
                        "dar": dict(attention="dar", window=128, d_down=128)}.items():
        torch.manual_seed(0)
        model = DimAttnForCausalLM(DimAttnConfig(vocab_size=vocab, max_position_embeddings=T, **arch, **extra)).to(
            device
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model)
        x = torch.randint(0, vocab, (B, T), device=device)

        def step():
            for _ in range(steps_per_measure):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = compiled(x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        seconds = interleaved({name: step}, repeats, device)[name] / steps_per_measure
        n_params = sum(p.numel() for p in model.parameters())
        # 6 N per token for the matmuls, plus causal attention's 6 L T d per token (half of 12 L T d)
        flops_per_token = 6 * n_params + 6 * arch["num_hidden_layers"] * T * arch["hidden_size"]
        tokens_per_s = B * T / seconds
        results[name] = seconds
        emit({"name": f"gpu_{name}_pythia70m_step", "ratio": tokens_per_s * flops_per_token / H200_BF16_FLOPS,
              "ratio_of": "MFU vs 790 TFLOP/s bf16", "tokens_per_s": tokens_per_s, "step_s": seconds,
              "params": n_params, "batch": [B, T], "device": torch.cuda.get_device_name()})
    emit({"name": "gpu_dar_over_vanilla_step", "ratio": results["dar"] / results["vanilla"]})


CPU_BENCHES = {"a": "dar", "b": "swa", "c": "step", "d": "cache", "e": "bf16"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--only", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e (cpu suite)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", type=Path, default=Path(__file__).resolve().parents[1] / "config.yaml")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as dimattn.pretraining.training does on CPU
    announce()
    if args.suite == "gpu":
        if not torch.cuda.is_available():
            parser.error("--suite gpu needs CUDA")
        bench_gpu(args.repeats)
        return
    only = set(args.only.split(","))
    unknown = only - set(CPU_BENCHES)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from a,b,c,d,e")
    if "a" in only:
        bench_dar_vs_sdpa(args.repeats)
    if "b" in only:
        bench_swa_scaling(args.repeats)
    if "c" in only:
        bench_train_step(args.repeats, args.config)
    if "d" in only:
        bench_cache_bytes(args.config)
    if "e" in only:
        bench_bf16_kernel(args.repeats, args.config)


if __name__ == "__main__":
    main()
