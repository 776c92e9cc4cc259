"""Every attention pattern against a naive per-query loop written from the papers' definitions:
DAR (seed 000, Eq. 3-4), sliding-window and dilated attention (seed 001); each kernel
(dense, blocked: the joint kernel and the LSE-merged paths with their hand-written backwards,
flex forward) against those loops, and the bfloat16 paths against float64."""

import math

import pytest
import torch

from dimattn.model import blocked
from dimattn.model.attention import (
    ATTENTION_VARIANTS,
    causal_attention,
    dar_attention,
    dilated_attention,
    latent_dar_attention,
    sliding_window_attention,
)



@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def naive_dar(q, k_near, v_near, k_far, v_far, window):
    """o_i = softmax(q_i K_i^T / sqrt(d_k)) V_i, with k_j, v_j near when i - j < w, else far: one
    query at a time, its key list K_i built position by position (batch and heads at once)."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        near = [i - j < window for j in range(i + 1)]
        K = torch.stack([(k_near if n else k_far)[:, :, j] for j, n in enumerate(near)], dim=2)
        V = torch.stack([(v_near if n else v_far)[:, :, j] for j, n in enumerate(near)], dim=2)
        weights = torch.softmax(q[:, :, i, None] @ K.transpose(-1, -2) / math.sqrt(D), dim=-1)
        out[:, :, i] = (weights @ V)[:, :, 0]
    return out


def naive_causal(q, k, v):
    return naive_dar(q, k, v, k, v, window=0)


def naive_pattern(q, k, v, keep):
    """o_i = softmax over the keys j <= i with keep(i, j), of q_i k_j / sqrt(d), times V."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        js = [j for j in range(i + 1) if keep(i, j)]
        weights = torch.softmax(q[:, :, i, None] @ k[:, :, js].transpose(-1, -2) / math.sqrt(D), dim=-1)
        out[:, :, i] = (weights @ v[:, :, js])[:, :, 0]
    return out


def naive_swa(q, k, v, window):
    """Seed 001: position i attends to i - W .. i for window_size W, i.e. i - j < window = W + 1."""
    return naive_pattern(q, k, v, lambda i, j: i - j < window)


def naive_dilated(q, k, v, window, dilation):
    """Seed 001: the window, plus every r-th token beyond it ("[0, 4, 8, 12, 16, ...]")."""
    return naive_pattern(q, k, v, lambda i, j: i - j < window or j % dilation == 0)


def random_qkv(B=2, H=3, T=9, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(5)]


def assert_same_outputs_and_grads(out, ref, ts):
    """out and ref equal, and so are their gradients with respect to ts under one random upstream
    gradient; an input ref does not read gets no gradient from out either (None or zeros)."""
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, ts, grad, allow_unused=True)
    want = torch.autograd.grad(ref, ts, grad, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:  # an input this pattern does not read
            assert g is None or (g == 0).all()
        else:
            torch.testing.assert_close(g, w)


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


# --- sliding window, dilated, and the kernels ------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5, 9, 30])
def test_sliding_window_matches_naive_loop(window):
    q, k, v, _, _ = random_qkv(T=11)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window), naive_swa(q, k, v, window))


def test_seed001_window_size_keeps_w_plus_one_tokens():
    """The seed's example: window_size=4 at position 20 attends to 16..20, five tokens."""
    q, k, v, _, _ = random_qkv(B=1, H=1, T=20)
    v = torch.zeros_like(v)
    v[:, :, 15] = 1.0  # only 1-based position 16 (index 15), the oldest token the seed keeps, has a value
    out = sliding_window_attention(q, k, v, window=4 + 1)
    assert out[0, 0, 19].abs().sum() > 0  # position 16 is seen from position 20 ...
    assert sliding_window_attention(q, k, v, window=4)[0, 0, 19].abs().sum() == 0  # ... not with one fewer


