"""Attention kernels: vanilla causal, DAR (seed 000, Eq. 3-4), uniform reduction, sliding window
and dilated attention (seed 001).

Every function takes tensors shaped (batch, heads, time, head_dim). Queries sit at absolute
positions ``q_offset + arange(Tq)``, keys at ``arange(Tk)``; ``q_offset = Tk - Tq`` when a cache
holds the earlier keys.

Window convention: key j <= i is "near" when i - j < window, so ``window`` counts the query's own
token. Seed 001's reference code keeps positions max(0, i - W) .. i, that is W + 1 tokens: its
``window_size=W`` is our ``window=W + 1``.

Three implementations compute the same thing, chosen by ``kernel``:

- ``"dense"``: one SDPA call under a boolean mask (for DAR, over the two key sets concatenated,
  a Tq x 2Tk mask). Handles a KV cache (q_offset) and key padding; the reference path.
- ``"blocked"``: training and prefill on CPU. Each pattern is a sum of *paths* (a band of recent
  keys, a causal set shifted by the window, a strided set). On CPU the *joint kernel* lays the
  paths' scores side by side, block of queries by block, each block holding only the keys its
  queries can see, under one softmax: batched matmuls in the inputs' dtype (bfloat16 under
  autocast) and in-place passes, probabilities kept for an exact backward. Where those would
  pass JOINT_MAX_BYTES, without a backward past JOINT_NOGRAD_MAX_T queries, and off CPU, each
  path is computed on its own and merged through the
  log-sum-exp into one softmax: no T x 2T mask exists, the band costs O(T * 2 block), the
  shifted causal path runs in PyTorch's fused CPU flash kernel, and the backward is exact (each
  path's gradient uses the *merged* output and log-sum-exp). Vanilla and uniform layers take
  the joint kernel too ("auto" and "blocked"), with one causal path.
- ``"flex"``: FlexAttention with a block mask, for CUDA (where it compiles to a fused kernel
  with a backward); on CPU it runs unfused and forward-only, which is what the tests check.

``"auto"`` picks flex on CUDA, blocked on CPU when there is no cache offset and no padding,
dense otherwise. This file imports nothing from the rest of ``dimattn`` because
``save_pretrained`` copies it next to the model code (trust_remote_code loading).
"""

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .blocked import Band, ShiftedCausal, Strided, blocked_attention, joint_attention

KERNELS = ("auto", "dense", "blocked", "flex")


# --- dense masks (reference path, caches, padding) ---------------------------------------------


def _distances(tq: int, tk: int, q_offset: int, device) -> torch.Tensor:
    """(Tq, Tk) matrix of i - j, query position minus key position."""
    i = torch.arange(tq, device=device) + q_offset
    j = torch.arange(tk, device=device)
    return i[:, None] - j[None, :]


