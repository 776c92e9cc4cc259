"""Losses of dimattn.dimpo.objectives against loops written straight from seed 003's equations and the
constants of the authors' code: values and gradients, on small float64 batches."""

import math

import pytest
import torch

from dimattn.dimpo import objectives
from dimattn.dimpo.objectives import (
    OBJECTIVES,
    cpo_loss,
    dimpo_kl_loss,
    dimpo_loss,
    get_objective,
    head_loss,
    kl_loss,
    listwise_loss,
    orpo_loss,
    pca_projection,
    random_projection,
    select_pairs,
    simpo_loss,
    triplet_loss,
)

from dimattn.workflow.schema import dimpo_presets

# The losses take every hyperparameter; the tests give the fit settings' defaults
# (schemas/dimpo_presets.yaml) where a case varies only some.
HP = dimpo_presets()["defaults"]
LIST = {n: HP[n] for n in ("beta", "gamma", "delta", "normalise", "max_preferred")}


def listwise(x, psi, mask, **over):
    return listwise_loss(x, psi, mask, **(LIST | over))


def dimpo(x, psi, mask, **over):
    return dimpo_loss(x, psi, mask, **(LIST | {"k": HP["k"], "lam": HP["lam"]} | over))


def dimpo_kl(x, psi, mask, **over):
    return dimpo_kl_loss(x, psi, mask, **(LIST | {"kl_weight": HP["kl_weight"]} | over))


def pairs(scores, mask, mode, **over):
    return select_pairs(scores, mask, mode, **({"num_pairs": HP["num_pairs"], "distance": HP["pair_distance"]} | over))


