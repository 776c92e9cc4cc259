"""DimPO stage (seed 003): fit one projection per layer on a capture, measure fidelity.

Read top to bottom:

1. ``dimattn.capture.capture_qkv`` (its own module: it needs transformers, the fits do not)
   runs a frozen causal LM once through a registered attention function that records
   post-RoPE queries, keys and values per layer, then hands over to transformers' SDPA (on
   a DAR or uniform layer, to the layer's own kernels).
2. ``save_capture`` / ``load_capture`` store them as safetensors (``layer{l}.q`` ...).
3. ``FitSettings`` and ``PRESETS``: every choice of a fit as a named field, with the authors'
   value and ours; ``resolve_settings`` merges preset, objective defaults and config hparams.
4. ``build_instances`` / ``build_pairs``: training instances, one (sequence, head, query
   position) each with its key list, and for pairwise objectives the chosen/rejected pairs.
5. ``fit_layer`` / ``fit_projections``: one affine map F(x) = W x + b per layer (``Affine``),
   shared by queries and keys (Siamese) and by all heads; values are never projected.
6. ``attention_fidelity``: the paper's proxy metrics (Appendix D, the authors'
   attn_similarity.py): KL(psi || pi) and the MSE between psi V and pi V.
7. ``fit_to_file``, ``fidelity_to_file`` (and ``dimattn.capture.capture_to_file``): the same
   steps file to file, one per workflow rule (rules/dimpo.smk).

Shapes: a layer capture holds q (N, H, T, d), k and v (N, H_kv, T, d); query head h reads
key/value head h // (H / H_kv), as transformers' ``repeat_kv`` lays them out.

A DAR or uniform layer of our models (seed 000) also holds k_far and v_far, the keys and values
of the bottlenecked states, and its ``window``: query i scores key j with k_j when
0 <= i - j < window (:func:`near_mask`) and with k_far_j otherwise, future keys of non-causal
lists included; values likewise. Every gather of a key list (instances, pairs, PCA data,
fidelity) follows that rule, so the objectives fit F on the keys the layer really scores.
"""

import csv
import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .affine import Affine, DamagedFileError, LayerFile, as_affine, check_head_dim, check_meta, encode_metadata
from .affine import load_projections, logit_scale, projected_logits, save_atomic, save_projections
from .atomic import atomic_file
from .formats import FIDELITY_COLUMNS
from .objectives import get_objective, pca_projection, select_pairs
from .resources import fit_group
from .settings import from_mapping, key_list_length, resolve_top_k

CAPTURE_PARTS = ("q", "k", "v", "k_far", "v_far")


