"""Every choice of a DimPO fit as a named field (``FitSettings``, built from the schema), the two
presets (``PRESETS``, from schemas/dimpo_presets.yaml), and ``resolve_settings``, which merges a
preset, an objective's own settings and the config's hparams."""

from dataclasses import field, make_dataclass, replace
from typing import Any

from dimattn.dimpo.objectives import get_objective
from dimattn.workflow.schema import dimpo_presets, schema, violation
from dimattn.workflow.settings import from_mapping, resolve_top_k


# ---- settings --------------------------------------------------------------------------------

_SOURCE = dimpo_presets()
_FIELDS = schema()["$defs"]["fit_fields"]["properties"]


def _check(self):
    # each field's type, choices and bounds are the schema's $defs/fit_fields, checked by jsonschema
    if self.preset not in _SOURCE["presets"]:
        raise ValueError(f"preset={self.preset!r} must be one of {tuple(_SOURCE['presets'])}")
    problem = violation("fit_fields", {name: getattr(self, name) for name in _FIELDS})
    if problem is not None:
        raise ValueError(f"fit setting {problem}")
    if self.num_sampled_keys is not None and self.causal:
        raise ValueError("num_sampled_keys needs causal=False (Appendix B lists are non-causal)")


# Built from the schema, so that no field, default or description is written twice: each field's
# description (the authors' value and ours) is its schemas/config.schema.yaml $defs/fit_fields
# entry, its default schemas/dimpo_presets.yaml's (the ``ours`` preset).
FitSettings = make_dataclass(
    "FitSettings",
    [(name, Any, field(default=_SOURCE["defaults"][name])) for name in ["preset", *_FIELDS]],
    namespace={
        "__post_init__": _check,
        "__module__": __name__,
        "__doc__": "Every choice of one DimPO-stage fit; fields and descriptions: the schema's "
        "$defs/fit_fields, defaults: schemas/dimpo_presets.yaml (``ours``). Sources for \"authors\": "
        "github.com/lanzv/dimpo (run_projection_experiment.py, src/models/lowdim_modules.py, dimpo_loss.py, "
        "dimpo_kl.py, lowdim_trainer.py, lowdim_dataset.py, attn_similarity.py).",
    },
)

# The fields an objective sets for itself (schemas/dimpo_presets.yaml objectives), which a preset
# leaves to it.
_OBJECTIVE_FIELDS = {name for values in _SOURCE["objectives"].values() for name in values}

# {preset: {field: value}}: every field but the objectives' own.
PRESETS: dict[str, dict] = {
    name: {k: v for k, v in (_SOURCE["defaults"] | over).items() if k not in _OBJECTIVE_FIELDS}
    for name, over in _SOURCE["presets"].items()
}


def resolve_settings(objective: str | None = None, hparams=None) -> FitSettings:
    """Settings of one fit: preset < the objective's defaults < ``hparams`` <
    hparams["per_objective"][objective] < hparams["setting"].

    ``hparams`` may name ``preset`` (default: the presets file's), ``per_objective`` ({objective: {field:
    value}}), ``setting`` (a dimpo.ablations setting: fields, and a ``preset`` that replaces the
    base preset) and ``seed`` (ignored here); every other key must be a FitSettings field.
    """
    if isinstance(hparams, FitSettings):
        return hparams
    hp = dict(hparams or {})
    hp.pop("seed", None)
    per = dict(hp.pop("per_objective", None) or {})
    setting = dict(hp.pop("setting", None) or {})
    preset = setting.pop("preset", hp.pop("preset", _SOURCE["defaults"]["preset"]))
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    for name in per:
        get_objective(name)
    values = dict(PRESETS[preset])
    layers = [dict(get_objective(objective).defaults) if objective is not None else {}, hp,
              (per.get(objective) or {}) if objective is not None else {}, setting]
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
