"""Attention kernels: vanilla causal, DAR (seed 000, Eq. 3-4) and uniform reduction.

Every function takes tensors shaped (batch, heads, time, head_dim). Queries sit at absolute
positions ``q_offset + arange(Tq)``, keys at ``arange(Tk)``; ``q_offset = Tk - Tq`` when a cache
holds the earlier keys. This file imports nothing from the rest of ``dimattn`` because
``save_pretrained`` copies it next to the model code (trust_remote_code loading).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def causal_attention(q, k, v, *, q_offset: int | None = None, key_padding_mask=None):
    """Softmax(q k^T / sqrt(d)) v over keys j <= i."""
    tq, tk = q.shape[-2], k.shape[-2]
    q_offset = tk - tq if q_offset is None else q_offset
    if key_padding_mask is None and q_offset == 0 and tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = _distances(tq, tk, q_offset, q.device) >= 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_with_padding(mask, key_padding_mask))


def dar_attention(
    q, k_near, v_near, k_far, v_far, window: int, *, q_offset: int | None = None, key_padding_mask=None
):
    """Distance-aware attention, seed 000 Eq. 3-4.

    Key/value j <= i comes from the near set when i - j < window, else from the far set; one
    softmax over the union, scaled by 1/sqrt(head_dim). Concatenating the two key sets along
    time and masking each to its own distance band gives exactly one live copy of every key.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    tq, tk = q.shape[-2], k_near.shape[-2]
    q_offset = tk - tq if q_offset is None else q_offset
    dist = _distances(tq, tk, q_offset, q.device)
    near = (dist >= 0) & (dist < window)
    far = dist >= window
    mask = torch.cat([near, far], dim=-1)  # (Tq, 2 Tk)
    if key_padding_mask is not None:
        key_padding_mask = torch.cat([key_padding_mask, key_padding_mask], dim=-1)
    k = torch.cat([k_near, k_far], dim=-2)  # (B, H, 2 Tk, D)
    v = torch.cat([v_near, v_far], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_with_padding(mask, key_padding_mask))


@dataclass(frozen=True)
class AttentionVariant:
    """How a variant builds keys and values and combines them.

    ``near``: keys/values from the full hidden state are used; ``far``: keys/values from the
    bottlenecked state h W_down W_up are used.
    """

    near: bool
    far: bool

    def __call__(self, q, near_kv, far_kv, *, window, q_offset=None, key_padding_mask=None):
        if self.near and self.far:
            return dar_attention(
                q, *near_kv, *far_kv, window, q_offset=q_offset, key_padding_mask=key_padding_mask
            )
        k, v = near_kv if self.near else far_kv
        return causal_attention(q, k, v, q_offset=q_offset, key_padding_mask=key_padding_mask)


# Registry of attention variants, looked up by the config field ``attention``.
ATTENTION_VARIANTS: dict[str, AttentionVariant] = {
    "vanilla": AttentionVariant(near=True, far=False),
    "dar": AttentionVariant(near=True, far=True),
    # Seed 000's uniform reduction baseline: every token through the d_down bottleneck.
    "uniform": AttentionVariant(near=False, far=True),
}