def near_mask(query_pos, key_pos, window: int):
    """Whether query position i reads key position j near (full): 0 <= i - j < window (seed
    000, Eq. 3; dimattn.attention's convention). Broadcasts."""
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
    """(capture, meta) as written by :func:`save_capture`: capture a :class:`~dimattn.affine.LayerFile`,
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
        )  # fmt: skip
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
                                   "shaped as k and v")  # fmt: skip
    n, heads, seq_len, head_dim = shapes[first]["q"]
    derived = dict(head_dim=head_dim, heads=heads, kv_heads=shapes[first]["k"][1], seq_len=seq_len,
                   n_sequences=n, layers=sorted(shapes))  # fmt: skip
    check_meta(path, what, meta, derived)
    windows = meta.get("windows", {})
    far = sorted(layer for layer, parts in shapes.items() if "k_far" in parts)
    if sorted(int(layer) for layer in windows) != far:
        raise DamagedFileError(f"{what} {path}: metadata gives windows of layers {sorted(map(int, windows))}, "
                               f"the tensors hold far keys of layers {far}")  # fmt: skip
    for layer in far:
        capture.extra[layer] = {"window": int(windows[str(layer)])}
    return capture, meta


# ---- settings --------------------------------------------------------------------------------

_CHOICES = {
    "preset": ("authors", "ours"),
    "capture_dtype": ("float32", "bfloat16"),
    "pair_mode": ("extreme", "all", "halves", "distance"),
    "delta": ("lambda", "difference"),
    "normalise": ("pairs", "delta"),
    "init": ("default", "pca"),
    "pca_fit": ("all", "last"),
    "train_scale": ("d_prime", "d"),
    "inference_scale": ("d_prime", "d"),
}


@dataclass
class FitSettings:
    """Every choice of one DimPO-stage fit. Defaults: the ``ours`` preset with DimPO's values.

    Sources for "authors": github.com/lanzv/dimpo (run_projection_experiment.py, src/models/
    lowdim_modules.py, dimpo_loss.py, dimpo_kl.py, lowdim_trainer.py, lowdim_dataset.py,
    attn_similarity.py). Values marked *per objective* come from ``Objective.defaults``
    (dimattn.objectives), the same in both presets.
    """

    preset: str = "ours"
    """Name of the preset these settings started from: "authors" or "ours"."""

    # -- capture (read by capture_to_file) --
    capture_dtype: str = "float32"
    """dtype the frozen model runs in for the capture. Authors: float32 (from_pretrained
    without a dtype). Ours: float32 (we used bfloat16 on GPUs before)."""
    special_tokens: bool = False
    """Tokenise with special tokens (BOS). Authors: False (encode(add_special_tokens=False)). Ours: False."""

    # -- training instances --
    causal: bool = False
    """Key lists, psi and the fidelity metrics causal (keys <= the query position) or not.
    Authors: False, every instance sees all 4,096 keys of its chapter, future ones included, in
    training and in Table 1. Ours: False (faithful; the projection is still used causally)."""
    query_stride: int | None = None
    """Query positions 0, s, 2s, ... of every head and sequence; None: s = number of query heads
    H. Authors: H (queries[:, :, ::H]: 32 x 128 x 10 = 40,960 instances a layer on
    Llama-3.1-8B). Ours: H."""
    n_instances: int | None = None
    """Keep a uniform random subset of this many strided instances (None: all). Authors: None.
    Ours: None (CPU configs set it)."""
    num_sampled_keys: int | None = None
    """Appendix B: each (sequence, key/value head) keeps this many random keys, psi renormalised
    over them (the listwise term's and the pairwise objectives' "all key pairs" runs). Needs
    causal False. Authors: None in the main tables. Ours: None."""
    pair_mode: str = "extreme"
    """Pairs of pairwise objectives (dimattn.objectives.select_pairs): extreme | all | halves |
    distance. Authors: extreme (argmax / argmin of raw q.k). Ours: extreme."""
    num_pairs: int = 1
    """Pairs a query in pair_mode "halves". Authors: 1..64 in Appendix B. Ours: 1."""
    pair_distance: int = 1
    """Rank distance in pair_mode "distance". Authors: 1..127 in Appendix B. Ours: 1."""

    # -- losses (per objective: see Objective.defaults) --
    beta: float = 1.0
    """DimPO s_i = beta log p_i; SimPO and CPO beta. Authors: 1. Ours: 1."""
    gamma: float = 1e-4
    """Margin. Authors (per objective): DimPO 1e-4, SimPO 1.0. Ours: the same."""
    k: int = 64
    """Top-k keys of DimPO's head term, where k_share is None. Authors: 64 of their 4,096-key
    lists (dimpo), 0 (dimpo_list, dimpo_kl). Ours: the same, DimPO's given as k_share."""
    k_share: float | None = None
    """DimPO's k as a share of the key list, resolved per capture (dimattn.settings.resolve_top_k:
    rounded half up, at least 1); None: k as given. A layer of hparams that sets k alone clears
    an earlier share. Authors: 64 / 4,096 = 1/64 (per objective, dimpo). Ours: 1/64, so that a
    shorter capture keeps the paper's share rather than every key (k >= the list: DimPO = KL)."""
    lam: float = 1.0
    """Authors (per objective): DimPO's head weight 1, ORPO's and CPO's lambda 0.1. Ours: the same."""
    kl_weight: float = 1.0
    """Weight of KL in dimpo_kl. Authors: 1. Ours: 1."""
    margin: float = 0.1
    """Triplet margin. Authors: 0.1. Ours: 0.1."""
    delta: str = "lambda"
    """Delta_ij of L_list: "lambda" (LiPO's |G_i - G_j| |1/D(tau_i) - 1/D(tau_j)|) or
    "difference" (psi_i - psi_j). Authors: lambda. Ours: lambda (we had difference before)."""
    normalise: str = "pairs"
    """L_list's per-instance divisor: "pairs" (the number of pairs psi_i > psi_j) or "delta"
    (their sum of Delta). Authors: pairs, which makes L_list ~1e-6 of the head term at 4,096
    keys (Adam still trains it alone). Ours: pairs (we had delta before)."""
    max_preferred: int | None = None
    """Keep only pairs whose preferred key is among the top-m by psi. Authors: None (every
    pair). Ours: None (CPU configs may set it)."""

    # -- the projection --
    bias: bool = True
    """F(x) = W x + b (nn.Linear) or W x. Authors: True. Ours: True (we had no bias before)."""
    init: str = "default"
    """Start of trained objectives: "default" (nn.Linear's U(-1/sqrt(d), 1/sqrt(d)) for W and
    b) or "pca" (the pca objective's solution). Authors: default. Ours: default (we had pca)."""
    pca_center: bool = True
    """PCA centred (sklearn: x -> V (x - mu), so b = -V mu) or on the raw second moment.
    Authors: True. Ours: True."""
    pca_fit: str = "all"
    """Data of the PCA fit: queries of all heads at the strided positions pooled with all keys,
    of "all" sequences or only the "last". Authors: last (a quirk: PCA is refitted after every
    chapter on that chapter's vectors only, so the final one has seen one chapter). Ours: all,
    since discarding 9 of 10 chapters is a defect, not a choice."""
    train_scale: str = "d_prime"
    """Logit scale in training: "d_prime" (1/sqrt(d')) or "d" (1/sqrt(d)). Authors: d_prime.
    Ours: d_prime. Table 1's metric code also scores with 1/sqrt(d')."""
    inference_scale: str = "d_prime"
    """Logit scale when the projection replaces attention in the model. Authors: d (their
    attention wrapper keeps the model's 1/sqrt(d) on the projected q, k: logits sqrt(d / d')
    too small relative to training, a mismatch). Ours: d_prime, the scale it was trained for.
    fidelity_to_file(scale="inference") scores at this scale."""

    # -- optimiser (Adam, no schedule) --
    lr: float = 1e-4
    """Adam learning rate. Authors (per objective): 1e-4 dimpo, dimpo_kl, kl, cpo, triplet; 1e-3
    simpo, orpo. Ours: the same."""
    batch_size: int = 1
    """Instances (list objectives) or pairs a step. Authors: 1 list objectives, 32 pairwise.
    Ours: the same."""
    epochs: int = 1
    """Passes over the instances or pairs. Authors: 1. Ours: 1."""
    steps: int | None = None
    """Exact number of steps (cycling epochs), overriding epochs. Authors: None. Ours: None."""
    weight_decay: float = 0.0
    """Adam weight decay. Authors: 0. Ours: 0."""
    shuffle: bool = True
    """Shuffle instances every epoch. Authors: False (chapter by chapter, head by head, position
    by position; the last updates all come from one chapter's last head). Ours: True."""

    # -- fidelity metric --
    mse_head_chunk: int = 0
    """0: attention-output MSE over all query heads. c > 0: only the last chunk of c heads, as
    the authors' latest attn eval does (its loop over chunks of 4 heads keeps only the last
    chunk for the MSE; the KL uses all heads). Authors: 4. Ours: 0."""

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        for name in ("query_stride", "n_instances", "num_sampled_keys", "max_preferred", "steps"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"{name}={value!r} must be >= 1 or None")
        if self.k_share is not None and not 0 < self.k_share < 1:
            raise ValueError(f"k_share={self.k_share!r} must lie in (0, 1) or be None")
        if self.num_sampled_keys is not None and self.causal:
            raise ValueError("num_sampled_keys needs causal=False (Appendix B lists are non-causal)")


