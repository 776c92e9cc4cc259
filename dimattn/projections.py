"""DimPO stage (seed 003): capture queries/keys/values, fit one projection W per layer, measure fidelity.

Read top to bottom:

1. ``capture_qkv`` runs a frozen causal LM once through a registered attention function that
   records post-RoPE queries, keys and values per layer, then hands over to transformers' SDPA.
2. ``save_capture`` / ``load_capture`` store them as safetensors (``layer{l}.q`` ...).
3. ``sample_instances`` draws training instances: one (sequence, head, query position) each,
   with the causal key list of its key/value head and psi = Softmax(q K^T / sqrt(d)).
4. ``fit_layer`` / ``fit_projections`` fit W in R^{d' x d}, shared by queries and keys
   (Siamese, q' = W q, k' = W k) and by all heads of a layer; values are never projected.
   Closed-form objectives (random, pca) are fitted directly; the others run Adam on their loss
   from ``dimattn.objectives``, starting from the PCA solution (``init="pca"``) unless
   ``init="random"``.
5. ``attention_fidelity``: the paper's proxy metrics (section 4.1) over *all* query positions,
   KL(psi || pi_theta) and the MSE between psi V and pi_theta V.
6. ``capture_to_file``, ``fit_to_file``, ``fidelity_to_file``: the same steps file to file, one
   per workflow rule (rules/dimpo.smk).

Shapes: a layer capture holds q (N, H, T, d), k and v (N, H_kv, T, d); query head h reads
key/value head h // (H / H_kv), as transformers' ``repeat_kv`` lays them out.
"""

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .atomic import atomic_file
from .settings import from_mapping
from .objectives import OBJECTIVES, get_objective, pca_projection, random_projection

CAPTURE_IMPLEMENTATION = "dimattn_capture"

# Filled by _capture_attention while capture_qkv runs: {layer: {"q": [...], "k": [...], "v": [...]}}.
_capture_store: dict[int, dict[str, list[torch.Tensor]]] | None = None
_capture_layers: set[int] | None = None


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Record (q, k, v) of ``module.layer_idx``, then attend exactly as ``sdpa`` would."""
    layer = module.layer_idx
    if _capture_store is not None and (_capture_layers is None or layer in _capture_layers):
        q = query.detach().float()
        scaling = kwargs.get("scaling")
        if scaling is not None and abs(scaling * math.sqrt(q.shape[-1]) - 1.0) > 1e-6:
            # psi is defined with 1/sqrt(d); fold any other model scaling into the queries.
            q = q * (scaling * math.sqrt(q.shape[-1]))
        entry = _capture_store.setdefault(layer, {"q": [], "k": [], "v": []})
        entry["q"].append(q.cpu())
        entry["k"].append(key.detach().float().cpu())
        entry["v"].append(value.detach().float().cpu())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention)
# Models that build their masks through transformers build the same ones as for sdpa.
AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)


def _switch_attention(model, implementation):
    """``set_attn_implementation``, or the config attribute where the model class refuses it.

    transformers only lets a class switch if its modeling source contains the text
    ``ALL_ATTENTION_FUNCTIONS.get_interface(``; for any other class the call only logs a
    warning. Setting the config attribute is what the call does once its checks pass.
    """
    if type(model)._can_set_attn_implementation():
        model.set_attn_implementation(implementation)
    if model.config._attn_implementation != implementation:
        model.config._attn_implementation = implementation


@torch.no_grad()
def capture_qkv(model, input_ids: torch.LongTensor, *, layers=None, batch_size: int | None = None):
    """Post-RoPE queries, keys and values of every (or the listed) attention layer.

    input_ids: (N, T), unpadded. Returns {layer: {"q": (N, H, T, d), "k": (N, H_kv, T, d),
    "v": (N, H_kv, T, d)}}, float32 on CPU. The model runs in eval mode without a KV cache,
    ``batch_size`` sequences at a time; its outputs are unchanged and its attention
    implementation and train/eval mode are restored afterwards.
    """
    global _capture_store, _capture_layers
    previous, was_training = model.config._attn_implementation, model.training
    device = next(model.parameters()).device
    _capture_store, _capture_layers = {}, None if layers is None else set(layers)
    try:
        model.eval()
        _switch_attention(model, CAPTURE_IMPLEMENTATION)
        for batch in input_ids.split(batch_size or len(input_ids)):
            model(input_ids=batch.to(device), use_cache=False)
        store = _capture_store
    finally:
        _capture_store, _capture_layers = None, None
        _switch_attention(model, previous)
        model.train(was_training)
    missing = sorted(set(layers) - set(store)) if layers is not None else []
    if not store or missing:
        raise RuntimeError(
            f"no capture for layer(s) {missing or 'any'} of {type(model).__name__}: a layer index out of range, "
            f"or attention that does not call ALL_ATTENTION_FUNCTIONS[config._attn_implementation]"
        )
    return {
        layer: {name: torch.cat(parts) for name, parts in store[layer].items()} for layer in sorted(store)
    }


def _metadata(meta: Mapping) -> dict[str, str]:
    return {key: json.dumps(value) for key, value in meta.items()}


def _read_metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {key: json.loads(value) for key, value in (f.metadata() or {}).items()}


def _save_atomic(tensors, path, metadata) -> None:
    """safetensors into a temp sibling, then rename: a killed job leaves no half-written file."""
    with atomic_file(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def save_capture(capture, path, meta: Mapping | None = None) -> None:
    """Safetensors file with tensors ``layer{l}.q|k|v`` and JSON-string metadata.

    The metadata always holds head_dim, heads, kv_heads, seq_len, n_sequences and layers (read
    off the tensors); ``meta`` adds to it (e.g. ``model``) and may not contradict it.
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
    meta = dict(meta or {})
    for key, value in derived.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"meta[{key!r}]={meta[key]!r} disagrees with the capture ({value!r})")
    tensors = {
        f"layer{layer}.{name}": t.contiguous() for layer, qkv in capture.items() for name, t in qkv.items()
    }
    _save_atomic(tensors, path, _metadata({**meta, **derived}))


