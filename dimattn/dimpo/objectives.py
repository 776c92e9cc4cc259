"""Training objectives for a low-dimensional query/key projection F(x) = W x + b (seed 003).

Every objective of the paper's Table 1 and Table 6 and Appendix B, written from the equations
of seed 003 with the constants of the authors' code (github.com/lanzv/dimpo, files
``src/models/dimpo_loss.py``, ``dimpo_kl.py``, ``lowdim_modules.py``, ``run_projection_experiment.py``).

Inputs. A *list* objective (kl, dimpo, dimpo_list, dimpo_kl) reads, for N instances padded to L keys,

- ``logits`` (N, L) projected logits F(q).F(k_j) * scale (scale 1/sqrt(d') in training). A
  per-query constant may be dropped: every list loss reads the logits only through
  p = Softmax(logits) over the valid keys (pi_theta of the paper);
- ``psi``    (N, L) original attention weights Softmax(q K^T / sqrt(d)), 0 at padding;
- ``mask``   (N, L) bool, True at valid keys. Every row needs >= 1 valid key.

A *pair* objective (simpo, orpo, cpo) reads the scaled logits ``s_w``, ``s_l`` (P,) of the
chosen and the rejected key of P pairs; a *triplet* objective reads the projected vectors
F(q), F(k_w), F(k_l) (P, d'). Pairs come from :func:`select_pairs`.

Definitions (the authors' code; the paper leaves them open):

- DimPO's listwise term, with s_i = beta log max(p_i, 1e-8):
  L_list = sum_{psi_i > psi_j} Delta_ij softplus(-(s_i - s_j - gamma)) / Z, averaged over
  instances. ``delta="lambda"`` is LiPO's lambda weight Delta_ij = |G_i - G_j| |1/D(tau_i) -
  1/D(tau_j)|, G = 2^psi - 1, D(tau) = ln(1 + tau), tau the rank by psi (1 = largest; ties broken
  by key order); ``delta="difference"`` is psi_i - psi_j. ``normalise="pairs"``: Z = the number
  of pairs with psi_i > psi_j (at least 1; the authors'); ``normalise="delta"``: Z = sum of
  Delta_ij over them. With 4,096 keys and the authors' choices the term is ~1e-6 of the head term.
  ``max_preferred = m`` keeps only pairs whose preferred key is among the top-m by psi.
- L_head = -sum_{top-k keys by psi} psi_i log p_i, psi not renormalised, p over the full list.
- KL(psi || p) with psi clamped below at 1e-6 (not renormalised), averaged over instances.
- Pairwise: p_w, p_l from a 2-way softmax of (s_w, s_l), clamped to [1e-6, 1 - 1e-6].

Memory: the pair terms of L_list are formed in blocks of at most ``PAIR_CHUNK_ELEMENTS`` pairs
(instances x preferred rows x keys), never one L x L tensor per instance, and the forward pass
also forms the gradient, so backward keeps only (N, L) tensors.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dimattn.workflow.schema import dimpo_presets

# Pair terms of the listwise loss are built at most this many at a time.
PAIR_CHUNK_ELEMENTS = 1 << 22
LIST_EPS = 1e-8  # s_i = beta log max(p_i, LIST_EPS) (DimPOLoss eps)
PROB_EPS = 1e-6  # psi floor of the KL objective; clamp of the pairwise p_w, p_l (EPSILON_FOR_LOGARITHMS)

# ---- list objectives -------------------------------------------------------------------------


def _masked_log_softmax(logits, mask):
    return torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def _reduced(per_row, reduce: bool):
    """The mean over rows (instances or pairs), or the rows themselves (``reduce=False``: a
    lockstep fit of several layers, dimattn.dimpo.projections.fit_layers, needs each layer's mean)."""
    return per_row.mean() if reduce else per_row


def kl_loss(logits, psi, mask, reduce: bool = True):
    """Mean over instances of sum_j c_j (log c_j - log p_j), c = max(psi, 1e-6), valid keys only."""
    mask = mask.bool()
    log_p = _masked_log_softmax(logits, mask).masked_fill(~mask, 0.0)
    c = psi.detach().clamp(min=PROB_EPS)
    return _reduced(torch.where(mask, c * (c.log() - log_p), torch.zeros_like(c)).sum(-1), reduce)


class _ListwiseFunction(torch.autograd.Function):
    """Per-instance L_list (N,) from s (N, L) sorted by psi descending.

    ``pref`` / ``disp``: psi as the preferred / dispreferred key (padding -1 / 2, so it is never
    in a pair); ``gain``, ``disc``: Delta_ij = (gain_i - gain_j)(disc_i - disc_j) on a pair
    (``disc`` None: 1). Rows i < m only. Sorted, a pair i, j has j > i, so a block of rows
    [i0, i1) needs only the columns after i0. The gradient is formed here:
    w_ij = Delta_ij sigmoid(s_j - s_i + gamma) / Z, d/ds_i = -sum_j w_ij, d/ds_j = +sum_i w_ij.
    """

    @staticmethod
    def forward(ctx, s, pref, disp, gain, disc, m, gamma, count_pairs):
        n, length = s.shape
        num, norm = s.new_zeros(n), s.new_zeros(n)
        grad = torch.zeros_like(s)
        budget = max(PAIR_CHUNK_ELEMENTS, length)
        if m * length <= budget:
            inst_step, row_step = max(1, budget // (m * length)), m
        else:
            inst_step, row_step = 1, max(1, budget // length)
        for c in torch.arange(n, device=s.device).split(inst_step):
            for i0 in range(0, m, row_step):
                i1, cols = min(i0 + row_step, m), slice(i0 + 1, length)
                if i0 + 1 >= length:
                    continue
                valid = pref[c, i0:i1, None] > disp[c, None, cols]  # (c, r, L')
                delta = (gain[c, i0:i1, None] - gain[c, None, cols]) * valid
                if disc is not None:
                    delta.mul_(disc[c, i0:i1, None] - disc[c, None, cols])
                x = s[c, None, cols] - s[c, i0:i1, None] + gamma  # -(s_i - s_j - gamma)
                # Below -40 a term is < 1e-17; clamping avoids float32 denormals (10x slower on CPU).
                x.clamp_(min=-40.0)
                num[c] += F.softplus(x).mul_(delta).sum((1, 2))
                norm[c] += valid.sum((1, 2)).to(s.dtype) if count_pairs else delta.sum((1, 2))
                w = x.sigmoid_().mul_(delta)
                grad[c, i0:i1] -= w.sum(2)
                grad[c, cols] += w.sum(1)
        if count_pairs:
            inv = 1.0 / norm.clamp(min=1.0)
        else:
            inv = torch.where(norm > 0, 1.0 / norm.clamp(min=torch.finfo(s.dtype).tiny), 0.0)
        ctx.save_for_backward(grad * inv[:, None])
        return num * inv

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss[:, None], None, None, None, None, None, None, None


def listwise_scores(logits, mask, beta: float, eps: float = LIST_EPS):
    """s = beta log max(p, eps), p = Softmax(logits) over the valid keys; 0 at padding."""
    log_p = _masked_log_softmax(logits, mask)
    if eps > 0:
        log_p = log_p.clamp(min=math.log(eps))
    return torch.where(mask, beta * log_p, torch.zeros_like(log_p))


def listwise_loss(
    logits,
    psi,
    mask,
    *,
    beta: float,
    gamma: float,
    delta: str,
    normalise: str,
    max_preferred: int | None,
    reduce: bool = True,
):
    """L_list of seed 003 as the authors compute it (module docstring), mean over instances."""
    if delta not in ("lambda", "difference") or normalise not in ("pairs", "delta"):
        raise ValueError(f"delta={delta!r} must be lambda|difference, normalise={normalise!r} pairs|delta")
    mask = mask.bool()
    psi = psi.detach()
    s = listwise_scores(logits, mask, beta)
    pref = psi.masked_fill(~mask, -1.0)
    order = pref.argsort(dim=-1, descending=True, stable=True)  # padding last
    s, pref = s.gather(-1, order), pref.gather(-1, order)
    disp = psi.masked_fill(~mask, 2.0).gather(-1, order)
    psi_sorted = psi.gather(-1, order)
    length = s.shape[-1]
    if delta == "lambda":
        rank = torch.arange(1, length + 1, device=s.device, dtype=s.dtype)
        gain, disc = torch.pow(2.0, psi_sorted) - 1.0, (1.0 / torch.log1p(rank)).expand_as(s)
    else:
        gain, disc = psi_sorted, None
    m = length if max_preferred is None else max(1, min(int(max_preferred), length))
    per_instance = _ListwiseFunction.apply(s, pref, disp, gain, disc, m, float(gamma), normalise == "pairs")
    return _reduced(per_instance, reduce)


def head_loss(logits, psi, mask, *, k: int, reduce: bool = True):
    """L_head = -sum_{i in top-k keys by psi} psi_i log p_i, p over all valid keys; mean over instances.

    k = 0 gives 0 (still connected to ``logits`` for autograd).
    """
    mask = mask.bool()
    if k <= 0:
        return _reduced(torch.where(mask, logits, torch.zeros_like(logits)).sum(-1) * 0.0, reduce)
    psi = psi.detach() * mask
    log_p = _masked_log_softmax(logits, mask).masked_fill(~mask, 0.0)
    top = psi.topk(min(k, psi.shape[-1]), dim=-1).indices  # padded picks have psi 0
    return _reduced(-(psi.gather(-1, top) * log_p.gather(-1, top)).sum(-1), reduce)


def dimpo_loss(logits, psi, mask, *, beta, gamma, k, lam, delta, normalise, max_preferred, reduce=True):
    """DimPO = L_list + lambda L_head (seed 003, section 3.2); k = 0 or lambda = 0 drops the head."""
    loss = listwise_loss(logits, psi, mask, beta=beta, gamma=gamma, delta=delta, normalise=normalise,
                         max_preferred=max_preferred, reduce=reduce)
    if k > 0 and lam != 0:
        loss = loss + lam * head_loss(logits, psi, mask, k=k, reduce=reduce)
    return loss


def dimpo_kl_loss(logits, psi, mask, *, beta, gamma, kl_weight, delta, normalise, max_preferred, reduce=True):
    """DimPO (k = 0) + KL of Table 6: L_list + kl_weight KL(psi || p)."""
    loss = listwise_loss(logits, psi, mask, beta=beta, gamma=gamma, delta=delta, normalise=normalise,
                         max_preferred=max_preferred, reduce=reduce)
    return loss + kl_weight * kl_loss(logits, psi, mask, reduce)


# ---- pairwise objectives ------------------------------------------------------------------------


def _pair_probs(s_w, s_l):
    probs = torch.softmax(torch.stack([s_w, s_l], dim=-1), dim=-1)
    return probs[..., 0].clamp(PROB_EPS, 1 - PROB_EPS), probs[..., 1].clamp(PROB_EPS, 1 - PROB_EPS)


def simpo_loss(s_w, s_l, *, beta: float, gamma: float, reduce: bool = True):
    """SimPO: mean of -log sigmoid(beta (log p_w - log p_l) - gamma)."""
    p_w, p_l = _pair_probs(s_w, s_l)
    return _reduced(-F.logsigmoid(beta * (p_w.log() - p_l.log()) - gamma), reduce)


def orpo_loss(s_w, s_l, *, lam: float, reduce: bool = True):
    """ORPO: mean of -log p_w - lambda log sigmoid(logodds(p_w) - logodds(p_l))."""
    p_w, p_l = _pair_probs(s_w, s_l)
    odds = (p_w / (1 - p_w)).log() - (p_l / (1 - p_l)).log()
    return _reduced(-p_w.log() - lam * F.logsigmoid(odds), reduce)


def cpo_loss(s_w, s_l, *, beta: float, lam: float, reduce: bool = True):
    """CPO: mean of -log max(beta (log p_w - log p_l), 1e-6) - lambda log p_w."""
    p_w, p_l = _pair_probs(s_w, s_l)
    return _reduced(-(beta * (p_w.log() - p_l.log())).clamp(min=PROB_EPS).log() - lam * p_w.log(), reduce)


def triplet_loss(anchor, positive, negative, *, margin: float, reduce: bool = True):
    """Mongoose's triplet loss: torch's TripletMarginLoss (Euclidean, eps 1e-6, mean)."""
    return F.triplet_margin_loss(anchor, positive, negative, margin=margin, p=2,
                                 reduction="mean" if reduce else "none")


# ---- pair selection (section 3.3 and Appendix B) ------------------------------------------------

PAIR_MODES = ("extreme", "all", "halves", "distance")


def select_pairs(scores, mask, mode: str, *, generator=None, num_pairs: int, distance: int):
    """(row, chosen, rejected) long tensors: pairs of key columns of ``scores`` (N, L), raw q.k.

    - ``extreme``: one pair a row, chosen = argmax, rejected = argmin over the valid keys
      (the main tables, after Mongoose);
    - ``all``: every pair (a, b), a ranked above b, of the row's keys (Appendix B "all key
      pairs", where each row holds n sampled keys);
    - ``halves``: ``num_pairs`` pairs a row, chosen ranks drawn without replacement from the top
      half (L // 2 ranks), rejected from the bottom half, the t-th chosen with the t-th rejected
      (Appendix B "multiple distinct pairs"; no key used twice);
    - ``distance``: one pair a row, chosen rank uniform in [0, L - g), rejected rank + g,
      g = min(distance, L - 1) (Appendix B "level of key diversity").

    All modes but ``extreme`` need every key valid (the authors' Appendix B lists are non-causal).
    Draws use ``generator`` (CPU).
    """
    n, length = scores.shape
    mask = mask.bool()
    device = scores.device
    if mode == "extreme":
        rows = torch.arange(n, device=device)
        chosen = scores.masked_fill(~mask, float("-inf")).argmax(-1)
        rejected = scores.masked_fill(~mask, float("inf")).argmin(-1)
        return rows, chosen, rejected
    if mode not in PAIR_MODES:
        raise ValueError(f"pair mode {mode!r} not in {PAIR_MODES}")
    if not bool(mask.all()):
        raise ValueError(f"pair mode {mode!r} needs full (non-causal) key lists")
    order = scores.argsort(dim=-1, descending=True, stable=True)  # rank -> column
    if mode == "all":
        a, b = torch.triu_indices(length, length, offset=1, device=device)
        rows = torch.arange(n, device=device).repeat_interleave(len(a))
        ranks_w, ranks_l = a.repeat(n), b.repeat(n)
    elif mode == "halves":
        top = length // 2
        if not 0 < num_pairs <= top:
            raise ValueError(f"num_pairs={num_pairs} must be in 1..{top} for {length} keys")
        ranks_w = torch.rand(n, top, generator=generator).argsort(-1)[:, :num_pairs]
        ranks_l = torch.rand(n, length - top, generator=generator).argsort(-1)[:, :num_pairs] + top
        rows = torch.arange(n).repeat_interleave(num_pairs).to(device)
        ranks_w, ranks_l = ranks_w.reshape(-1).to(device), ranks_l.reshape(-1).to(device)
    else:
        gap = min(int(distance), length - 1)
        if gap < 1:
            raise ValueError(f"distance={distance} needs >= 2 keys")
        ranks_w = torch.randint(0, length - gap, (n,), generator=generator).to(device)
        ranks_l, rows = ranks_w + gap, torch.arange(n, device=device)
    return rows, order[rows, ranks_w], order[rows, ranks_l]


# ---- closed-form projections ---------------------------------------------------------------------


def random_projection(d: int, d_prime: int, generator=None, dtype=torch.float32):
    """(W, None): W = R^T for R ~ N(0, 1)^{d x d'}, unscaled, no bias (the authors' Rand).

    The authors draw R unseeded; here ``generator`` (CPU) makes it reproducible, same law.
    """
    if not 0 < d_prime <= d:
        raise ValueError(f"d_prime={d_prime} must satisfy 0 < d_prime <= d={d}")
    return torch.randn(d, d_prime, generator=generator, dtype=dtype).T.contiguous(), None


def pca_projection(queries, keys, d_prime: int, center: bool = True):
    """(W, b): the top-d' principal directions of the pooled rows of ``queries`` and ``keys``.

    ``center`` (sklearn's PCA, the authors'): x -> V (x - mu), so W = V and b = -V mu, V the
    top eigenvectors of the covariance of the pooled vectors. Uncentred: eigenvectors of the
    second moment, b = None. Rows are pooled as given (the authors: the queries of all heads at
    the sampled positions and every key of every key/value head). W has the dtype of ``queries``.
    """
    d = queries.shape[-1]
    if not 0 < d_prime <= d:
        raise ValueError(f"d_prime={d_prime} must satisfy 0 < d_prime <= d={d}")
    parts = [queries.reshape(-1, d), keys.reshape(-1, d)]
    count = sum(len(p) for p in parts)
    total = sum(p.sum(0, dtype=torch.float64) for p in parts)
    mu = total / count if center else torch.zeros(d, dtype=torch.float64, device=queries.device)
    moment = torch.zeros(d, d, dtype=torch.float64, device=queries.device)
    for x in parts:
        for part in x.split(1 << 18):  # bounded float64 copies at paper scale
            part = part.double() - mu
            moment += part.T @ part
    _, vectors = torch.linalg.eigh(moment / count)  # ascending eigenvalues
    w = vectors[:, -d_prime:].flip(-1).T  # (d', d), leading direction first
    # Fix each row's sign (largest entry positive) so the result is reproducible.
    w = w * torch.sign(w.gather(1, w.abs().argmax(1, keepdim=True)))
    bias = -(w @ mu) if center else None
    dtype = queries.dtype
    return w.contiguous().to(dtype), None if bias is None else bias.to(dtype)


# ---- registry -----------------------------------------------------------------------------------

KINDS = ("closed", "list", "pair", "triplet")


@dataclass(frozen=True)
class Objective:
    """One entry of :data:`OBJECTIVES`.

    ``kind``: closed (a ``fit``), list, pair or triplet (a ``loss``). ``hparams``: keyword
    arguments of ``loss`` read from the fit settings. ``defaults``: the authors' per-objective
    settings (run_projection_experiment.py; schemas/dimpo_presets.yaml), applied over a preset and
    under explicit hparams.
    """

    name: str
    kind: str
    loss: Callable[..., torch.Tensor] | None = None
    hparams: tuple[str, ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()
    fit: Callable | None = None

    @property
    def trained(self) -> bool:
        return self.loss is not None

    def __call__(self, *tensors, hparams=None, reduce: bool = True):
        """The loss on one batch; hyperparameters from ``hparams`` (mapping or settings object),
        else this objective's defaults, else the presets file's (the loss functions have none).
        ``reduce=False``: one loss per row (instance or pair), whose mean is the loss."""
        if self.loss is None:
            raise TypeError(f"objective {self.name!r} is closed-form and has no loss")
        values = _DEFAULTS | dict(self.defaults)
        if isinstance(hparams, Mapping):
            values.update(hparams)
        elif hparams is not None:
            values.update({n: getattr(hparams, n) for n in self.hparams if hasattr(hparams, n)})
        return self.loss(*tensors, **{n: values[n] for n in self.hparams if n in values}, reduce=reduce)


_LIST = ("beta", "gamma", "delta", "normalise", "max_preferred")
# Each objective's own settings (the authors' lr, batch, margins): schemas/dimpo_presets.yaml.
_PRESETS = dimpo_presets()
_OWN, _DEFAULTS = _PRESETS["objectives"], _PRESETS["defaults"]


def _fit_random(queries, keys, d_prime, *, generator=None, center=True):
    return random_projection(queries.shape[-1], d_prime, generator, dtype=queries.dtype)


def _fit_pca(queries, keys, d_prime, *, generator=None, center=True):
    return pca_projection(queries, keys, d_prime, center)


def _objective(name, kind, loss=None, hparams=(), fit=None):
    return Objective(name, kind, loss, tuple(hparams), tuple(_OWN.get(name, {}).items()), fit)


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in [
        _objective("random", "closed", fit=_fit_random),
        _objective("pca", "closed", fit=_fit_pca),
        _objective("triplet", "triplet", triplet_loss, ("margin",)),
        _objective("cpo", "pair", cpo_loss, ("beta", "lam")),
        _objective("simpo", "pair", simpo_loss, ("beta", "gamma")),
        _objective("orpo", "pair", orpo_loss, ("lam",)),
        _objective("kl", "list", kl_loss),
        _objective("dimpo", "list", dimpo_loss, (*_LIST, "k", "lam")),
        # Table 1's "DimPO (k=0, lambda=0)": the listwise term alone (its k and lambda: the presets file).
        _objective("dimpo_list", "list", dimpo_loss, (*_LIST, "k", "lam")),
        _objective("dimpo_kl", "list", dimpo_kl_loss, (*_LIST, "kl_weight")),
    ]
}


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; known objectives: {sorted(OBJECTIVES)}") from None
