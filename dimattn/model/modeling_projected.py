"""Projected models (seed 003, Section 4): a frozen causal LM whose last l attention layers score
keys with fitted low-dimensional query/key projections.

On a projected layer, with F(x) = W x + b the layer's projection (dimattn.model.affine.Affine),

    attention = Softmax(F(q) F(K)^T * s) V,    s = 1/sqrt(d') ("d_prime") or 1/sqrt(d) ("d"),

values stay at full width, and keys are projected *before* the KV cache, so generation's cache
holds d' numbers per key (``ProjectedCache``). The layers N-l .. N-1 are projected, as in the
authors' code. The model's own attention implementation (SDPA) does the rest, so Llama, Qwen2,
Qwen3 (GQA) and our own DimAttn vanilla runs are served by one attention function registered
with transformers' ``AttentionInterface``; no hub code runs.

Both reductions composed: on a DAR or uniform layer of our models (seed 000) F applies to the
query and to whichever key it scores, near or far, F(q_i).F(k_ij) * s, with the layer's own
kernels. Such a model keeps its own DimAttnCache (the d_down latents of every token, full K/V of
the last w - 1): keys are projected at attention time, near keys as read from the cache and far
keys as rebuilt from the latents, so that cache holds no F(k) and KV compression does not apply.

A projected model is a model directory (:func:`save_projected_model`): ``config.json``
(``ProjectedConfig``: the base model's path or hub name, l, the scale), ``projections.safetensors``,
the tokenizer, and this module copied beside them, so that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (lm-eval's ``--model hf``
included) returns the base model class with the projections attached. That loader is ours,
saved with the directory; the base model itself loads with transformers' own classes (remote
code only for our own DimAttn run directories).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .affine import Affine, as_affine, check_head_dim, load_projections, logit_scale
from .configuration_projected import ProjectedConfig, check_kv, projected_layers
from .hf import switch_attention
from .kv_compression import KIVILayer, KIVISettings, SnapKVSettings, snapkv_compress

PROJECTED_ATTENTION = "dimattn_projected"
# Set on the key tensors a ProjectedCache returns: whether they are F(k) already (the attention
# must not project them again), and the cache layer, which SnapKV compresses after the prefill.
_PROJECTED_TAG = "_dimattn_projected"
_LAYER_TAG = "_dimattn_cache_layer"


def _apply(projection: Affine, x: torch.Tensor) -> torch.Tensor:
    return projection.to(dtype=x.dtype, device=x.device)(x)


def projected_attention(module, query, key, value, attention_mask, scaling=None, *, far_key=None, far_value=None,
                        window=None, attend=None, **kwargs):
    """transformers' SDPA on every layer; on a projected one (``module.dimattn_projection`` set),
    on F(q) and F(k) at the projection's scale. Keys a ProjectedCache returns are F(k) already.
    A DAR or uniform layer of our models hands over its far keys and its own kernels
    (``attend``, dimattn.model.modeling_dimattn CausalSelfAttention._attention): F applies to the
    near and the far keys alike, and ``attend`` scores at 1/sqrt(width of q), so the scale
    rides on F(q).

    The model's own ``scaling`` is folded into the queries first, as the capture that the
    projection was fitted on did (dimattn.dimpo.capture), so psi's 1/sqrt(d) convention holds.
    """
    projection = getattr(module, "dimattn_projection", None)
    d = query.shape[-1]
    if projection is not None:
        if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
            query = query * (scaling * math.sqrt(d))
        query = _apply(projection, query)
        if not getattr(key, _PROJECTED_TAG, False):
            key = _apply(projection, key)
        scaling = module.dimattn_scale
    if attend is not None:
        if projection is not None:
            far_key = _apply(projection, far_key)
            factor = scaling * math.sqrt(query.shape[-1])
            if abs(factor - 1.0) > 1e-6:
                query = query * factor
        return attend(query, (key, value), (far_key, far_value)), None
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = getattr(key, _LAYER_TAG, None)
    if layer is not None:
        layer.after_attention(query, 1.0 / math.sqrt(d) if scaling is None else scaling)
    return out


AttentionInterface.register(PROJECTED_ATTENTION, projected_attention)
AttentionMaskInterface.register(PROJECTED_ATTENTION, sdpa_mask)


# ---- the cache ----------------------------------------------------------------------------------


class ProjectedLayer(DynamicLayer):
    """One layer of a ProjectedCache: stores F(k) (d' numbers a key) on a projected layer, and
    compresses its keys and values with KIVI (quantised as they age) or SnapKV (evicted once,
    after the prefill) when the model asks for it (dimattn.model.kv_compression)."""

    def __init__(self, projection: Affine | None = None, kivi: KIVISettings | None = None,
                 snapkv: SnapKVSettings | None = None):
        super().__init__()
        if kivi is not None and snapkv is not None:
            raise ValueError("KIVI and SnapKV are alternatives (seed 003, Table 5), not a combination")
        self.projection = projection
        self.kivi = KIVILayer(kivi) if kivi is not None else None
        self.snapkv = snapkv
        self.prefilled = False

    def update(self, key_states, value_states, *args, **kwargs):
        if self.projection is not None:
            key_states = _apply(self.projection, key_states)
        if self.kivi is None:
            keys, values = super().update(key_states, value_states)
        else:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.kivi.update(key_states, value_states)
            self.keys, self.values = self.kivi.dequantized()
        setattr(keys, _PROJECTED_TAG, self.projection is not None)
        setattr(keys, _LAYER_TAG, self)
        return keys, values

    def after_attention(self, queries, scale: float) -> None:
        """SnapKV's eviction, once, after the prefill's attention: the prompt's last queries (F(q)
        on a projected layer) score the cached keys with the logits the layer used."""
        if self.prefilled:
            return
        self.prefilled = True
        if self.snapkv is not None:
            self.keys, self.values = snapkv_compress(queries, self.keys, self.values, self.snapkv, scale)

    def nbytes(self) -> int:
        """Bytes the layer holds: KIVI's packed codes, scales and residual, or the keys and values."""
        if self.kivi is not None:
            return self.kivi.nbytes()
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if isinstance(t, torch.Tensor))


