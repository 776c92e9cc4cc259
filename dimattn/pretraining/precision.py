"""Numeric precision of a forward pass, shared by training and scoring.

- "fp32": float32 throughout.
- "bf16": bfloat16 autocast of the matmuls; weights stay in their dtype, and the losses reduce
  in float32 (dimattn.model.modeling_dimattn.lm_head_loss).
- "auto": bf16 where the device runs it natively (``bf16_supported``), else fp32.
"""

from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16")
# /proc/cpuinfo flags of x86 CPUs whose bfloat16 matmuls run natively (oneDNN's fast path).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def bf16_supported(device) -> bool:
    """Whether bfloat16 matmuls run natively on device, so that "auto" precision takes bf16:
    a CUDA GPU with bf16 (not emulated), or a CPU with AMX-BF16 or AVX512-BF16 (checked at run
    time; torch.backends.cpu.get_cpu_capability() stops at "AVX512" and cannot tell)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(set(BF16_CPU_FLAGS) & _cpu_flags())
    return False


def resolve_precision(precision: str, device) -> str:
    """"fp32" or "bf16": what ``precision`` means on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    return precision


def autocast(device, precision: str):
    """bf16 autocast for "bf16" (or "auto" resolving to it), nothing for "fp32"."""
    precision = resolve_precision(precision, device)
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
