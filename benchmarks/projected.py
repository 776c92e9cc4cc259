"""Latency and cache size of projected models (seed 003, Appendix H), one JSON object per line.

    python benchmarks/projected.py                 # CPU: a small Llama (GQA), 2 threads
    python benchmarks/projected.py --device cuda   # the same shapes on CUDA, bf16

dimattn.evaluation.latency.measure on a random Llama of the given shape, with random projections at
d' = head_dim / 2 (latency does not depend on their values): the base model, SnapKV (a quarter
of the prompt), DimPO's projection on the last half and on every layer, and on every layer with
SnapKV. Each setting runs back to back with the base model in every repeat; each line gives
the medians and the median of the paired ratios to the base model: (a) prefill time, (b) time
per decoded token (and tokens/s), (c) KV-cache bytes, (d) peak memory (CUDA's allocator peak; on
CPU the weights plus the cache). The workflow's ``latency`` rule measures the dimpo models
themselves, with their fitted projections. The host line (benchmarks/_host.py, on stderr: the
CPU, also under --device cuda) comes first; every line carries the host's one-thread bf16
matmul peak, ``host_bf16_peak_gflops``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._host import announce, stamp  # noqa: E402
from dimattn.model.affine import Affine  # noqa: E402
from dimattn.evaluation.latency import measure  # noqa: E402
from dimattn.model.modeling_projected import attention_modules  # noqa: E402


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
    announce()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    base = build(args).to(args.device, dtype)
    d_prime = args.hidden // args.heads // 2
    meta = {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "d_prime": d_prime}
    for row in measure(base, projections(base, d_prime), args.prompt, args.new, args.repeats, args.device):
        print(json.dumps(stamp(row | meta)), flush=True)


if __name__ == "__main__":
    main()
