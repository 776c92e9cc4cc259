"""A fitted query/key projection as an object and as a file (seed 003): F(x) = W x + b per layer,
saved as safetensors. Shared by the fits (dimattn.dimpo.projections) and by the projected models
(dimattn.model.modeling_projected), whose directories carry a copy of this module, so it imports only
torch, safetensors and dimattn.model.atomic.

The file format, shared with the QKV captures (dimattn.dimpo.capture_files.save_capture,
dimattn.dimpo.capture): one safetensors file of ``layer{l}.{part}`` tensors, with JSON metadata.

* :func:`encode_metadata` / :func:`read_metadata`: a metadata mapping to safetensors' strings
  (each value JSON) and back;
* :func:`save_atomic`: write the tensors under a temporary name, metadata sorted so that equal
  contents give equal bytes, then rename;
* :class:`LayerFile`: ``{layer: {part: tensor}}`` read a layer at a time, shapes and metadata
  from the header; a missing, truncated or corrupt file or a tensor of another name refused
  (:class:`DamagedFileError`) naming the file. :func:`load_layers` reads every layer at once;
* :func:`check_meta`: refuse metadata that contradicts or lacks what the tensors say.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from .atomic import atomic_file


class DamagedFileError(ValueError):
    """A projections or capture file that is truncated, corrupt or not what its metadata says;
    the message names the file and what is wrong."""


def encode_metadata(meta: Mapping) -> dict[str, str]:
    """safetensors' metadata (strings) from ``meta``: each value as JSON."""
    return {key: json.dumps(value) for key, value in meta.items()}


def read_metadata(path, what: str = "file") -> dict:
    """The metadata of a safetensors file, each value decoded from JSON (``what``: how a
    refusal names the file)."""
    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
    meta = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise DamagedFileError(f"{what} {path}: metadata {key!r} is not JSON ({e}): {value[:80]!r}") from None
    return meta


def _unreadable(path, what: str, e: Exception) -> DamagedFileError:
    return DamagedFileError(
        f"{what} {path} is not a readable safetensors file ({e}): truncated or corrupt; "
        "delete it and rerun the step that wrote it"
    )