class ProjectedCache(Cache):
    """A ProjectedLayer a model layer (projected or not), with the model's KV compression."""

    def __init__(self, model):
        kv = getattr(model, "dimattn_kv", None) or {}
        kivi = KIVISettings(**kv["kivi"]) if "kivi" in kv else None
        snapkv = SnapKVSettings(**kv["snapkv"]) if "snapkv" in kv else None
        layers = [
            ProjectedLayer(getattr(m, "dimattn_projection", None), kivi=kivi, snapkv=snapkv)
            for _, m in sorted(attention_modules(model).items())
        ]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes of the cached keys and values, compressed as stored."""
        return sum(layer.nbytes() for layer in self.layers)


def _cache_argument(kwargs) -> str:
    return "cache" if "cache" in kwargs or "past_key_values" not in kwargs else "past_key_values"


def _keeps_own_cache(model) -> bool:
    """Our DAR and uniform models cache d_down latents (DimAttnCache), which a ProjectedCache
    cannot hold; their projected layers project keys at attention time instead."""
    return bool(getattr(model.config, "uses_bottleneck", False))


class ProjectedForwardMixin:
    """Put in front of the base model's class by :func:`attach_projections`: every forward that
    will cache keys caches F(k). generate() hands the model an empty DynamicCache; it is
    replaced by a ProjectedCache, which the outputs carry back to generate() (except on a
    model that keeps its own cache)."""

    def forward(self, *args, **kwargs):
        name = _cache_argument(kwargs)
        cache = kwargs.get(name)
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.config, "use_cache", False) if use_cache is None else use_cache
        if use_cache and not isinstance(cache, ProjectedCache) and not _keeps_own_cache(self):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"a projected model needs a ProjectedCache, got a filled {type(cache).__name__}")
            kwargs[name] = ProjectedCache(self)
        return super().forward(*args, **kwargs)


# ---- attaching projections ------------------------------------------------------------------------


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """{layer index: attention module}: the modules with a ``layer_idx`` that own query weights."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and any(hasattr(module, n) for n in ("q_proj", "query_key_value")):
            found.setdefault(int(idx), module)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer_idx")
    return found


