"""A capture's file (safetensors: ``layer{l}.q`` ...) and which key a query scores on a DAR layer
(:func:`near_mask`): shared by the fits (dimattn.dimpo.projections) and the fidelity."""

from collections.abc import Mapping


from dimattn.model.affine import DamagedFileError, LayerFile, check_meta, encode_metadata
from dimattn.model.affine import save_atomic


CAPTURE_PARTS = ("q", "k", "v", "k_far", "v_far")


def near_mask(query_pos, key_pos, window: int):
    """Whether query position i reads key position j near (full): 0 <= i - j < window (seed
    000, Eq. 3; dimattn.model.attention's convention). Broadcasts."""
    distance = query_pos - key_pos
    return (distance >= 0) & (distance < window)


def save_capture(capture, path, meta: Mapping | None = None) -> None:
    """Safetensors file with tensors ``layer{l}.q|k|v`` (and ``k_far|v_far`` of DAR and uniform
    layers) and JSON-string metadata.

    The metadata always holds head_dim, heads, kv_heads, seq_len, n_sequences and layers (read
    off the tensors), and ``windows`` ({layer: window}) when a layer has far keys; ``meta`` adds
    to it (e.g. ``model``) and may not contradict it.
    """
    first = capture[min(capture)]
    n, heads, seq_len, head_dim = first["q"].shape
    derived = dict(
        head_dim=head_dim,
        heads=heads,
        kv_heads=first["k"].shape[1],
        seq_len=seq_len,
        n_sequences=n,
        layers=sorted(capture),
    )
    windows = {str(layer): int(parts["window"]) for layer, parts in capture.items() if "k_far" in parts}
    if windows:  # a vanilla capture's metadata stays as it was
        derived["windows"] = windows
    meta = dict(meta or {})
    for key, value in derived.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"meta[{key!r}]={meta[key]!r} disagrees with the capture ({value!r})")
    tensors = {
        f"layer{layer}.{name}": t.contiguous() for layer, qkv in capture.items() for name, t in qkv.items()
        if name != "window"
    }
    save_atomic(tensors, path, encode_metadata({**meta, **derived}))


def load_capture(path):
    """(capture, meta) as written by :func:`save_capture`: capture a :class:`~dimattn.model.affine.LayerFile`,
    read a layer at a time (a paper-scale capture does not fit in memory twice over); a layer with
    far keys gets its ``window`` back from the metadata. A truncated or corrupt file, a layer
    missing q, k or v, shapes that disagree (q (N, H, T, d), k and v (N, H_kv, T, .), H a
    multiple of H_kv, every layer alike, k_far and v_far shaped as k and v), or metadata
    contradicting them is refused naming the file, from the header, before any layer is read."""
    what = "capture"
    capture = LayerFile(path, CAPTURE_PARTS, what)
    meta, shapes = capture.meta, capture.shapes
    first = min(shapes)
    for layer, parts in shapes.items():
        missing = [part for part in "qkv" if part not in parts]
        if missing:
            raise DamagedFileError(f"{what} {path}: layer {layer} has no {' or '.join(missing)} tensor")
        q, k, v = parts["q"], parts["k"], parts["v"]
        ok = (
            len(q) == len(k) == len(v) == 4
            and q[0] == k[0] == v[0] and q[2] == k[2] == v[2]  # sequences, positions
            and q[3] == k[3] and k[1] == v[1] and k[1] > 0 and q[1] % k[1] == 0  # head_dim, GQA groups
        )
        if not ok:
            raise DamagedFileError(
                f"{what} {path}: layer {layer} has q {q}, k {k}, v {v}; expected q (N, H, T, d), "
                "k (N, H_kv, T, d) and v (N, H_kv, T, d_v) with H a multiple of H_kv"
            )
        qkv, ref = {part: parts[part] for part in "qkv"}, {part: shapes[first][part] for part in "qkv"}
        if qkv != ref:
            raise DamagedFileError(f"{what} {path}: layer {layer} has shapes {qkv}, layer {first} {ref}")
        far = {part: parts[part] for part in ("k_far", "v_far") if part in parts}
        if far and far != {"k_far": k, "v_far": v}:
            raise DamagedFileError(f"{what} {path}: layer {layer} has {far}; expected k_far {k} and v_far {v}, "
                                   "shaped as k and v")
    n, heads, seq_len, head_dim = shapes[first]["q"]
    derived = dict(head_dim=head_dim, heads=heads, kv_heads=shapes[first]["k"][1], seq_len=seq_len,
                   n_sequences=n, layers=sorted(shapes))
    check_meta(path, what, meta, derived)
    windows = meta.get("windows", {})
    far = sorted(layer for layer, parts in shapes.items() if "k_far" in parts)
    if sorted(int(layer) for layer in windows) != far:
        raise DamagedFileError(f"{what} {path}: metadata gives windows of layers {sorted(map(int, windows))}, "
                               f"the tensors hold far keys of layers {far}")
    for layer in far:
        capture.extra[layer] = {"window": int(windows[str(layer)])}
    return capture, meta