def load_capture(path):
    """(capture, meta) as written by :func:`save_capture`."""
    capture: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(path)).items():
        layer, part = name.split(".")
        capture.setdefault(int(layer.removeprefix("layer")), {})[part] = tensor
    return dict(sorted(capture.items())), _read_metadata(path)


def save_projections(W_by_layer, path, meta: Mapping | None = None) -> None:
    """Safetensors file with tensors ``layer{l}.W`` (d', d) and JSON-string metadata."""
    first = W_by_layer[min(W_by_layer)]
    meta = {
        **(meta or {}),
        "d_prime": first.shape[0],
        "head_dim": first.shape[1],
        "layers": sorted(W_by_layer),
    }
    _save_atomic({f"layer{l}.W": W.contiguous() for l, W in W_by_layer.items()}, path, _metadata(meta))


def load_projections(path):
    """(W_by_layer, meta) as written by :func:`save_projections`."""
    tensors = load_file(str(path))
    W = {int(name.removeprefix("layer").removesuffix(".W")): t for name, t in tensors.items()}
    return dict(sorted(W.items())), _read_metadata(path)


def _masked_softmax(logits, mask):
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


@dataclass
class Instances:
    """Training instances of one layer, (seq, head, pos) triples; keys are gathered per batch.

    Materialising every padded key list would take n x T x d floats (paper scale: 40,960 x
    4,096 x 128), so :meth:`batch` gathers them, and psi, for the instances asked for.
    """

    seq: torch.Tensor  # (n,) sequence index
    head: torch.Tensor  # (n,) query head
    pos: torch.Tensor  # (n,) query position; its causal keys are positions 0..pos
    query: torch.Tensor  # (n, d)
    keys_source: torch.Tensor  # (N, H_kv, T, d), the layer's captured keys (not copied)
    groups: int  # query heads per key/value head

    def __len__(self):
        return len(self.seq)

    def batch(self, index=None):
        """dict of query (B, d), keys (B, L, d), mask (B, L) and psi (B, L), L = max pos + 1."""
        device = self.keys_source.device
        index = torch.arange(len(self)) if index is None else torch.as_tensor(index)
        index = index.to(device)
        pos = self.pos[index]
        length = int(pos.max()) + 1
        keys = self.keys_source[self.seq[index], self.head[index] // self.groups, :length]  # (B, L, d)
        mask = torch.arange(length, device=device)[None, :] <= pos[:, None]
        query = self.query[index]
        logits = torch.einsum("bd,bld->bl", query, keys) / math.sqrt(query.shape[-1])
        return {"query": query, "keys": keys, "mask": mask, "psi": _masked_softmax(logits, mask)}


def sample_instances(capture_layer, n_instances: int, generator: torch.Generator, min_position: int = 1):
    """Uniform subsample, without replacement, of (sequence, head, query position) triples.

    Positions run from ``min_position`` (1: every instance has at least two keys) to T - 1.
    Asking for more instances than there are triples returns all of them.
    """
    q, k = capture_layer["q"], capture_layer["k"]
    n, heads, seq_len, _ = q.shape
    positions = seq_len - min_position
    if positions <= 0:
        raise ValueError(f"min_position={min_position} leaves no query position in T={seq_len}")
    total = n * heads * positions
    flat = torch.randperm(total, generator=generator)[: min(n_instances, total)].to(q.device)
    seq, rest = flat // (heads * positions), flat % (heads * positions)
    head, pos = rest // positions, rest % positions + min_position
    return Instances(seq, head, pos, q[seq, head, pos], k, heads // k.shape[1])


def projected_logits(W, query, keys):
    """s_j = (W q).(W k_j) / sqrt(d'), computed as (W^T W q).k_j: O(L d) per query, not O(L d d')."""
    W = W.to(query.dtype)
    u = (query @ W.T) @ W  # (B, d)
    return torch.einsum("bd,bld->bl", u, keys) / math.sqrt(W.shape[0])


@dataclass
class FitHparams:
    """Hyperparameters of one fit; defaults suit a CPU run (paper scale: n_instances=40960).

    gamma, k, lam, max_preferred: DimPO's margin, head top-k, head weight and preferred-key
    cap (``dimattn.objectives``). init: "pca" or "random", the start of gradient objectives.
    """

    lr: float = 1e-2
    steps: int = 200
    batch_size: int = 128
    n_instances: int = 2048
    gamma: float = 0.0
    k: int = 0
    lam: float = 0.0
    max_preferred: int | None = None
    init: str = "pca"
    min_position: int = 1

    @classmethod
    def from_mapping(cls, hparams) -> "FitHparams":
        if isinstance(hparams, cls):
            return hparams
        out = from_mapping(cls, hparams, "fit hyperparameters")
        if out.init not in ("pca", "random"):
            raise ValueError(f"init={out.init!r} must be 'pca' or 'random'")
        return out


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def initial_projection(layer_capture, d_prime: int, init: str, seed: int) -> torch.Tensor:
    if init == "pca":
        return pca_projection(_flat(layer_capture["q"]), _flat(layer_capture["k"]), d_prime)
    return random_projection(layer_capture["q"].shape[-1], d_prime, seed, dtype=layer_capture["q"].dtype)


def objective_loss(instances: Instances, objective: str, W, hparams=None, batch_size: int = 512) -> float:
    """Mean of a gradient objective's loss over all ``instances`` at projection W (no grad)."""
    obj, hp = get_objective(objective), FitHparams.from_mapping(hparams)
    total = 0.0
    with torch.no_grad():
        for index in torch.arange(len(instances)).split(batch_size):
            b = instances.batch(index)
            loss = obj(projected_logits(W, b["query"], b["keys"]), b["psi"], b["mask"], hp)
            total += float(loss) * len(index)
    return total / len(instances)


def fit_layer(
    layer_capture,
    objective: str,
    d_prime: int,
    hparams=None,
    seed: int = 0,
    *,
    progress: bool = True,
    device=None,
):
    """Fit W (d', d) for one layer. Returns (W, history), history = [(step, minibatch loss)].

    Closed-form objectives return an empty history. Gradient objectives: ``n_instances``
    instances sampled once, epochs of shuffled minibatches, Adam for ``steps`` steps, all
    drawn from one (CPU) generator seeded with ``seed``, so a fit is deterministic on a given
    device. ``device``: where to fit (default: where the capture is); W comes back on the CPU.
    """
    obj, hp = get_objective(objective), FitHparams.from_mapping(hparams)
    if device is not None:
        layer_capture = {name: t.to(device) for name, t in layer_capture.items()}
    if not obj.trained:
        return obj.fit(_flat(layer_capture["q"]), _flat(layer_capture["k"]), d_prime, seed).cpu(), []
    generator = torch.Generator().manual_seed(seed)
    instances = sample_instances(layer_capture, hp.n_instances, generator, hp.min_position)
    W = torch.nn.Parameter(
        initial_projection(layer_capture, d_prime, hp.init, seed).to(layer_capture["q"].device)
    )
    optimizer = torch.optim.Adam([W], lr=hp.lr)
    history, order = [], torch.empty(0, dtype=torch.long)
    for step in tqdm(range(hp.steps), desc=f"{objective} d'={d_prime}", disable=not progress, leave=False):
        if len(order) < min(hp.batch_size, len(instances)):  # new epoch
            order = torch.randperm(len(instances), generator=generator)
        index, order = order[: hp.batch_size], order[hp.batch_size :]
        b = instances.batch(index)
        loss = obj(projected_logits(W, b["query"], b["keys"]), b["psi"], b["mask"], hp)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append((step, loss.item()))
    return W.detach().cpu().clone(), history


def fit_projections(
    capture,
    objective: str,
    d_prime: int,
    hparams=None,
    seed: int = 0,
    *,
    progress: bool = True,
    return_history: bool = False,
    device=None,
):
    """{layer: W} for every captured layer, each fitted independently with seed ``seed + layer``.

    With ``return_history`` returns (W_by_layer, {layer: [(step, loss)]}).
    """
    W_by_layer, histories = {}, {}
    for layer in tqdm(sorted(capture), desc=f"layers ({objective})", disable=not progress):
        W_by_layer[layer], histories[layer] = fit_layer(
            capture[layer], objective, d_prime, hparams, seed + layer, progress=progress, device=device
        )
    return (W_by_layer, histories) if return_history else W_by_layer


@torch.no_grad()
def attention_fidelity(capture, projections, *, chunk_size: int = 256, device=None) -> list[dict]:
    """Per projected layer: mean KL(psi || pi_theta) over all (sequence, head, position) and
    mean squared error between psi V and pi_theta V over all output elements.

    Query positions go ``chunk_size`` at a time, so memory is O(H chunk_size T) per step.
    ``device``: where to compute (default: where the capture is).
    """
    rows = []
    for layer, W in sorted(projections.items()):
        if layer not in capture:
            raise KeyError(f"projection for layer {layer} but the capture has layers {sorted(capture)}")
        q, k, v = (capture[layer][name].to(device) for name in "qkv")
        n, heads, seq_len, d = q.shape
        kv_heads = k.shape[1]
        W = W.to(device=q.device, dtype=q.dtype)
        WtW = W.T @ W  # (d, d): q'.k' = (W^T W q).k
        kl_sum = mse_sum = 0.0
        for i in range(n):
            for start in range(0, seq_len, chunk_size):
                stop = min(start + chunk_size, seq_len)
                qc = q[i, :, start:stop].reshape(kv_heads, heads // kv_heads, stop - start, d)
                keys, values = k[i, :, :stop], v[i, :, :stop]  # (H_kv, stop, d)
                mask = (
                    torch.arange(stop, device=q.device)[None, :]
                    <= torch.arange(start, stop, device=q.device)[:, None]
                )
                full = torch.einsum("hgcd,htd->hgct", qc, keys) / math.sqrt(d)
                low = torch.einsum("hgcd,htd->hgct", qc @ WtW, keys) / math.sqrt(W.shape[0])
                log_psi = torch.log_softmax(full.masked_fill(~mask, float("-inf")), -1)
                log_pi = torch.log_softmax(low.masked_fill(~mask, float("-inf")), -1)
                psi = log_psi.exp()
                kl = torch.where(mask, psi * (log_psi - log_pi), torch.zeros_like(psi))
                kl_sum += kl.sum(dtype=torch.float64).item()
                diff = torch.einsum("hgct,htd->hgcd", psi - log_pi.exp(), values)  # psi V - pi V
                mse_sum += diff.pow(2).sum(dtype=torch.float64).item()
        rows.append(
            {"layer": layer, "kl": kl_sum / (n * heads * seq_len), "mse": mse_sum / (n * heads * seq_len * d)}
        )
    return rows


# ---- file-level steps, one per workflow rule (workflow_scripts/*.py call these) -------------


def document_windows(tokenizer, texts, seq_len: int, n_sequences: int) -> torch.LongTensor:
    """(n_sequences, seq_len) token windows: the first seq_len tokens of each document, as in
    seed 003 section 3.3 (first 4096 tokens of each chapter long enough), then the next
    non-overlapping window of each document in turn if there are fewer documents than
    sequences. Documents shorter than seq_len are skipped.
    """
    per_document = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        if windows:
            per_document.append(windows)
    rounds = max((len(w) for w in per_document), default=0)
    picked = [w[r] for r in range(rounds) for w in per_document if r < len(w)][:n_sequences]
    if len(picked) < n_sequences:
        raise ValueError(
            f"the documents hold only {len(picked)} windows of {seq_len} tokens, need {n_sequences}"
        )
    return torch.tensor(picked, dtype=torch.long)


def _is_dimattn_directory(source) -> bool:
    config = Path(str(source)) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "dimattn"


def capture_to_file(
    source,
    documents,
    seq_len: int,
    n_sequences: int,
    out_path,
    model_name: str,
    device: str = "cpu",
    batch_size: int = 1,
) -> dict:
    """Load the frozen model and tokenizer at ``source`` (our run directory or a hub name),
    capture q/k/v on windows of the jsonl ``documents`` and save them; returns the metadata."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import read_documents

    tokenizer = AutoTokenizer.from_pretrained(source)
    # Remote code only for our own run directories; a hub model loads with transformers' own
    # classes (Llama, Qwen2, ...) and never runs code from the hub.
    ours = _is_dimattn_directory(source)
    dtype = torch.float32 if ours or device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=ours, dtype=dtype).to(device).eval()
    ids = document_windows(
        tokenizer, (doc["text"] for doc in read_documents(documents)), seq_len, n_sequences
    )
    capture = capture_qkv(model, ids, batch_size=batch_size)
    meta = {"model": model_name, "source": str(source), "documents": str(documents)}
    save_capture(capture, out_path, meta)
    return _read_metadata(out_path)


def fit_to_file(capture_path, objective: str, d_prime: int, hparams, out_path, device: str = "cpu") -> None:
    """Fit one projection per captured layer and save it; ``hparams`` may carry ``seed``."""
    hparams = dict(hparams or {})
    seed = int(hparams.pop("seed", 0))
    hp = FitHparams.from_mapping(hparams)
    capture, capture_meta = load_capture(capture_path)
    W, histories = fit_projections(capture, objective, d_prime, hp, seed, return_history=True, device=device)
    meta = {
        "model": capture_meta.get("model"),
        "objective": objective,
        "seed": seed,
        "hparams": asdict(hp) if get_objective(objective).trained else {},
        "history": {str(layer): h for layer, h in histories.items()},
    }
    save_projections(W, out_path, meta)


def fidelity_to_file(
    capture_path,
    projections_path,
    out_csv,
    model_name: str,
    objective: str,
    d_prime: int,
    device: str | None = None,
) -> list[dict]:
    """Per-layer KL and MSE on the evaluation capture, as a CSV with columns
    model, objective, d_prime, head_dim, layer, kl, mse."""
    capture, meta = load_capture(capture_path)
    W, _ = load_projections(projections_path)
    rows = [
        {"model": model_name, "objective": objective, "d_prime": d_prime, "head_dim": meta["head_dim"], **row}
        for row in attention_fidelity(capture, W, device=device)
    ]
    with atomic_file(Path(out_csv)) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["model", "objective", "d_prime", "head_dim", "layer", "kl", "mse"]
        )
        writer.writeheader()
        writer.writerows(rows)
    return rows


__all__ = [
    "CAPTURE_IMPLEMENTATION",
    "FitHparams",
    "Instances",
    "OBJECTIVES",
    "attention_fidelity",
    "capture_qkv",
    "capture_to_file",
    "document_windows",
    "fidelity_to_file",
    "fit_to_file",
    "fit_layer",
    "fit_projections",
    "load_capture",
    "load_projections",
    "objective_loss",
    "projected_logits",
    "sample_instances",
    "save_capture",
    "save_projections",
]
