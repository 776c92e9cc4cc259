"""Every choice of a DimPO fit as a named field (``FitSettings``), with the authors' value and
ours, the two presets (``PRESETS``), and ``resolve_settings``, which merges a preset, an
objective's defaults and the config's hparams."""

from dataclasses import dataclass, replace


from dimattn.dimpo.objectives import get_objective
from dimattn.workflow.settings import from_mapping, resolve_top_k


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
    (dimattn.dimpo.objectives), the same in both presets.
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
    """Pairs of pairwise objectives (dimattn.dimpo.objectives.select_pairs): extreme | all | halves |
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
    """DimPO's k as a share of the key list, resolved per capture (dimattn.workflow.settings.resolve_top_k:
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
    and is refused, naming k or k_share (planning refuses a config's first: dimattn.workflow.sweeps)."""
    k = resolve_top_k(settings.k, settings.k_share, n_keys)
    if k >= n_keys and k > 0 and settings.lam != 0:
        given = f"k_share={settings.k_share} (k={k})" if settings.k_share is not None else f"k={k}"
        raise ValueError(f"{given} reaches the {n_keys} keys of {what}'s lists: DimPO's head term would keep "
                         "every key, which is KL plus a constant; choose k < the keys or a smaller k_share")
    return replace(settings, k=k)