@pytest.mark.parametrize("window,dilation", [(1, 1), (1, 4), (3, 2), (4, 4), (20, 3)])
def test_dilated_matches_naive_loop(window, dilation):
    q, k, v, _, _ = random_qkv(T=13)
    torch.testing.assert_close(dilated_attention(q, k, v, window, dilation), naive_dilated(q, k, v, window, dilation))


def test_dilation_one_is_full_causal():
    q, k, v, _, _ = random_qkv()
    torch.testing.assert_close(dilated_attention(q, k, v, 3, 1), naive_causal(q, k, v))


PATTERNS = {
    "dar": (lambda ts, w, kernel: dar_attention(*ts, w, kernel=kernel),
            lambda ts, w: naive_dar(*ts, w), 0),
    "swa": (lambda ts, w, kernel: sliding_window_attention(*ts[:3], w, kernel=kernel),
            lambda ts, w: naive_swa(*ts[:3], w), 1),
    "dilated": (lambda ts, w, kernel: dilated_attention(*ts[:3], w, 3, kernel=kernel),
                lambda ts, w: naive_dilated(*ts[:3], w, 3), 1),
}


def use_blocked(monkeypatch, impl):
    """"joint": the CPU kernel; "flash-paths" / "math-paths": the LSE-merged paths, which serve
    beyond the joint kernel's memory budget, with PyTorch's fused CPU kernel or pure PyTorch."""
    if impl != "joint":
        monkeypatch.setattr(blocked, "JOINT_MAX_BYTES", -1)
    if impl == "math-paths":
        monkeypatch.setattr(blocked, "_fused_cpu", lambda x: False)


