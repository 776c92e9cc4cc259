"""Seed 003 Table 1's fidelity of a projection: KL(psi || pi) and the MSE between psi V and pi V
(Appendix D, the authors' attn_similarity.py), and our top-k recall, per layer."""

import math

import torch

from dimattn.model.affine import as_affine
from dimattn.model.affine import logit_scale

from dimattn.dimpo.capture_files import near_mask

# ---- fidelity (Table 1) -----------------------------------------------------------------------

KL_EPS = 1e-9  # the authors' log(pi + 1e-9)
# The top-k fidelity's k: DimPO's k of seed 003 (64) over the paper's key list (4,096), for every
# objective alike, so that the head DimPO fits is measured beside the distribution KL fits.
FIDELITY_TOP_K_SHARE = 1 / 64


@torch.no_grad()
def attention_fidelity(capture, projections, *, causal: bool = False, scale: str = "d_prime",
                       mse_head_chunk: int = 0, chunk_size: int = 256, device=None, top_k: int = 0
                       ) -> list[dict]:
    """Per projected layer, the authors' metrics (attn_similarity.py) over every (sequence,
    head, query position): mean KL = sum_j psi_j (log psi_j - log(pi_j + 1e-9)) and the mean
    squared error between psi V and pi V (V repeated over the query heads of a key/value
    head), averaged over heads, positions and value dimensions.

    psi = Softmax(q K^T / sqrt(d)); pi = Softmax(F(q) F(K)^T * scale), scale 1/sqrt(d') for
    "d_prime" (Table 1) or 1/sqrt(d) for "d" (the authors' inference). On a layer with far keys,
    K and V hold for each (query i, key j) the near or the far key and value (near_mask).
    ``causal`` False: every query sees all T keys (the authors'). ``mse_head_chunk`` c > 0: the
    MSE over the last chunk of c query heads only (the authors' latest code). Query positions
    go ``chunk_size`` at a time, so memory is O(H chunk_size T). ``device``: where to compute
    (default: the capture's).

    ``top_k`` k > 0 adds ``topk_recall``: of each query's k keys of highest psi, the share among
    the k of highest pi (k at most the keys a causal query sees), averaged like KL: what DimPO's
    head term asks the projection to keep, where KL weighs every key.
    """
    rows = []
    for layer, projection in sorted(projections.items()):
        if layer not in capture:
            raise KeyError(f"projection for layer {layer} but the capture has layers {sorted(capture)}")
        # a function a layer: its tensors are freed before the next layer is read (LayerFile)
        kl, mse, recall = _layer_fidelity(capture[layer], projection, causal, scale, mse_head_chunk, chunk_size,
                                          device, top_k)
        rows.append({"layer": layer, "kl": kl, "mse": mse} | ({"topk_recall": recall} if top_k else {}))
    return rows


def _layer_fidelity(parts, projection, causal, scale, mse_head_chunk, chunk_size, device, top_k=0
                    ) -> tuple[float, float, float]:
    """(mean KL, mean MSE, mean top-k recall or 0.0) of one layer (attention_fidelity)."""
    q, k, v = (parts[name].to(device) for name in "qkv")
    far = "k_far" in parts
    if far:
        k_far, v_far = (parts[name].to(device) for name in ("k_far", "v_far"))
    n, heads, seq_len, d = q.shape
    kv_heads, d_v = k.shape[1], v.shape[-1]
    proj = as_affine(projection).to(device=q.device, dtype=q.dtype)
    low_scale = logit_scale(scale, d, proj.W.shape[0])
    first = mse_head_chunk * ((heads - 1) // mse_head_chunk) if mse_head_chunk else 0
    kl_sum = mse_sum = recall_sum = 0.0
    for i in range(n):
        for start in range(0, seq_len, chunk_size):
            stop = min(start + chunk_size, seq_len)
            width = stop if causal else seq_len
            qc = q[i, :, start:stop]  # (H, c, d)
            u = proj.query_vector(qc).reshape(kv_heads, heads // kv_heads, stop - start, d)
            qc = qc.reshape(kv_heads, heads // kv_heads, stop - start, d)
            keys, values = k[i, :, :width], v[i, :, :width]  # (H_kv, width, d)
            full = torch.einsum("hgcd,htd->hgct", qc, keys) / math.sqrt(d)
            low = torch.einsum("hgcd,htd->hgct", u, keys) * low_scale
            if far:
                near = near_mask(torch.arange(start, stop, device=q.device)[:, None],
                                 torch.arange(width, device=q.device), parts["window"])  # (c, width)
                far_keys = k_far[i, :, :width]
                full = torch.where(near, full, torch.einsum("hgcd,htd->hgct", qc, far_keys) / math.sqrt(d))
                low = torch.where(near, low, torch.einsum("hgcd,htd->hgct", u, far_keys) * low_scale)
            if causal:
                future = (
                    torch.arange(width, device=q.device)[None, :] > torch.arange(start, stop, device=q.device)[:, None]
                )
                full, low = full.masked_fill(future, float("-inf")), low.masked_fill(future, float("-inf"))
            log_psi = torch.log_softmax(full, -1)
            psi, pi = log_psi.exp(), torch.softmax(low, -1)
            kl = torch.where(psi > 0, psi * (log_psi - torch.log(pi + KL_EPS)), torch.zeros_like(psi))
            kl_sum += kl.sum(dtype=torch.float64).item()
            if top_k:
                recall_sum += _topk_recall(full, low, top_k).sum(dtype=torch.float64).item()
            if far:
                weights = psi - pi
                diff = (torch.einsum("hgct,htd->hgcd", weights.masked_fill(~near, 0.0), values)
                        + torch.einsum("hgct,htd->hgcd", weights.masked_fill(near, 0.0), v_far[i, :, :width]))
            else:
                diff = torch.einsum("hgct,htd->hgcd", psi - pi, values)
            diff = diff.reshape(heads, stop - start, d_v)
            mse_sum += diff[first:].pow(2).sum(dtype=torch.float64).item()
    count = n * heads * seq_len
    return kl_sum / count, mse_sum / (n * (heads - first) * seq_len * d_v), recall_sum / count


def _topk_recall(full, low, k: int):
    """Per query (..., c): |top-k(full) & top-k(low)| / k', k' = min(k, its live keys); masked
    (-inf) keys never count, though topk may list them where fewer than k are live."""
    k = min(k, full.shape[-1])
    top_full, top_low = full.topk(k, -1), low.topk(k, -1).indices
    live = top_full.values > float("-inf")  # (..., c, k)
    common = (top_full.indices[..., :, None] == top_low[..., None, :]).any(-1) & live
    return common.sum(-1) / live.sum(-1).clamp(min=1)
