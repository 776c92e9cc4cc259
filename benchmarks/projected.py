"""Latency and cache size of projected models (seed 003, Appendix H), one JSON object per line.

    python benchmarks/projected.py                 # CPU: a small Llama (GQA), 2 threads
    python benchmarks/projected.py --device cuda   # the same shapes on CUDA, bf16

Each line compares a setting with the base model, measured in the same process, the two back
to back in every repeat (the median of the repeats' ratios), so that machine noise hits both
sides alike:

(a) prefill of a ``--prompt``-token prompt: time / the base model's;
(b) decoding ``--new`` tokens after it: time per token / the base model's;
(c) the KV cache's bytes after decoding / the base model's.

Settings: DimPO-style projections (random weights: latency does not depend on their values) of
the last half and of every layer at d' = head_dim / 2, SnapKV (budget a quarter of the prompt)
and KIVI-2 and -4 (dimattn.kv_compression), alone and with the projection on every layer. KIVI
here quantises and dequantises in torch (simulated, as KIVI's own accuracy runs), so its time is
an upper bound on a packed kernel's; SnapKV's and the projection's are what they cost.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dimattn.affine import Affine  # noqa: E402
from dimattn.modeling_projected import attach_projections, attention_modules  # noqa: E402


def build(args):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new + 8)
    return LlamaForCausalLM(config).eval()


def projections(model, d_prime):
    g = torch.Generator().manual_seed(1)
    d = next(iter(attention_modules(model).values())).head_dim
    return {i: Affine(torch.randn(d_prime, d, generator=g) / d**0.5, torch.zeros(d_prime))
            for i in attention_modules(model)}


def settings(model, args):
    layers = args.layers
    d_prime = model.config.hidden_size // model.config.num_attention_heads // 2
    p = projections(model, d_prime)
    snap = {"snapkv": {"budget": args.prompt // 4, "window": 32, "kernel": 5}}
    return {
        f"projected l={layers // 2}": (p, layers // 2, None),
        f"projected l={layers}": (p, layers, None),
        "snapkv": (p, 0, snap),
        "kivi2": (p, 0, {"kivi": {"bits": 2}}),
        "kivi4": (p, 0, {"kivi": {"bits": 4}}),
        f"projected l={layers} + snapkv": (p, layers, snap),
        f"projected l={layers} + kivi4": (p, layers, {"kivi": {"bits": 4}}),
    }


@torch.no_grad()
def run(model, prompt, new, device):
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    out = model(prompt, use_cache=True)
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    sync()
    t1 = time.perf_counter()
    for _ in range(new):
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    sync()
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / new, cache.nbytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    base = build(args).to(args.device, dtype)
    attach_projections(base, {}, 0)  # the same attention path (SDPA through ProjectedCache), nothing projected
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(args.device)
    models = {"base": base}
    for name, (p, layers, kv) in settings(base, args).items():
        models[name] = attach_projections(copy.deepcopy(base), p, layers, kv=kv)
    for model in models.values():
        run(model, prompt, 2, args.device)  # warm-up
    meta = {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "prompt": args.prompt,
            "new": args.new, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads}
    for name, model in list(models.items())[1:]:
        # base and setting back to back, repeats times: each ratio pairs two neighbouring runs
        pairs = [(run(base, prompt, args.new, args.device), run(model, prompt, args.new, args.device))
                 for _ in range(args.repeats)]  # fmt: skip
        for i, (what, unit) in enumerate((("(a) prefill", "seconds"), ("(b) decode per token", "seconds"),
                                          ("(c) cache bytes", "bytes"))):  # fmt: skip
            ratio = statistics.median(b_s[i] and m_s[i] / b_s[i] for b_s, m_s in pairs)
            print(json.dumps({"name": f"{what} / base: {name}", "ratio": ratio,
                              unit: statistics.median(m_s[i] for _, m_s in pairs),
                              f"base_{unit}": statistics.median(b_s[i] for b_s, _ in pairs), **meta}))

if __name__ == "__main__":
    main()
