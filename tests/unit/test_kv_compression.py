"""SnapKV and KIVI (dimattn.model.kv_compression) against naive references written from the methods'
definitions: per-(batch, head, query, key) loops for SnapKV's scores, per-group loops for KIVI's
quantiser, and KIVI's own prefill/decode case analysis (llama_kivi.py) replayed step by step."""

import math

import pytest
import torch

from dimattn.model.kv_compression import (
    KIVILayer,
    KIVISettings,
    SnapKVSettings,
    dequantize_groups,
    quantize_groups,
    snapkv_compress,
    snapkv_indices,
)

B, H, H_KV, D_K, D_V = 2, 4, 2, 8, 12  # projected keys (d' = 8), values keep their own width


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------------------- SnapKV


def naive_snapkv_indices(queries, keys, budget, window, kernel, scale):
    """Window queries i (prompt position T - window + i) softmax over keys 0..T-window+i; per KV
    head, mean over its query heads of the summed attention to each prefix key; zero-padded
    average over `kernel` neighbours divided by `kernel`; top budget - window, then the window."""
    n_batch, n_heads, n_queries, _ = queries.shape
    _, n_kv, T, _ = keys.shape
    if T <= budget:
        return None
    rep, prefix, half = n_heads // n_kv, T - window, kernel // 2
    rows = []
    for b in range(n_batch):
        heads = []
        for g in range(n_kv):
            score = [0.0] * prefix
            for r in range(rep):
                h = g * rep + r
                for i in range(window):
                    q = queries[b, h, n_queries - window + i]
                    logits = [scale * float(torch.dot(q, keys[b, g, j])) for j in range(T - window + i + 1)]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    total = sum(weights)
                    for j in range(prefix):
                        score[j] += weights[j] / total / rep
            pooled = [sum(score[j + o] for o in range(-half, half + 1) if 0 <= j + o < prefix) / kernel
                      for j in range(prefix)]
            best = sorted(range(prefix), key=lambda j: -pooled[j])[: budget - window]
            heads.append(sorted(best) + list(range(prefix, T)))
        rows.append(heads)
    return torch.tensor(rows)


@pytest.mark.parametrize(
    "T,budget,window,kernel",
    [
        (64, 40, 8, 5),
        (80, 48, 32, 5),  # the authors' window
        (41, 40, 8, 5),  # one token over budget
        (50, 9, 8, 5),  # a single prefix token kept
        (60, 30, 8, 1),  # no pooling
        (60, 30, 8, 3),
    ],
)
def test_snapkv_indices_match_naive(T, budget, window, kernel):
    q, k = randn(B, H, T, D_K, seed=1), randn(B, H_KV, T, D_K, seed=2)
    scale = 1 / math.sqrt(16)  # a projected layer may keep the unprojected scale
    got = snapkv_indices(q, k, SnapKVSettings(budget, window, kernel), scale)
    assert got.dtype == torch.int64 and got.shape == (B, H_KV, budget)
    assert torch.equal(got, naive_snapkv_indices(q, k, budget, window, kernel, scale))


def test_snapkv_multi_head_attention_and_query_tail():
    T, settings = 48, SnapKVSettings(budget=24, window=8, kernel=5)
    q, k = randn(B, H, T, D_K, seed=3), randn(B, H, T, D_K, seed=4)
    full = snapkv_indices(q, k, settings, scale=0.5)
    assert torch.equal(full, naive_snapkv_indices(q, k, 24, 8, 5, 0.5))
    # only the last queries given: the same selection
    assert torch.equal(snapkv_indices(q[:, :, -8:], k, settings, scale=0.5), full)
    assert torch.equal(snapkv_indices(q[:, :, -20:], k, settings, scale=0.5), full)


def test_snapkv_compress_gathers_keys_and_values():
    T, settings = 56, SnapKVSettings(budget=20, window=8, kernel=5)
    q, k, v = randn(B, H, T, D_K, seed=5), randn(B, H_KV, T, D_K, seed=6), randn(B, H_KV, T, D_V, seed=7)
    keys, values = snapkv_compress(q, k, v, settings, scale=1 / math.sqrt(D_K))
    index = naive_snapkv_indices(q, k, 20, 8, 5, 1 / math.sqrt(D_K))
    assert keys.shape == (B, H_KV, 20, D_K) and values.shape == (B, H_KV, 20, D_V)
    for b in range(B):
        for g in range(H_KV):
            for slot, position in enumerate(index[b, g].tolist()):
                assert torch.equal(keys[b, g, slot], k[b, g, position])
                assert torch.equal(values[b, g, slot], v[b, g, position])
    assert torch.equal(keys[:, :, -8:], k[:, :, -8:])


