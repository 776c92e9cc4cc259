"""A Pythia / GPT-NeoX style causal LM whose attention keeps full-dimensional keys and values for
the last ``window`` tokens and sends older tokens through a ``d_down`` bottleneck (seed 000).

Read top to bottom: rotary embedding, Bottleneck, CausalSelfAttention, MLP, Block, the model,
and the training loss (``lm_head_loss``: on CPU, a loss asked for with return_logits=False
comes without the logits).
Parameter names follow transformers' GPT-NeoX so that a vanilla model counts exactly as Pythia.
"""

import functools
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import ATTENTION_VARIANTS, latent_dar_attention
from .configuration_dimattn import DimAttnConfig

# Attention implementations that mean "use our own kernels"; any other registered name (for
# example the query/key capture of the DimPO stage) is called like transformers calls it.
NATIVE_IMPLEMENTATIONS = {None, "eager", "sdpa"}


@functools.cache
def takes_far_keys(attention_fn) -> bool:
    """Whether a registered attention function also serves DAR and uniform layers: it names the
    keyword ``attend`` (see CausalSelfAttention._attention); transformers' own functions would
    silently drop far keys into their **kwargs."""
    return "attend" in inspect.signature(attention_fn).parameters


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """GPT-NeoX partial rotary: the first ``rotary_pct * head_dim`` channels rotate.

    The frequencies are recomputed at each call rather than kept in a buffer: from_pretrained
    builds modules on the meta device and would leave a non-persistent buffer uninitialised.
    """

    def __init__(self, config: DimAttnConfig):
        super().__init__()
        self.rotary_ndims = int(config.head_dim * config.rotary_pct)
        self.base = config.rotary_emb_base

    def forward(self, position_ids):  # (B, T) -> cos, sin (B, 1, T, rotary_ndims)
        exponents = torch.arange(0, self.rotary_ndims, 2, device=position_ids.device).float() / self.rotary_ndims
        inv_freq = 1.0 / (self.base**exponents)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


def apply_rotary(x, cos, sin):
    n = cos.shape[-1]
    x_rot, x_pass = x[..., :n], x[..., n:]
    x_rot = x_rot * cos.to(x.dtype) + rotate_half(x_rot) * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


