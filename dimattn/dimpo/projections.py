"""DimPO stage (seed 003): fit one projection per layer on a capture, measure fidelity.

Read top to bottom:

1. ``dimattn.dimpo.capture.capture_qkv`` (its own module: it needs transformers, the fits do not)
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
7. ``fit_to_file``, ``fidelity_to_file`` (and ``dimattn.dimpo.capture.capture_to_file``): the same
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dimattn.model.affine import Affine, as_affine, check_head_dim
from dimattn.model.affine import load_projections, logit_scale, projected_logits, save_projections
from dimattn.model.atomic import atomic_file
from dimattn.workflow.formats import FIDELITY_COLUMNS
from dimattn.dimpo.objectives import get_objective, pca_projection, select_pairs
from dimattn.workflow.resources import fit_group
from dimattn.workflow.settings import key_list_length, resolve_top_k

from dimattn.dimpo.capture_files import load_capture, near_mask
from dimattn.dimpo.fidelity import FIDELITY_TOP_K_SHARE, attention_fidelity
from dimattn.dimpo.fit_settings import FitSettings, resolve_settings, with_top_k

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
    causal: bool
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
                     layer_capture.get("k_far"), layer_capture.get("window", 0))


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
    """Pairs of every instance by ``settings.pair_mode`` (dimattn.dimpo.objectives.select_pairs), in
    instance order; the key lists are gathered a bounded number of instances at a time."""
    _, _, length, d = instances.keys_source.shape
    chunk = max(1, GATHER_ELEMENTS // (length * d))
    parts = []
    for index in torch.arange(len(instances)).split(chunk):
        b = instances.batch(index)
        rows, chosen, rejected = select_pairs(
            b["scores"], b["mask"], settings.pair_mode, generator=generator,
            num_pairs=settings.num_pairs, distance=settings.pair_distance,
        )
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
              device=None):
    """Fit F for one layer. Returns (Affine on the CPU, history).

    history: [(step, mean minibatch loss since the previous point)], empty for closed-form
    objectives. All draws (instances, pairs, init, order) come from one CPU generator seeded
    with ``seed``, so a fit is deterministic on a given device. A step whose loss is not finite
    is skipped, as the authors do. ``device``: where to fit (default: where the capture is).
    """
    return fit_layers({0: layer_capture}, objective, d_prime, hparams, {0: seed}, progress=progress, device=device)[0]


def fit_layers(layer_captures: Mapping, objective: str, d_prime: int, hparams=None, seeds: Mapping | None = None, *,
               progress=True, device=None) -> dict:
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
    }


def lockstep_group(layer_capture, layers: int) -> int:
    """Layers of a capture of ``layers`` layers shaped as ``layer_capture`` that a fit steps
    together (dimattn.workflow.resources.fit_group on the layer's tensor bytes)."""
    return fit_group(sum(t.numel() * t.element_size() for t in layer_capture.values() if torch.is_tensor(t)), layers)


def fit_projections(capture, objective: str, d_prime: int, hparams=None, seed: int = 0, *, progress=True,
                    return_history=False, device=None):
    """{layer: Affine} for every captured layer, each fitted with seed ``seed + layer`` as if
    alone; the layers go in lockstep groups (:func:`fit_layers`) of as many as fit in
    dimattn.workflow.resources.FIT_LOCKSTEP_BYTES, read a group at a time from a LayerFile.

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
                          progress=progress, device=device)
        del group_captures
        for layer, (projection, history) in fits.items():
            out[layer], histories[layer] = projection, history
    return (out, histories) if return_history else out


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
                     setting: str = "default", device: str | None = None) -> list[dict]:
    """Per-layer attention fidelity on the evaluation capture, as a CSV with
    dimattn.workflow.formats.FIDELITY_COLUMNS.

    kl, mse: at the projection's train_scale (Table 1); kl_inference, mse_inference: at its
    inference_scale, what the model sees once the projection replaces attention (equal to kl,
    mse when the two scales agree); topk_recall: the share of each query's top_k keys the
    projection keeps, top_k the paper's 64 of 4,096 (FIDELITY_TOP_K_SHARE) of the capture's keys,
    the same for every objective. causal and mse_head_chunk come from the fit's settings;
    ``setting`` names them (dimattn.workflow.vocabulary.setting_name).
    """
    capture, meta = load_capture(capture_path)
    projections, pmeta = load_projections(projections_path)
    check_head_dim(projections, meta["head_dim"], projections_path)
    settings = resolve_settings(None, pmeta.get("settings"))

    top_k = resolve_top_k(0, FIDELITY_TOP_K_SHARE, meta["seq_len"])

    def score(scale, top_k=0):
        return attention_fidelity(capture, projections, causal=settings.causal, scale=scale,
                                  mse_head_chunk=settings.mse_head_chunk, device=device, top_k=top_k)

    train = score(settings.train_scale, top_k)  # a logit scale does not reorder keys: top-k once
    inference = train if settings.inference_scale == settings.train_scale else score(settings.inference_scale)
    fit = {"model": model_name, "objective": objective, "setting": setting, "d_prime": d_prime,
           "head_dim": meta["head_dim"], "seed": int(pmeta["seed"])}
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
                       fidelity_out, partial_dir, model_name: str, setting: str = "default", *,
                       device: str) -> None:
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
                         f"fidelity outputs")
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