class LayerFile(Mapping):
    """{layer: {part: tensor}} of a safetensors file of ``layer{l}.{part}`` tensors, each layer
    read from the file when it is asked for, never the whole file at once: a paper-scale capture
    (Llama-3.1-8B, 32 layers, 10 x 4,096 tokens: 32 GiB of fp32 q, k, v) goes through a fit or a
    fidelity pass a layer at a time, so the job's host memory is one layer's, not the file's
    (dimattn.workflow.resources.fit). Bind ``f[layer]`` once a layer: each access reads it again.

    ``shapes`` ({layer: {part: shape}}) and ``meta`` come from the header alone; ``extra``
    ({layer: {key: value}}) adds non-tensor entries to a layer (a capture's DAR window). A
    missing, truncated or corrupt file, or a tensor of another name, is refused naming the file.
    """

    def __init__(self, path, parts: tuple[str, ...], what: str):
        self.path, self.what = Path(path), what
        if not self.path.is_file():
            raise FileNotFoundError(f"{what} {self.path} does not exist")
        try:  # safetensors checks at opening that the header's offsets cover the file exactly
            with safe_open(str(self.path), framework="pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            self.meta = read_metadata(self.path, what)
        except (SafetensorError, OSError) as e:
            raise _unreadable(self.path, what, e) from None
        self.shapes: dict[int, dict[str, tuple]] = {}
        for name, shape in shapes.items():
            layer, _, part = name.partition(".")
            number = layer.removeprefix("layer")
            if not (layer.startswith("layer") and number.isdigit() and part in parts):
                expected = " or ".join(f"layer<l>.{p}" for p in parts)
                raise DamagedFileError(f"{what} {self.path}: unexpected tensor {name!r} (expected {expected})")
            self.shapes.setdefault(int(number), {})[part] = shape
        if not self.shapes:
            raise DamagedFileError(f"{what} {self.path} holds no tensors")
        self.shapes = dict(sorted(self.shapes.items()))
        self.extra: dict[int, dict] = {}

    def __getitem__(self, layer: int) -> dict:
        parts = self.shapes[layer]
        try:
            with safe_open(str(self.path), framework="pt") as f:
                tensors = {part: f.get_tensor(f"layer{layer}.{part}") for part in parts}
        except (SafetensorError, OSError) as e:
            raise _unreadable(self.path, self.what, e) from None
        return tensors | self.extra.get(layer, {})

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def load_layers(path, parts: tuple[str, ...], what: str) -> tuple[dict[int, dict[str, torch.Tensor]], dict]:
    """({layer: {part: tensor}}, metadata), every layer read now (a :class:`LayerFile`'s
    checks); for small files (projections)."""
    layers = LayerFile(path, parts, what)
    return {layer: layers[layer] for layer in layers}, layers.meta


def check_meta(path, what: str, meta: dict, derived: dict) -> None:
    """Refuse a file whose metadata contradicts (or lacks) what its tensors say."""
    for key, value in derived.items():
        if key not in meta:
            raise DamagedFileError(f"{what} {path}: metadata has no {key!r} (the tensors say {value!r})")
        if meta[key] != value:
            raise DamagedFileError(f"{what} {path}: metadata says {key}={meta[key]!r}, the tensors say {value!r}")


def _sort_metadata(path: Path) -> None:
    """safetensors writes the metadata in hash order, which changes from process to process:
    rewrite the header in place, same length, with the metadata sorted, so that equal contents
    give equal bytes (a rerun reproduces the file exactly)."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        meta = header.pop("__metadata__", None)
        if not meta:
            return
        text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header}, separators=(",", ":"),
                          ensure_ascii=False).encode()
        if len(text) <= size:  # the same JSON, reordered: always, unless escapes were written differently
            f.seek(8)
            f.write(text.ljust(size, b" "))


def save_atomic(tensors, path, metadata) -> None:
    """safetensors into a temp sibling, then rename: a killed job leaves no half-written file."""
    with atomic_file(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        _sort_metadata(tmp)


class Affine(NamedTuple):
    """F(x) = x W^T + b, W (d', d), b (d',) or None; x (..., d).

    Or G layers' maps at once (a lockstep fit, dimattn.dimpo.projections.fit_layers): W (G, d', d),
    b (G, d') on x (G, B, d), layer g's map on its rows x[g]."""

    W: torch.Tensor
    b: torch.Tensor | None = None

    def __call__(self, x):
        y = x @ self.W.mT
        if self.b is None:
            return y
        return y + (self.b if self.W.dim() == 2 else self.b.unsqueeze(-2))

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
    O(L d) per query. ``scale`` None: 1/sqrt(d'). A stack of G maps (:class:`Affine`): query
    (G, B, d), keys (G, B, L, d), logits (G, B, L)."""
    proj = as_affine(projection).to(query.dtype)
    scale = 1.0 / math.sqrt(proj.W.shape[-2]) if scale is None else scale
    return torch.einsum("...d,...ld->...l", proj.query_vector(query), keys) * scale


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
    save_atomic(tensors, path, encode_metadata(meta))


def load_projections(path):
    """({layer: Affine}, meta) as written by :func:`save_projections`. A truncated or corrupt
    file, a layer without W, W of another shape than the other layers' or a bias of another
    length than d', or metadata that contradicts the tensors, is refused naming the file."""
    what = "projections file"
    parts, meta = load_layers(path, ("W", "b"), what)
    first = min(parts)
    for layer, p in parts.items():
        if "W" not in p:
            raise DamagedFileError(f"{what} {path}: layer {layer} has a bias but no W")
        if p["W"].dim() != 2:
            raise DamagedFileError(f"{what} {path}: layer{layer}.W has shape {tuple(p['W'].shape)}, not (d', d)")
        if p["W"].shape != parts[first]["W"].shape:
            raise DamagedFileError(
                f"{what} {path}: layer{layer}.W has shape {tuple(p['W'].shape)}, "
                f"layer{first}.W {tuple(parts[first]['W'].shape)}"
            )
        if ("b" in p) != ("b" in parts[first]):
            raise DamagedFileError(f"{what} {path}: some layers have a bias, others not (layer {layer})")
        if "b" in p and tuple(p["b"].shape) != (p["W"].shape[0],):
            raise DamagedFileError(
                f"{what} {path}: layer{layer}.b has shape {tuple(p['b'].shape)}, W maps to d'={p['W'].shape[0]}"
            )
    d_prime, d = parts[first]["W"].shape
    derived = {"d_prime": d_prime, "head_dim": d, "layers": sorted(parts), "bias": "b" in parts[first]}
    check_meta(path, what, meta, derived)
    projections = {layer: Affine(p["W"], p.get("b")) for layer, p in parts.items()}
    return projections, meta


def check_head_dim(projections, head_dim: int, source) -> None:
    """Refuse projections fitted on heads of another width than ``head_dim``; ``source`` (the
    file) is named in the message."""
    shapes = {layer: tuple(as_affine(p).W.shape) for layer, p in projections.items()}
    wrong = {layer: shape for layer, shape in shapes.items() if shape[-1] != head_dim}
    if wrong:
        got = ", ".join(f"layer {layer}: W {shape}" for layer, shape in sorted(wrong.items()))
        raise ValueError(f"{source}: projections map {head_dim}-dimensional heads as W (d', {head_dim}); got {got}")



__all__ = [
    "Affine",
    "DamagedFileError",
    "LayerFile",
    "as_affine",
    "check_head_dim",
    "load_projections",
    "logit_scale",
    "projected_logits",
    "save_projections",
]