@pytest.mark.parametrize("impl", ["joint", "flash-paths", "math-paths"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("T,window", [(1, 1), (9, 1), (9, 4), (40, 16), (70, 20), (70, 100), (90, 0)])
def test_blocked_kernel_forward_and_backward_match_naive(pattern, T, window, impl, monkeypatch):
    """The blocked kernels and their hand-written backwards against autograd through the loop.
    T = 40, 70 with window 16, 20 span several blocks and a padded last block."""
    use_blocked(monkeypatch, impl)
    fn, naive, minimum = PATTERNS[pattern]
    if window < minimum:
        pytest.skip("window below the pattern's minimum")
    ts = [t.requires_grad_(True) for t in random_qkv(B=2, H=2, T=T, D=4)]
    assert_same_outputs_and_grads(fn(ts, window, "blocked"), naive(ts, window), ts)


JOINT_PATTERNS = {
    "causal": lambda ts, w, kernel: causal_attention(*ts[:3], kernel=kernel),
    "dar": lambda ts, w, kernel: dar_attention(*ts, w, kernel=kernel),
    "swa": lambda ts, w, kernel: sliding_window_attention(*ts[:3], w, kernel=kernel),
    "dilated": lambda ts, w, kernel: dilated_attention(*ts[:3], w, 3, kernel=kernel),
}


@pytest.mark.parametrize("rows", [1, 7, 16, 64])
@pytest.mark.parametrize("pattern", JOINT_PATTERNS)
@pytest.mark.parametrize("T,window", [(5, 1), (33, 4), (100, 17), (130, 64)])
def test_joint_kernel_block_geometry(pattern, T, window, rows, monkeypatch):
    """Blocks of any height, widths padded with masked keys to JOINT_ALIGN, first and last
    blocks cut short: the same output and gradients as the dense reference."""
    monkeypatch.setattr(blocked, "JOINT_ROWS", rows)
    fn = JOINT_PATTERNS[pattern]
    ts = [t.requires_grad_(True) for t in random_qkv(B=1, H=2, T=T, D=4, seed=T)]
    out = fn(ts, window, "blocked")
    assert_same_outputs_and_grads(out, fn(ts, window, "dense"), ts)
    with torch.no_grad():  # no probabilities kept: the same forward
        torch.testing.assert_close(fn(ts, window, "blocked"), out)


def test_joint_kernel_serves_cpu_within_its_memory_budget(monkeypatch):
    q, kn, vn, kf, vf = [t.requires_grad_(True) for t in random_qkv(T=40)]
    calls = []
    monkeypatch.setattr(blocked._JointAttention, "apply", lambda *a: calls.append("joint") or q * 0)
    monkeypatch.setattr(blocked._MergedAttention, "apply", lambda *a: calls.append("merged") or q * 0)
    dar_attention(q, kn, vn, kf, vf, 8, kernel="blocked")
    monkeypatch.setattr(blocked, "JOINT_MAX_BYTES", 2 * 3 * 40 * 40 * 8 // 2)  # about half of what it keeps
    dar_attention(q, kn, vn, kf, vf, 8, kernel="blocked")
    with torch.no_grad():  # nothing kept for a backward: no budget
        dar_attention(q, kn, vn, kf, vf, 8, kernel="blocked")
    assert calls == ["joint", "merged", "joint"]


def bf16_case(fn, T, window, seed=0):
    """(max error of fn in bfloat16, max error of the dense float64 reference rounded through
    bfloat16 once), over the output and every gradient, each relative to the reference's scale."""
    ts64 = [t.to(torch.bfloat16).double().requires_grad_(True) for t in random_qkv(B=2, H=2, T=T, D=16, seed=seed)]
    ts16 = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in ts64]
    ref = fn(ts64, window, "dense")
    out = fn(ts16, window, "blocked")
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    want = torch.autograd.grad(ref, ts64, grad.double(), allow_unused=True)
    got = torch.autograd.grad(out, ts16, grad, allow_unused=True)
    errors = [(out.double() - ref).abs().max() / ref.abs().max()]
    rounding = [(ref.bfloat16().double() - ref).abs().max() / ref.abs().max()]
    for g, w in zip(got, want):
        if w is not None:
            errors.append((g.double() - w).abs().max() / w.abs().max())
            rounding.append((w.bfloat16().double() - w).abs().max() / w.abs().max())
    return max(errors).item(), max(rounding).item()


@pytest.mark.parametrize("impl", ["joint", "flash-paths"])
@pytest.mark.parametrize("pattern", JOINT_PATTERNS)
def test_blocked_kernels_in_bfloat16_stay_within_bf16_rounding(pattern, impl, monkeypatch):
    """bfloat16 in and out (the model's autocast), float32 softmax inside: every output and
    gradient within a few bf16 roundings (2^-8 relative each) of the float64 result."""
    use_blocked(monkeypatch, impl)
    error, rounding = bf16_case(JOINT_PATTERNS[pattern], T=150, window=24)
    assert rounding < 2**-8
    assert error < 8 * 2**-8, error


def test_blocked_kernel_in_fused_cpu_float32():
    """float32 against the dense kernel in float32, element by element (bf16: below)."""
    ts = [t.requires_grad_(True) for t in random_qkv(T=150, D=8)]
    out = dar_attention(*ts, 16, kernel="blocked")
    ref = dar_attention(*ts, 16, kernel="dense")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for g, w in zip(torch.autograd.grad(out, ts, grad), torch.autograd.grad(ref, ts, grad)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_blocked_kernel_in_fused_cpu_bfloat16():
    """bf16 through the default dispatch, under the float32 default dtype the models run with:
    output and gradients within a few bf16 roundings of the float64 truth, relative to each
    one's scale (element by element two bf16 kernels differ by any relative amount on entries
    near zero, which is no test of either)."""
    torch.set_default_dtype(torch.float32)  # the autouse fixture restores float64 after
    error, rounding = bf16_case(lambda ts, w, kernel: dar_attention(*ts, w, kernel=kernel), T=150, window=16)
    assert rounding < 2**-8
    assert error < 8 * 2**-8, error


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("T,window", [(9, 1), (40, 16), (150, 20)])
def test_flex_kernel_forward_matches_naive(pattern, T, window):
    """FlexAttention's block masks (CUDA's kernel); forward only, as on CPU it has no backward."""
    fn, naive, _ = PATTERNS[pattern]
    ts = random_qkv(B=1, H=2, T=T, D=8)
    torch.testing.assert_close(fn(ts, window, "flex"), naive(ts, window))


def test_auto_kernel_falls_back_to_dense_with_a_cache_offset():
    q, kn, vn, kf, vf = random_qkv(T=10)
    with pytest.raises(ValueError, match="dense"):
        dar_attention(q[:, :, -2:], kn, vn, kf, vf, 3, kernel="blocked")
    torch.testing.assert_close(
        dar_attention(q[:, :, -2:], kn, vn, kf, vf, 3), naive_dar(q, kn, vn, kf, vf, 3)[:, :, -2:]
    )


@pytest.mark.parametrize("window", [0, 1, 3, 6])
def test_latent_cache_attention_matches_full(window):
    """The DAR cache sees only the last window - 1 near slots before the queries: same result."""
    q, kn, vn, kf, vf = random_qkv(T=12)
    tq = 2
    near_start = max(0, 12 - tq - (window - 1)) if window else 12
    out = latent_dar_attention(q[:, :, -tq:], kn[:, :, near_start:], vn[:, :, near_start:], kf, vf, window,
                               q_start=12 - tq, near_start=near_start)
    torch.testing.assert_close(out, naive_dar(q, kn, vn, kf, vf, window)[:, :, -tq:])


@pytest.mark.parametrize("name", ["swa", "dilated"])
def test_window_zero_rejected_where_no_key_would_remain(name):
    q, k, v, _, _ = random_qkv()
    fn = PATTERNS[name][0]
    with pytest.raises(ValueError, match="window"):
        fn([q, k, v], 0, "auto")


def test_registry_variants_match_public_functions():
    q, kn, vn, kf, vf = random_qkv(T=12)
    reg = ATTENTION_VARIANTS
    torch.testing.assert_close(reg["swa"](q, (kn, vn), None, window=4), naive_swa(q, kn, vn, 4))
    torch.testing.assert_close(reg["dilated"](q, (kn, vn), None, window=2, dilation=3), naive_dilated(q, kn, vn, 2, 3))
    torch.testing.assert_close(reg["dar"](q, (kn, vn), (kf, vf), window=4), naive_dar(q, kn, vn, kf, vf, 4))


@pytest.mark.parametrize("impl", ["flash-paths", "math-paths"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_band_blocks_differ_between_forward_and_backward(pattern, impl, monkeypatch):
    """Window 80: the band's forward takes blocks of 32 (4 per span); its backward, blocks of 40
    (3 per span) in PyTorch, of the window itself in the flash kernel (its own block causally,
    the block before under a mask). T = 150 is a multiple of none of these and the window of
    neither 32 nor 40. A shifted causal path (DAR) covers only the queries past the window and is
    merged into those rows."""
    use_blocked(monkeypatch, impl)
    window = 80
    assert blocked.Band(window)._geometry(150) == (32, 4, 5)
    assert blocked.Band(window)._geometry(150, backward=True) == (40, 3, 4)
    fn, naive, _ = PATTERNS[pattern]
    ts = [t.requires_grad_(True) for t in random_qkv(B=1, H=2, T=150, D=4, seed=3)]
    assert_same_outputs_and_grads(fn(ts, window, "blocked"), naive(ts, window), ts)


def test_sliding_window_without_grad_leaves_the_joint_kernel_past_its_length(monkeypatch):
    """No backward: past JOINT_NOGRAD_MAX_T queries one flash call per path serves, same values."""
    monkeypatch.setattr(blocked, "JOINT_NOGRAD_MAX_T", 32)
    q, k, v = random_qkv(B=1, H=2, T=70, D=4)[:3]
    calls = []
    merged = blocked._MergedAttention.apply
    monkeypatch.setattr(blocked._MergedAttention, "apply", lambda *a: calls.append("merged") or merged(*a))
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 20, kernel="blocked")
        short = sliding_window_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], 20, kernel="blocked")
    assert calls == ["merged"]
    torch.testing.assert_close(out, naive_swa(q, k, v, 20))
    torch.testing.assert_close(short, naive_swa(q[:, :, :30], k[:, :, :30], v[:, :, :30], 20))