def _with_padding(mask: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Combine a (Tq, Tk') boolean mask with a (B, Tk') key padding mask into (B, 1, Tq, Tk').

    Rows left with no key (a padded query) get their keys back; their outputs are never used,
    and an all-masked row would turn the softmax into NaN.
    """
    if key_padding_mask is None:
        return mask
    mask = mask[None, None] & key_padding_mask[:, None, None, :]
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def _dense(q, k, v, mask, key_padding_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_with_padding(mask, key_padding_mask))


def _strided(dist: torch.Tensor, window: int, dilation: int) -> torch.Tensor:
    """Keys beyond the window kept by dilated attention: absolute positions 0, r, 2r, ..."""
    j = torch.arange(dist.shape[-1], device=dist.device)[None, :]
    return (dist >= window) & (j % dilation == 0)


# --- FlexAttention (CUDA) ----------------------------------------------------------------------


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Unfused (it materialises the scores) unless compiled; inductor fuses it on CUDA.
    if not torch.cuda.is_available():
        return flex_attention
    # One compiled flex_attention serves every pattern and length of a process, each a recompile
    # (dynamo guards on the mask's code and T): past dynamo's default limit of 8 it ran unfused
    # without a word but a warning, the dilated kernel 36x slower than causal SDPA (H200).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _create_block_mask(mask_name, t, window, dilation, device):
    from torch.nn.attention.flex_attention import create_block_mask

    kv_len = 2 * t if mask_name == "dar" else t  # DAR: near keys, then far keys
    return create_block_mask(_FLEX_MASKS[mask_name](t, window, dilation), None, None, t, kv_len, device=device)


_cached_block_mask = functools.lru_cache(maxsize=32)(_create_block_mask)


def _flex_dar(t, window, dilation):
    def mask_mod(b, h, q_idx, kv_idx):
        far = kv_idx >= t
        j = torch.where(far, kv_idx - t, kv_idx)
        dist = q_idx - j
        return torch.where(far, dist >= window, (dist >= 0) & (dist < window))

    return mask_mod


def _flex_swa(t, window, dilation):
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window)


def _flex_dilated(t, window, dilation):
    def mask_mod(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        return (dist >= 0) & ((dist < window) | ((dist >= window) & (kv_idx % dilation == 0)))

    return mask_mod


_FLEX_MASKS = {"dar": _flex_dar, "swa": _flex_swa, "dilated": _flex_dilated}


def _flex_attention(mask_name, q, k, v, window, dilation=1):
    from torch.nn.attention.flex_attention import flex_attention

    t = q.shape[-2]
    if torch.compiler.is_compiling():
        # Inside a compiled model (training.compile): the mask is traced into its graph, as
        # flex_attention is. Dynamo cannot trace an lru_cache, and the cached path below cost a
        # graph break in every layer (torch 2.11, H200).
        return flex_attention(q, k, v, block_mask=_create_block_mask(mask_name, t, window, dilation, q.device))
    mask = _cached_block_mask(mask_name, t, window, dilation, str(q.device))
    return _compiled_flex()(q, k, v, block_mask=mask)


# --- public kernels ------------------------------------------------------------------------------


def _choose(kernel, q, tk, q_offset, key_padding_mask):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    aligned = key_padding_mask is None and q_offset == 0 and q.shape[-2] == tk
    if kernel == "auto":
        if not aligned or q.shape[-2] == 1:
            return "dense"
        return "flex" if q.device.type == "cuda" else "blocked"
    if kernel != "dense" and not aligned:
        raise ValueError(f"kernel={kernel!r} needs aligned queries and keys without padding; use 'dense'")
    return kernel


def _check_window(window: int, minimum: int) -> None:
    if window < minimum:
        raise ValueError(f"window must be >= {minimum}, got {window}")


def causal_attention(q, k, v, *, q_offset: int | None = None, key_padding_mask=None, kernel: str = "auto"):
    """Softmax(q k^T / sqrt(d)) v over keys j <= i. ``kernel``: "auto" and "blocked" take the
    joint kernel on CPU for short aligned sequences (ShiftedCausal(0)), else SDPA."""
    tq, tk = q.shape[-2], k.shape[-2]
    q_offset = tk - tq if q_offset is None else q_offset
    if key_padding_mask is None and q_offset == 0 and tq == tk:
        out = joint_attention(q, (ShiftedCausal(0),), [k, v]) if kernel in ("auto", "blocked") and tq > 1 else None
        return out if out is not None else F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _dense(q, k, v, _distances(tq, tk, q_offset, q.device) >= 0, key_padding_mask)


def dar_attention(
    q, k_near, v_near, k_far, v_far, window: int, *, q_offset: int | None = None, key_padding_mask=None,
    kernel: str = "auto",
):
    """Distance-aware attention, seed 000 Eq. 3-4.

    Key/value j <= i comes from the near set when i - j < window, else from the far set; one
    softmax over the union, scaled by 1/sqrt(head_dim).
    """
    _check_window(window, 0)
    tq, tk = q.shape[-2], k_near.shape[-2]
    q_offset = tk - tq if q_offset is None else q_offset
    kernel = _choose(kernel, q, tk, q_offset, key_padding_mask)
    if kernel == "blocked":
        if window == 0:  # no near path: every key through the bottleneck (uniform)
            return causal_attention(q, k_far, v_far, kernel=kernel)
        return blocked_attention(q, [(Band(window), k_near, v_near), (ShiftedCausal(window), k_far, v_far)])
    if kernel == "flex":
        k, v = torch.cat([k_near, k_far], dim=-2), torch.cat([v_near, v_far], dim=-2)
        return _flex_attention("dar", q, k, v, window)
    # Both key sets along time, each masked to its own distance band: one live copy of every key.
    dist = _distances(tq, tk, q_offset, q.device)
    mask = torch.cat([(dist >= 0) & (dist < window), dist >= window], dim=-1)  # (Tq, 2 Tk)
    if key_padding_mask is not None:
        key_padding_mask = torch.cat([key_padding_mask, key_padding_mask], dim=-1)
    k, v = torch.cat([k_near, k_far], dim=-2), torch.cat([v_near, v_far], dim=-2)
    return _dense(q, k, v, mask, key_padding_mask)


def latent_dar_attention(q, k_near, v_near, k_far, v_far, window: int, *, q_start: int, near_start: int,
                         key_padding_mask=None):
    """DAR over a DAR cache: near keys cover only slots near_start.., far keys every slot 0..;
    queries sit at slots q_start... window=0 is the uniform reduction (no near key)."""
    tq, n_near = q.shape[-2], k_near.shape[-2]
    i = torch.arange(tq, device=q.device)[:, None] + q_start
    dist_near = i - (torch.arange(n_near, device=q.device) + near_start)
    dist_far = i - torch.arange(k_far.shape[-2], device=q.device)
    mask = torch.cat([(dist_near >= 0) & (dist_near < window), dist_far >= window], dim=-1)
    if key_padding_mask is not None:
        key_padding_mask = torch.cat([key_padding_mask[:, near_start:], key_padding_mask], dim=-1)
    k, v = torch.cat([k_near, k_far], dim=-2), torch.cat([v_near, v_far], dim=-2)
    return _dense(q, k, v, mask, key_padding_mask)


def sliding_window_attention(
    q, k, v, window: int, *, q_offset: int | None = None, key_padding_mask=None, kernel: str = "auto"
):
    """Seed 001's sliding window: key j <= i kept when i - j < window (window >= 1)."""
    _check_window(window, 1)
    tq, tk = q.shape[-2], k.shape[-2]
    q_offset = tk - tq if q_offset is None else q_offset
    kernel = _choose(kernel, q, tk, q_offset, key_padding_mask)
    if kernel == "blocked":
        return blocked_attention(q, [(Band(window), k, v)])
    if kernel == "flex":
        return _flex_attention("swa", q, k, v, window)
    dist = _distances(tq, tk, q_offset, q.device)
    return _dense(q, k, v, (dist >= 0) & (dist < window), key_padding_mask)


def dilated_attention(
    q, k, v, window: int, dilation: int, *, q_offset: int | None = None, key_padding_mask=None,
    kernel: str = "auto", key_positions: torch.Tensor | None = None,
):
    """Seed 001's dilated attention: the sliding window, plus every ``dilation``-th token beyond
    it (absolute positions 0, r, 2r, ..., as in the seed's "[0, 4, 8, 12, 16, ...]").

    ``key_positions`` (Tk,): the keys' absolute positions where they are a subset (a dilated
    layer's cache keeps only the keys this pattern reads again); the queries are the last Tq."""
    _check_window(window, 1)
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    tq, tk = q.shape[-2], k.shape[-2]
    if key_positions is not None:
        dist = key_positions[-tq:, None] - key_positions[None, :]
        mask = ((dist >= 0) & (dist < window)) | ((dist >= window) & (key_positions % dilation == 0)[None, :])
        return _dense(q, k, v, mask, key_padding_mask)
    q_offset = tk - tq if q_offset is None else q_offset
    kernel = _choose(kernel, q, tk, q_offset, key_padding_mask)
    if kernel == "blocked":
        return blocked_attention(q, [(Band(window), k, v), (Strided(window, dilation), k, v)])
    if kernel == "flex":
        return _flex_attention("dilated", q, k, v, window, dilation)
    dist = _distances(tq, tk, q_offset, q.device)
    mask = ((dist >= 0) & (dist < window)) | _strided(dist, window, dilation)
    return _dense(q, k, v, mask, key_padding_mask)


# --- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionVariant:
    """How a layer attends. ``near``: it reads keys/values of the full hidden state; ``far``: it
    reads keys/values of the bottlenecked state h W_down W_up (and so owns a bottleneck)."""

    near: bool
    far: bool
    attend: Callable

    def __call__(self, q, near_kv, far_kv, *, window, dilation=1, q_offset=None, key_padding_mask=None,
                 kernel="auto", key_positions=None):
        if key_positions is not None:  # a subset of keys by position: only a dilated layer's cache
            return self.attend(q, near_kv, far_kv, window=window, dilation=dilation, q_offset=q_offset,
                               key_padding_mask=key_padding_mask, kernel=kernel, key_positions=key_positions)
        return self.attend(q, near_kv, far_kv, window=window, dilation=dilation, q_offset=q_offset,
                           key_padding_mask=key_padding_mask, kernel=kernel)


def _vanilla(q, near_kv, far_kv, *, window, dilation, q_offset, key_padding_mask, kernel):
    return causal_attention(q, *near_kv, q_offset=q_offset, key_padding_mask=key_padding_mask, kernel=kernel)


def _uniform(q, near_kv, far_kv, *, window, dilation, q_offset, key_padding_mask, kernel):
    return causal_attention(q, *far_kv, q_offset=q_offset, key_padding_mask=key_padding_mask, kernel=kernel)


def _dar(q, near_kv, far_kv, *, window, dilation, q_offset, key_padding_mask, kernel):
    return dar_attention(q, *near_kv, *far_kv, window, q_offset=q_offset, key_padding_mask=key_padding_mask,
                         kernel=kernel)


def _swa(q, near_kv, far_kv, *, window, dilation, q_offset, key_padding_mask, kernel):
    return sliding_window_attention(q, *near_kv, window, q_offset=q_offset, key_padding_mask=key_padding_mask,
                                    kernel=kernel)


def _dilated(q, near_kv, far_kv, *, window, dilation, q_offset, key_padding_mask, kernel, key_positions=None):
    return dilated_attention(q, *near_kv, window, dilation, q_offset=q_offset, key_padding_mask=key_padding_mask,
                             kernel=kernel, key_positions=key_positions)


# Registry of attention variants, looked up by the config field ``attention``.
ATTENTION_VARIANTS: dict[str, AttentionVariant] = {
    "vanilla": AttentionVariant(near=True, far=False, attend=_vanilla),
    "dar": AttentionVariant(near=True, far=True, attend=_dar),
    # Seed 000's uniform reduction baseline: every token through the d_down bottleneck.
    "uniform": AttentionVariant(near=False, far=True, attend=_uniform),
    "swa": AttentionVariant(near=True, far=False, attend=_swa),
    "dilated": AttentionVariant(near=True, far=False, attend=_dilated),
}
