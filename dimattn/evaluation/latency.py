"""Inference latency of projected models (seed 003, Appendix H): prefill time, time per decoded
token, tokens/s, KV-cache bytes and peak memory of the base model, SnapKV and DimPO's projection
(on the last half and on every layer, alone and with SnapKV), measured in one process.

Each setting runs back to back with the base model in every repeat and each ratio is the median
of the repeats' ratios, so that machine noise hits both sides alike (the brief's rule: speed is
checked by ratios measured side by side, never by timed unit tests). Peak memory is CUDA's
allocator peak of a run (``torch.cuda.max_memory_allocated``); a CPU process has no per-run
peak, so there it is the weights plus the KV cache after decoding.

Used by the workflow's ``latency`` rule (one job, every core: nothing runs beside it) and by
``benchmarks/projected.py`` (a random Llama of chosen shape).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from dimattn.model.atomic import write_json
from dimattn.model.modeling_projected import attach_projections, attention_modules


def settings(n_layers: int, projections: dict, prompt: int) -> dict[str, tuple[dict, int, dict | None]]:
    """{name: (projections, l, kv)}: SnapKV keeps a quarter of the prompt (window 32, kernel 5,
    the authors' defaults; at most half the budget), DimPO's projection on the last half and on
    every layer, and on every layer with SnapKV."""
    budget = max(prompt // 4, 2)
    snap = {"snapkv": {"budget": budget, "window": min(32, budget // 2), "kernel": 5}}
    return {
        "snapkv": ({}, 0, snap),
        f"dimpo l={n_layers // 2}": (projections, n_layers // 2, None),
        f"dimpo l={n_layers}": (projections, n_layers, None),
        f"dimpo l={n_layers} + snapkv": (projections, n_layers, snap),
    }


@torch.no_grad()
def _run(model, prompt, new: int, device: str) -> tuple[float, float, int, int | None]:
    """(prefill seconds, seconds per decoded token, cache bytes, CUDA peak bytes or None)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(new):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / max(new, 1), cache.nbytes(), torch.cuda.max_memory_allocated() if cuda else None


def measure(base, projections: dict, prompt_len: int, new: int, repeats: int, device: str = "cpu",
            vocab_size: int | None = None, seed: int = 2) -> list[dict]:
    """One row per setting (the base model first): medians over ``repeats`` of prefill seconds,
    seconds per decoded token, tokens/s, cache bytes and peak bytes, and each as a ratio to the
    base model's (median of the paired repeats). ``base`` is a causal LM on ``device``; it is
    copied, never changed, for each setting."""
    if repeats < 1 or new < 1 or prompt_len < 2:
        raise ValueError(f"need repeats >= 1, new >= 1, prompt >= 2; got {repeats}, {new}, {prompt_len}")
    n_layers = len(attention_modules(base))
    base = attach_projections(copy.deepcopy(base), {}, 0)  # the same attention path, nothing projected
    vocab = vocab_size or base.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed)).to(device)
    models = {"base": (base, 0, "none")}
    for name, (p, l, kv) in settings(n_layers, projections, prompt_len).items():
        models[name] = (attach_projections(copy.deepcopy(base), p, l, kv=kv), l, next(iter(kv)) if kv else "none")
    weights = sum(t.numel() * t.element_size() for t in base.parameters())
    for model, _, _ in models.values():
        _run(model, prompt, 2, device)  # warm-up
    rows = []
    for name, (model, l, kv) in models.items():
        pairs = [(_run(base, prompt, new, device), _run(model, prompt, new, device)) for _ in range(repeats)]
        mine = [m for _, m in pairs]
        peak = [m[3] if m[3] is not None else weights + m[2] for m in mine]
        base_peak = [b[3] if b[3] is not None else weights + b[2] for b, _ in pairs]
        row = {"setting": name, "num_projected": l, "kv": kv, "prompt": prompt_len, "new": new, "repeats": repeats,
               "device": device, "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),
               "prefill_s": statistics.median(m[0] for m in mine),
               "decode_s": statistics.median(m[1] for m in mine),
               "cache_bytes": statistics.median(m[2] for m in mine),
               "peak_bytes": statistics.median(peak),
               "peak_kind": "cuda_max_allocated" if mine[0][3] is not None else "weights_plus_cache"}
        row["tokens_per_s"] = 1.0 / row["decode_s"]
        for key, i in (("prefill", 0), ("decode", 1), ("cache", 2)):
            row[f"{key}_ratio"] = statistics.median(m[i] / b[i] if b[i] else float("nan") for b, m in pairs)
        row["peak_ratio"] = statistics.median(p / b for p, b in zip(peak, base_peak))
        rows.append(row)
    return rows


def latency_to_file(source: str, projections_path, out_json, model_name: str, prompt: int, new: int,
                    repeats: int, device: str) -> list[dict]:
    """The rows of :func:`measure` for the model at ``source`` (our run directory or a hub name)
    with the fitted projections at ``projections_path``, as JSON with the model's name."""
    from transformers import AutoModelForCausalLM

    from dimattn.model.affine import load_projections
    from dimattn.model.hf import is_dimattn_directory

    projections = load_projections(projections_path)[0]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=is_dimattn_directory(source), dtype=dtype)
    rows = measure(model.to(device).eval(), projections, prompt, new, repeats, device)
    rows = [{"model": model_name, "d_prime": int(next(iter(projections.values())).W.shape[0]), **r} for r in rows]
    write_json(rows, out_json)
    return rows
