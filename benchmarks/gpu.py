"""GPU readiness in one run (issue 16, item 5), one JSON object per line.

    python benchmarks/gpu.py                        # one CUDA GPU, full shapes, well under 10 minutes
    python benchmarks/gpu.py --device cpu --small   # every section at tiny shapes on CPU (the test's run)
    python benchmarks/gpu.py --only kernels,fit     # a subset of kernels, train, fit, capture

Sections, in order (each line names its section; ``elapsed_s`` is the section's wall time):

- ``matmul_peak``: a square bf16 matmul on random data (n = 8192 on CUDA, 1024 on CPU; the fastest call on CPU), FLOP/s: the peak the
  MFU lines divide by, beside benchmarks/attention.py's constant for the H200 (790 TFLOP/s).
- ``kernels``: the DAR, sliding-window and dilated FlexAttention kernels (``kernel="flex"``, what
  "auto" picks on CUDA) in bf16 against the CPU reference kernel ("dense") in float64 on the same
  bf16 inputs, plus the CPU training kernel ("blocked") in bf16 as a baseline: outputs and the
  gradients of q, k, v (and the far keys/values of DAR) under one random upstream gradient. Per
  tensor: max_abs = max |x - ref|, max_rel = max_abs / max |ref|, rel_norm = ||x - ref|| / ||ref||.
  A check passes when every tensor is finite with rel_norm <= 2e-2 and max_rel <= 5e-2 (bf16
  operands land between 1e-3 and 1e-2 by norm: device METHOD notes). T is not a multiple of
  FlexAttention's 128-block at one shape. Off CUDA FlexAttention runs unfused and forward-only,
  so gradients are skipped there (a ``skipped`` line says so; the test runs the gradient checks
  on CPU with the blocked kernel as ``KERNEL``).
- ``kernel_speed``: each FlexAttention kernel through the library call (``kernel="flex"``) over causal
  SDPA (what vanilla attention runs), forward+backward on CUDA at Pythia-70M's attention shape (B=16, H=8,
  T=2048, D=64) at w = 128 and 512, bf16; forward alone at tiny shapes with --small off CUDA (unfused there).
  Each line puts ``time_ratio_over_sdpa`` beside ``live_pair_ratio`` (live (query, key) pairs of the
  mask_mod over causal's) and what decides whether time can follow them: the BlockMask's block size and
  full / partial / empty block counts, its sparsity, ``computed_blocks_over_causal`` (the floor a
  block-sparse kernel can reach), ``mask_build_s`` (built outside the timed step), whether the timed
  calls reused the cached mask (``mask_cached``), the same kernel with the mask passed in directly
  (``flex_prebuilt_mask_ms``), and ``compiled``: whether the call ran one of flex_attention's own compiled
  graphs (past dynamo's recompile limit it silently runs the unfused path; a check on CUDA).
- ``train``: one optimizer step of dimattn.pretraining.training's loop (bf16 autocast, forward with the loss,
  backward, clipping, configure_optimizer's fused AdamW) on Pythia-70M's shapes (6 layers, d=512,
  8 heads, rotary_pct 0.25, vocab 50,304, seq 2048; vanilla and DAR w=128, d_down=128), through
  torch.compile as training.compile does on CUDA (skipped off CUDA): tokens/s and MFU, FLOPs
  counted as benchmarks/training.py counts them (step_flops), and the graph breaks dynamo took
  (a check: a compiled model must trace whole, FlexAttention and its masks included).
- ``fit``: dimattn.dimpo.projections.fit_layer (what fit_to_file, the fit_projection rule's code, calls
  per layer) with objective dimpo at d' = 64 on a synthetic capture of Llama-3.1-8B's layer shape
  (32 query heads, 8 KV heads, head_dim 128, 4,096 keys a list, the authors' settings: batch 1):
  instances/s from the time of S more steps (a run of s0 + S steps minus one of s0).
- ``capture``: dimattn.dimpo.capture.capture_qkv on a random two-layer LlamaConfig model with
  Llama-3.1-8B's layer (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128,256) at seq 4096,
  in float32 (capture_dtype's default): the allocator's peak GPU memory
  (torch.cuda.max_memory_allocated) and the host's peak RSS over the capture, against the bytes
  of the captured tensors.
- ``pretrain``: dimattn.pretraining.training.pretrain, the pretrain rule's loop (bf16 autocast, torch.compile,
  checkpoints, the save_pretrained export), on config.yaml's recall corpus and scale (the corpus
  generated here: dimattn.data.recall), vanilla and DAR at w = 4, d_down = 4 (vanilla alone with
  --small); then the exported directory is loaded and scored through its KV cache
  (dimattn.data.recall.score_recall, as the recall rule does). A check passes when the validation
  loss fell to half the first step's loss, recall is at least twice chance and the compiled
  model traced whole. steps/s, wall time, graph breaks.
- ``summary``: every failed check by name; the exit status is 1 when any failed.
"""