@pytest.mark.parametrize("T", [10, 39, 40])
def test_snapkv_is_a_no_op_within_budget(T):
    q, k, v = randn(B, H, T, D_K, seed=8), randn(B, H_KV, T, D_K, seed=9), randn(B, H_KV, T, D_V, seed=10)
    settings = SnapKVSettings(budget=40, window=32, kernel=5)
    assert snapkv_indices(q, k, settings, scale=1.0) is None
    keys, values = snapkv_compress(q, k, v, settings, scale=1.0)
    assert keys is k and values is v


def test_snapkv_half_precision_keeps_dtypes():
    T = 40
    q, k, v = (randn(B, H, T, D_K, seed=11).bfloat16(), randn(B, H_KV, T, D_K, seed=12).bfloat16(),
               randn(B, H_KV, T, D_V, seed=13).bfloat16())
    keys, values = snapkv_compress(q, k, v, SnapKVSettings(budget=16, window=8, kernel=5), scale=0.3)
    assert keys.dtype == values.dtype == torch.bfloat16 and keys.shape[2] == values.shape[2] == 16


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"budget": 32, "window": 32}, "budget"),
        ({"budget": 8, "window": 0}, "window"),
        ({"budget": 40, "window": 8, "kernel": 4}, "kernel"),
        ({"budget": 40, "window": 8, "kernel": 0}, "kernel"),
    ],
)
def test_snapkv_settings_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SnapKVSettings(**{"kernel": 5} | kwargs)


