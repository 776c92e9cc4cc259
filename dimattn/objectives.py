"""Training objectives for a low-dimensional query/key projection W (seed 003, sections 3.1-3.2).

A training instance is one query with its causal key list. For a batch of N instances padded to
L keys every loss reads the same three tensors:

- ``s``    (N, L) projected logits s_j = q'.k'_j / sqrt(d'), with q' = W q and k'_j = W k_j;
- ``psi``  (N, L) original attention weights Softmax(q K^T / sqrt(d)), 0 at padding;
- ``mask`` (N, L) bool, True at valid (causal, non-padded) keys. Every row needs >= 1 valid key.

pi_theta = Softmax(s) over the valid keys is the projected attention of the paper.

Definitions the paper leaves open (seed 003, Eq. L_list):

- ``s_i`` is the projected logit of key i. It equals log pi_theta(k_i | q) up to the per-query
  normaliser log sum_j exp(s_j), which cancels in s_i - s_j, so the listwise loss is the same
  whether written with logits or log-probabilities.
- ``Delta_ij = psi_i - psi_j`` (LambdaRank style): a pair whose original weights differ more
  counts more, and a pair of near-ties barely counts. Because the sum runs over psi_i > psi_j,
  Delta_ij * [psi_i > psi_j] = relu(psi_i - psi_j), which is how the code writes it.
- ``gamma`` is a fixed margin: the preferred key should win by at least gamma nats.
  Default 0, the plain pairwise logistic (RankNet) loss.
- Each instance's sum is divided by its sum of Delta_ij over the same pairs, so the loss is a
  Delta-weighted mean of pairwise logistic losses whose scale does not grow with L^2; the batch
  loss is the mean over instances (an instance without any pair contributes 0).
- ``max_preferred = m`` keeps only pairs whose preferred key i is among the top-m keys by psi
  (all its dispreferred partners j stay): O(N m L) instead of O(N L^2), needed at L = 4096.
  The pairs dropped have Delta_ij <= psi_i <= the m-th largest psi, so they weigh little.

L_list reads s only through differences s_i - s_j and keeps falling as they grow, so nothing
in it stops pi_theta from becoming sharper than psi: trained alone it inflates ||W|| and the
KL to psi rises with training. The head term (k > 0, lam > 0) pins the temperature, since
-sum_top-k psi_i log p_i grows again once p puts all mass on the very top keys.

Registry: ``OBJECTIVES`` maps a name to an :class:`Objective`. A gradient objective carries a
``loss(s, psi, mask, **hparams)`` and the names of the hyperparameters it reads; a closed-form
objective carries ``fit(queries, keys, d_prime, seed) -> W``. A pairwise objective (triplet,
CPO, SimPO, ORPO) is one more entry whose loss picks its chosen/rejected keys from ``psi``.

Closed-form choices: ``random`` is a Gaussian matrix with orthonormalised rows (fixed seed);
``pca`` takes the top-d' eigenvectors of the *uncentered* second moment
E[q q^T] + E[k k^T] of the layer's captured queries and keys (each set averaged on its own, so
grouped-query attention's extra query heads do not outweigh the keys). Uncentered, because W is
applied to the raw vectors (q' = W q, no mean subtracted): this W is the best rank-d' subspace
for reconstructing the vectors whose dot products the attention actually uses.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Pair tensors (instances x preferred x keys) are built at most this many elements at a time.
PAIR_CHUNK_ELEMENTS = 1 << 22


def _masked_log_softmax(s, mask):
    return torch.log_softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def kl_loss(s, psi, mask):
    """Mean over instances of KL(psi || pi_theta) = sum_j psi_j (log psi_j - log pi_j)."""
    log_pi = _masked_log_softmax(s, mask).masked_fill(~mask, 0.0)
    live = mask & (psi > 0)
    log_psi = torch.where(live, psi, torch.ones_like(psi)).log()
    return torch.where(live, psi * (log_psi - log_pi), torch.zeros_like(psi)).sum(-1).mean()


class _ListwiseFunction(torch.autograd.Function):
    """Per-instance L_list (N,) of preferred keys s_i (N, m) against all keys s (N, L).

    The (instances x m x L) pair tensors are built once, a chunk of instances at a time, and the
    forward pass also forms the gradient, w_ij = Delta_ij sigmoid(gamma - s_i + s_j) / sum Delta:
    d/ds_i = -sum_j w_ij, d/ds_j = +sum_i w_ij. Backward then needs only (N, m) and (N, L).
    """

    @staticmethod
    def forward(ctx, s_i, s, psi_i, psi, mask, gamma):
        need_grad = any(ctx.needs_input_grad[:2])
        n, m, length = s.shape[0], s_i.shape[1], s.shape[1]
        # As the dispreferred key j, padding gets psi = 2 > any psi_i, so Delta_ij = 0 there.
        psi_j = psi.masked_fill(~mask, 2.0)
        s_i = s_i - gamma
        loss = s.new_zeros(n)
        grad_i, grad_j = (torch.zeros_like(s_i), torch.zeros_like(s)) if need_grad else (None, None)
        per_chunk = max(1, PAIR_CHUNK_ELEMENTS // max(1, m * length))
        for c in torch.arange(n, device=s.device).split(per_chunk):
            delta = (psi_i[c, :, None] - psi_j[c, None, :]).clamp_(
                min=0
            )  # (c, m, L): Delta_ij [psi_i > psi_j]
            den = delta.sum((1, 2))
            inv = torch.where(den > 0, 1 / den.clamp(min=torch.finfo(den.dtype).tiny), 0.0)
            x = s[c, None, :] - s_i[c, :, None]  # -(s_i - s_j - gamma)
            # Below -40 a term is < 1e-17; clamping avoids float32 denormals (10x slower on CPU).
            x.clamp_(min=-40.0)
            loss[c] = F.softplus(x).mul_(delta).sum((1, 2)) * inv
            if need_grad:
                w = x.sigmoid_().mul_(delta)
                grad_i[c], grad_j[c] = -w.sum(2) * inv[:, None], w.sum(1) * inv[:, None]
        ctx.save_for_backward(grad_i, grad_j)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_i, grad_j = ctx.saved_tensors
        return grad_i * grad_loss[:, None], grad_j * grad_loss[:, None], None, None, None, None


def listwise_loss(s, psi, mask, gamma: float = 0.0, max_preferred: int | None = None):
    """L_list of seed 003: sum_{psi_i > psi_j} Delta_ij log(1 + exp(-(s_i - s_j - gamma))).

    Per instance normalised by sum Delta_ij, then averaged over instances; see the module
    docstring for the definitions of s_i, Delta_ij, gamma and ``max_preferred``. Memory is
    bounded by PAIR_CHUNK_ELEMENTS pair terms at a time.
    """
    mask = mask.bool()
    psi = (psi * mask).detach()  # padding must carry psi = 0 so that it is never preferred
    s = torch.where(mask, s, torch.zeros_like(s))  # finite everywhere: padded s may be -inf
    if max_preferred is None or max_preferred >= s.shape[1]:
        s_i, psi_i = s, psi
    else:
        top = psi.topk(max_preferred, dim=-1).indices  # (N, m); padded picks have psi 0
        s_i, psi_i = s.gather(-1, top), psi.gather(-1, top)
    return _ListwiseFunction.apply(s_i, s, psi_i, psi, mask, float(gamma)).mean()


def head_loss(s, psi, mask, k: int = 0):
    """L_head = -sum_{i in top-k keys by psi} psi_i log p_i, p = pi_theta over all valid keys.

    Averaged over instances; k = 0 gives 0 (still connected to ``s`` for autograd).
    """
    mask = mask.bool()
    if k <= 0:
        return torch.where(mask, s, torch.zeros_like(s)).sum() * 0.0
    psi = psi * mask
    log_p = _masked_log_softmax(s, mask).masked_fill(~mask, 0.0)
    top = psi.topk(min(k, psi.shape[-1]), dim=-1).indices  # padded picks have psi 0
    return -(psi.gather(-1, top) * log_p.gather(-1, top)).sum(-1).mean()


def dimpo_loss(s, psi, mask, gamma: float = 0.0, k: int = 0, lam: float = 0.0, max_preferred=None):
    """DimPO = L_list + lambda L_head (seed 003, section 3.2)."""
    loss = listwise_loss(s, psi, mask, gamma=gamma, max_preferred=max_preferred)
    if lam and k > 0:
        loss = loss + lam * head_loss(s, psi, mask, k=k)
    return loss


def random_projection(d: int, d_prime: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """(d', d) Gaussian matrix with orthonormal rows (the paper's Rand baseline)."""
    if not 0 < d_prime <= d:
        raise ValueError(f"d_prime={d_prime} must satisfy 0 < d_prime <= d={d}")
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(d, d_prime, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)  # q: (d, d') orthonormal columns
    q = q * torch.sign(torch.diagonal(r))  # unique QR: same seed, same W on every platform
    return q.T.contiguous().to(dtype)


def pca_projection(queries: torch.Tensor, keys: torch.Tensor, d_prime: int) -> torch.Tensor:
    """(d', d) top-d' eigenvectors of E[q q^T] + E[k k^T], uncentered (see module docstring).

    ``queries`` (n, d) and ``keys`` (m, d) are the raw (post-RoPE) vectors of one layer; W has
    the dtype of ``queries``.
    """
    d = queries.shape[-1]
    if not 0 < d_prime <= d:
        raise ValueError(f"d_prime={d_prime} must satisfy 0 < d_prime <= d={d}")
    moment = torch.zeros(d, d, dtype=torch.float64, device=queries.device)
    for x in (queries, keys):
        x = x.reshape(-1, d)
        for part in x.split(1 << 18):  # bounded float64 copies at paper scale
            part = part.double()
            moment += part.T @ part / x.shape[0]
    _, vectors = torch.linalg.eigh(moment)  # ascending eigenvalues
    w = vectors[:, -d_prime:].flip(-1).T  # (d', d), leading direction first
    # Fix each row's sign (largest entry positive) so the result is reproducible.
    w = w * torch.sign(w.gather(1, w.abs().argmax(1, keepdim=True)))
    return w.contiguous().to(queries.dtype)


@dataclass(frozen=True)
class Objective:
    """One entry of :data:`OBJECTIVES`: either a gradient ``loss`` or a closed-form ``fit``.

    ``hparams`` names the keyword arguments of ``loss`` that come from the fit hyperparameters.
    """

    name: str
    loss: Callable[..., torch.Tensor] | None = None
    hparams: tuple[str, ...] = ()
    fit: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None = None

    @property
    def trained(self) -> bool:
        return self.loss is not None

    def __call__(self, s, psi, mask, hparams=None):
        """The loss of a gradient objective on one batch, reading its hyperparameters."""
        if self.loss is None:
            raise TypeError(f"objective {self.name!r} is closed-form and has no loss")
        hparams = hparams or {}
        get = hparams.get if isinstance(hparams, Mapping) else lambda n: getattr(hparams, n)
        return self.loss(s, psi, mask, **{n: get(n) for n in self.hparams})


def _fit_random(queries, keys, d_prime, seed):
    return random_projection(queries.shape[-1], d_prime, seed, dtype=queries.dtype)


def _fit_pca(queries, keys, d_prime, seed):
    return pca_projection(queries, keys, d_prime)


OBJECTIVES: dict[str, Objective] = {
    "random": Objective("random", fit=_fit_random),
    "pca": Objective("pca", fit=_fit_pca),
    "kl": Objective("kl", loss=kl_loss),
    "dimpo": Objective("dimpo", loss=dimpo_loss, hparams=("gamma", "k", "lam", "max_preferred")),
}


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; known objectives: {sorted(OBJECTIVES)}") from None
