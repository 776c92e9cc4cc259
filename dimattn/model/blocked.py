"""The blocked kernel (dimattn.model.attention's ``"blocked"``): each attention pattern as a sum of
*paths* (Band, ShiftedCausal, Strided), computed jointly under one softmax on CPU (the joint
kernel) or path by path, merged through the log-sum-exp. Like every module of dimattn/model/, it
imports only its siblings: save_pretrained copies it beside the model code.
"""

import functools

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")

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
        dk, dv = torch.zeros_like(kp).unflatten(-2, (nb + m - 1, b)), torch.zeros_like(vp).unflatten(
            -2, (nb + m - 1, b)
        )
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
    total = (
        first.to(wide) if first.shape[-2] == t else first.new_zeros(*first.shape[:-2], t, first.shape[-1], dtype=wide)
    )
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


def joint_attention(q, paths, kvs):
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
    out = joint_attention(q, paths, kvs)
    return out if out is not None else _MergedAttention.apply(q, paths, q.shape[-1] ** -0.5, *kvs)