import argparse
import ctypes
import platform
import resource
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._host import matmul_peak as host_matmul_peak  # noqa: E402
from benchmarks.attention import H200_BF16_FLOPS, emit, interleaved  # noqa: E402
from benchmarks.training import step_flops  # noqa: E402
from dimattn import DimAttnConfig, DimAttnForCausalLM  # noqa: E402
from dimattn.model import attention as attn  # noqa: E402
from dimattn.model.attention import dar_attention, dilated_attention, sliding_window_attention  # noqa: E402
from dimattn.pretraining.precision import autocast  # noqa: E402
from dimattn.pretraining.training import TrainConfig, configure_optimizer, keep_freed_memory  # noqa: E402

SECTIONS = ("kernels", "kernel_speed", "train", "fit", "capture", "pretrain")
TOLERANCE = {"rel_norm": 2e-2, "max_rel": 5e-2}  # of every checked tensor, bf16 against float64
KERNEL = "flex"  # the kernel checked; the test swaps in "blocked" to run the gradient checks on CPU

# (B, H, T, D, window) of the kernel checks; dilation 4 (DimAttnConfig's default).
KERNEL_SHAPES = {"full": [(2, 8, 1000, 64, 128), (1, 8, 2048, 64, 256)],
                 "small": [(1, 2, 150, 16, 20), (2, 2, 64, 16, 16)]}
DILATION = 4
# kernel_speed: (B, H, T, D) and the windows. full: Pythia-70M's attention shape, w 128 and a wider one so
# the run shows time against live pairs at two points; small: T of 4 blocks of 128, two windows whose
# block masks differ (at one block each, w 16 and w 64 would cover the same blocks)
SPEED = {"full": dict(shape=(16, 8, 2048, 64), windows=(128, 512)),
         "small": dict(shape=(1, 2, 512, 16), windows=(128, 256))}
PYTHIA_70M = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, rotary_pct=0.25)
SHAPES = {
    # Pythia-70M: (architecture, vocab, seq, batch); DAR w=128, d_down=d/4 as benchmarks/attention.py's gpu suite
    "train": {"full": (PYTHIA_70M, 50304, 2048, 16),
              "small": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25), 256, 32, 2)},
    # Llama-3.1-8B's layer: (sequences, heads, kv_heads, keys, head_dim, d', s0, S)
    "fit": {"full": (2, 32, 8, 4096, 128, 64, 20, 500), "small": (1, 4, 2, 128, 16, 4, 2, 6)},
    # (hidden, heads, kv_heads, mlp, vocab, layers, seq, sequences)
    "capture": {"full": (4096, 32, 8, 14336, 128256, 2, 4096, 2), "small": (64, 4, 2, 128, 256, 2, 32, 2)},
}

failures: list[str] = []


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def skipped(section, what, reason):
    emit({"name": "skipped", "section": section, "what": what, "reason": reason})


# --- matmul peak -------------------------------------------------------------------------------


