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

KERNELS = ("auto", "dense", "blocked", "flex")
NEG_INF = float("-inf")


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


# --- blocked paths, merged through their log-sum-exp ---------------------------------------------


def _wide(*xs):
    return [x.float() if x.dtype in (torch.float16, torch.bfloat16) else x for x in xs]


def _masked_forward(q, k, v, mask, scale):
    """Softmax attention restricted to ``mask``; returns (output, log-sum-exp). Rows with no
    key get output 0 and lse -inf, so they drop out of the merge. The scores are the one big
    tensor here, so every pass over them is done in place; half precision computes in float32."""
    q, k, v = _wide(q, k, v)
    s = (q * scale) @ k.transpose(-1, -2)
    s.masked_fill_(~mask, NEG_INF)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    p = s.sub_(m).exp_()
    total = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(total == 0, 1.0, total)
    return out, (m + total.log()).squeeze(-1)


def _masked_backward(q, k, v, mask, scale, d_out, out, lse):
    """Gradient of one path inside a merged softmax: P uses the merged lse, D the merged output."""
    q, k, v, d_out, out = _wide(q, k, v, d_out, out)
    s = (q * scale) @ k.transpose(-1, -2)
    s.masked_fill_(~mask, NEG_INF)
    p = s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
    ds = (d_out @ v.transpose(-1, -2)).sub_((d_out * out).sum(-1, keepdim=True)).mul_(p)
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ d_out


def _fused_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64, torch.bfloat16)


class _Path:
    """A set of keys per query. For the joint kernel: ``key()`` (equal paths hash alike, so that
    plans are cached), ``key_range`` (the keys a block of queries may see), ``live`` (which of
    them a query does see), ``key_count``, and ``joint_kv`` / ``joint_grads`` (the keys the
    columns index, and their gradients back onto k and v)."""

    def key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other):
        return type(other) is type(self) and other.key() == self.key()

    def __hash__(self):
        return hash(self.key())

    def key_count(self, t: int) -> int:
        return t

    def joint_kv(self, k, v):
        return k, v

    def joint_grads(self, dk, dv, k, v):
        return dk, dv