def make_batch(n=5, length=7, seed=0, lengths=(7, 1, 3, 5, 2), tie=False):
    """float64 logits (padding -inf), psi (0 at padding) and mask; row i has lengths[i] valid keys.

    ``tie``: row 0 gets three keys of equal psi (ties must not form pairs)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:n, None]
    logits = torch.randn(n, length, generator=g, dtype=torch.float64) * 2
    raw = torch.randn(n, length, generator=g, dtype=torch.float64) * 2
    if tie:
        raw[0, 4:7] = raw[0, 1]
    psi = torch.softmax(raw.masked_fill(~mask, float("-inf")), -1)
    return logits.masked_fill(~mask, float("-inf")), psi, mask


def valid(row_mask):
    return [j for j in range(len(row_mask)) if row_mask[j]]


def naive_log_p(row, keys):
    z = torch.logsumexp(torch.stack([row[j] for j in keys]), 0)
    return {j: row[j] - z for j in keys}


# ---- naive references: one python loop per key or pair, torch scalars for autograd ---------


def naive_kl(logits, psi, mask):
    total = 0.0
    for n in range(len(logits)):
        keys = valid(mask[n])
        log_p = naive_log_p(logits[n], keys)
        for j in keys:
            c = max(psi[n, j].item(), 1e-6)
            total = total + c * (math.log(c) - log_p[j])
    return total / len(logits)


def naive_listwise(logits, psi, mask, beta=1.0, gamma=1e-4, delta="lambda", normalise="pairs", max_preferred=None):
    total = 0.0
    for n in range(len(logits)):
        keys = valid(mask[n])
        log_p = naive_log_p(logits[n], keys)
        s = {j: beta * torch.clamp(log_p[j], min=math.log(1e-8)) for j in keys}  # beta log max(p, 1e-8)
        p = {j: psi[n, j].item() for j in keys}
        ranked = sorted(keys, key=lambda j: -p[j])  # stable: ties in key order
        tau = {j: ranked.index(j) + 1 for j in keys}
        preferred = ranked[:max_preferred] if max_preferred else keys
        num, den = 0.0, 0.0
        for i in preferred:
            for j in keys:
                if p[i] > p[j]:
                    if delta == "lambda":
                        gain = abs((2 ** p[i] - 1) - (2 ** p[j] - 1))
                        d = gain * abs(1 / math.log(1 + tau[i]) - 1 / math.log(1 + tau[j]))
                    else:
                        d = p[i] - p[j]
                    num = num + d * torch.log1p(torch.exp(-(s[i] - s[j] - gamma)))
                    den += 1 if normalise == "pairs" else d
        if normalise == "pairs":
            total = total + num / max(den, 1)
        elif den > 0:
            total = total + num / den
    return total / len(logits)


def naive_head(logits, psi, mask, k):
    total = 0.0
    for n in range(len(logits)):
        keys = valid(mask[n])
        log_p = naive_log_p(logits[n], keys)
        for i in sorted(keys, key=lambda j: -psi[n, j].item())[:k]:
            total = total - psi[n, i].item() * log_p[i]
    return total / len(logits)


def naive_pair_probs(s_w, s_l):
    z = torch.exp(s_w) + torch.exp(s_l)
    return (torch.clamp(torch.exp(s_w) / z, 1e-6, 1 - 1e-6), torch.clamp(torch.exp(s_l) / z, 1e-6, 1 - 1e-6))


def naive_pairwise(name, s_w, s_l, **hp):
    total = 0.0
    for a, b in zip(s_w, s_l):
        p_w, p_l = naive_pair_probs(a, b)
        if name == "simpo":
            total = total - torch.log(torch.sigmoid(hp["beta"] * (torch.log(p_w) - torch.log(p_l)) - hp["gamma"]))
        elif name == "orpo":
            odds = torch.log(p_w / (1 - p_w)) - torch.log(p_l / (1 - p_l))
            total = total - torch.log(p_w) - hp["lam"] * torch.log(torch.sigmoid(odds))
        else:  # cpo
            margin = torch.clamp(hp["beta"] * (torch.log(p_w) - torch.log(p_l)), min=1e-6)
            total = total - torch.log(margin) - hp["lam"] * torch.log(p_w)
    return total / len(s_w)


def naive_triplet(anchor, pos, neg, margin):
    total = 0.0
    for a, p, n in zip(anchor, pos, neg):
        d_ap = torch.sqrt(sum((a[i] - p[i] + 1e-6) ** 2 for i in range(len(a))))  # torch's pairwise_distance eps
        d_an = torch.sqrt(sum((a[i] - n[i] + 1e-6) ** 2 for i in range(len(a))))
        total = total + torch.clamp(d_ap - d_an + margin, min=0)
    return total / len(anchor)


def finite_logits(logits, mask):
    return logits.masked_fill(~mask, 0.0).requires_grad_()


def assert_same_value_and_grad(fn, naive, *tensors):
    got, want = fn(*tensors), naive(*tensors)
    assert got.item() == pytest.approx(float(want.detach()), rel=1e-9, abs=1e-14)
    grads_got = torch.autograd.grad(got, [t for t in tensors if t.requires_grad], allow_unused=True)
    grads_want = torch.autograd.grad(want, [t for t in tensors if t.requires_grad], allow_unused=True)
    for g, w in zip(grads_got, grads_want):
        w = torch.zeros_like(g) if w is None else w
        assert torch.allclose(g, w, rtol=1e-8, atol=1e-13), (g, w)


# ---- list objectives --------------------------------------------------------------------


def test_kl_matches_naive_with_psi_floor():
    logits, psi, mask = make_batch()
    logits = finite_logits(logits, mask)
    assert_same_value_and_grad(lambda x: kl_loss(x, psi, mask), lambda x: naive_kl(x, psi, mask), logits)


def test_kl_psi_floor_applies_where_psi_is_below_it():
    """Teacher weights far below the floor (1e-6): the loss and its gradient are those of psi
    clamped at 1e-6, not of psi itself nor of a lower floor."""
    logits, psi, mask = make_batch()
    psi = torch.softmax((psi.log() * 6).masked_fill(~mask, float("-inf")), -1)  # sharper: tails ~1e-12
    below = mask & (psi < 1e-6)
    assert below.sum() >= 5 and (psi[below] < 1e-8).any()
    logits = finite_logits(logits, mask)
    assert_same_value_and_grad(lambda x: kl_loss(x, psi, mask), lambda x: naive_kl(x, psi, mask), logits)


@pytest.mark.parametrize("delta", ["lambda", "difference"])
@pytest.mark.parametrize("normalise", ["pairs", "delta"])
@pytest.mark.parametrize("max_preferred", [None, 1, 2, 4, 100])
def test_listwise_matches_naive(delta, normalise, max_preferred):
    logits, psi, mask = make_batch(tie=True)
    logits = finite_logits(logits, mask)
    hp = dict(beta=1.3, gamma=0.4, delta=delta, normalise=normalise, max_preferred=max_preferred)
    assert_same_value_and_grad(
        lambda x: listwise(x, psi, mask, **hp), lambda x: naive_listwise(x, psi, mask, **hp), logits
    )


def test_listwise_probability_floor_stops_gradient():
    # A key whose p is below 1e-8 sits at s = beta log 1e-8 and gets no gradient through s.
    psi = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logits = torch.tensor([[0.0, -30.0, 1.0]], dtype=torch.float64, requires_grad=True)
    loss = listwise(logits, psi, mask, gamma=0.0)
    assert loss.item() == pytest.approx(float(naive_listwise(logits.detach(), psi, mask, gamma=0.0)), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(grad[0, 1]) < 1e-10  # clamped: only the normaliser's -p_1 (~1e-13) is left


@pytest.mark.parametrize("budget", [1, 10, 60, 1 << 22])
def test_listwise_blocks_give_same_loss_and_grad(monkeypatch, budget):
    """Blocks of instances, or of preferred rows within one instance (budget < L), change nothing."""
    logits, psi, mask = make_batch(seed=2)
    logits = finite_logits(logits, mask)
    full = listwise(logits, psi, mask)
    (grad_full,) = torch.autograd.grad(full, logits)
    monkeypatch.setattr(objectives, "PAIR_CHUNK_ELEMENTS", budget)
    blocked = listwise(logits, psi, mask)
    (grad_blocked,) = torch.autograd.grad(blocked, logits)
    assert blocked.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(grad_blocked, grad_full, rtol=1e-10, atol=1e-15)


def test_listwise_gradcheck():
    logits, psi, mask = make_batch(seed=5)
    x = finite_logits(logits, mask)
    for normalise in ("pairs", "delta"):
        assert torch.autograd.gradcheck(lambda y: listwise(y, psi, mask, gamma=0.3, normalise=normalise), (x,))


def test_listwise_is_tiny_next_to_the_head_term_at_many_keys():
    # The authors' normalisation by the number of pairs: ~1e-6 of the head term at 4,096 keys.
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 4096, generator=g) * 2
    psi, mask = torch.softmax(raw, -1), torch.ones(1, 4096, dtype=torch.bool)
    logits = torch.randn(1, 4096, generator=g)
    ratio = listwise(logits, psi, mask) / head_loss(logits, psi, mask, k=64)
    assert 1e-8 < ratio.item() < 1e-4


@pytest.mark.parametrize("k", [0, 1, 3, 50])
def test_head_matches_naive(k):
    logits, psi, mask = make_batch()
    logits = finite_logits(logits, mask)
    if k == 0:
        loss = head_loss(logits, psi, mask, k=0)
        (grad,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
        return
    assert_same_value_and_grad(lambda x: head_loss(x, psi, mask, k=k), lambda x: naive_head(x, psi, mask, k), logits)


def test_dimpo_and_dimpo_kl_compose_their_terms():
    logits, psi, mask = make_batch()
    logits = finite_logits(logits, mask)
    assert_same_value_and_grad(
        lambda x: dimpo(x, psi, mask, gamma=0.1, k=2, lam=0.5, max_preferred=3),
        lambda x: naive_listwise(x, psi, mask, gamma=0.1, max_preferred=3) + 0.5 * naive_head(x, psi, mask, 2),
        logits,
    )
    assert_same_value_and_grad(
        lambda x: dimpo_kl(x, psi, mask, kl_weight=0.7),
        lambda x: naive_listwise(x, psi, mask) + 0.7 * naive_kl(x, psi, mask),
        logits,
    )


@pytest.mark.parametrize(
    "loss",
    [
        kl_loss,
        lambda x, psi, mask: listwise(x, psi, mask, gamma=0.3, max_preferred=2),
        lambda x, psi, mask: head_loss(x, psi, mask, k=2),
        lambda x, psi, mask: dimpo(x, psi, mask, k=3),
        dimpo_kl,
    ],
)
def test_gradients_finite_with_padding(loss):
    logits, psi, mask = make_batch()
    logits = logits.requires_grad_()  # padded entries are -inf
    loss(logits, psi, mask).backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.all(logits.grad[~mask] == 0)


# ---- pairwise objectives -------------------------------------------------------------------


def pair_logits(seed=0, n=9):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, n, generator=g, dtype=torch.float64) * 3
    s[:, 0] = torch.tensor([20.0, -20.0])  # p_w clamped at 1 - 1e-6
    s[:, 1] = torch.tensor([-20.0, 20.0])  # p_w clamped at 1e-6 (CPO's margin clamp too)
    return s[0].clone().requires_grad_(), s[1].clone().requires_grad_()


@pytest.mark.parametrize(
    "name,fn,hp",
    [
        ("simpo", simpo_loss, dict(beta=1.0, gamma=1.0)),
        ("simpo", simpo_loss, dict(beta=2.5, gamma=0.3)),
        ("orpo", orpo_loss, dict(lam=0.1)),
        ("orpo", orpo_loss, dict(lam=1.0)),
        ("cpo", cpo_loss, dict(beta=1.0, lam=0.1)),
        ("cpo", cpo_loss, dict(beta=0.5, lam=0.5)),
    ],
)
def test_pairwise_matches_naive(name, fn, hp):
    s_w, s_l = pair_logits()
    assert_same_value_and_grad(
        lambda a, b: fn(a, b, **hp), lambda a, b: naive_pairwise(name, a, b, **hp), s_w, s_l
    )


def test_triplet_matches_naive():
    g = torch.Generator().manual_seed(1)
    a, p, n = (torch.randn(6, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    assert_same_value_and_grad(
        lambda *x: triplet_loss(*x, margin=0.1), lambda *x: naive_triplet(*x, margin=0.1), a, p, n
    )


# ---- pair selection ------------------------------------------------------------------------------


def test_extreme_pairs_are_argmax_and_argmin_of_valid_keys():
    logits, _, mask = make_batch()
    scores = logits.masked_fill(~mask, 0.0)
    rows, chosen, rejected = pairs(scores, mask, "extreme")
    assert rows.tolist() == list(range(5))
    for r, w, l in zip(rows, chosen, rejected):
        keys = valid(mask[r])
        assert w == max(keys, key=lambda j: scores[r, j]) and l == min(keys, key=lambda j: scores[r, j])


def ranks(scores):
    return {int(j): r for r, j in enumerate(scores.argsort(descending=True))}


def test_all_pairs_are_every_ordered_pair():
    scores = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    rows, chosen, rejected = pairs(scores, torch.ones(3, 6, dtype=torch.bool), "all")
    assert len(rows) == 3 * 15
    for r in range(3):
        got = {(int(w), int(l)) for rr, w, l in zip(rows, chosen, rejected) if rr == r}
        want = {(w, l) for w in range(6) for l in range(6) if scores[r, w] > scores[r, l]}
        assert got == want


def test_halves_pairs_are_distinct_top_against_bottom():
    scores = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rows, chosen, rejected = pairs(scores, torch.ones(4, 10, dtype=torch.bool), "halves", generator=g,
                                          num_pairs=3)
    assert len(rows) == 12
    for r in range(4):
        rk = ranks(scores[r])
        w = [int(c) for rr, c in zip(rows, chosen) if rr == r]
        l = [int(c) for rr, c in zip(rows, rejected) if rr == r]
        assert len(set(w + l)) == 6  # no key used twice
        assert all(rk[c] < 5 for c in w) and all(rk[c] >= 5 for c in l)
    with pytest.raises(ValueError, match="num_pairs"):
        pairs(scores, torch.ones(4, 10, dtype=torch.bool), "halves", num_pairs=6)


@pytest.mark.parametrize("distance", [1, 3, 9, 50])
def test_distance_pairs_have_the_rank_gap(distance):
    scores = torch.randn(20, 10, generator=torch.Generator().manual_seed(0))
    rows, chosen, rejected = pairs(scores, torch.ones(20, 10, dtype=torch.bool), "distance",
                                          generator=torch.Generator().manual_seed(2), distance=distance)
    for r, w, l in zip(rows, chosen, rejected):
        rk = ranks(scores[r])
        assert rk[int(l)] - rk[int(w)] == min(distance, 9)


def test_appendix_modes_need_full_key_lists():
    _, _, mask = make_batch()
    with pytest.raises(ValueError, match="non-causal"):
        pairs(torch.zeros(mask.shape), mask, "all")
    with pytest.raises(ValueError, match="pair mode"):
        pairs(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "nearest")


# ---- closed forms and registry -------------------------------------------------------------------


def test_random_projection_is_unscaled_gaussian_without_bias():
    W, b = random_projection(64, 32, torch.Generator().manual_seed(1))
    assert W.shape == (32, 64) and W.dtype == torch.float32 and b is None
    assert abs(W.mean().item()) < 0.05 and W.std().item() == pytest.approx(1.0, abs=0.05)
    assert torch.equal(W, random_projection(64, 32, torch.Generator().manual_seed(1))[0])


def test_pca_centred_is_sklearn_style_and_uncentred_has_no_bias():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 3, generator=g))[0]
    shift = torch.randn(16, generator=g) * 5
    spread = torch.tensor([5.0, 3.0, 1.0])  # distinct variances: unique directions
    q = (torch.randn(500, 3, generator=g) * spread) @ basis.T + 0.01 * torch.randn(500, 16, generator=g) + shift
    k = (torch.randn(300, 3, generator=g) * spread) @ basis.T + shift
    W, b = pca_projection(q, k, 3)
    pooled = torch.cat([q, k]).double()
    mu = pooled.mean(0)
    assert torch.allclose(W @ W.T, torch.eye(3), atol=1e-5)
    assert torch.allclose((W.T @ W).double() @ basis.double(), basis.double(), atol=1e-3)  # the shared subspace
    assert torch.allclose(b.double(), -(W.double() @ mu), atol=1e-4)  # x -> W (x - mu)
    _, _, v = torch.linalg.svd(pooled - mu, full_matrices=False)  # sklearn's components, up to sign
    assert torch.allclose((W.double() @ v[:3].T).abs(), torch.eye(3, dtype=torch.float64), atol=1e-4)
    W0, b0 = pca_projection(q, k, 3, center=False)
    assert b0 is None and W0.shape == (3, 16)


def test_registry_holds_every_objective_with_the_authors_settings():
    assert set(OBJECTIVES) == {
        "random", "pca", "triplet", "cpo", "simpo", "orpo", "kl", "dimpo", "dimpo_list", "dimpo_kl",
    }
    d = {name: dict(o.defaults) for name, o in OBJECTIVES.items()}
    assert d["dimpo"] == dict(lr=1e-4, batch_size=1, beta=1.0, gamma=1e-4, k_share=1 / 64, lam=1.0)
    assert d["dimpo_list"]["k"] == 0 and d["dimpo_kl"]["kl_weight"] == 1.0
    assert d["simpo"] == dict(lr=1e-3, batch_size=32, beta=1.0, gamma=1.0)
    assert d["orpo"] == dict(lr=1e-3, batch_size=32, lam=0.1)
    assert d["cpo"] == dict(lr=1e-4, batch_size=32, beta=1.0, lam=0.1)
    assert d["triplet"] == dict(lr=1e-4, batch_size=32, margin=0.1)
    assert d["kl"] == dict(lr=1e-4, batch_size=1)
    assert {o.kind for o in OBJECTIVES.values()} == {"closed", "list", "pair", "triplet"}
    assert not OBJECTIVES["pca"].trained and OBJECTIVES["dimpo"].trained


def test_objective_call_reads_hparams_then_defaults():
    logits, psi, mask = make_batch()
    got = OBJECTIVES["dimpo"](logits, psi, mask, hparams={"k": 2, "lr": 1.0})
    assert got.item() == pytest.approx(dimpo(logits, psi, mask, k=2, lam=1.0, gamma=1e-4).item())
    s_w, s_l = pair_logits()
    assert OBJECTIVES["simpo"](s_w, s_l).item() == pytest.approx(simpo_loss(s_w, s_l, beta=1.0, gamma=1.0).item())
    with pytest.raises(ValueError, match=r"'cosine'.*dimpo"):
        get_objective("cosine")
    with pytest.raises(TypeError, match="closed-form"):
        OBJECTIVES["pca"](logits, psi, mask)


@pytest.mark.parametrize("name", [o.name for o in OBJECTIVES.values() if o.trained])
def test_per_row_losses_average_to_the_loss(name):
    """reduce=False (a lockstep fit's per-layer means, dimattn.dimpo.projections.fit_layers): one loss a
    row, whose mean is the loss and whose gradient is the loss's, for every trained objective."""
    obj = get_objective(name)
    g = torch.Generator().manual_seed(1)
    if obj.kind == "list":
        logits, psi, mask = make_batch()
        tensors = [logits.masked_fill(~mask, 0.0).requires_grad_(), psi, mask]
    elif obj.kind == "pair":
        tensors = [torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    else:
        tensors = [torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    rows = obj(*tensors, hparams={"k": 2}, reduce=False)
    assert rows.shape == (len(tensors[0]),)
    loss = obj(*tensors, hparams={"k": 2})
    torch.testing.assert_close(rows.mean(), loss)
    (grad_rows,) = torch.autograd.grad(rows.mean(), tensors[0])
    (grad_loss,) = torch.autograd.grad(loss, tensors[0])
    torch.testing.assert_close(grad_rows, grad_loss)