def attach_projections(model, projections: dict, num_projected: int, scale: str = "d_prime", kv: dict | None = None,
                       source="projections"):
    """Project the last ``num_projected`` attention layers of ``model`` (in place; returned).

    ``projections``: {layer: Affine or W} for (at least) those layers, fitted on this model's
    post-RoPE queries and keys. ``scale``: "d_prime" (1/sqrt(d'), the scale the fits train at) or
    "d" (1/sqrt(d), the authors' inference). num_projected = 0 gives the base model's outputs.
    ``kv``: KV-cache compression of every layer, {"kivi": KIVISettings fields} or {"snapkv":
    SnapKVSettings fields} (seed 003, Table 5), or None. ``source`` (the projections file) is
    named in errors.
    """
    kv = check_kv(kv)
    if kv and _keeps_own_cache(model):
        raise ValueError(f"kv={kv!r}: KV compression needs a plain KV cache; {type(model).__name__} with DAR or "
                         "uniform layers keeps its own (DimAttnCache)")
    modules = attention_modules(model)
    layers = projected_layers(len(modules), num_projected)
    missing = [layer for layer in layers if layer not in projections]
    if missing:
        raise ValueError(f"no projection for layer(s) {missing}; the file has {sorted(projections)}")
    for layer in layers:
        check_head_dim({layer: projections[layer]}, modules[layer].head_dim, source)
    for idx, module in modules.items():
        if idx in layers:
            projection = as_affine(projections[idx])
            d_prime, d = projection.W.shape
            module.dimattn_projection = projection
            module.dimattn_scale = logit_scale(scale, d, d_prime)
        else:
            module.dimattn_projection = None
    if not isinstance(model, ProjectedForwardMixin):
        base = type(model)
        model.__class__ = type(f"Projected{base.__name__}", (ProjectedForwardMixin, base), {})
    switch_attention(model, PROJECTED_ATTENTION)
    model.dimattn_kv = kv
    model.config.dimattn_projection = {"projected_layers": layers, "scale": scale, "kv": kv}
    return model


# ---- the model directory's loader (written by dimattn.model.configuration_projected.save_projected_model) ----


class ProjectedForCausalLM(PreTrainedModel):
    """Loader of a projected model directory: ``from_pretrained`` returns the base model's own
    class (LlamaForCausalLM, ...) with the projections attached, so every tool that takes a
    transformers causal LM (lm-eval's ``hf`` model, ``generate()``) runs it unchanged."""

    config_class = ProjectedConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        directory = Path(pretrained_model_name_or_path)
        config = config if isinstance(config, ProjectedConfig) else ProjectedConfig.from_pretrained(directory)
        kwargs.pop("trust_remote_code", None)
        base = config.base_model
        if not Path(base).is_absolute() and (directory / base).exists():
            base = str(directory / base)
        model = AutoModelForCausalLM.from_pretrained(base, *args, trust_remote_code=config.base_trust_remote_code,
                                                     **kwargs)
        projections = load_projections(directory / config.projections)[0] if config.num_projected else {}
        return attach_projections(model, projections, config.num_projected, config.scale, config.kv,
                                  source=directory / config.projections)


__all__ = [
    "PROJECTED_ATTENTION",
    "ProjectedCache",
    "ProjectedForCausalLM",
    "ProjectedLayer",
    "attach_projections",
    "attention_modules",
    "projected_attention",
]