_COMMON = dict(
    capture_dtype="float32", special_tokens=False, causal=False, query_stride=None, n_instances=None,
    num_sampled_keys=None, pair_mode="extreme", num_pairs=1, pair_distance=1, delta="lambda",
    normalise="pairs", max_preferred=None, bias=True, init="default", pca_center=True,
    train_scale="d_prime", epochs=1, steps=None, weight_decay=0.0,
)  # fmt: skip

PRESETS: dict[str, dict] = {
    "authors": {**_COMMON, "preset": "authors", "pca_fit": "last", "inference_scale": "d", "shuffle": False,
                "mse_head_chunk": 4},
    "ours": {**_COMMON, "preset": "ours", "pca_fit": "all", "inference_scale": "d_prime", "shuffle": True,
             "mse_head_chunk": 0},
}  # fmt: skip


def resolve_settings(objective: str | None = None, hparams=None) -> FitSettings:
    """Settings of one fit: preset < the objective's defaults < ``hparams`` <
    hparams["per_objective"][objective] < hparams["setting"].

    ``hparams`` may name ``preset`` (default "ours"), ``per_objective`` ({objective: {field:
    value}}), ``setting`` (a dimpo.ablations setting: fields, and a ``preset`` that replaces the
    base preset) and ``seed`` (ignored here); every other key must be a FitSettings field.
    """
    if isinstance(hparams, FitSettings):
        return hparams
    hp = dict(hparams or {})
    hp.pop("seed", None)
    per = dict(hp.pop("per_objective", None) or {})
    setting = dict(hp.pop("setting", None) or {})
    preset = setting.pop("preset", hp.pop("preset", "ours"))
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    for name in per:
        get_objective(name)
    values = dict(PRESETS[preset])
    layers = [dict(get_objective(objective).defaults) if objective is not None else {}, hp,
              (per.get(objective) or {}) if objective is not None else {}, setting]  # fmt: skip
    for layer in layers:
        if "k" in layer and "k_share" not in layer:  # a k given later wins over an earlier share
            values["k_share"] = None
        values.update(layer)
    return from_mapping(FitSettings, values, "fit settings")


def with_top_k(settings: FitSettings, n_keys: int, what: str = "the capture") -> FitSettings:
    """``settings`` with DimPO's k resolved on lists of ``n_keys`` (k_share kept beside it). A
    head term that keeps every key (k >= n_keys, lambda != 0) makes DimPO KL plus a constant
    and is refused, naming k or k_share (planning refuses a config's first: dimattn.sweeps)."""
    k = resolve_top_k(settings.k, settings.k_share, n_keys)
    if k >= n_keys and k > 0 and settings.lam != 0:
        given = f"k_share={settings.k_share} (k={k})" if settings.k_share is not None else f"k={k}"
        raise ValueError(f"{given} reaches the {n_keys} keys of {what}'s lists: DimPO's head term would keep "
                         "every key, which is KL plus a constant; choose k < the keys or a smaller k_share")
    return replace(settings, k=k)


# ---- projections ------------------------------------------------------------------------------


GATHER_ELEMENTS = 1 << 24


def _masked_softmax(logits, mask):
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