def test_snapkv_rejects_mismatched_shapes():
    k = randn(B, H_KV, 48, D_K)
    settings = SnapKVSettings(budget=24, window=8, kernel=5)
    with pytest.raises(ValueError, match="window"):
        snapkv_indices(randn(B, H, 4, D_K), k, settings, scale=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        snapkv_indices(randn(B, H, 48, D_V), k, settings, scale=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        snapkv_indices(randn(B, 3, 48, D_K), k, settings, scale=1.0)


# ------------------------------------------------------------------------------------------- KIVI


def naive_group(xs, bits):
    """One group (a list of floats): min, scale = (max - min) / (2^bits - 1), clamped rounded
    codes; a constant group keeps scale 0 and codes 0."""
    levels = 2**bits - 1
    low, scale = min(xs), (max(xs) - min(xs)) / levels
    codes = [0 if scale == 0 else min(max(round((x - low) / scale), 0), levels) for x in xs]
    return codes, scale, low


def naive_fake_quant(x, bits, group_size, dim):
    """Groups of group_size consecutive entries along dim (2: tokens, 3: channels), last one short."""
    out = x.clone()
    n_b, n_h, n_t, n_d = x.shape
    for b in range(n_b):
        for h in range(n_h):
            lines = range(n_d) if dim == 2 else range(n_t)
            for line in lines:
                length = n_t if dim == 2 else n_d
                for start in range(0, length, group_size):
                    at = [(t, line) if dim == 2 else (line, t) for t in range(start, min(start + group_size, length))]
                    codes, scale, low = naive_group([float(x[b, h, t, c]) for t, c in at], bits)
                    for (t, c), code in zip(at, codes):
                        out[b, h, t, c] = code * scale + low
    return out


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim,group_size", [(2, 4), (2, 6), (3, 4), (3, 5), (3, 32)])
def test_quantize_groups_matches_naive(bits, dim, group_size):
    x = randn(B, H_KV, 12, D_V, seed=20)
    codes, scale, minimum = quantize_groups(x, bits, group_size, dim)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.shape[dim] == minimum.shape[dim] == math.ceil(x.shape[dim] / group_size)
    assert int(codes.max()) <= 2**bits - 1
    got = dequantize_groups(codes, scale, minimum, group_size, dim)
    torch.testing.assert_close(got, naive_fake_quant(x, bits, group_size, dim))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim,group_size", [(2, 4), (3, 5)])
def test_dequantized_values_stay_in_group_range_within_half_a_step(bits, dim, group_size):
    x = randn(B, H_KV, 12, D_V, seed=21) * 3
    codes, scale, minimum = quantize_groups(x, bits, group_size, dim)
    got = dequantize_groups(codes, scale, minimum, group_size, dim)
    step, low = (t.repeat_interleave(group_size, dim=dim).narrow(dim, 0, x.shape[dim]) for t in (scale, minimum))
    high = low + step * (2**bits - 1)  # the group maximum
    eps = 1e-12
    assert bool((got >= low - eps).all() and (got <= high + eps).all())
    assert bool(((got - x).abs() <= step / 2 + eps).all())
    assert bool((x >= low - eps).all() and (x <= high + eps).all())


@pytest.mark.parametrize("bits", [2, 4])
def test_constant_groups_dequantize_exactly(bits):
    x = randn(1, 2, 8, 4, seed=22)
    x[0, 0, :4, :] = 0.37  # four constant token groups (G = 4), one per channel
    x[0, 1, :, 1] = -2.5  # a constant channel
    codes, scale, minimum = quantize_groups(x, bits, 4, dim=2)
    got = dequantize_groups(codes, scale, minimum, 4, dim=2)
    assert torch.equal(got[0, 0, :4], x[0, 0, :4]) and torch.equal(got[0, 1, :, 1], x[0, 1, :, 1])
    assert bool((scale[0, 0, 0] == 0).all()) and int(codes[0, 0, :4].max()) == 0
    assert torch.isfinite(got).all()
    flat = torch.full((2, 2, 3, 12), 4.0, dtype=torch.float64)
    assert torch.equal(dequantize_groups(*quantize_groups(flat, bits, 5, dim=3), 5, dim=3), flat)


class NaiveKIVI:
    """KIVI's LlamaAttention_KIVI.forward case analysis for one layer, one token per decode step."""

    def __init__(self, bits, group_size, residual):
        self.bits, self.G, self.R = bits, group_size, residual

    def quant(self, x, dim):
        return naive_fake_quant(x, self.bits, self.G, dim)

    def prefill(self, k, v):
        T, R = k.shape[2], self.R
        split = T - T % R  # T < R: nothing; T % R == 0: everything
        self.k_quant, self.k_full = self.quant(k[:, :, :split], 2), k[:, :, split:]
        split = max(T - R, 0)
        self.v_quant, self.v_full = self.quant(v[:, :, :split], 3), v[:, :, split:]
        return k, v

    def decode(self, k, v):
        self.k_full = torch.cat([self.k_full, k], dim=2)
        attended_k = torch.cat([self.k_quant, self.k_full], dim=2)
        if self.k_full.shape[2] == self.R:
            self.k_quant = torch.cat([self.k_quant, self.quant(self.k_full, 2)], dim=2)
            self.k_full = self.k_full[:, :, :0]
        self.v_full = torch.cat([self.v_full, v], dim=2)
        attended_v = torch.cat([self.v_quant, self.v_full], dim=2)
        if self.v_full.shape[2] > self.R:
            self.v_quant = torch.cat([self.v_quant, self.quant(self.v_full[:, :, :1], 3)], dim=2)
            self.v_full = self.v_full[:, :, 1:]
        return attended_k, attended_v

    def stored(self):
        return torch.cat([self.k_quant, self.k_full], dim=2), torch.cat([self.v_quant, self.v_full], dim=2)


@pytest.mark.parametrize(
    "bits,group_size,residual,prefill,steps",
    [
        (2, 4, 8, 21, 12),  # 16 keys quantised at prefill, two key blocks and 12 values during decode
        (4, 4, 8, 16, 10),  # T % R == 0: every prefill key quantised
        (2, 4, 8, 8, 9),  # T == R: all keys quantised, all values kept
        (4, 8, 16, 5, 14),  # T < R: nothing quantised until decode crosses R
    ],
)
def test_kivi_prefill_then_decode_matches_naive(bits, group_size, residual, prefill, steps):
    T = prefill + steps
    k, v = randn(B, H_KV, T, D_K, seed=30), randn(B, H_KV, T, D_V, seed=31)
    layer, naive = KIVILayer(KIVISettings(bits, group_size, residual)), NaiveKIVI(bits, group_size, residual)
    got = layer.update(k[:, :, :prefill], v[:, :, :prefill])
    assert torch.equal(got[0], k[:, :, :prefill]) and torch.equal(got[1], v[:, :, :prefill])  # exact prefill
    naive.prefill(k[:, :, :prefill], v[:, :, :prefill])
    for name, a, b in zip("kv", layer.dequantized(), naive.stored()):
        torch.testing.assert_close(a, b, msg=f"{name} after prefill")
    for t in range(prefill, T):
        got = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        want = naive.decode(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert layer.seq_length == t + 1
        for name, a, b in zip("kv", got, want):
            torch.testing.assert_close(a, b, msg=f"{name} attended at step {t}")
        for name, a, b in zip("kv", layer.dequantized(), naive.stored()):
            torch.testing.assert_close(a, b, msg=f"{name} stored after step {t}")
    # the last R tokens of values are exact; keys' residual holds T mod R tokens here
    assert torch.equal(layer.dequantized()[1][:, :, -residual:], v[:, :, -residual:])


def test_kivi_defaults_and_narrow_projected_keys():
    settings = KIVISettings(bits=2, group_size=32, residual=128)
    assert (settings.group_size, settings.residual) == (32, 128)
    T, d_k, d_v = 130, 8, 16  # d' = 8 keys; 16 value channels < G: one short group per token
    k, v = randn(1, H_KV, T + 1, d_k, seed=40), randn(1, H_KV, T + 1, d_v, seed=41)
    layer, naive = KIVILayer(settings), NaiveKIVI(2, 32, 128)
    layer.update(k[:, :, :T], v[:, :, :T])
    naive.prefill(k[:, :, :T], v[:, :, :T])
    got, want = layer.update(k[:, :, T:], v[:, :, T:]), naive.decode(k[:, :, T:], v[:, :, T:])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not torch.equal(got[0][:, :, :128], k[:, :, :128])  # the first block is quantised


def test_kivi_nbytes_by_hand():
    layer = KIVILayer(KIVISettings(bits=2, group_size=4, residual=8))
    assert layer.nbytes() == 0
    layer.update(randn(B, H_KV, 21, D_K, seed=50, dtype=torch.float32),
                 randn(B, H_KV, 21, D_V, seed=51, dtype=torch.float32))
    # keys: 16 quantised tokens -> 2*2*16*8 = 512 codes (128 B), 2*2*8*(16/4) = 128 groups; 5 fp32 tokens
    # values: 13 quantised tokens -> 2*2*13*12 = 624 codes (156 B), 2*2*13*3 = 156 groups; 8 fp32 tokens
    key_residual, value_residual = 2 * 2 * 5 * 8 * 4, 2 * 2 * 8 * 12 * 4
    assert layer.nbytes() == 128 + 156 + (128 + 156) * 2 * 2 + key_residual + value_residual

    layer = KIVILayer(KIVISettings(bits=2, group_size=2, residual=2))
    keys, values = layer.update(randn(1, 1, 3, 2, seed=52).half(), randn(1, 1, 3, 3, seed=53).half())
    assert keys.dtype == values.dtype == torch.float16
    # keys: 2 tokens x 2 channels = 4 codes -> 1 B, 2 groups; 1 fp16 token of 2 channels -> 4 B
    # values: 1 token x 3 channels = 6 bits -> 1 B, ceil(3/2) = 2 groups; 2 fp16 tokens x 3 -> 12 B
    assert layer.nbytes() == 1 + 1 + (2 + 2) * 2 * 2 + 4 + 12


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"bits": 3}, "bits"),
        ({"bits": 8}, "bits"),
        ({"bits": 2, "group_size": 0}, "group_size"),
        ({"bits": 2, "residual": 0}, "residual"),
        ({"bits": 2, "group_size": 32, "residual": 48}, "residual"),
    ],
)
def test_kivi_settings_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KIVISettings(**{"group_size": 32, "residual": 128} | kwargs)


def test_kivi_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(randn(1, 1, 4, 4), 9, 4, dim=2)
    with pytest.raises(ValueError, match="group_size"):
        quantize_groups(randn(1, 1, 4, 4), 2, 0, dim=2)
    layer = KIVILayer(KIVISettings(bits=4, group_size=4, residual=8))
    with pytest.raises(ValueError, match="differ"):
        layer.update(randn(1, 2, 3, D_K), randn(1, 2, 4, D_V))
    with pytest.raises(ValueError, match="empty"):
        layer.dequantized()
    layer.update(randn(1, 2, 3, D_K), randn(1, 2, 3, D_V))
    with pytest.raises(ValueError, match="does not fit"):
        layer.update(randn(1, 2, 1, D_V), randn(1, 2, 1, D_V))