def matmul_peak(device, small, repeats=10):
    """bf16 FLOP/s of an n x n matmul on random data (never zeros: they run faster on an H200). On a
    CPU the fastest single call at this process's threads (benchmarks/_host.py's measure): a median
    of 256-wide calls is mostly call overhead there, below what a model step reaches (CI's host read
    an MFU of 1.02 against it)."""
    cuda = device.type == "cuda"
    n = (256 if small else 8192) if cuda else (512 if small else 1024)  # 8192 on a CPU: minutes
    if cuda:
        g = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(n, n, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        loops = 4 if small else 20
        seconds = interleaved({"mm": lambda: [torch.mm(a, b, out=out) for _ in range(loops)]}, repeats, device)["mm"]
        flops = 2 * n**3 * loops / seconds
    else:
        flops = host_matmul_peak(torch.bfloat16, n=n, threads=torch.get_num_threads()) * 1e9
    emit({"name": "matmul_peak", "dtype": "bfloat16", "n": n, "tflops": round(flops / 1e12, 3), "flop_per_s": flops,
          "measure": "median of interleaved loops" if cuda else "fastest call",
          "h200_constant_tflops": H200_BF16_FLOPS / 1e12, "device": _device_name(device)})
    return flops


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# --- FlexAttention against the CPU kernels -----------------------------------------------------

PATTERNS = {
    "dar": (5, lambda ts, w, kernel: dar_attention(*ts, w, kernel=kernel)),
    "swa": (3, lambda ts, w, kernel: sliding_window_attention(*ts, w, kernel=kernel)),
    "dilated": (3, lambda ts, w, kernel: dilated_attention(*ts, w, DILATION, kernel=kernel)),
}


def errors(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    diff = (x - ref).abs()
    finite = bool(torch.isfinite(x).all())
    max_ref = float(ref.abs().max())
    return {"max_abs": float(diff.max()), "max_rel": float(diff.max()) / max_ref if max_ref else float("inf"),
            "rel_norm": float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)), "finite": finite}


def within(err):
    return err["finite"] and all(err[key] <= tol for key, tol in TOLERANCE.items())


def _outputs(fn, ts, window, kernel, grad_out, backward):
    """(out, grads of the inputs) of fn on leaf copies of ts."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in ts]
    out = fn(leaves, window, kernel)
    if not backward:
        return out.detach(), []
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out.detach(), list(grads)


def check_kernels(device, small):
    backward = device.type == "cuda" or KERNEL != "flex"
    if not backward:
        skipped("kernels", "FlexAttention backward (gradients)",
                f"FlexAttention compiles its backward on CUDA only; on {device.type} it runs unfused, forward-only")
    for pattern, (n_inputs, fn) in PATTERNS.items():
        for B, H, T, D, w in KERNEL_SHAPES["small" if small else "full"]:
            g = torch.Generator().manual_seed(zlib.crc32(f"{pattern}{T}".encode()))  # fresh inputs per check
            ts = [torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(n_inputs)]
            grad_out = torch.randn(B, H, T, D, generator=g).to(torch.bfloat16)
            start = time.perf_counter()
            flex, flex_grads = _outputs(fn, [t.to(device) for t in ts], w, KERNEL, grad_out.to(device), backward)
            _sync(device)
            flex_s = time.perf_counter() - start  # includes the compilation of this shape
            ref, ref_grads = _outputs(fn, [t.double() for t in ts], w, "dense", grad_out.double(), backward)
            cpu, cpu_grads = _outputs(fn, ts, w, "blocked", grad_out, backward)
            names = ["out"] + [f"grad_{n}" for n in ("q", "k", "v", "k_far", "v_far")[:n_inputs]][: len(ref_grads)]
            flex_err = {n: errors(x, r) for n, x, r in zip(names, [flex, *flex_grads], [ref, *ref_grads])}
            cpu_err = {n: errors(x, r) for n, x, r in zip(names, [cpu, *cpu_grads], [ref, *ref_grads])}
            passed = all(within(e) for e in flex_err.values())
            name = f"{KERNEL}_{pattern}_T{T}"
            if not passed:
                failures.append(name)
            emit(
                {
                    "name": "kernel_check",
                    "section": "kernels",
                    "check": name,
                    "pattern": pattern,
                    "passed": passed,
                    "kernel": KERNEL,
                    "dtype": "bfloat16",
                    "device": device.type,
                    "reference": "dense, float64, cpu",
                    "gradients": backward,
                    "errors": flex_err,
                    "cpu_blocked_bf16_errors": cpu_err,
                    "tolerance": TOLERANCE,
                    "flex_first_call_s": round(flex_s, 3),
                    "shape": dict(
                        B=B, H=H, T=T, D=D, window=w, **({"dilation": DILATION} if pattern == "dilated" else {})
                    ),
                }
            )


def _live_pairs(pattern, T, w):
    """Live (query, key) pairs of a pattern's mask_mod, evaluated densely on CPU: what the kernel is told."""
    kv_len = 2 * T if pattern == "dar" else T
    i, j = torch.arange(T)[:, None], torch.arange(kv_len)[None, :]
    return int(attn._FLEX_MASKS[pattern](T, w, DILATION)(0, 0, i, j).sum())