@dataclass
class Instances:
    """Training instances of one layer, (seq, head, pos) triples; keys are gathered per batch.

    Materialising every key list would take n x T x d floats (paper scale: 40,960 x 4,096 x
    128), so :meth:`batch` gathers them, and psi, for the instances asked for.
    """

    seq: torch.Tensor  # (n,) sequence index
    head: torch.Tensor  # (n,) query head
    pos: torch.Tensor  # (n,) query position
    query: torch.Tensor  # (n, d)
    keys_source: torch.Tensor  # (N, H_kv, T, d), the layer's captured keys (not copied)
    groups: int  # query heads per key/value head
    causal: bool = False
    key_subset: torch.Tensor | None = None  # (N, H_kv, n_keys) sampled key positions
    far_keys_source: torch.Tensor | None = None  # (N, H_kv, T, d), a DAR / uniform layer's far keys
    window: int = 0  # keys beyond it are far (near_mask)

    def __len__(self):
        return len(self.seq)

    @property
    def n_keys(self) -> int:
        """Keys of the longest list (a causal list ends at its query)."""
        return self.keys_source.shape[2] if self.key_subset is None else self.key_subset.shape[-1]

    def key_vectors(self, inst, positions):
        """(P, d) keys that instances ``inst`` (P,) score at key ``positions`` (P,): near, or
        far beyond the window (near_mask) on a layer with far keys."""
        seq, kv_head = self.seq[inst], self.head[inst] // self.groups
        keys = self.keys_source[seq, kv_head, positions]
        if self.far_keys_source is None:
            return keys
        near = near_mask(self.pos[inst], positions, self.window)
        return torch.where(near[:, None], keys, self.far_keys_source[seq, kv_head, positions])

    def list_length(self, index) -> int:
        """L of :meth:`batch`: the key list, which a causal batch ends at its last query."""
        if self.key_subset is not None or not self.causal:
            return self.n_keys
        return int(self.pos[torch.as_tensor(index).to(self.pos.device)].max()) + 1

    def batch(self, index=None, length: int | None = None):
        """dict of query (B, d), keys (B, L, d), positions (B, L) of the keys in the sequence,
        mask (B, L), scores (B, L) = q.k / sqrt(d) and psi (B, L) = their masked softmax.
        ``length``: a causal list's L, at least :meth:`list_length` (the keys past a query are
        masked)."""
        device = self.keys_source.device
        index = torch.arange(len(self)) if index is None else torch.as_tensor(index)
        index = index.to(device)
        seq, kv_head, pos = self.seq[index], self.head[index] // self.groups, self.pos[index]
        if self.key_subset is not None:
            positions = self.key_subset[seq, kv_head]  # (B, n_keys)
            where = (seq[:, None], kv_head[:, None], positions)
        else:
            length = length or self.list_length(index)
            positions = torch.arange(length, device=device).expand(len(index), length)
            where = (seq, kv_head, slice(None, length))
        keys = self.keys_source[where]
        if self.far_keys_source is not None:
            near = near_mask(pos[:, None], positions, self.window)
            keys = torch.where(near[..., None], keys, self.far_keys_source[where])
        mask = positions <= pos[:, None] if self.causal else torch.ones_like(positions, dtype=torch.bool)
        query = self.query[index]
        scores = torch.einsum("bd,bld->bl", query, keys) / math.sqrt(query.shape[-1])
        psi = _masked_softmax(scores, mask)
        return {"query": query, "keys": keys, "positions": positions, "mask": mask, "scores": scores, "psi": psi}


def build_instances(layer_capture, settings: FitSettings, generator: torch.Generator) -> Instances:
    """Every ``query_stride``-th position (from 0) of every head and sequence, in (sequence,
    head, position) order; optionally a random subset of ``n_instances`` (order kept) and
    ``num_sampled_keys`` random keys per (sequence, key/value head)."""
    q, k = layer_capture["q"], layer_capture["k"]
    n, heads, seq_len, _ = q.shape
    stride = settings.query_stride or heads
    grid = torch.arange(0, seq_len, stride)
    seq, head, pos = (t.reshape(-1) for t in torch.meshgrid(torch.arange(n), torch.arange(heads), grid, indexing="ij"))
    if settings.n_instances is not None and settings.n_instances < len(seq):
        keep = torch.randperm(len(seq), generator=generator)[: settings.n_instances].sort().values
        seq, head, pos = seq[keep], head[keep], pos[keep]
    subset = None
    if settings.num_sampled_keys is not None:
        n_keys = min(settings.num_sampled_keys, seq_len)
        subset = torch.rand(n, k.shape[1], seq_len, generator=generator).argsort(-1)[..., :n_keys].to(q.device)
    seq, head, pos = seq.to(q.device), head.to(q.device), pos.to(q.device)
    return Instances(seq, head, pos, q[seq, head, pos], k, heads // k.shape[1], settings.causal, subset,
                     layer_capture.get("k_far"), layer_capture.get("window", 0))  # fmt: skip


@dataclass
class Pairs:
    """Chosen/rejected keys of pairwise objectives: instance index and key positions, (P,) each."""

    inst: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor

    def __len__(self):
        return len(self.inst)

    def vectors(self, instances: Instances, index):
        """(query, chosen key, rejected key), (B, d) each, for pairs ``index``."""
        index = torch.as_tensor(index).to(self.inst.device)
        inst = self.inst[index]
        chosen, rejected = (instances.key_vectors(inst, keys[index]) for keys in (self.chosen, self.rejected))
        return instances.query[inst], chosen, rejected