class Rope:
    """The rotary embedding of one forward (apply_rotary's), laid out for the fused q | k | v
    projection: x (B, T, H, P, hs) -> x * C + rotate_half(x) * S with C = [cos, 1] and
    S = [sin, 0] over head_dim, on rows of q | k | v (a value row is left as it is: C = 1,
    S = 0). rotate_half of the first n channels is a fixed signed permutation, applied as a
    (hs x hs) matmul: three full-width passes instead of a dozen small strided ones."""

    def __init__(self, cos, sin, head_dim: int):  # cos, sin: (B, 1, T, n)
        b, _, t, n = cos.shape
        pad = head_dim - n
        row = lambda x, fill: torch.cat([x[:, 0], x.new_full((b, t, pad), fill)], -1)  # noqa: E731
        c, s = row(cos, 1.0), row(sin, 0.0)
        self.c = torch.stack([c, c, torch.ones_like(c)], -2)[:, :, None]  # (B, T, 1, 3, hs)
        self.s = torch.stack([s, s, torch.zeros_like(s)], -2)[:, :, None]
        r = torch.zeros(head_dim, head_dim, device=cos.device)
        half = torch.arange(n // 2, device=cos.device)
        r[half + n // 2, half] = -1.0  # rotate_half: [x1, x2] -> [-x2, x1]
        r[half, half + n // 2] = 1.0
        self.r, self._cast = r, {}

    def _tables(self, dtype):
        if dtype not in self._cast:
            self._cast[dtype] = tuple(x.to(dtype) for x in (self.c, self.s, self.r))
        return self._cast[dtype]

    def __call__(self, x, rows=slice(0, 3)):
        """x: (B, T, H, P, hs), its P rows being rows ``rows`` of q | k | v."""
        c, s, r = self._tables(x.dtype)
        turned = (x.reshape(-1, x.shape[-1]) @ r).view(x.shape)  # one 2-D matmul, never a batched one
        return torch.addcmul(x * c[..., rows, :], turned, s[..., rows, :])


class Bottleneck(nn.Module):
    """h' = a(h W_down) W_up, seed 000 Eq. 1-2: d -> d_down -> d, no bias; a is the identity
    (the paper's choice) or the sigmoid it also tried. ``encode`` gives the d_down latent that
    the DAR cache stores for distant tokens."""

    def __init__(self, config: DimAttnConfig):
        super().__init__()
        self.down = nn.Linear(config.hidden_size, config.d_down, bias=False)
        self.up = nn.Linear(config.d_down, config.hidden_size, bias=False)
        # Initialised as a pair by _init_weights (W_up = W_down^T); a plain attribute, not a submodule.
        object.__setattr__(self.up, "transpose_of", self.down)
        self.down.is_bottleneck_down = True
        self.sigmoid = config.bottleneck_activation == "sigmoid"

    def encode(self, h):
        z = self.down(h)
        return torch.sigmoid(z) if self.sigmoid else z

    def forward(self, h):
        return self.up(self.encode(h))


class LatentLayer:
    """One DAR or uniform layer of DimAttnCache: full keys/values of the last window - 1 slots
    (the next query adds its own) and the d_down latent of every slot."""

    def __init__(self):
        self.near_k = self.near_v = self.latent = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.near_k, self.near_v, self.latent) if t is not None)


class DimAttnCache(DynamicCache):
    """Generation cache of seed 000's inference story: for DAR layers it keeps full K/V only
    for the last w tokens and the d_down latent for older ones; their far keys/values are
    rebuilt from the latent at each step (memory traded for compute, as in MLA). Other
    layers keep DynamicCache's full K/V. ``positions`` holds each slot's rotary position,
    which the rebuilt far keys need."""

    def __init__(self, config: DimAttnConfig):
        super().__init__()
        self.latent_layers = {
            i: LatentLayer() for i in range(config.num_hidden_layers)
            if ATTENTION_VARIANTS[config.layer_attention(i)].far
        }
        self.positions = None  # (B, slots) int32
        self.num_slots = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_slots

    def nbytes(self) -> int:
        full = sum(
            t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values)
            if isinstance(t, torch.Tensor)
        )
        latent = sum(layer.nbytes() for layer in self.latent_layers.values())
        return (
            full
            + latent
            + (self.positions.numel() * self.positions.element_size() if self.positions is not None else 0)
        )

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        for layer in self.latent_layers.values():
            for name in ("near_k", "near_v", "latent"):
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.index_select(0, beam_idx.to(t.device)))
        self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def crop(self, max_length):
        raise NotImplementedError("DimAttnCache cannot be cropped (assisted decoding is not supported)")


class CompactSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding layer (its length counts every token seen), keeping the last
    window - 1 tokens as copies: its own kept states are views into the whole update (after a
    prefill, the whole prompt stays allocated, unseen by kv_cache_nbytes), and at window 1 its
    slice [-0:] keeps everything."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        keep = self.sliding_window - 1
        if not self.record_past and keys.shape[-2] > keep:  # record_past: transformers trims in crop()
            self.keys, self.values = (x[..., x.shape[-2] - keep :, :].clone() for x in (keys, values))
        return keys, values


class DilatedLayer(DynamicLayer):
    """A dilated layer's cache (seed 001): the last window - 1 tokens and, older than them, only
    the tokens at absolute positions 0, r, 2r, ...: every key dilated attention reads again.
    ``positions`` are the kept keys' absolute positions and ``returned_positions`` those of the
    keys the last update returned, which the attention's mask reads (dilated_attention's
    key_positions). Positions are arithmetic, so they are not counted as cache bytes."""

    def __init__(self, window: int, dilation: int):
        super().__init__()
        self.window, self.dilation = window, dilation
        self.cumulative_length = 0
        self.positions = self.returned_positions = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        new = torch.arange(self.cumulative_length, self.cumulative_length + t, device=key_states.device)
        self.cumulative_length += t
        keys, values = torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        positions = new if self.positions is None else torch.cat([self.positions, new])
        # the next query (at cumulative_length) reads the last window - 1 and the strided set
        keep = (positions % self.dilation == 0) | (positions > self.cumulative_length - self.window)
        self.keys, self.values = keys[..., keep, :].clone(), values[..., keep, :].clone()
        self.positions, self.returned_positions = positions[keep], positions
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, max_length):
        raise NotImplementedError("a dilated layer's cache cannot be cropped (assisted decoding is not supported)")


