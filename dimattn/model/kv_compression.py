"""KV-cache compression baselines as plain torch: SnapKV (token eviction) and KIVI (quantisation).

Shapes: queries (B, H, Tq, d_qk), keys (B, H_kv, T, d_qk), values (B, H_kv, T, d_v). Keys and
values may differ in their last dimension (a projected layer stores keys with d' channels and
values with d); query head h reads KV head h // (H / H_kv), transformers' ``repeat_kv`` layout.

SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024;
FasterDecoding/SnapKV, ``snapkv/monkeypatch/snapkv_utils.py``), applied once, at prefill, when the
prompt length T exceeds the budget:

1. scores: the last ``window`` queries of the prompt attend to all T keys with the layer's own
   logits ``(q @ k^T) * scale``, causally inside the window, softmax in fp32;
2. each prefix key (positions 0 .. T-window-1) gets the sum of its attention over the window
   queries, then ``avg_pool1d(kernel, padding=kernel // 2, stride=1)`` along tokens with
   torch's default ``count_include_pad=True``, as the authors call it;
3. GQA: a KV head scores with the mean over its H / H_kv query heads (the authors repeat K and V
   and select per query head; the group mean, as later GQA-aware ports do, keeps H_kv heads);
4. the top (budget - window) prefix keys per KV head are kept, in their original order (the
   authors keep top-k order; order is invisible to attention, sorting keeps positions
   increasing), followed by the whole window: ``budget`` tokens in all.

Logits are computed in fp32 too (the authors take them in the model dtype). ``queries`` may hold
the whole prompt or only its tail: the last ``window`` rows are used and are taken to sit at
prompt positions T-window .. T-1.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024;
jy-yuan/KIVI, ``models/llama_kivi.py`` and ``quant/new_pack.py``): asymmetric min-max integer
quantisation, scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) clamped to
[0, 2^bits - 1], x ~ code * scale + min, with

- keys per channel: each channel's tokens in groups of G consecutive tokens;
- values per token: each token's channels in groups of G consecutive channels. KIVI requires
  d_v % G == 0; here the last group of a token is shorter when it is not (d_v = 8 with G = 32:
  one group of 8 channels);
- a full-precision residual of recent tokens. Keys: whenever the residual holds R or more keys,
  the oldest whole blocks of R are quantised, so a prefill of T tokens quantises its first
  T - T % R keys and decoding quantises the residual as one block when it reaches R (R % G == 0
  so groups never straddle blocks). Values: everything but the last R tokens is quantised, so a
  prefill quantises its first T - R values (none when T <= R) and each decode step quantises
  the one value that falls out of the window.
- each step attends to what the cache held before the step, in its stored form, plus the new
  tokens in full precision (prefill attention is exact); quantisation then applies for the
  following steps, as in KIVI's forward.

Defaults G = 32 and R = 128: the group size and residual length of the KIVI repository's
LongBench runs (``docs/long_bench.md``: "We use a 32 group size and 128 residual length for both
KIVI-2 and KIVI-4").
The quantisation is simulated (quantise then dequantise, like the fake quantisers of KIVI's
``models/utils_quant.py``);
``KIVILayer.nbytes`` gives the size of a real packed cache: ceil(bits * count / 8) bytes of codes,
an fp16 scale and an fp16 minimum per group, and the residual at its own dtype's size.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FP16_BYTES = 2  # KIVI keeps each group's scale and minimum in the model dtype, fp16


def _check_kv(keys: Tensor, values: Tensor) -> None:
    if keys.dim() != 4 or values.dim() != 4:
        raise ValueError(
            f"keys and values must be 4-D (B, H_kv, T, d), got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in (B, H_kv, T)")


# ----------------------------------------------------------------------------------------- SnapKV


@dataclass(frozen=True)
class SnapKVSettings:
    """budget: tokens kept per KV head, window included; window: observation window; kernel:
    average-pooling kernel. No defaults here: the schema's (the authors' 32 and 5) arrive with
    the config, and travel in the projected model's config.json."""

    budget: int
    window: int
    kernel: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.budget <= self.window:
            raise ValueError(f"budget must exceed window={self.window}, got {self.budget}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and >= 1 (same-length pooling), got {self.kernel}")