def build_pairs(instances: Instances, settings: FitSettings, generator: torch.Generator) -> Pairs:
    """Pairs of every instance by ``settings.pair_mode`` (dimattn.objectives.select_pairs), in
    instance order; the key lists are gathered a bounded number of instances at a time."""
    _, _, length, d = instances.keys_source.shape
    chunk = max(1, GATHER_ELEMENTS // (length * d))
    parts = []
    for index in torch.arange(len(instances)).split(chunk):
        b = instances.batch(index)
        rows, chosen, rejected = select_pairs(
            b["scores"], b["mask"], settings.pair_mode, generator=generator,
            num_pairs=settings.num_pairs, distance=settings.pair_distance,
        )  # fmt: skip
        positions = b["positions"]
        parts.append((index.to(rows.device)[rows], positions[rows, chosen], positions[rows, rejected]))
    return Pairs(*(torch.cat(column) for column in zip(*parts)))


# ---- fitting ----------------------------------------------------------------------------------


def pca_data(layer_capture, settings: FitSettings):
    """(queries, keys) of a PCA fit: the queries of all heads at the strided positions and all
    keys, of all sequences or only the last (``settings.pca_fit``). A layer with far keys pools
    the keys it scores: near and far ones alike, far ones only on a uniform layer (window 0)."""
    q, k = layer_capture["q"], layer_capture["k"]
    if "k_far" in layer_capture:
        far = layer_capture["k_far"]
        k = torch.cat([k, far], dim=2) if layer_capture["window"] > 0 else far
    if settings.pca_fit == "last":
        q, k = q[-1:], k[-1:]
    return q[:, :, :: settings.query_stride or q.shape[1]], k


def initial_projection(layer_capture, d_prime: int, settings: FitSettings, generator) -> Affine:
    """Start of a trained objective (``settings.init``, ``settings.bias``), float32 on the capture's device."""
    device, d = layer_capture["q"].device, layer_capture["q"].shape[-1]
    if settings.init == "pca":
        W, b = pca_projection(*pca_data(layer_capture, settings), d_prime, settings.pca_center)
        if settings.bias and b is None:
            b = torch.zeros(d_prime, dtype=W.dtype, device=W.device)
        return Affine(W.float(), b.float() if settings.bias else None)
    bound = 1.0 / math.sqrt(d)  # nn.Linear: kaiming_uniform(a=sqrt(5)) and its bias rule
    W = (torch.rand(d_prime, d, generator=generator) * 2 - 1) * bound
    b = (torch.rand(d_prime, generator=generator) * 2 - 1) * bound if settings.bias else None
    return Affine(W, b).to(device)


def _layer_losses(obj, settings, proj, instances, pairs, index, scale):
    """(G,) each layer's loss on its batch: ``proj`` a stack of G maps (:class:`Affine`, W (G,
    d', d)), ``instances``, ``pairs`` (or None) and ``index`` one a layer. The G batches go
    through the objective as one (G B rows, reduce=False), then each layer's rows are averaged:
    the loss a fit of that layer alone takes."""
    if obj.kind == "list":
        # A causal list ends at its batch's last query: every layer's batch gathered as long as the longest.
        length = max(i.list_length(x) for i, x in zip(instances, index))
        parts = [i.batch(x, length) for i, x in zip(instances, index)]
        query, keys, psi, mask = (torch.stack([b[name] for b in parts]) for name in ("query", "keys", "psi", "mask"))
        logits = projected_logits(proj, query, keys, scale)
        rows = obj(logits.flatten(0, 1), psi.flatten(0, 1), mask.flatten(0, 1), hparams=settings, reduce=False)
    else:
        vectors = [p.vectors(i, x) for p, i, x in zip(pairs, instances, index)]
        q, k_w, k_l = (proj(torch.stack(v)) for v in zip(*vectors))  # (G, B, d') each
        if obj.kind == "triplet":
            rows = obj(q.flatten(0, 1), k_w.flatten(0, 1), k_l.flatten(0, 1), hparams=settings, reduce=False)
        else:
            s_w, s_l = ((q * k).sum(-1).flatten() * scale for k in (k_w, k_l))
            rows = obj(s_w, s_l, hparams=settings, reduce=False)
    return rows.view(len(index), -1).mean(1)


def objective_loss(instances: Instances, objective: str, projection, hparams=None, batch_size: int = 512) -> float:
    """Mean of a list objective's loss over all ``instances`` at ``projection`` (no grad)."""
    obj, st = get_objective(objective), resolve_settings(objective, hparams)
    if "k" in obj.hparams:
        st = with_top_k(st, instances.n_keys)
    proj = as_affine(projection).to(device=instances.query.device, dtype=instances.query.dtype)
    stacked = Affine(proj.W[None], None if proj.b is None else proj.b[None])
    scale = logit_scale(st.train_scale, proj.W.shape[1], proj.W.shape[0])
    total = 0.0
    with torch.no_grad():
        for index in torch.arange(len(instances)).split(batch_size):
            total += float(_layer_losses(obj, st, stacked, [instances], None, [index], scale)) * len(index)
    return total / len(instances)


HISTORY_POINTS = 500  # at most about this many (step, mean loss) points are kept per layer


def fit_layer(layer_capture, objective: str, d_prime: int, hparams=None, seed: int = 0, *, progress=True,
              device=None):  # fmt: skip
    """Fit F for one layer. Returns (Affine on the CPU, history).

    history: [(step, mean minibatch loss since the previous point)], empty for closed-form
    objectives. All draws (instances, pairs, init, order) come from one CPU generator seeded
    with ``seed``, so a fit is deterministic on a given device. A step whose loss is not finite
    is skipped, as the authors do. ``device``: where to fit (default: where the capture is).
    """
    return fit_layers({0: layer_capture}, objective, d_prime, hparams, {0: seed}, progress=progress, device=device)[0]


def fit_layers(layer_captures: Mapping, objective: str, d_prime: int, hparams=None, seeds: Mapping | None = None, *,
               progress=True, device=None) -> dict:  # fmt: skip
    """:func:`fit_layer` of each of several layers ({layer: capture}, each with its seed, 0 by
    default), stepped in lockstep: {layer: (Affine, history)}, each as that layer's fit alone.

    Each layer keeps its own generator (its draws, in fit_layer's order), projection, Adam
    state and skipped steps; a step gathers every layer's batch, computes their losses in one
    pass (:func:`_layer_losses`) and takes one backward and one optimizer step for all, which
    at batch 1 costs about what one layer's step did. Layers' gradients never mix (each loss
    reads its own map only), so the results equal separate fits up to float summation order.
    """
    obj, st = get_objective(objective), resolve_settings(objective, hparams)
    layers = list(layer_captures)
    captures = [layer_captures[layer] for layer in layers]
    if "k" in obj.hparams:
        st = with_top_k(st, key_list_length(captures[0]["q"].shape[2], st.num_sampled_keys))
    if device is not None:
        captures = [{name: t.to(device) if torch.is_tensor(t) else t for name, t in c.items()} for c in captures]
    generators = [torch.Generator().manual_seed((seeds or {}).get(layer, 0)) for layer in layers]
    if not obj.trained:
        out = {}
        for layer, capture, generator in zip(layers, captures, generators):
            queries, keys = pca_data(capture, st)
            W, b = obj.fit(queries, keys, d_prime, generator=generator, center=st.pca_center)
            out[layer] = (Affine(W.cpu(), None if b is None else b.cpu()), [])
        return out
    if obj.kind == "list" and st.pair_mode not in ("extreme", "all"):
        # A list objective compares every pair of its list: pair_mode "all" says so (Figure 4 (a)
        # runs it beside the pairwise objectives), "extreme" is the default; "halves" and
        # "distance" pick pairs, which a list objective has no use for.
        raise ValueError(
            f"{objective} uses every pair of its key list; Appendix B's 'all key pairs' for the listwise "
            "term is num_sampled_keys, the pair modes halves and distance apply to pairwise objectives only"
        )
    instances = [build_instances(c, st, g) for c, g in zip(captures, generators)]
    pairs = None if obj.kind == "list" else [build_pairs(i, st, g) for i, g in zip(instances, generators)]
    counts = {len(x) for x in (instances if pairs is None else pairs)}
    if len(counts) > 1:  # equal-shaped layers give equal counts; a lockstep fit needs them
        raise ValueError(f"layers {layers} have {sorted(counts)} training items: lockstep needs them equal")
    (items,) = counts
    starts = [initial_projection(c, d_prime, st, g) for c, g in zip(captures, generators)]
    weights = [torch.nn.Parameter(start.W.clone()) for start in starts]
    biases = [torch.nn.Parameter(start.b.clone()) for start in starts] if starts[0].b is not None else []
    # Adam is elementwise: one optimizer over every layer's parameters is each layer's own Adam.
    optimizer = torch.optim.Adam([*weights, *biases], lr=st.lr, weight_decay=st.weight_decay)
    total = st.steps or st.epochs * math.ceil(items / st.batch_size)
    scale = logit_scale(st.train_scale, captures[0]["q"].shape[-1], d_prime)
    every = max(1, total // HISTORY_POINTS)
    histories = {layer: [] for layer in layers}
    orders = [torch.empty(0, dtype=torch.long) for _ in layers]
    running, count = torch.zeros(len(layers), device=weights[0].device), torch.zeros(len(layers), dtype=torch.long)
    desc = f"{objective} d'={d_prime}" + (f" layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else "")
    for step in tqdm(range(total), desc=desc, disable=not progress, leave=False):
        index = []
        for g, generator in enumerate(generators):
            if len(orders[g]) == 0:  # new epoch
                orders[g] = torch.randperm(items, generator=generator) if st.shuffle else torch.arange(items)
            index.append(orders[g][: st.batch_size])
            orders[g] = orders[g][st.batch_size :]
        proj = Affine(torch.stack(weights), torch.stack(biases) if biases else None)
        losses = _layer_losses(obj, st, proj, instances, pairs, index, scale)
        finite = torch.isfinite(losses).cpu()
        if bool(finite.any()):
            optimizer.zero_grad()
            losses[finite.to(losses.device)].sum().backward()
            for g in torch.nonzero(~finite).flatten().tolist():  # that layer skips the step, as alone
                weights[g].grad = None
                if biases:
                    biases[g].grad = None
            optimizer.step()
            live = finite.to(losses.device)
            running = running + torch.where(live, losses.detach(), 0.0)
            count += finite
        if (step + 1) % every == 0 or step + 1 == total:
            for g, layer in enumerate(layers):
                histories[layer].append((step, float(running[g] / count[g]) if count[g] else float("nan")))
            running, count = torch.zeros_like(running), torch.zeros_like(count)
    return {
        layer: (Affine(weights[g].detach().cpu().clone(), biases[g].detach().cpu().clone() if biases else None),
                histories[layer])
        for g, layer in enumerate(layers)
    }  # fmt: skip


def lockstep_group(layer_capture, layers: int) -> int:
    """Layers of a capture of ``layers`` layers shaped as ``layer_capture`` that a fit steps
    together (dimattn.resources.fit_group on the layer's tensor bytes)."""
    return fit_group(sum(t.numel() * t.element_size() for t in layer_capture.values() if torch.is_tensor(t)), layers)


def fit_projections(capture, objective: str, d_prime: int, hparams=None, seed: int = 0, *, progress=True,
                    return_history=False, device=None):  # fmt: skip
    """{layer: Affine} for every captured layer, each fitted with seed ``seed + layer`` as if
    alone; the layers go in lockstep groups (:func:`fit_layers`) of as many as fit in
    dimattn.resources.FIT_LOCKSTEP_BYTES, read a group at a time from a LayerFile.

    With ``return_history`` returns (projections, {layer: history}).
    """
    settings = resolve_settings(objective, hparams)
    layers = sorted(capture)
    first = capture[layers[0]]  # every layer is shaped alike (load_capture)
    group = lockstep_group(first, len(layers))
    out, histories = {}, {}
    for g0 in tqdm(range(0, len(layers), group), desc=f"layers ({objective})", disable=not progress):
        chunk = layers[g0 : g0 + group]
        group_captures = {layer: first if layer == layers[0] else capture[layer] for layer in chunk}
        first = None  # held by the first group only: a group's layers are all a job keeps
        fits = fit_layers(group_captures, objective, d_prime, settings, {layer: seed + layer for layer in chunk},
                          progress=progress, device=device)  # fmt: skip
        del group_captures
        for layer, (projection, history) in fits.items():
            out[layer], histories[layer] = projection, history
    return (out, histories) if return_history else out


# ---- fidelity (Table 1) -----------------------------------------------------------------------

KL_EPS = 1e-9  # the authors' log(pi + 1e-9)
# The top-k fidelity's k: DimPO's k of seed 003 (64) over the paper's key list (4,096), for every
# objective alike, so that the head DimPO fits is measured beside the distribution KL fits.
FIDELITY_TOP_K_SHARE = 1 / 64


@torch.no_grad()
def attention_fidelity(capture, projections, *, causal: bool = False, scale: str = "d_prime",
                       mse_head_chunk: int = 0, chunk_size: int = 256, device=None, top_k: int = 0
                       ) -> list[dict]:  # fmt: skip
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
                                          device, top_k)  # fmt: skip
        rows.append({"layer": layer, "kl": kl, "mse": mse} | ({"topk_recall": recall} if top_k else {}))
    return rows


def _layer_fidelity(parts, projection, causal, scale, mse_head_chunk, chunk_size, device, top_k=0
                    ) -> tuple[float, float, float]:  # fmt: skip
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
                future = torch.arange(width, device=q.device)[None, :] > torch.arange(start, stop, device=q.device)[:, None]
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


# ---- file-level steps, one per workflow rule (workflow_scripts/*.py call these) -------------


def fit_to_file(capture_path, objective: str, d_prime: int, hparams, out_path, device: str = "cpu") -> None:
    """Fit one projection per captured layer and save it with its settings in the metadata.

    ``hparams``: FitSettings fields plus ``preset``, ``per_objective`` and ``seed``.
    """
    hparams = dict(hparams or {})
    seed = int(hparams.pop("seed", 0))
    settings = resolve_settings(objective, hparams)
    capture, capture_meta = load_capture(capture_path)
    if "k" in get_objective(objective).hparams:  # the metadata records the k each layer was fitted with
        n_keys = key_list_length(capture_meta["seq_len"], settings.num_sampled_keys)
        settings = with_top_k(settings, n_keys, str(capture_path))
    projections, histories = fit_projections(
        capture, objective, d_prime, settings, seed, return_history=True, device=device
    )
    meta = {
        "model": capture_meta.get("model"),
        "objective": objective,
        "seed": seed,
        "preset": settings.preset,
        "settings": asdict(settings),
        "history": {str(layer): h for layer, h in histories.items()},
    }
    save_projections(projections, out_path, meta)


def fidelity_to_file(capture_path, projections_path, out_csv, model_name: str, objective: str, d_prime: int,
                     setting: str = "default", device: str | None = None) -> list[dict]:  # fmt: skip
    """Per-layer attention fidelity on the evaluation capture, as a CSV with
    dimattn.formats.FIDELITY_COLUMNS.

    kl, mse: at the projection's train_scale (Table 1); kl_inference, mse_inference: at its
    inference_scale, what the model sees once the projection replaces attention (equal to kl,
    mse when the two scales agree); topk_recall: the share of each query's top_k keys the
    projection keeps, top_k the paper's 64 of 4,096 (FIDELITY_TOP_K_SHARE) of the capture's keys,
    the same for every objective. causal and mse_head_chunk come from the fit's settings;
    ``setting`` names them (dimattn.sweeps.setting_name).
    """
    capture, meta = load_capture(capture_path)
    projections, pmeta = load_projections(projections_path)
    check_head_dim(projections, meta["head_dim"], projections_path)
    settings = resolve_settings(None, pmeta.get("settings"))

    top_k = resolve_top_k(0, FIDELITY_TOP_K_SHARE, meta["seq_len"])

    def score(scale, top_k=0):
        return attention_fidelity(capture, projections, causal=settings.causal, scale=scale,
                                  mse_head_chunk=settings.mse_head_chunk, device=device, top_k=top_k)  # fmt: skip

    train = score(settings.train_scale, top_k)  # a logit scale does not reorder keys: top-k once
    inference = train if settings.inference_scale == settings.train_scale else score(settings.inference_scale)
    fit = {"model": model_name, "objective": objective, "setting": setting, "d_prime": d_prime,
           "head_dim": meta["head_dim"], "seed": int(pmeta.get("seed", 0))}  # fmt: skip
    rows = [
        fit | {"layer": t["layer"], "kl": t["kl"], "mse": t["mse"], "kl_inference": i["kl"], "mse_inference": i["mse"],
               "top_k": top_k, "topk_recall": t["topk_recall"]}
        for t, i in zip(train, inference, strict=True)
    ]
    with atomic_file(Path(out_csv)) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIDELITY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _file_identity(path: Path) -> list:
    stat = Path(path).stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def fit_seeds_to_files(fit_capture, eval_capture, objective: str, d_prime: int, hparams, seeds, projections_out,
                       fidelity_out, partial_dir, model_name: str, setting: str = "default",
                       device: str = "cpu") -> None:  # fmt: skip
    """One fit_projection job: :func:`fit_to_file` and :func:`fidelity_to_file` for each fit seed
    of ``seeds`` (dimpo.seeds) in turn, into ``projections_out[i]`` and ``fidelity_out[i]``.

    One process for every seed: a job's start (torch's import, the captures' first read) cost as
    much as a small fit, and cpu-full fitted each seed in a job of its own (792 jobs; 268 now).
    Each finished seed is kept in ``partial_dir`` (not a Snakemake output: a failed job's outputs
    are deleted, that folder is not) beside a record of what made it, the hparams and the
    captures' size and mtime; a retry copies the seeds whose record matches and fits the rest.
    The folder goes once every output is written."""
    partial_dir = Path(partial_dir)
    if not len(seeds) == len(projections_out) == len(fidelity_out):
        raise ValueError(f"{len(seeds)} seeds for {len(projections_out)} projection and {len(fidelity_out)} "
                         f"fidelity outputs")  # fmt: skip
    spec = {"objective": objective, "d_prime": int(d_prime), "hparams": dict(hparams or {}), "setting": setting,
            "fit_capture": _file_identity(fit_capture), "eval_capture": _file_identity(eval_capture)}
    for seed, projections, fidelity in zip(seeds, projections_out, fidelity_out):
        kept = partial_dir / f"s{seed}"
        record = kept / "spec.json"
        wanted = json.loads(json.dumps(spec | {"seed": int(seed)}))  # as it reads back
        if not (record.is_file() and json.loads(record.read_text()) == wanted):
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir(parents=True)
            fit_to_file(fit_capture, objective, int(d_prime), {**spec["hparams"], "seed": int(seed)},
                        kept / "projections.safetensors", device=device)
            fidelity_to_file(eval_capture, kept / "projections.safetensors", kept / "fidelity.csv", model_name,
                             objective, int(d_prime), setting=setting, device=device)
            with atomic_file(record) as tmp:  # written last: the seed's files are whole
                tmp.write_text(json.dumps(wanted))
        for name, dest in (("projections.safetensors", projections), ("fidelity.csv", fidelity)):
            with atomic_file(Path(dest)) as tmp:
                shutil.copyfile(kept / name, tmp)
    shutil.rmtree(partial_dir, ignore_errors=True)


__all__ = [
    "PRESETS",
    "FitSettings",
    "Instances",
    "Pairs",
    "attention_fidelity",
    "build_instances",
    "build_pairs",
    "fidelity_to_file",
    "fit_layer",
    "fit_layers",
    "fit_projections",
    "fit_seeds_to_files",
    "fit_to_file",
    "load_capture",
    "lockstep_group",
    "objective_loss",
    "resolve_settings",
    "save_capture",
]
