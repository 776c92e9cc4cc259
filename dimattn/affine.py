"""A fitted query/key projection as an object and as a file (seed 003): F(x) = W x + b per layer,
saved as safetensors. Shared by the fits (dimattn.projections) and by the projected models
(dimattn.modeling_projected), whose directories carry a copy of this module, so it imports only
torch, safetensors and dimattn.atomic.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, safe_open, save_file

from .atomic import atomic_file


def _metadata(meta: Mapping) -> dict[str, str]:
    return {key: json.dumps(value) for key, value in meta.items()}


def _read_metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {key: json.loads(value) for key, value in (f.metadata() or {}).items()}


def _save_atomic(tensors, path, metadata) -> None:
    """safetensors into a temp sibling, then rename: a killed job leaves no half-written file."""
    with atomic_file(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


class Affine(NamedTuple):
    """F(x) = x W^T + b, W (d', d), b (d',) or None."""

    W: torch.Tensor
    b: torch.Tensor | None = None

    def __call__(self, x):
        y = x @ self.W.T
        return y if self.b is None else y + self.b

    def query_vector(self, q):
        """u = W^T F(q): F(q).F(k) = u.k + F(q).b, and the last term is the same for every key."""
        return self(q) @ self.W

    def to(self, *args, **kwargs):
        return Affine(self.W.to(*args, **kwargs), None if self.b is None else self.b.to(*args, **kwargs))


def as_affine(projection) -> Affine:
    """An :class:`Affine`, from an Affine or a bare W."""
    return projection if isinstance(projection, Affine) else Affine(projection, None)


def logit_scale(kind: str, d: int, d_prime: int) -> float:
    """1/sqrt(d') for "d_prime", 1/sqrt(d) for "d"."""
    if kind not in ("d_prime", "d"):
        raise ValueError(f"scale {kind!r} must be 'd_prime' or 'd'")
    return 1.0 / math.sqrt(d_prime if kind == "d_prime" else d)


def projected_logits(projection, query, keys, scale: float | None = None):
    """(B, L) F(q).F(k_j) * scale up to a per-query constant, as u.k_j with u = W^T F(q):
    O(L d) per query. ``scale`` None: 1/sqrt(d')."""
    proj = as_affine(projection).to(query.dtype)
    scale = 1.0 / math.sqrt(proj.W.shape[0]) if scale is None else scale
    return torch.einsum("bd,bld->bl", proj.query_vector(query), keys) * scale


def save_projections(projections, path, meta: Mapping | None = None) -> None:
    """Safetensors with ``layer{l}.W`` (d', d) and, with a bias, ``layer{l}.b``; JSON metadata."""
    projections = {layer: as_affine(p) for layer, p in projections.items()}
    first = projections[min(projections)]
    meta = {
        **(meta or {}),
        "d_prime": first.W.shape[0],
        "head_dim": first.W.shape[1],
        "layers": sorted(projections),
        "bias": first.b is not None,
    }
    tensors = {}
    for layer, p in projections.items():
        tensors[f"layer{layer}.W"] = p.W.contiguous()
        if p.b is not None:
            tensors[f"layer{layer}.b"] = p.b.contiguous()
    _save_atomic(tensors, path, _metadata(meta))


def load_projections(path):
    """({layer: Affine}, meta) as written by :func:`save_projections`."""
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(path)).items():
        layer, part = name.split(".")
        parts.setdefault(int(layer.removeprefix("layer")), {})[part] = tensor
    projections = {layer: Affine(p["W"], p.get("b")) for layer, p in sorted(parts.items())}
    return projections, _read_metadata(path)


# ---- training instances and pairs ---------------------------------------------------------------

# Key vectors gathered at once when building pairs (instances x keys x d).


__all__ = ["Affine", "as_affine", "load_projections", "logit_scale", "projected_logits", "save_projections"]