def snapkv_indices(queries: Tensor, keys: Tensor, settings: SnapKVSettings, scale: float) -> Tensor | None:
    """Positions kept per KV head, (B, H_kv, budget) int64, increasing; None when T <= budget.

    queries (B, H, Tq, d) with window <= Tq <= T: the prompt's queries or only its last ones.
    """
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries and keys must be 4-D, got {tuple(queries.shape)} and {tuple(keys.shape)}")
    B, H, Tq, dq = queries.shape
    Bk, H_kv, T, dk = keys.shape
    if B != Bk or dq != dk or H % H_kv:
        raise ValueError(f"queries {tuple(queries.shape)} do not fit keys {tuple(keys.shape)}")
    if T <= settings.budget:
        return None
    W = settings.window
    if not W <= Tq <= T:
        raise ValueError(f"need window={W} <= query length {Tq} <= key length {T}")
    compute = torch.promote_types(queries.dtype, torch.float32)
    q = queries[:, :, -W:].to(compute).unflatten(1, (H_kv, H // H_kv))
    logits = torch.einsum("bgrwd,bgtd->bgrwt", q, keys.to(compute)) * scale
    # window query i sits at position T - W + i and sees keys up to it
    future = torch.ones(W, W, dtype=torch.bool, device=keys.device).triu(1)
    logits[..., T - W:] = logits[..., T - W:].masked_fill(future, float("-inf"))
    prefix = logits.softmax(dim=-1)[..., : T - W].sum(dim=3).mean(dim=2)  # (B, H_kv, T - W)
    pooled = F.avg_pool1d(prefix, settings.kernel, stride=1, padding=settings.kernel // 2)
    kept = pooled.topk(settings.budget - W, dim=-1).indices.sort(dim=-1).values
    window = torch.arange(T - W, T, device=keys.device).expand(B, H_kv, W)
    return torch.cat([kept, window], dim=-1)


def snapkv_compress(
    queries: Tensor, keys: Tensor, values: Tensor, settings: SnapKVSettings, scale: float
) -> tuple[Tensor, Tensor]:
    """(keys, values) restricted to ``snapkv_indices``: (B, H_kv, budget, d_k / d_v); the inputs
    themselves when T <= budget."""
    _check_kv(keys, values)
    index = snapkv_indices(queries, keys, settings, scale)
    if index is None:
        return keys, values
    index = index.unsqueeze(-1)
    return (keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
            values.gather(2, index.expand(-1, -1, -1, values.shape[-1])))


# ------------------------------------------------------------------------------------------- KIVI


def quantize_groups(x: Tensor, bits: int, group_size: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric min-max quantisation in groups of ``group_size`` consecutive entries along
    ``dim`` (the last group shorter when the length is not a multiple).

    Returns codes (uint8, x's shape) and scale and minimum (x's shape with ``dim`` cut to the
    number of groups; fp32, or fp64 for fp64 input). A constant group gets scale 0 and codes 0,
    so it dequantises to its value exactly.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8 (uint8 codes), got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    levels = 2**bits - 1
    moved = x.to(torch.promote_types(x.dtype, torch.float32)).movedim(dim, -1)
    n = moved.shape[-1]
    groups = math.ceil(n / group_size)
    # repeating the last entry fills the short group without moving its min or max
    padded = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], groups * group_size - n)], dim=-1)
    grouped = padded.unflatten(-1, (groups, group_size))
    minimum = grouped.amin(dim=-1)
    scale = (grouped.amax(dim=-1) - minimum) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((grouped - minimum[..., None]) / safe[..., None]).round().clamp(0, levels)
    codes = codes.flatten(-2)[..., :n].to(torch.uint8)
    return codes.movedim(-1, dim), scale.movedim(-1, dim), minimum.movedim(-1, dim)


def dequantize_groups(codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int, dim: int) -> Tensor:
    """code * scale + min with each group's scale and min, in scale's dtype (inverse of
    ``quantize_groups``)."""
    n = codes.shape[dim]
    scale, minimum = (t.repeat_interleave(group_size, dim=dim).narrow(dim, 0, n) for t in (scale, minimum))
    return codes.to(scale.dtype) * scale + minimum


def fake_quantize(x: Tensor, bits: int, group_size: int, dim: int) -> Tensor:
    """Quantise then dequantise, back in x's dtype."""
    codes, scale, minimum = quantize_groups(x, bits, group_size, dim)
    return dequantize_groups(codes, scale, minimum, group_size, dim).to(x.dtype)