class LayerwiseCache(DynamicCache):
    """Generation cache of a model without DAR or uniform layers: an SWA layer keeps only the last
    window - 1 tokens (all it can read again; the next query adds its own), a dilated layer those
    and the strided set beyond them (DilatedLayer), every other layer keeps all. (DimAttnConfig
    has no ``layer_types``, from which DynamicCache(config=...) would build this.)"""

    def __init__(self, config: DimAttnConfig):
        def layer(i):
            attention = config.layer_attention(i)
            if attention == "swa":
                return CompactSlidingWindowLayer(sliding_window=config.window)
            if attention == "dilated":
                return DilatedLayer(config.window, config.dilation)
            return DynamicLayer()

        Cache.__init__(self, layers=[layer(i) for i in range(config.num_hidden_layers)])


def new_cache(config: DimAttnConfig) -> DynamicCache:
    """The generation cache of a model of this config, fitted to its layers' attention."""
    return DimAttnCache(config) if config.uses_bottleneck else LayerwiseCache(config)


def kv_cache_nbytes(cache) -> int:
    """Bytes held by a DimAttnCache or a DynamicCache (LayerwiseCache: SWA layers hold their window)."""
    if isinstance(cache, DimAttnCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: DimAttnConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.variant_name = config.layer_attention(layer_idx)
        self.variant = ATTENTION_VARIANTS[self.variant_name]
        # Query i reads key j near (full) when 0 <= i - j < window, far (bottlenecked) otherwise;
        # a uniform layer has no near key.
        self.window = config.window if self.variant.near else 0
        # Attributes transformers' attention functions read (used by the DimPO capture).
        self.is_causal = True
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        # GPT-NeoX layout: per head, [q | k | v] interleaved in one fused projection.
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.bottleneck = Bottleneck(config) if self.variant.far else None

    def _far_key_value(self, z):
        """Keys and values of the bottlenecked states h' = z W_up, reusing W_K and W_V (seed 000,
        Eq. 3), from the d_down latent z: z (W W_up)^T + b, a d_down -> d matmul each instead of
        d_down -> d -> d. (B, T, d_down) -> keys, values (B, T, H, hs)."""
        d, heads, hs = self.config.hidden_size, self.num_heads, self.head_dim
        w, b = self.query_key_value.weight.view(heads, 3, hs, d), self.query_key_value.bias.view(heads, 3, hs)
        up = self.bottleneck.up.weight
        return tuple(F.linear(z, w[:, i].reshape(-1, d) @ up, b[:, i].reshape(-1)).unflatten(-1, (heads, hs))
                     for i in (1, 2))

    def forward(self, h, rope: Rope, key_padding_mask=None, cache: Cache | None = None, rope_all=None):
        b, t, _ = h.shape
        # GPT-NeoX layout: per head [q | k | v]; q and k rotate in one pass.
        qk, v = self.query_key_value(h).unflatten(-1, (self.num_heads, 3, self.head_dim)).split([2, 1], -2)
        q, k = (x.transpose(1, 2) for x in rope(qk, rows=slice(0, 2)).unbind(-2))  # (B, H, T, hs)
        v = v.squeeze(-2).transpose(1, 2)
        if isinstance(cache, DimAttnCache) and self.layer_idx in cache.latent_layers:
            out = self._attend_from_latents(q, k, v, h, cache, rope_all, key_padding_mask)
            return self.dense(out.reshape(b, t, -1))
        near_kv = far_kv = None
        if self.variant.near:
            near_kv = (k, v)
        if self.variant.far:
            k_far, v_far = self._far_key_value(self.bottleneck.encode(h))
            k_far = rope(k_far.unsqueeze(-2), rows=slice(1, 2)).squeeze(-2)
            far_kv = (k_far.transpose(1, 2), v_far.transpose(1, 2))

        key_positions = None
        if cache is not None and (near_kv is None) != (far_kv is None):
            # One set: cached as it is (a projected model's cache stores F(k), d' wide).
            kv = cache.update(*(near_kv or far_kv), self.layer_idx)
            near_kv, far_kv = (kv, None) if self.variant.near else (None, kv)
            layer = cache.layers[self.layer_idx] if hasattr(cache, "layers") else None
            if isinstance(layer, DilatedLayer):  # its keys are a subset: the mask needs their positions
                key_positions = layer.returned_positions
        elif cache is not None:
            # One cache entry per layer: near and far sets side by side along head_dim.
            keys = torch.cat([kv[0] for kv in (near_kv, far_kv) if kv is not None], dim=-1)
            values = torch.cat([kv[1] for kv in (near_kv, far_kv) if kv is not None], dim=-1)
            keys, values = cache.update(keys, values, self.layer_idx)
            keys, values = keys.split(self.head_dim, dim=-1), values.split(self.head_dim, dim=-1)
            pairs = iter(zip(keys, values))
            near_kv = next(pairs) if self.variant.near else None
            far_kv = next(pairs) if self.variant.far else None
        if key_padding_mask is not None:  # (B, past + T); a sliding layer's cache returns its last keys only
            if key_positions is not None:
                key_padding_mask = key_padding_mask[:, key_positions]
            else:
                key_padding_mask = key_padding_mask[:, -(near_kv or far_kv)[0].shape[-2]:]

        def attend(q, near_kv, far_kv):
            return self.variant(
                q, near_kv, far_kv, window=self.config.window, dilation=self.config.dilation,
                key_padding_mask=key_padding_mask, kernel=self.config.attention_kernel, key_positions=key_positions,
            ).transpose(1, 2)

        # A uniform layer never reads its full keys (window 0); a capture records them all the same.
        out = self._attention(q, (k, v) if near_kv is None else near_kv, far_kv, attend)
        return self.dense(out.reshape(b, t, -1))  # (B, T, H, hs) -> (B, T, d)

    def _attention(self, q, near_kv, far_kv, attend):
        """(B, T, H, hs): ``attend(q, near_kv, far_kv)``, our kernels, under a native implementation;
        else the registered function, called as transformers calls it. On a DAR or uniform layer
        only a function that takes far keys (takes_far_keys) is called, with ``far_key``,
        ``far_value``, ``window`` and ``attend`` besides: it may transform q and both key sets
        (the projected attention applies F to them), then calls ``attend``, which keeps the
        layer's masks, padding and cache."""
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation in NATIVE_IMPLEMENTATIONS:
            return attend(q, near_kv, far_kv)
        attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
        if self.variant_name == "vanilla":
            return attention_fn(self, q, *near_kv, None, scaling=self.scaling, dropout=0.0)[0]
        if not (self.variant.far and takes_far_keys(attention_fn)):
            raise ValueError(f"attention implementation {implementation!r} supports only vanilla layers"
                             + (" (and DAR / uniform ones if it accepts far keys)" if self.variant.far else ""))
        out, _ = attention_fn(self, q, *near_kv, None, scaling=self.scaling, dropout=0.0, far_key=far_kv[0],
                              far_value=far_kv[1], window=self.window, attend=attend)
        return out

    def _attend_from_latents(self, q, k, v, h, cache, rope_all, key_padding_mask):
        """DAR / uniform attention against DimAttnCache: far keys and values rebuilt from the
        latents of every slot, near ones read from the last window - 1 slots. (B, T, H, hs)."""
        state, t = cache.latent_layers[self.layer_idx], q.shape[-2]
        z = self.bottleneck.encode(h)
        state.latent = z if state.latent is None else torch.cat([state.latent, z], dim=1)
        slots = state.latent.shape[1]
        k_far, v_far = (x.transpose(1, 2) for x in self._far_key_value(state.latent))  # (B, H, slots, hs)
        k_far = apply_rotary(k_far, *rope_all)
        window = self.window
        if window:
            near_k = k if state.near_k is None else torch.cat([state.near_k, k], dim=-2)
            near_v = v if state.near_v is None else torch.cat([state.near_v, v], dim=-2)
            keep = max(0, near_k.shape[-2] - (window - 1))  # the next query needs w - 1 besides itself
            # copies: a view would keep the whole prefill's keys allocated, unseen by nbytes
            state.near_k, state.near_v = near_k[..., keep:, :].clone(), near_v[..., keep:, :].clone()
        else:
            near_k = near_v = k[..., :0, :]

        def attend(q, near_kv, far_kv):
            return latent_dar_attention(
                q, *near_kv, *far_kv, window, q_start=slots - t, near_start=slots - near_kv[0].shape[-2],
                key_padding_mask=key_padding_mask,
            ).transpose(1, 2)

        return self._attention(q, (near_k, near_v), (k_far, v_far), attend)


class MLP(nn.Module):
    def __init__(self, config: DimAttnConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class Block(nn.Module):
    def __init__(self, config: DimAttnConfig, layer_idx: int):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, rope, key_padding_mask=None, cache=None, rope_all=None):
        a = self.attention(self.input_layernorm(x), rope, key_padding_mask, cache, rope_all)
        if self.use_parallel_residual:  # Pythia: x + attn(ln1(x)) + mlp(ln2(x))
            return x + a + self.mlp(self.post_attention_layernorm(x))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class DimAttnPreTrainedModel(PreTrainedModel):
    config_class = DimAttnConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        # The bottleneck pair: W_down with orthonormal rows, W_up = W_down^T, so h' starts as the
        # projection of h onto a d_down-dimensional subspace at h's own scale (d_down = d: h' = h,
        # the no-bottleneck control starts as vanilla). Two normal(0.02) matrices would start far
        # keys at ~1% of h's scale, from where they learn slowly.
        if getattr(module, "is_bottleneck_down", False):
            nn.init.orthogonal_(module.weight)
            return
        if isinstance(module, nn.Linear) and hasattr(module, "transpose_of"):
            with torch.no_grad():
                module.weight.copy_(module.transpose_of.weight.T)
            return
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class DimAttnModel(DimAttnPreTrainedModel):
    def __init__(self, config: DimAttnConfig):
        super().__init__(config)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_in

    def set_input_embeddings(self, value):
        self.embed_in = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        b, t = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        key_padding_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_padding_mask = attention_mask.bool()  # (B, past + T)
        if position_ids is None:
            if attention_mask is not None:  # left padding: positions count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        rope = Rope(*self.rotary(position_ids), self.config.head_dim)
        rope_all = None
        if isinstance(cache, DimAttnCache):  # far keys of every slot are rebuilt at their positions
            positions = position_ids.to(torch.int32)
            if cache.positions is not None:
                positions = torch.cat([cache.positions, positions], dim=1)
            cache.positions = positions
            rope_all = self.rotary(positions)
        x = self.embed_in(input_ids)  # (B, T, d)
        for block in self.layers:
            x = block(x, rope, key_padding_mask, cache, rope_all)
        if isinstance(cache, DimAttnCache):
            cache.num_slots += t
        return self.final_layer_norm(x)


class DimAttnForCausalLM(DimAttnPreTrainedModel, GenerationMixin):
    def __init__(self, config: DimAttnConfig):
        super().__init__(config)
        self.gpt_neox = DimAttnModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.embed_out

    def set_output_embeddings(self, value):
        self.embed_out = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        labels=None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        return_logits: bool = True,
        **kwargs,
    ):
        """The usual causal-LM forward. ``return_logits=False`` with ``labels`` (our trainer and
        validation loss) lets a CPU forward compute the loss without the (N, V) logits, which
        then come back as None; every other caller gets logits as from any transformers model."""
        cache = cache if cache is not None else past_key_values
        if (use_cache and cache is None) or (type(cache) is DynamicCache and cache.get_seq_length() == 0):
            cache = new_cache(self.config)  # generate() hands every model an empty plain DynamicCache
        hidden = self.gpt_neox(input_ids, attention_mask, position_ids, cache if use_cache is not False else None)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if labels is not None and not return_logits and _fused_loss_applies(hidden, logits_to_keep):
            # A loss on CPU: the logits are never materialised (logits=None), see lm_head_loss.
            loss = lm_head_loss(hidden[:, :-1].flatten(0, 1), self.embed_out.weight, labels[:, 1:].flatten())
            return CausalLMOutputWithPast(loss=loss, logits=None, cache=cache)
        logits = self.embed_out(hidden)
        loss = None
        if labels is not None:  # next-token prediction, seed 000 Eq. 5
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)


