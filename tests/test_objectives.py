"""Losses of dimattn.objectives against loops written straight from seed 003's equations."""

import math

import pytest
import torch
import torch.nn.functional as F

from dimattn import objectives
from dimattn.objectives import (
    OBJECTIVES,
    dimpo_loss,
    get_objective,
    head_loss,
    kl_loss,
    listwise_loss,
    pca_projection,
    random_projection,
)


def make_batch(n=5, length=7, seed=0, lengths=(7, 1, 3, 5, 2)):
    """float64 logits, psi (0 at padding) and mask; instance i has lengths[i] valid keys."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:n, None]
    s = torch.randn(n, length, generator=g, dtype=torch.float64) * 2
    raw = torch.randn(n, length, generator=g, dtype=torch.float64) * 2
    psi = torch.softmax(raw.masked_fill(~mask, float("-inf")), -1)
    s = s.masked_fill(~mask, float("-inf"))  # padded logits are garbage the losses must ignore
    return s, psi, mask


def valid(row_mask):
    return [j for j in range(len(row_mask)) if row_mask[j]]


def naive_log_pi(s_row, keys):
    z = math.log(sum(math.exp(s_row[j]) for j in keys))
    return {j: s_row[j] - z for j in keys}


def naive_kl(s, psi, mask):
    total = 0.0
    for n in range(len(s)):
        keys = valid(mask[n])
        log_pi = naive_log_pi(s[n].tolist(), keys)
        total += sum(
            psi[n, j].item() * (math.log(psi[n, j].item()) - log_pi[j]) for j in keys if psi[n, j] > 0
        )
    return total / len(s)


def naive_listwise(s, psi, mask, gamma=0.0, max_preferred=None):
    total = 0.0
    for n in range(len(s)):
        keys = valid(mask[n])
        p = {j: psi[n, j].item() for j in keys}
        preferred = sorted(keys, key=lambda j: -p[j])[:max_preferred] if max_preferred else keys
        num = den = 0.0
        for i in preferred:
            for j in keys:
                if p[i] > p[j]:
                    delta = p[i] - p[j]
                    num += delta * math.log(1 + math.exp(-(s[n, i].item() - s[n, j].item() - gamma)))
                    den += delta
        total += num / den if den > 0 else 0.0
    return total / len(s)


def naive_head(s, psi, mask, k):
    total = 0.0
    for n in range(len(s)):
        keys = valid(mask[n])
        log_p = naive_log_pi(s[n].tolist(), keys)
        top = sorted(keys, key=lambda j: -psi[n, j].item())[:k]
        total -= sum(psi[n, i].item() * log_p[i] for i in top)
    return total / len(s)


def test_kl_matches_naive():
    s, psi, mask = make_batch()
    assert kl_loss(s, psi, mask).item() == pytest.approx(naive_kl(s, psi, mask), rel=1e-10)


def test_kl_is_zero_at_log_psi():
    _, psi, mask = make_batch()
    s = torch.log(psi) + 3.0  # any per-query shift leaves pi unchanged
    assert abs(kl_loss(s, psi, mask).item()) < 1e-12


@pytest.mark.parametrize("gamma", [0.0, 0.7, -0.3])
@pytest.mark.parametrize("max_preferred", [None, 1, 2, 4, 100])
def test_listwise_matches_naive(gamma, max_preferred):
    s, psi, mask = make_batch()
    got = listwise_loss(s, psi, mask, gamma=gamma, max_preferred=max_preferred).item()
    assert got == pytest.approx(naive_listwise(s, psi, mask, gamma, max_preferred), rel=1e-10)


def test_listwise_chunking_gives_same_loss_and_grad(monkeypatch):
    s, psi, mask = make_batch()
    s = s.masked_fill(~mask, 0.0).requires_grad_()
    full = listwise_loss(s, psi, mask, gamma=0.2)
    (grad_full,) = torch.autograd.grad(full, s)
    monkeypatch.setattr(objectives, "PAIR_CHUNK_ELEMENTS", 60)  # one instance per chunk
    chunked = listwise_loss(s, psi, mask, gamma=0.2)
    (grad_chunked,) = torch.autograd.grad(chunked, s)
    assert chunked.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(grad_chunked, grad_full, rtol=1e-10, atol=1e-14)


def test_listwise_decreases_toward_psi_order():
    s, psi, mask = make_batch(seed=3)
    start, target = s.masked_fill(~mask, 0.0), torch.log(psi).masked_fill(~mask, 0.0)  # target: psi's order
    # Interpolate toward the psi order, then sharpen it (larger margins, smaller loss).
    path = [(1 - t) * start + t * target for t in (0.0, 0.25, 0.5, 0.75, 1.0)] + [2 * target, 4 * target]
    losses = [listwise_loss(x, psi, mask).item() for x in path]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("k", [0, 1, 3, 50])
def test_head_matches_naive(k):
    s, psi, mask = make_batch()
    assert head_loss(s, psi, mask, k=k).item() == pytest.approx(
        naive_head(s, psi, mask, k), rel=1e-10, abs=1e-14
    )


def test_head_k0_is_zero_with_zero_gradient():
    s, psi, mask = make_batch()
    s = s.masked_fill(~mask, 0.0).requires_grad_()
    loss = head_loss(s, psi, mask, k=0)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(s.grad) == 0


def test_dimpo_is_listwise_plus_lambda_head():
    s, psi, mask = make_batch()
    got = dimpo_loss(s, psi, mask, gamma=0.1, k=2, lam=0.5, max_preferred=3).item()
    want = naive_listwise(s, psi, mask, 0.1, 3) + 0.5 * naive_head(s, psi, mask, 2)
    assert got == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize(
    "loss",
    [
        kl_loss,
        lambda s, psi, mask: listwise_loss(s, psi, mask, gamma=0.3, max_preferred=2),
        lambda s, psi, mask: head_loss(s, psi, mask, k=2),
        lambda s, psi, mask: dimpo_loss(s, psi, mask, gamma=0.1, k=3, lam=1.0),
    ],
)
def test_gradients_finite_with_padding(loss):
    s, psi, mask = make_batch()
    s = s.requires_grad_()  # padded entries are -inf
    loss(s, psi, mask).backward()
    assert torch.isfinite(s.grad).all()
    assert torch.all(s.grad[~mask] == 0)


def test_random_projection_orthonormal_and_seeded():
    W = random_projection(16, 4, seed=1)
    assert W.shape == (4, 16)
    assert W.dtype == torch.float32
    assert torch.allclose(W @ W.T, torch.eye(4, dtype=W.dtype), atol=1e-6)
    assert torch.equal(W, random_projection(16, 4, seed=1))
    assert not torch.equal(W, random_projection(16, 4, seed=2))


def test_pca_finds_the_shared_subspace():
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32)  # noqa: E731
    basis = torch.linalg.qr(randn(16, 3))[0]  # (16, 3)
    q = randn(500, 3) @ basis.T * 3 + 0.01 * randn(500, 16)
    k = randn(300, 3) @ basis.T * 2
    W = pca_projection(q, k, 3)
    assert W.dtype == torch.float32
    assert torch.allclose(W @ W.T, torch.eye(3, dtype=W.dtype), atol=1e-5)
    # Same subspace: projecting the basis onto W's rows keeps it whole.
    assert torch.allclose((W.T @ W) @ basis, basis, atol=1e-3)


def test_registry():
    assert {"random", "pca", "kl", "dimpo"} <= set(OBJECTIVES)
    assert not OBJECTIVES["pca"].trained and OBJECTIVES["dimpo"].trained
    s, psi, mask = make_batch()
    hp = {"gamma": 0.2, "k": 2, "lam": 1.0, "max_preferred": None, "lr": 1.0}
    assert OBJECTIVES["dimpo"](s, psi, mask, hp).item() == pytest.approx(
        dimpo_loss(s, psi, mask, gamma=0.2, k=2, lam=1.0).item()
    )
    with pytest.raises(ValueError, match=r"'cpo'.*dimpo"):
        get_objective("cpo")


def reference_listwise(s, psi, mask, gamma, max_preferred):
    """Plain autograd version of the same loss, for checking the hand-written gradient."""
    losses = []
    for n in range(len(s)):
        keys = torch.nonzero(mask[n]).flatten()
        order = keys[psi[n, keys].argsort(descending=True)]
        preferred = order[:max_preferred] if max_preferred else keys
        delta = (psi[n, preferred, None] - psi[n, None, keys]).clamp(min=0)
        terms = F.softplus(-(s[n, preferred, None] - s[n, None, keys] - gamma))
        den = delta.sum()
        losses.append((delta * terms).sum() / den if den > 0 else s[n, keys].sum() * 0)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("gamma,max_preferred", [(0.0, None), (0.5, 2), (-0.2, 4)])
def test_listwise_gradient_matches_autograd(gamma, max_preferred):
    s, psi, mask = make_batch(seed=5)
    s = s.masked_fill(~mask, 0.0).requires_grad_()
    (got,) = torch.autograd.grad(listwise_loss(s, psi, mask, gamma, max_preferred), s)
    (want,) = torch.autograd.grad(reference_listwise(s, psi, mask, gamma, max_preferred), s)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x: listwise_loss(x, psi, mask, gamma, max_preferred), (s,))