class Band(_Path):
    """Keys 0 <= i - j < window, block by block: a block of b queries sees its own block and the
    m - 1 blocks before it (L = m b >= window - 1 + b keys), so the scores cost T * L, never
    T^2; blocks of b ~ window / 2, from 16 to 32 in the forward (64 in the backward), trade some
    wasted scores for larger matmuls (forward at T 8192, w 256, in the flash kernel: b 32 beat
    64, 128 and 256). The key spans are strided views (``unfold``, or overlapping
    ``as_strided`` heads for the flash kernel) of the padded keys, never copies; gradients of the
    spans are added back chunk by chunk for the same reason (the flash backward takes blocks of
    the window itself and needs no spans, see below)."""

    def __init__(self, window: int):
        self.window = window

    block = None  # queries per block; None: about window / 2

    def key(self):
        return ("band", self.window)

    def key_range(self, n0: int, n1: int, t: int) -> tuple[int, int]:
        """Keys queries n0 .. n1 - 1 may see (the joint kernel's column span)."""
        return max(0, n0 - self.window + 1), n1

    def live(self, i, j):
        return (i - j >= 0) & (i - j < self.window)

    def _geometry(self, t: int, backward: bool = False):
        # The forward and the backward each recompute the scores, so each takes its own blocks:
        # the (non-fused) backward adds m key-span gradients back, so fewer, larger blocks (up
        # to 64) pay there (T 2048, w 128: 64 took 0.65 of 32's time).
        b = self.block or min(64 if backward else 32, max(16, self.window // 2))
        m = -(-(self.window - 1) // b) + 1  # key blocks per query block
        return b, m, -(-t // b)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _bias(window, b, m, nb, device, dtype):
        """0 where a key is live, -inf elsewhere: adding it is far cheaper than masked_fill."""
        n = torch.arange(nb, device=device)[:, None, None]
        i = n * b + torch.arange(b, device=device)[:, None]  # absolute query position
        j = (n - m + 1) * b + torch.arange(m * b, device=device)  # absolute key position
        live = (j >= 0) & (i - j >= 0) & (i - j < window)  # (nb, b, m b)
        return torch.zeros(live.shape, device=device, dtype=dtype).masked_fill_(~live, NEG_INF)

    @staticmethod
    def _blocks(x, b, nb):  # (B, H, T, D) -> (B, H, nb, b, D), zero-padded at the end
        pad = nb * b - x.shape[-2]
        return (F.pad(x, (0, 0, 0, pad)) if pad else x).unflatten(-2, (nb, b))

    @staticmethod
    def _padded(x, b, m, nb):  # m - 1 zero blocks in front, padding at the end
        return F.pad(x, (0, 0, (m - 1) * b, nb * b - x.shape[-2]))

    @staticmethod
    def _spans_t(x_padded, b, m):  # (B, H, nb, D, m b): key spans, transposed, as a view
        return x_padded.unfold(-2, m * b, b)

    def _probabilities(self, qb, kp, b, m, nb, lse=None):
        s = qb @ self._spans_t(kp, b, m)
        s.add_(self._bias(self.window, b, m, nb, qb.device, s.dtype))
        if lse is not None:  # backward: the merged softmax's probabilities
            return s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_(), None
        mx = s.amax(dim=-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), 0.0, mx)
        return s.sub_(mx).exp_(), mx

    # On CPU the blocks go through PyTorch's fused flash kernel: batch x heads fold into the
    # kernel's batch, and block n's queries become "head" n against their key span, under one
    # additive (nb, b, L) mask shared by every batch row. The kernel reads its inputs through
    # their strides, so the spans are overlapping views of the padded keys: m times fewer bytes
    # written than copies.

    def _span_heads(self, x, b, m, nb):  # (B, H, T, D) -> (B H, nb, m b, D), an overlapping view
        xp = self._padded(x, b, m, nb).flatten(0, 1).contiguous()
        rows, d = xp.shape[-2:]
        return xp.as_strided((xp.shape[0], nb, m * b, d), (rows * d, b * d, d, 1))

    def _head_bias(self, b, m, nb, x):
        return self._bias(self.window, b, m, nb, x.device, torch.promote_types(x.dtype, torch.float32)).to(
            x.dtype)[None]

    @staticmethod
    def _as_heads(x, b, nb):  # (B, H, T, ...) -> (B H, nb, b, ...)
        pad = nb * b - x.shape[2]
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.unflatten(2, (nb, b)).flatten(0, 1).contiguous()

    @staticmethod
    def _from_heads(x, shape, t):  # (B H, nb, b, ...) -> (B, H, T, ...)
        return x.unflatten(0, shape[:2]).flatten(2, 3)[:, :, :t]

    def _flash_forward(self, q, k, v, scale):
        """The first m - 1 blocks (whose spans reach before key 0) over front-padded keys and
        their own masks; every later block's span lies inside the keys, so those spans are views
        of the keys themselves (no padded copy) under one (b, L) mask, broadcast over blocks (it
        stays in cache: 0.87 of the per-block mask's time at T 8192, w 256)."""
        t = q.shape[-2]
        b, m, nb = self._geometry(t)
        front = min(t, (m - 1) * b)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        parts = []
        if front:
            qf, kf, vf = (x[..., :front, :] for x in (q, k, v))
            nf = -(-front // b)
            o, lse = flash(self._as_heads(qf, b, nf), self._span_heads(kf, b, m, nf), self._span_heads(vf, b, m, nf),
                           0.0, False, attn_mask=self._head_bias(b, m, nf, q), scale=scale)
            parts.append((self._from_heads(o, q.shape, front), self._from_heads(lse, q.shape, front)))
        if t > front:
            n = nb - m + 1  # blocks m - 1 .. nb - 1; block m - 1 + i spans keys i b .. (i + m) b
            pad = nb * b - t

            def rows(x):  # (B, H, T, D) -> (B H, nb b, D), padded at the end, contiguous
                return (F.pad(x, (0, 0, 0, pad)) if pad else x).flatten(0, 1).contiguous()

            qh = rows(q)[:, front:].unflatten(1, (n, b))
            kh, vh = ((x := rows(y)).as_strided((x.shape[0], n, m * b, x.shape[-1]), (x.stride(0), b * x.stride(1),
                                                                                     x.stride(1), 1)) for y in (k, v))
            bias = self._head_bias(b, m, m, q)[:, m - 1 :].expand(1, n, b, m * b)
            o, lse = flash(qh, kh, vh, 0.0, False, attn_mask=bias, scale=scale)
            parts.append((self._from_heads(o, q.shape, t - front), self._from_heads(lse, q.shape, t - front)))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts], -2), torch.cat([lse for _, lse in parts], -1)

    # The backward needs no spans: with blocks of exactly ``window`` queries, query block n sees
    # its own block causally and block n - 1 where i - j < window (i mod w < j mod w), two flash
    # calls over plain reshaped views whose key gradients land on the keys themselves, without
    # the m-fold span gradients to zero-fill and fold back (T 2048, w 128: 0.9 of the spans'
    # time). Padded queries get lse +inf, so P = 0 there.

    def _flash_backward(self, q, k, v, scale, d_out, out, lse):
        t, w = q.shape[-2], self.window
        nb = -(-t // w)

        def blocks(x, fill=0.0):  # (B, H, T, ...) -> (B H, nb, w, ...)
            if nb * w > t:
                x = F.pad(x, (0, 0, 0, nb * w - t) if x.dim() == 4 else (0, nb * w - t), value=fill)
            return x.reshape(-1, nb, w, *x.shape[3:])

        qh, kh, vh, doh, oh = (blocks(x) for x in (q, k, v, d_out, out.to(q.dtype)))
        lseh = blocks(lse, float("inf"))
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = backward(doh, qh, kh, vh, oh, lseh.contiguous(), 0.0, True, scale=scale)
        if nb > 1 and w > 1:
            prev = self._previous_block_bias(w, q.device, q.dtype).expand(1, nb - 1, w, w)
            dq1, dk1, dv1 = backward(doh[:, 1:], qh[:, 1:], kh[:, :-1], vh[:, :-1], oh[:, 1:],
                                     lseh[:, 1:].contiguous(), 0.0, False, attn_mask=prev, scale=scale)
            dq[:, 1:] += dq1
            dk[:, :-1] += dk1
            dv[:, :-1] += dv1
        return tuple(x.reshape(*q.shape[:2], nb * w, x.shape[-1])[:, :, :t] for x in (dq, dk, dv))

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def _previous_block_bias(w, device, dtype):  # key j of the block before sees query i iff i < j
        i = torch.arange(w, device=device)
        return torch.zeros(w, w, device=device, dtype=dtype).masked_fill_(i[None, :] <= i[:, None], NEG_INF)

    def forward(self, q, k, v, scale):
        if _fused_cpu(q):
            return self._flash_forward(q, k, v, scale)
        t = q.shape[-2]
        b, m, nb = self._geometry(t)
        q, k, v = _wide(q, k, v)
        qb = self._blocks(q * scale, b, nb)
        p, mx = self._probabilities(qb, self._padded(k, b, m, nb), b, m, nb)
        total = p.sum(dim=-1, keepdim=True)
        out = (p @ self._spans_t(self._padded(v, b, m, nb), b, m).transpose(-1, -2))
        out = out / torch.where(total == 0, 1.0, total)
        lse = (mx + total.log()).squeeze(-1)
        return out.flatten(-3, -2)[..., :t, :], lse.flatten(-2)[..., :t]

    def backward(self, q, k, v, scale, d_out, out, lse):
        if _fused_cpu(q):
            return self._flash_backward(q, k, v, scale, d_out, out, lse)
        t = q.shape[-2]
        b, m, nb = self._geometry(t, backward=True)
        q, k, v, d_out, out = _wide(q, k, v, d_out, out)
        qb = self._blocks(q * scale, b, nb)
        dob, ob = self._blocks(d_out, b, nb), self._blocks(out, b, nb)
        lseb = F.pad(lse, (0, nb * b - t)).unflatten(-1, (nb, b))
        kp, vp = self._padded(k, b, m, nb), self._padded(v, b, m, nb)
        p, _ = self._probabilities(qb, kp, b, m, nb, lseb)
        ds = (dob @ self._spans_t(vp, b, m)).sub_((dob * ob).sum(-1, keepdim=True)).mul_(p)
        dq = (ds @ self._spans_t(kp, b, m).transpose(-1, -2)) * scale
        dk, dv = torch.zeros_like(kp).unflatten(-2, (nb + m - 1, b)), torch.zeros_like(vp).unflatten(-2, (nb + m - 1, b))
        for c in range(m):  # chunk c of query block n's span is key block n + c (padded index)
            chunk = slice(c * b, (c + 1) * b)
            dk[..., c : c + nb, :, :] += ds[..., chunk].transpose(-1, -2) @ qb
            dv[..., c : c + nb, :, :] += p[..., chunk].transpose(-1, -2) @ dob
        trim = lambda g: g.flatten(-3, -2)[..., (m - 1) * b : (m - 1) * b + t, :]  # noqa: E731
        return dq.flatten(-3, -2)[..., :t, :], trim(dk), trim(dv)


class ShiftedCausal(_Path):
    """Keys j <= i - shift: causal attention of queries [shift:] over keys [:T - shift], in
    PyTorch's fused CPU flash kernel (which returns the log-sum-exp the merge needs). The kernel
    reads the slices as views; its output and dq cover queries [shift:] only (the merge adds
    them into the last rows), saving a T x D copy and fill each."""

    def __init__(self, shift: int):
        self.shift = shift

    def key(self):
        return ("shifted", self.shift)

    def key_range(self, n0: int, n1: int, t: int) -> tuple[int, int]:
        return 0, max(0, n1 - self.shift)

    def live(self, i, j):
        return i - j >= self.shift

    def forward(self, q, k, v, scale):
        t, s = q.shape[-2], min(self.shift, q.shape[-2])
        qs, ks, vs = q[..., s:, :], k[..., : t - s, :], v[..., : t - s, :]
        if s == t:  # no query sees a key: no rows
            return q.new_zeros(*qs.shape[:-1], v.shape[-1]), q.new_zeros(qs.shape[:-1])
        if _fused_cpu(q):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, True, scale=scale)
        return _masked_forward(qs, ks, vs, self._tril(t - s, q.device), scale)

    @staticmethod
    def _tril(n, device):
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()

    def backward(self, q, k, v, scale, d_out, out, lse):
        t, s = q.shape[-2], self.shift
        if s >= t:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        args = (q[..., s:, :], k[..., : t - s, :], v[..., : t - s, :])
        tail = [x[..., s:, :].to(q.dtype) for x in (d_out, out)]
        if _fused_cpu(q):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                tail[0], *args, tail[1], lse[..., s:].contiguous(), 0.0, True, scale=scale
            )
        else:
            dq, dk, dv = _masked_backward(*args, self._tril(t - s, q.device), scale, tail[0], tail[1], lse[..., s:])
        return dq, F.pad(dk, (0, 0, 0, s)), F.pad(dv, (0, 0, 0, s))


class Strided(_Path):
    """Dilated keys beyond the window: absolute positions 0, r, 2r, ... with i - j >= window.
    Scores cost O(T * T / r)."""

    def __init__(self, window: int, dilation: int):
        self.window, self.dilation = window, dilation

    def key(self):
        return ("strided", self.window, self.dilation)

    # The joint kernel sees the strided keys k[::r] only: column m is absolute position m r.
    def key_range(self, n0: int, n1: int, t: int) -> tuple[int, int]:
        return 0, -(-max(0, n1 - self.window) // self.dilation)

    def key_count(self, t: int) -> int:
        return -(-t // self.dilation)

    def live(self, i, m):
        return i - m * self.dilation >= self.window

    def joint_kv(self, k, v):
        return k[..., :: self.dilation, :], v[..., :: self.dilation, :]

    def joint_grads(self, dk, dv, k, v):
        full_k, full_v = k.new_zeros(k.shape), v.new_zeros(v.shape)
        full_k[..., :: self.dilation, :], full_v[..., :: self.dilation, :] = dk, dv
        return full_k, full_v

    def _mask(self, t, device):
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(0, t, self.dilation, device=device)[None, :]
        return i - j >= self.window

    def forward(self, q, k, v, scale):
        r = self.dilation
        return _masked_forward(q, k[..., ::r, :], v[..., ::r, :], self._mask(q.shape[-2], q.device), scale)

    def backward(self, q, k, v, scale, d_out, out, lse):
        r = self.dilation
        mask = self._mask(q.shape[-2], q.device)
        dq, dks, dvs = _masked_backward(q, k[..., ::r, :], v[..., ::r, :], mask, scale, d_out, out, lse)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[..., ::r, :], dv[..., ::r, :] = dks, dvs
        return dq, dk, dv


def _sum_rows(parts, t):
    """Sum of (..., rows_i, D) tensors over the last rows of t (a path's output or dq may cover
    only the last queries), in float32 or wider; the first full part is taken over, not copied."""
    parts = sorted(parts, key=lambda x: -x.shape[-2])
    first = parts[0]
    wide = torch.promote_types(first.dtype, torch.float32)
    total = first.to(wide) if first.shape[-2] == t else first.new_zeros(*first.shape[:-2], t, first.shape[-1], dtype=wide)
    for part in parts[1:] if first.shape[-2] == t else parts:
        if part.shape[-2]:
            total[..., t - part.shape[-2] :, :] += part
    return total


def merge_paths(parts, t):
    """[(out_i, lse_i)] -> (out, lse) of one softmax over the union of the paths' keys, for t
    queries. A part may cover only the last queries (a shifted path has none before its shift);
    the rows before them have no key in that path."""
    wide = torch.promote_types(parts[0][0].dtype, torch.float32)
    if len(parts) == 1 and parts[0][1].shape[-1] == t:  # one path: its own softmax
        return parts[0][0].to(wide), parts[0][1].to(wide)
    lse = torch.full(parts[0][1].shape[:-1] + (t,), NEG_INF, dtype=wide, device=parts[0][1].device)
    for _, l in parts:
        tail = lse[..., t - l.shape[-1] :]
        torch.logaddexp(tail, l.to(wide), out=tail)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    out = _sum_rows([torch.exp(l.to(wide) - safe[..., t - l.shape[-1] :])[..., None] * o for o, l in parts], t)
    return out, lse


class _MergedAttention(torch.autograd.Function):
    """Paths over their own key/value sets, one softmax; the backward is exact."""

    @staticmethod
    def forward(ctx, q, paths, scale, *kvs):
        pairs = list(zip(kvs[0::2], kvs[1::2]))
        out, lse = merge_paths([p.forward(q, k, v, scale) for p, (k, v) in zip(paths, pairs)], q.shape[-2])
        out = out.to(q.dtype)
        ctx.paths, ctx.scale = paths, scale
        ctx.save_for_backward(q, out, lse, *kvs)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, out, lse, *kvs = ctx.saved_tensors
        d_out = d_out.contiguous()
        dqs, grads = [], []
        for path, k, v in zip(ctx.paths, kvs[0::2], kvs[1::2]):
            g_q, g_k, g_v = path.backward(q, k, v, ctx.scale, d_out, out, lse)
            dqs.append(g_q)
            grads += [g_k.to(k.dtype), g_v.to(v.dtype)]
        return _sum_rows(dqs, q.shape[-2]).to(q.dtype), None, None, *grads


# --- the joint kernel: CPU training --------------------------------------------------------------
#
# On CPU the paths' scores are laid side by side and go through one softmax, block of JOINT_ROWS
# queries by block: block n's columns are only the keys its queries can see (a causal block skips
# the keys after it, the band keeps window + rows keys), so about half of a T x T score matrix
# exists, in pieces that stay in cache. Every step is a batched matmul in the inputs' dtype
# (bfloat16 under autocast: the CPU's fast path) over plain row-major blocks (a block's key
# segments are copied side by side), or one pass of add, softmax, subtract or multiply, in
# place; block widths are padded with masked keys so that softmax runs without a scalar tail.
# The probabilities are kept for the backward, which is exact; where they would pass
# JOINT_MAX_BYTES the merged paths above take over (flash, O(T) memory). PyTorch's flash kernel
# spends most of its time outside the matmuls at these sizes, in bfloat16 most of all: DAR's
# forward and backward at the default model's shape (T 256, head_dim 32) run ~5x faster in
# bfloat16 than through the merged paths, and ~2x faster at T 2048, head_dim 64.

JOINT_ROWS = 64
JOINT_ALIGN = 32  # block widths are padded to a multiple (masked keys): softmax has no scalar tail
JOINT_MAX_BYTES = 256 << 20  # probabilities kept for the backward, per call
# Without a backward the joint kernel's one advantage, probabilities kept, is moot: past this
# many queries one flash call per path beats its hundreds of small matmuls (sliding window,
# T 2048 and 8192, w 256: 3-9x faster, by more where the two cores are shared).
JOINT_NOGRAD_MAX_T = 1024


@functools.lru_cache(maxsize=256)
def _joint_plan(paths, t, device, dtype, rows, align):
    """[(n0, n1, [(path index, key start, key stop), ...], bias), ...] for queries in blocks of
    ``rows`` (JOINT_ROWS), widths padded to a multiple of ``align`` (JOINT_ALIGN). bias:
    (n1 - n0, columns), 0 where the key is live, -inf where it is masked; None when every key is
    live. (Adding it over the whole block beats adding a strided part.)"""
    plan = []
    for n0 in range(0, t, rows):
        n1 = min(t, n0 + rows)
        segments = [[i, *path.key_range(n0, n1, t)] for i, path in enumerate(paths)]
        segments = [seg for seg in segments if seg[2] > seg[1]]
        short = -sum(b - a for _, a, b in segments) % align
        for seg in segments:  # widen with masked keys where the key set has some to spare
            grow = min(short, paths[seg[0]].key_count(t) - seg[2])
            seg[2] += grow
            short -= grow
            grow = min(short, seg[1])
            seg[1] -= grow
            short -= grow
        i = torch.arange(n0, n1, device=device)[:, None]
        live = torch.cat([paths[p].live(i, torch.arange(a, b, device=device)[None, :]) for p, a, b in segments], 1)
        if not bool(live.any(-1).all()):
            raise ValueError("every query needs a key: the joint kernel has no empty-row handling")
        bias = None
        if not bool(live.all()):
            bias = torch.zeros(live.shape, device=device, dtype=dtype).masked_fill_(~live, NEG_INF)
        plan.append((n0, n1, [tuple(seg) for seg in segments], bias))
    return plan


def _plan(paths, t, device, dtype):
    return _joint_plan(tuple(paths), t, str(device), dtype, JOINT_ROWS, JOINT_ALIGN)


def _rows(x):  # (B, H, T, D) -> (B H, T, D), contiguous
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def _gather(xs, segments):
    """The keys (or values) of a block's segments, side by side: (B H, columns, D). One segment
    is a view; several are copied together, so that every matmul reads plain row-major blocks."""
    parts = [xs[i][:, a:b] for i, a, b in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class _JointAttention(torch.autograd.Function):
    """One softmax over all paths' keys, by blocks of queries (see above)."""

    @staticmethod
    def forward(ctx, q, paths, scale, keep, *kvs):
        shape, t = q.shape, q.shape[-2]
        qs = _rows(q * scale)  # the scale rides on q: a T x D pass instead of a T x T one
        keys, values = [], []
        for path, k, v in zip(paths, kvs[0::2], kvs[1::2]):
            k, v = path.joint_kv(k, v)
            keys.append(_rows(k))
            values.append(_rows(v))
        out = qs.new_empty(qs.shape[0], t, values[0].shape[-1])
        plan = _plan(paths, t, q.device, qs.dtype)
        probs = []
        for n0, n1, segments, bias in plan:
            s = torch.bmm(qs[:, n0:n1], _gather(keys, segments).transpose(1, 2))
            if bias is not None:
                s.add_(bias)
            p = torch.softmax(s, -1)
            torch.bmm(p, _gather(values, segments), out=out[:, n0:n1])
            if keep:
                probs.append(p)
        if keep:
            ctx.paths, ctx.scale, ctx.plan, ctx.shape, ctx.n = paths, scale, plan, shape, len(paths)
            ctx.save_for_backward(qs, out, *kvs, *keys, *values, *probs)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, d_out):
        n = ctx.n
        qs, out, *rest = ctx.saved_tensors
        kvs, keys, values, probs = rest[: 2 * n], rest[2 * n : 3 * n], rest[3 * n : 4 * n], rest[4 * n :]
        d_out = _rows(d_out.to(out.dtype))
        wide = torch.promote_types(out.dtype, torch.float32)
        delta = (d_out.to(wide) * out.to(wide)).sum(-1, keepdim=True).to(out.dtype)  # rowsum(dO * O)
        dq = torch.empty_like(qs)
        dks, dvs = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
        for (n0, n1, segments, _), p in zip(ctx.plan, probs):
            ds = torch.bmm(d_out[:, n0:n1], _gather(values, segments).transpose(1, 2))
            # dS = P (dP - rowsum(dO O)), in place in P's dtype: under bfloat16 the row sum's
            # rounding is of the order of dP's own, and two passes cost less than five.
            ds.sub_(delta[:, n0:n1]).mul_(p)
            torch.bmm(ds, _gather(keys, segments), out=dq[:, n0:n1])
            if len(segments) == 1:
                i, a, b = segments[0]
                dks[i][:, a:b].baddbmm_(ds.transpose(1, 2), qs[:, n0:n1])
                dvs[i][:, a:b].baddbmm_(p.transpose(1, 2), d_out[:, n0:n1])
                continue
            dk, dv = ds.transpose(1, 2) @ qs[:, n0:n1], p.transpose(1, 2) @ d_out[:, n0:n1]
            c = 0
            for i, a, b in segments:
                dks[i][:, a:b] += dk[:, c : c + b - a]
                dvs[i][:, a:b] += dv[:, c : c + b - a]
                c += b - a
        b_, h_ = ctx.shape[:2]
        grads = []
        for path, k, v, dk, dv in zip(ctx.paths, kvs[0::2], kvs[1::2], dks, dvs):
            dk, dv = path.joint_grads(dk.unflatten(0, (b_, h_)), dv.unflatten(0, (b_, h_)), k, v)
            grads += [dk.to(k.dtype), dv.to(v.dtype)]
        return dq.mul_(ctx.scale).view(ctx.shape), None, None, None, *grads


def _joint(q, paths, kvs):
    """The joint kernel's output, or None where it does not serve (not CPU, or over budget)."""
    if q.device.type != "cpu":
        return None
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, *kvs))
    if not keep and q.shape[-2] > JOINT_NOGRAD_MAX_T:
        return None
    if keep:
        plan = _plan(paths, q.shape[-2], q.device, q.dtype)
        kept = sum((n1 - n0) * sum(b - a for _, a, b in segments) for n0, n1, segments, _ in plan)
        if kept * q.shape[0] * q.shape[1] * q.element_size() > JOINT_MAX_BYTES:
            return None
    return _JointAttention.apply(q, paths, q.shape[-1] ** -0.5, keep, *kvs)


def blocked_attention(q, paths_and_kvs):
    """Attention over [(path, k, v), ...]: the joint kernel on CPU, else each path on its own,
    merged through the log-sum-exp (see module doc)."""
    paths = tuple(p for p, _, _ in paths_and_kvs)
    kvs = [x for _, k, v in paths_and_kvs for x in (k, v)]
    out = _joint(q, paths, kvs)
    return out if out is not None else _MergedAttention.apply(q, paths, q.shape[-1] ** -0.5, *kvs)


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
        out = _joint(q, (ShiftedCausal(0),), [k, v]) if kernel in ("auto", "blocked") and tq > 1 else None
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