# --- the training loss without the logits ---------------------------------------------------------

# Logits per chunk of lm_head_loss (rows x vocab): a chunk's scores and probabilities stay in cache.
LOSS_CHUNK_ELEMENTS = 1 << 20
# Rows whose softmax gradient is summed into W's gradient in one matmul (a longer reduction per
# call; fewer bf16 -> fp32 accumulations).
LOSS_GRAD_ROWS = 512
# The head on labelled rows only (lm_head_loss); benchmarks/training.py times it against all rows.
SKIP_UNLABELLED = True


def _fused_loss_applies(hidden, logits_to_keep) -> bool:
    """The chunked loss serves losses asked for without logits on CPU (training and validation);
    CUDA keeps F.cross_entropy (fused by torch.compile there)."""
    return not logits_to_keep and hidden.device.type == "cpu" and not torch.compiler.is_compiling()


class _LMHeadLoss(torch.autograd.Function):
    """mean over labelled rows of -log softmax(h W^T)[label], chunk by chunk of rows.

    The forward computes the gradients too when they are wanted (softmax - onehot is at hand
    there), so the (N, V) logits, their fp32 copy, log-softmax and its gradient never exist as
    whole tensors: on CPU those passes over N x V floats cost more than the head's matmuls.
    Matmuls run in ``dtype`` (bfloat16 under autocast); the softmax accumulates in float32.
    Without gradients (validation, perplexity) the probabilities are float32 and the loss exact.
    With gradients in a 16-bit ``dtype`` the softmax writes its 16-bit result straight into the
    gradient buffer, which is 16-bit anyway (it feeds the backward matmuls): no float32 copy of
    the (rows, V) chunk and no cast pass, which were a third of a CPU training step. The loss
    reported then comes from the 16-bit probability of the label (about 2^-9 relative, under
    0.002 nats a token: the train-loss column only; the gradient is unchanged in kind).
    The backward only scales."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, dtype, need_grad):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            n, vocab = h.shape[0], w.shape[0]
            rows = max(1, min(n, LOSS_CHUNK_ELEMENTS // vocab))
            group = max(rows, LOSS_GRAD_ROWS // rows * rows)
            wide = torch.promote_types(dtype, torch.float32)
            in_place = need_grad and dtype.itemsize < wide.itemsize  # softmax straight into the gradient
            valid = labels != -100
            target = labels.clamp(min=0)[:, None]
            nll = torch.empty(n, dtype=wide, device=h.device)
            if need_grad:
                grad_h = torch.empty_like(h)
                grad_w = torch.zeros(weight.shape, dtype=wide, device=h.device)
                grad_logits = torch.empty(min(group, n), vocab, dtype=dtype, device=h.device)
            for g0 in range(0, n, group):
                g1 = min(n, g0 + group)
                for s in range(g0, g1, rows):
                    e = min(g1, s + rows)
                    tgt, live = target[s:e], valid[s:e, None]
                    if in_place:
                        p = grad_logits[s - g0 : e - g0]
                        torch.ops.aten._softmax.out(h[s:e] @ w.T, -1, False, out=p)
                        p_target = p.gather(1, tgt).to(wide)
                    else:
                        p = torch.softmax(h[s:e] @ w.T, -1, dtype=wide)
                        p_target = p.gather(1, tgt)
                    nll[s:e] = _nll(p_target, h[s:e], w, tgt).squeeze(1)
                    if not need_grad:
                        continue
                    p.scatter_(1, tgt, (p_target - live.to(wide)).to(p.dtype))  # softmax - onehot
                    if not bool(live.all()):
                        p.mul_(live)
                    if not in_place:
                        grad_logits[s - g0 : e - g0].copy_(p)
                    torch.mm(grad_logits[s - g0 : e - g0], w, out=grad_h[s:e])
                if need_grad:
                    grad_w.add_(grad_logits[: g1 - g0].T @ h[g0:g1])
            count = valid.sum()
            loss = torch.where(valid, nll, 0.0).sum() / count  # 0 / 0 = nan, as F.cross_entropy
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w, count)
            ctx.hidden_dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = d_loss / count
        return grad_h.to(ctx.hidden_dtype) * scale, grad_w * scale, None, None, None


def _nll(p_target, h, w, target):
    """-log p[target], exactly (from the logit and log-sum-exp) where the fp32 softmax underflowed."""
    nll = -torch.log(p_target)
    tiny = (p_target < 1e-30).squeeze(1)
    if bool(tiny.any()):
        logits = (h[tiny] @ w.T).to(p_target.dtype)
        nll[tiny] = torch.logsumexp(logits, -1, keepdim=True) - logits.gather(1, target[tiny])
    return nll


def lm_head_loss(hidden, weight, labels):
    """F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100) without the logits: hidden
    (N, d), weight (V, d), labels (N,). Under autocast the matmuls take its dtype."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    labelled = labels != -100
    if SKIP_UNLABELLED and 0 < int(labelled.sum()) < len(labels):
        # A corpus that trains on its answers only (the recall probe, the long-context suite)
        # labels 1 row in 8: the head's matmuls and softmax skip the rest, whose loss and
        # gradient are zero anyway (the index's backward scatters zeros into them).
        hidden, labels = hidden[labelled], labels[labelled]
    return _LMHeadLoss.apply(hidden, weight, labels, dtype, need_grad)
