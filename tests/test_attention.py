"""DAR attention against a naive per-query loop written from seed 000, Eq. 3-4."""

import math

import pytest
import torch

from dimattn.attention import ATTENTION_VARIANTS, causal_attention, dar_attention



@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def naive_dar(q, k_near, v_near, k_far, v_far, window):
    """o_i = softmax(q_i K_i^T / sqrt(d_k)) V_i, with k_j, v_j near when i - j < w, else far."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys, values = [], []
                for j in range(i + 1):
                    near = i - j < window
                    keys.append(k_near[b, h, j] if near else k_far[b, h, j])
                    values.append(v_near[b, h, j] if near else v_far[b, h, j])
                K, V = torch.stack(keys), torch.stack(values)
                weights = torch.softmax(K @ q[b, h, i] / math.sqrt(D), dim=0)
                out[b, h, i] = weights @ V
    return out


def naive_causal(q, k, v):
    return naive_dar(q, k, v, k, v, window=0)


def random_qkv(B=2, H=3, T=9, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(5)]


@pytest.mark.parametrize("window", [0, 1, 2, 4, 8, 9, 20])
def test_dar_matches_naive_loop(window):
    q, kn, vn, kf, vf = random_qkv()
    torch.testing.assert_close(dar_attention(q, kn, vn, kf, vf, window), naive_dar(q, kn, vn, kf, vf, window))


@pytest.mark.parametrize("window", [9, 10, 1000])
def test_window_covering_sequence_is_vanilla(window):
    q, kn, vn, kf, vf = random_qkv()
    torch.testing.assert_close(dar_attention(q, kn, vn, kf, vf, window), naive_causal(q, kn, vn))


def test_window_zero_is_uniform():
    q, kn, vn, kf, vf = random_qkv()
    uniform = ATTENTION_VARIANTS["uniform"](q, None, (kf, vf), window=0)
    torch.testing.assert_close(dar_attention(q, kn, vn, kf, vf, 0), uniform)
    torch.testing.assert_close(uniform, naive_causal(q, kf, vf))


def test_vanilla_variant_is_causal_attention():
    q, k, v, _, _ = random_qkv()
    torch.testing.assert_close(ATTENTION_VARIANTS["vanilla"](q, (k, v), None, window=3), naive_causal(q, k, v))


def test_far_keys_get_gradient_only_where_used():
    """Key j is far for some query iff T - 1 - j >= w: the last w keys are never far."""
    T, w = 9, 3
    q, kn, vn, kf, vf = random_qkv(T=T)
    for t in (kf, vf, kn, vn):
        t.requires_grad_(True)
    dar_attention(q, kn, vn, kf, vf, w).sum().backward()
    used_far = torch.arange(T) <= T - 1 - w
    assert (kf.grad[:, :, ~used_far] == 0).all() and (vf.grad[:, :, ~used_far] == 0).all()
    assert (vf.grad[:, :, used_far].abs().sum(-1) > 0).all()
    assert (vn.grad.abs().sum(-1) > 0).all()  # every key is near for its own query (i = j)


def test_query_offset_matches_full_computation():
    """Decoding with a cache: the last Tq queries against all Tk keys."""
    q, kn, vn, kf, vf = random_qkv(T=10)
    full = dar_attention(q, kn, vn, kf, vf, 3)
    tail = dar_attention(q[:, :, -2:], kn, vn, kf, vf, 3)
    torch.testing.assert_close(tail, full[:, :, -2:])
    torch.testing.assert_close(causal_attention(q[:, :, -1:], kn, vn), naive_causal(q, kn, vn)[:, :, -1:])


def test_key_padding_mask_hides_padded_keys():
    """Left padding: real tokens of a padded row see exactly what an unpadded row sees."""
    q, kn, vn, kf, vf = random_qkv(B=1, T=7)
    pad = 3
    padded = [torch.cat([torch.randn(1, 3, pad, 4), t], dim=2) for t in (q, kn, vn, kf, vf)]
    mask = torch.tensor([[False] * pad + [True] * 7])
    # positions shift by the padding, distances do not
    out = dar_attention(*padded, 2, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, pad:], dar_attention(q, kn, vn, kf, vf, 2))
    assert torch.isfinite(out).all()


def test_negative_window_rejected():
    q, kn, vn, kf, vf = random_qkv()
    with pytest.raises(ValueError, match="window"):
        dar_attention(q, kn, vn, kf, vf, -1)