def _block_stats(mask):
    """Block counts of a BlockMask (one batch and head: the masks broadcast). kv_num_blocks counts the
    partial blocks (mask_mod applied per element) once full_kv_num_blocks holds the full ones."""
    bq, bk = mask.BLOCK_SIZE
    q_blocks, kv_blocks = -(-mask.seq_lengths[0] // bq), -(-mask.seq_lengths[1] // bk)
    partial = int(mask.kv_num_blocks.sum())
    full = int(mask.full_kv_num_blocks.sum()) if mask.full_kv_num_blocks is not None else 0
    total = q_blocks * kv_blocks
    return {"block_size": [bq, bk], "q_blocks": q_blocks, "kv_blocks": kv_blocks, "total_blocks": total,
            "full_blocks": full, "partial_blocks": partial, "empty_blocks": total - full - partial,
            "sparsity": round(mask.sparsity() / 100, 6)}


def _ran_compiled(call):
    """Whether one call ran a graph compiled from flex_attention itself. Past dynamo's recompile limit the
    compiled wrapper runs flex_attention eagerly (unfused) with no error, and eager flex_attention compiles
    an inner wrapper of its own, so a compiled region alone proves nothing: it must be one of
    flex_attention's cache entries."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    own = {getattr(entry, "trace_annotation", None) or f"Torch-Compiled Region: {entry.compile_id}"
           for entry in _flex_cache_entries()}
    return any(event.name in own for event in prof.events())


def _flex_cache_entries():
    """dynamo's compiled graphs of flex_attention itself."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    return _debug_get_cache_entry_list(flex_attention)


def kernel_speed(device, small, repeats=None):
    """Each flex kernel / causal SDPA beside its live (query, key) pairs / causal's, with what decides
    whether time can follow them: the BlockMask's blocks, where the mask is built, whether compiled."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    cuda = device.type == "cuda"
    if not cuda and not small:
        skipped("kernel_speed", "FlexAttention timing",
                "full shapes off CUDA: the unfused path materialises B*H*T*T scores; run with --small")
        return
    if not cuda:
        skipped("kernel_speed", "FlexAttention backward timing",
                f"FlexAttention compiles its backward on CUDA only; on {device.type} forward alone is timed")
    import torch.nn.functional as F

    speed = SPEED["small" if small else "full"]
    B, H, T, D = speed["shape"]
    repeats = repeats or (20 if cuda else 3)
    g = torch.Generator(device=device).manual_seed(0)
    # no grad off CUDA: FlexAttention refuses inputs that require it there
    ts = [torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(cuda)
          for _ in range(5)]
    grad = torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.bfloat16)
    kv2 = [torch.cat(ts[i:5:2], -2).detach().requires_grad_(cuda) for i in (1, 2)]  # DAR's keys, values
    kernel_fn = attn._compiled_flex()  # what the library calls outside a compiled model

    def step(fn):  # one timed step: forward+backward where flex has a backward (CUDA), else forward
        return (lambda: fn().backward(grad)) if cuda else fn

    causal = T * (T + 1) / 2
    cases = {"sdpa": step(lambda: F.scaled_dot_product_attention(*ts[:3], is_causal=True))}
    if cuda:
        cases["sdpa_fwd"] = lambda: F.scaled_dot_product_attention(*ts[:3], is_causal=True)
    info = {}
    for w in speed["windows"]:
        for pattern, (n_inputs, fn) in PATTERNS.items():
            key = f"{pattern}_w{w}"
            start = time.perf_counter()
            fresh = attn._create_block_mask(pattern, T, w, DILATION, device)  # what a miss of the cache costs
            _sync(device)
            build_first = time.perf_counter() - start
            mask_build_s = interleaved({"build": lambda: attn._create_block_mask(pattern, T, w, DILATION, device)}, 3,
                                       device)["build"]
            library = step(lambda fn=fn, n=n_inputs, w=w: fn(ts[:n], w, "flex"))
            mask = attn._cached_block_mask(pattern, T, w, DILATION, str(ts[0].device))  # the library's object
            kv = kv2 if pattern == "dar" else ts[1:3]
            prebuilt = step(lambda kv=kv, mask=mask: kernel_fn(ts[0], *kv, block_mask=mask))
            start = time.perf_counter()
            library()  # compiles this pattern and shape where the kernel is compiled
            _sync(device)
            first_call_s = time.perf_counter() - start
            misses = attn._cached_block_mask.cache_info().misses
            compiled = _ran_compiled(library)
            info[key] = dict(pattern=pattern, w=w, mask=fresh, mask_build_s=mask_build_s, build_first_s=build_first,
                             first_call_s=first_call_s, compiled=compiled,
                             built_in_call=attn._cached_block_mask.cache_info().misses - misses,
                             live=_live_pairs(pattern, T, w))
            cases[key], cases[f"{key}_prebuilt"] = library, prebuilt
            if cuda:
                cases[f"{key}_fwd"] = lambda fn=fn, n=n_inputs, w=w: fn(ts[:n], w, "flex")
            if kernel_fn is not flex_attention and not compiled:
                failures.append(f"kernel_speed_{key}_not_compiled")
    misses, frames = attn._cached_block_mask.cache_info().misses, counters["frames"]["total"]
    t = interleaved(cases, repeats, device)
    misses, frames = attn._cached_block_mask.cache_info().misses - misses, counters["frames"]["total"] - frames
    for key, rec in info.items():
        stats = _block_stats(rec["mask"])
        q_blocks = stats["q_blocks"]
        computed = stats["full_blocks"] + stats["partial_blocks"]
        record = {
            "name": "kernel_speed",
            "section": "kernel_speed",
            "pattern": rec["pattern"],
            "window": rec["w"],
            "timed": "forward+backward" if cuda else "forward",
            "live_pair_ratio": round(rec["live"] / causal, 6),
            "time_ratio_over_sdpa": round(t[key] / t["sdpa"], 4),
            # the least time a block-sparse kernel can take over causal's blocks at this block size
            "computed_blocks_over_causal": round(computed / (q_blocks * (q_blocks + 1) / 2), 4),
            "flex_ms": round(1e3 * t[key], 3),
            "flex_prebuilt_mask_ms": round(1e3 * t[f"{key}_prebuilt"], 3),
            "sdpa_causal_ms": round(1e3 * t["sdpa"], 3),
            **stats,
            "mask_build_s": round(rec["mask_build_s"], 6),
            "mask_first_build_s": round(rec["build_first_s"], 4),
            "mask_built_in_timed_call": bool(rec["built_in_call"]),
            "mask_cache_misses_during_timing": misses,
            "mask_cached": not rec["built_in_call"] and not misses,
            "compiled": rec["compiled"],
            "dynamo_frames_compiled_during_timing": frames,
            "kernel_fn": (
                "flex_attention (eager: unfused, scores materialised)"
                if kernel_fn is flex_attention
                else "torch.compile(flex_attention)"
            ),
            "flex_cache_entries": len(_flex_cache_entries()),
            "recompile_limit": torch._dynamo.config.recompile_limit,
            "first_call_s": round(rec["first_call_s"], 3),
            "shape": dict(
                B=B, H=H, T=T, D=D, window=rec["w"], **({"dilation": DILATION} if rec["pattern"] == "dilated" else {})
            ),
            "dtype": "bfloat16",
            "device": _device_name(device),
        }
        if cuda:
            record |= {"fwd_ratio_over_sdpa": round(t[f"{key}_fwd"] / t["sdpa_fwd"], 4),
                       "flex_fwd_ms": round(1e3 * t[f"{key}_fwd"], 3), "sdpa_fwd_ms": round(1e3 * t["sdpa_fwd"], 3)}
        emit(record)


# --- Pythia-70M training step ------------------------------------------------------------------


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def train_step(device, small, peak, repeats):
    arch, vocab, T, B = SHAPES["train"]["small" if small else "full"]
    cuda = device.type == "cuda"
    if not cuda:
        skipped("train", "torch.compile",
                f"dimattn.pretraining.training compiles on CUDA only (training.compile is ignored on {device.type})")
    cfg = TrainConfig(seq_len=T, batch_size=B, max_steps=1, lr=1e-3, precision="bf16", compile=cuda)  # lr: Pythia-70M's
    x = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    cases, flops, params = {}, {}, {}
    d = arch["hidden_size"]
    breaks = _graph_breaks()
    for variant, extra in {"vanilla": dict(attention="vanilla"),
                           "dar": dict(attention="dar", window=min(128, T // 2), d_down=d // 4)}.items():
        torch.manual_seed(0)
        model = DimAttnForCausalLM(DimAttnConfig(vocab_size=vocab, max_position_embeddings=T, **arch, **extra)).to(
            device
        )
        model.train()
        optimizer = configure_optimizer(model, cfg)
        forward = torch.compile(model) if cfg.compile else model  # as dimattn.pretraining.training._train

        def step(model=model, forward=forward, optimizer=optimizer):
            with autocast(device.type, cfg.precision):
                loss = forward(x, labels=x, return_logits=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        start = time.perf_counter()
        for _ in range(2 if cfg.compile else 1):  # compilation, then the first step with optimizer state
            step()
        _sync(device)
        graph_breaks = _graph_breaks() - breaks
        breaks += graph_breaks
        if graph_breaks:
            failures.append(f"train_{variant}_graph_breaks")
        emit({"name": "train_warmup", "section": "train", "variant": variant, "compiled": cfg.compile,
              "seconds": round(time.perf_counter() - start, 3), "graph_breaks": graph_breaks})
        cases[variant], flops[variant] = step, step_flops(model, B, T)
        params[variant] = sum(p.numel() for p in model.parameters())
    t = interleaved(cases, repeats, device)
    for variant, seconds in t.items():
        achieved = flops[variant] / seconds
        emit({"name": "train_step", "section": "train", "variant": variant, "tokens_per_s": round(B * T / seconds, 1),
              "step_s": round(seconds, 5), "flop_per_step": flops[variant],
              "model_tflops": achieved / 1e12, "mfu": achieved / peak, "mfu_of": "matmul_peak",
              "mfu_vs_h200_constant": achieved / H200_BF16_FLOPS, "precision": "bf16 autocast",
              "compiled": cfg.compile, "params": params[variant], "batch": [B, T], "repeats": repeats,
              "model": {**arch, "vocab": vocab}, "device": _device_name(device)})
    emit({"name": "train_dar_over_vanilla", "section": "train", "ratio": round(t["dar"] / t["vanilla"], 4)})


# --- DimPO fit step ----------------------------------------------------------------------------


def fit_step(device, small):
    from dimattn.dimpo.projections import fit_layer
    from dimattn.dimpo.fit_settings import resolve_settings

    n, heads, kv_heads, keys, head_dim, d_prime, s0, extra = SHAPES["fit"]["small" if small else "full"]
    g = torch.Generator().manual_seed(0)
    capture = {"q": torch.randn(n, heads, keys, head_dim, generator=g),
               "k": torch.randn(n, kv_heads, keys, head_dim, generator=g),
               "v": torch.randn(n, kv_heads, keys, head_dim, generator=g)}
    capture = {name: t.to(device) for name, t in capture.items()}
    settings = resolve_settings("dimpo", {})

    def run(steps):
        _sync(device)
        start = time.perf_counter()
        fit_layer(capture, "dimpo", d_prime, {"steps": steps}, progress=False, device=device)
        _sync(device)
        return time.perf_counter() - start

    run(s0)  # warm-up: kernels, allocator
    base, longer = run(s0), run(s0 + extra)
    seconds = max(longer - base, 1e-9)
    emit({"name": "fit_step", "section": "fit", "objective": "dimpo", "d_prime": d_prime,
          "instances_per_s": round(extra * settings.batch_size / seconds, 2), "step_s": round(seconds / extra, 6),
          "steps_timed": extra, "batch_size": settings.batch_size, "keys_per_instance": keys,
          "setup_s": round(base - s0 * seconds / extra, 4),
          "capture_shape": {"sequences": n, "heads": heads, "kv_heads": kv_heads, "keys": keys, "head_dim": head_dim},
          "device": _device_name(device)})


# --- capture of one Llama-3.1-8B layer ---------------------------------------------------------


def _status(key):  # bytes, from /proc/self/status (VmRSS: now; VmHWM: the peak since the reset)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), after handing freed heap back."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def capture_layer(device, small):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dimattn.dimpo.capture import capture_qkv

    hidden, heads, kv_heads, mlp, vocab, layers, T, n = SHAPES["capture"]["small" if small else "full"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=T,
                         rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no 6 GB host copy first
        model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(0))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    resettable = _reset_host_peak()
    rss_before = _status("VmRSS")
    start = time.perf_counter()
    capture = capture_qkv(model, ids, batch_size=1)
    _sync(device)
    seconds = time.perf_counter() - start
    host_peak = _status("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    captured = sum(t.numel() * t.element_size() for parts in capture.values() for t in parts.values()
                   if torch.is_tensor(t))
    record = {"name": "capture", "section": "capture", "captured_bytes": captured, "model_bytes": model_bytes,
              "host_rss_before_bytes": rss_before, "host_peak_rss_bytes": host_peak,
              "host_peak_increase_bytes": host_peak - rss_before,
              "host_peak_over_captured": round((host_peak - rss_before) / captured, 3),
              "host_peak_of": "the capture (VmHWM reset before it)" if resettable else "the whole process (ru_maxrss)",
              "seconds": round(seconds, 3), "dtype": "float32", "batch_size": 1,
              "layer": {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": hidden // heads,
                        "mlp": mlp, "vocab": vocab, "layers": layers}, "sequences": n, "seq_len": T,
              "device": _device_name(device)}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        record |= {"gpu_peak_bytes": peak, "gpu_peak_over_model": round(peak / model_bytes, 3),
                   "gpu_peak_over_captured": round(peak / captured, 3)}
    else:
        skipped("capture", "peak GPU memory", "torch.cuda.max_memory_allocated needs CUDA")
    emit(record)


# --- the pretrain rule's loop, end to end -------------------------------------------------------

# full: the default config's recall scale as it trains (1,200 steps; DAR at d_down = 4 reaches
# about 0.83 there on CPU); small: the vanilla run alone on fewer examples, long enough to learn
# (the CPU test's run)
PRETRAIN = {"full": dict(n_train=40000, max_steps=1200, variants=("vanilla", "dar")),
            "small": dict(n_train=2000, max_steps=240, variants=("vanilla",))}


def pretrain_run(device, small):
    import tempfile

    import pandas as pd
    import yaml

    from dimattn.evaluation.scoring import load_model
    from dimattn.data.recall import RecallSettings, score_recall, write_recall_corpus
    from dimattn.pretraining.training import pretrain

    size = PRETRAIN["small" if small else "full"]
    cuda = device.type == "cuda"
    config = yaml.safe_load((ROOT / "config.yaml").read_text())  # datasets.recall, scales.recall
    scale = config["pretraining"]["scales"]["recall"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_recall_corpus(RecallSettings.from_spec(config["datasets"]["recall"] | {"n_train": size["n_train"]}),
                            root / "recall")
        tokens = root / "recall" / "tokens"
        steps = size["max_steps"]
        cfg = TrainConfig.from_dict(scale["training"] | dict(max_steps=steps, eval_interval=steps // 6,
                                                             checkpoint_interval=steps // 3, precision="auto",
                                                             compile=cuda))
        arch = scale["architecture"]
        variants = {"vanilla": dict(attention="vanilla"), "dar": dict(attention="dar", window=4, d_down=4)}
        for variant in size["variants"]:
            extra = variants[variant]
            breaks = _graph_breaks()
            start = time.perf_counter()
            out = pretrain({**arch, **extra}, cfg, tokens / "train.bin", tokens / "validation.bin",
                           root / "recall" / "tokenizer", root / "models" / variant, root / "ckpt" / variant,
                           device=str(device))
            seconds = time.perf_counter() - start
            graph_breaks = _graph_breaks() - breaks
            metrics = pd.read_csv(out / "metrics.csv")
            first = float(metrics["train_loss"].iloc[0])  # the first step's: untrained
            val = metrics["val_loss"].dropna().tolist()
            recall = score_recall(load_model(out, str(device)), tokens / "test.bin", 64, through_cache=True)
            passed = val[-1] <= first / 2 and recall["accuracy"] >= 2 * recall["chance"] and not graph_breaks
            if not passed:
                failures.append(f"pretrain_{variant}")
            emit({"name": "pretrain", "section": "pretrain", "variant": variant, "passed": passed,
                  "steps": steps, "seconds": round(seconds, 2), "steps_per_s": round(steps / seconds, 1),
                  "compiled": cfg.compile, "graph_breaks": graph_breaks, "train_loss_first": round(first, 4),
                  "val_loss_last": round(val[-1], 4), "recall_accuracy": recall["accuracy"],
                  "chance": recall["chance"], "model": {**arch, **extra}, "device": _device_name(device)})


# --- main --------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU test's run)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed training steps (default 10, 2 with --small)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    only = args.only.split(",")
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu --small runs every section on CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        keep_freed_memory()  # as dimattn.pretraining.training does on CPU
    else:
        torch._logging.set_logs(graph_breaks=True)  # each break's reason on stderr, beside the count
    total = time.perf_counter()
    emit({"name": "env", "device": _device_name(device), "torch": torch.__version__, "small": args.small,
          "cuda": torch.version.cuda, "threads": torch.get_num_threads(), "sections": only})
    peak = matmul_peak(device, args.small)
    steps = {"kernels": lambda: check_kernels(device, args.small),
             "kernel_speed": lambda: kernel_speed(device, args.small),
             "train": lambda: train_step(device, args.small, peak, args.repeats or (2 if args.small else 10)),
             "fit": lambda: fit_step(device, args.small),
             "capture": lambda: capture_layer(device, args.small),
             "pretrain": lambda: pretrain_run(device, args.small)}
    for section in SECTIONS:
        if section not in only:
            continue
        start = time.perf_counter()
        try:
            steps[section]()
        except Exception as error:  # one failing section must not hide the others' figures
            failures.append(section)
            emit({"name": "error", "section": section, "error": f"{type(error).__name__}: {error}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit({"name": "section_done", "section": section, "elapsed_s": round(time.perf_counter() - start, 2)})
    emit({"name": "summary", "passed": not failures, "failed": failures,
          "elapsed_s": round(time.perf_counter() - total, 2)})
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