@dataclass(frozen=True)
class KIVISettings:
    """bits: 2 or 4 (KIVI-2, KIVI-4), keys and values alike; group_size: G; residual: R, the
    full-precision tokens, a multiple of G as KIVI asserts. No defaults here: the schema's
    (KIVI's 32 and 128) arrive with the config."""

    bits: int
    group_size: int
    residual: int

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.residual < 1 or self.residual % self.group_size:
            raise ValueError(
                f"residual must be a positive multiple of group_size={self.group_size}, got {self.residual}"
            )


class KIVILayer:
    """One layer's KIVI cache: dequantised quantised part followed by the full-precision residual,
    for keys and for values separately."""

    def __init__(self, settings: KIVISettings) -> None:
        self.settings = settings
        self._keys: tuple[Tensor, Tensor] | None = None  # (quantised part, residual)
        self._values: tuple[Tensor, Tensor] | None = None

    @property
    def seq_length(self) -> int:
        return 0 if self._keys is None else sum(part.shape[2] for part in self._keys)

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, H_kv, t, d_k) keys and (B, H_kv, t, d_v) values; returns what this step
        attends to, (B, H_kv, seq_length, d_k / d_v): the stored cache plus the new tokens in
        full precision. Then moves the tokens KIVI quantises out of the residual."""
        _check_kv(keys, values)
        if self._keys is None:
            self._keys = (keys[:, :, :0], keys[:, :, :0])
            self._values = (values[:, :, :0], values[:, :, :0])
        for old, new in ((self._keys[1], keys), (self._values[1], values)):
            if old.shape[:2] != new.shape[:2] or old.shape[3] != new.shape[3] or old.dtype != new.dtype:
                raise ValueError(
                    f"update {tuple(new.shape)} {new.dtype} does not fit cache {tuple(old.shape)} {old.dtype}"
                )
        R, G, bits = self.settings.residual, self.settings.group_size, self.settings.bits
        key_quant, key_full = self._keys[0], torch.cat([self._keys[1], keys], dim=2)
        value_quant, value_full = self._values[0], torch.cat([self._values[1], values], dim=2)
        attended = torch.cat([key_quant, key_full], dim=2), torch.cat([value_quant, value_full], dim=2)
        n = key_full.shape[2] // R * R  # whole residual blocks
        if n:
            key_quant = torch.cat([key_quant, fake_quantize(key_full[:, :, :n], bits, G, dim=2)], dim=2)
            key_full = key_full[:, :, n:]
        n = max(value_full.shape[2] - R, 0)  # all but the last R values
        if n:
            value_quant = torch.cat([value_quant, fake_quantize(value_full[:, :, :n], bits, G, dim=3)], dim=2)
            value_full = value_full[:, :, n:]
        self._keys, self._values = (key_quant, key_full), (value_quant, value_full)
        return attended

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """The stored cache, (B, H_kv, seq_length, d_k / d_v): what the next step attends to."""
        if self._keys is None:
            raise ValueError("empty cache: call update first")
        return torch.cat(self._keys, dim=2), torch.cat(self._values, dim=2)

    def nbytes(self) -> int:
        """Bytes of the real packed cache: codes, fp16 scale and min per group, residual."""
        if self._keys is None:
            return 0
        bits, G = self.settings.bits, self.settings.group_size
        key_quant, key_full = self._keys
        value_quant, value_full = self._values
        B, H, T_value, d_v = value_quant.shape
        groups = key_quant.numel() // G + B * H * T_value * math.ceil(d_v / G)
        codes = math.ceil(bits * key_quant.numel() / 8) + math.ceil(bits * value_quant.numel() / 8)
        residual = key_full.numel() * key_full.element_size() + value_full.numel() * value_full.element_size()
        return codes + 2 * FP16_BYTES * groups + residual


def kv_fields(kv: dict | None) -> dict:
    """{"kv_method", "kv_level"} of a model's compression ({"kivi": {...}}, {"snapkv": {...}} or
    none): the method and its bits or token budget, what Table 5's columns are."""
    if kv and "kivi" in kv:
        return {"kv_method": "kivi", "kv_level": int(kv["kivi"]["bits"])}
    if kv and "snapkv" in kv:
        return {"kv_method": "snapkv", "kv_level": int(kv["snapkv"]["budget"])}
    return {"kv_method": "none", "kv_level": 0}
