"""From a validated config to the workflow's plan: the pretraining runs of the expanded sweeps
and the cross-references between sections, every error naming the config key that holds the
culprit. No torch, no Snakemake: ``rules/common.smk`` builds its DAG from ``plan(config)`` and
the tests call it in-process.

Defaults live in ``schemas/config.schema.yaml`` alone: ``validate`` fills them in (Snakemake's
own validator), and nothing here falls back to a value of its own.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field

from dimattn.model import variants

from dimattn.workflow.schema import SCHEMA  # the one home of defaults
from dimattn.workflow.checks import check_references, check_scales, check_splits, need_dataset

# the vocabulary, read through this module by the stages as well (dimattn.workflow.vocabulary)
from dimattn.workflow.vocabulary import (  # noqa: F401
    BASE_OBJECTIVE,
    CAPTURE_FIELDS,
    ConfigError,
    DEFAULT_SETTING,
    HEAD_OBJECTIVES,
    LONGCTX_SOURCE,
    MAIN_STUDY,
    NO_KV,
    parse_setting,
    PROJECTABLE,
    RULER_MIN_LENGTH,
    RULER_TASK,
    RULER_TASKS,
    setting_name,
    SUITE_SUBTASKS,
    SYNTHETIC_SOURCES,
)


@dataclass(frozen=True)
class Fit:
    """One DimPO fit of a study, for every dimpo model and seed; ``order``: the setting's place
    in its study's list (the rows of the quirk table follow it)."""

    study: str
    order: int
    objective: str
    setting: str
    d_prime: int


# lm-eval's RULER subtasks (0.4.13), the 13 of seed 003's RULER average. Their data generation
# never ends for ruler_vt below ~2048 tokens (its example alone is ~500) and divides by zero in
# ruler_cwe, so every length asked of them is at least RULER_MIN_LENGTH.
@dataclass(frozen=True)
class Projected:
    """One projected model of dimpo.downstream: the fit of ``objective`` at ``d_prime`` with
    ``setting`` (Table 1's first, or a setting of the study ``study``: dimpo.downstream.studies)
    and fit seed ``seed``, on the last ``num_projected`` layers, with the KV compression ``kv`` (a
    name of dimpo.downstream.kv, or "none"). The base model is objective "base", d' 0, l 0,
    seed 0, setting "default"."""

    objective: str
    d_prime: int
    num_projected: int
    kv: str
    seed: int = 0
    setting: str = DEFAULT_SETTING
    study: str = MAIN_STUDY


def validate(config: dict) -> dict:
    """A deep copy of ``config`` checked against the schema, with its defaults filled in.

    The JSON round trip matters: Snakemake's validator fills every absent object with the
    schema's one default object, so two scales without ``resources`` would share one dict (and
    ``copy.deepcopy`` keeps shared objects shared).
    """
    from snakemake.utils import validate as snakemake_validate

    config = copy.deepcopy(config)
    snakemake_validate(config, str(SCHEMA))
    return json.loads(json.dumps(config))


@dataclass
class Run:
    """One pretraining run: a scale's architecture and recipe with one sweep's variant keys."""

    name: str
    scale: str
    dataset: str
    synthetic: bool
    model: dict
    training: dict
    resources: dict

    @property
    def seed(self) -> int:
        return self.training["seed"]

    @property
    def fields(self) -> dict:
        """variants.RUN_FIELDS plus what the plan knows: the scale and the training corpus."""
        return variants.run_fields(self.name, self.model, self.seed) | {
            "scale": self.scale,
            "dataset": self.dataset,
            "synthetic": self.synthetic,
        }


@dataclass
class Plan:
    config: dict
    runs: dict[str, Run] = field(default_factory=dict)

    # --- datasets
    def is_synthetic(self, dataset: str) -> bool:
        return self.config["datasets"][dataset]["source"] in SYNTHETIC_SOURCES

    def is_longctx(self, dataset: str) -> bool:
        return self.config["datasets"][dataset]["source"] == LONGCTX_SOURCE

    @property
    def longctx_datasets(self) -> list[str]:
        return [d for d in self.config["datasets"] if self.is_longctx(d)]

    @property
    def text_datasets(self) -> list[str]:
        return [d for d in self.config["datasets"] if not self.is_synthetic(d)]

    @property
    def synthetic_datasets(self) -> list[str]:
        return [d for d in self.config["datasets"] if self.is_synthetic(d)]

    def scale_dataset(self, scale: str) -> str:
        spec = self.config["pretraining"]["scales"][scale]
        return spec.get("dataset") or self.config["pretraining"]["dataset"]

    # --- runs by what scores them
    @property
    def text_runs(self) -> list[str]:
        return [r for r, run in self.runs.items() if not run.synthetic]

    @property
    def recall_runs(self) -> list[str]:
        return [r for r, run in self.runs.items() if run.synthetic and not self.is_longctx(run.dataset)]

    @property
    def longctx_runs(self) -> list[str]:
        """Runs trained on the long-context suite: scored on it (dimattn.data.longctx), no other probe."""
        return [r for r, run in self.runs.items() if self.is_longctx(run.dataset)]

    @property
    def reported_runs(self) -> list[str]:
        """The runs dimattn.reporting's tables read (the long-context suite's runs have their own summary)."""
        return [r for r in self.runs if r not in self.longctx_runs]

    def longctx_targets(self, run: str) -> list[str]:
        """The suite corpora a long-context run is scored on: its own, then evaluation.longctx.datasets
        (the same suite at other lengths: seed 003 Table 4's 1x and 2x)."""
        own = self.runs[run].dataset
        return [own] + [d for d in self.config["evaluation"]["longctx"]["datasets"] if d != own]

    @property
    def lm_eval(self) -> dict:
        return self.config["evaluation"]["lm_eval"]

    @property
    def lm_eval_runs(self) -> list[str]:
        if not self.lm_eval["tasks"]:
            return []
        scales = self.lm_eval["scales"]
        return [r for r in self.text_runs if scales is None or self.runs[r].scale in scales]

    @property
    def perplexity_datasets(self) -> list[str]:
        return self.config["evaluation"]["perplexity"]["datasets"]

    def perplexity_targets(self, run: str) -> list[str]:
        """Text runs: evaluation.perplexity.datasets (text corpora share one tokenizer).
        Synthetic runs have no perplexity: only their answers are trained on, so the recall
        probe scores them."""
        return [] if self.runs[run].synthetic else list(self.perplexity_datasets)

    # --- DimPO
    @property
    def dimpo(self) -> dict:
        return self.config["dimpo"]

    @property
    def dimpo_models(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.dimpo["models"]}

    @property
    def dimpo_enabled(self) -> bool:
        return bool(self.dimpo_models)

    @property
    def dimpo_fits(self) -> list[Fit]:
        """Table 1's grid, then each study of dimpo.ablations; a fit in two studies is listed twice."""
        fits = []
        for study, spec in {MAIN_STUDY: self.dimpo, **self.dimpo["ablations"]}.items():
            fits += [
                Fit(study, order, objective, setting_name(overrides), d)
                for order, overrides in enumerate(spec["settings"])
                for objective in spec["objectives"]
                for d in spec["d_prime"]
            ]
        return fits

    @property
    def dimpo_studies(self) -> tuple[str, ...]:
        """The studies fitted (reporting.outputs.Asked.dimpo), and "downstream" where projected
        models are scored, "long_context" and "kv" where that includes a long-context probe and
        KV compression on it, "suite" where a model is scored on the long-context suite: none
        without DimPO models."""
        if not self.dimpo_enabled:
            return ()
        studies = tuple(dict.fromkeys(f.study for f in self.dimpo_fits))
        if not self.dimpo_projected:
            return studies
        # long context: the recall probe or the suite, or RULER on a hub model (seed 003 Tables 2-3); "kv":
        # compression scored there (Table 5)
        ruler = any(t["name"] in RULER_TASKS for t in self.downstream["tasks"])
        long = [m for m in self.dimpo_models if self.generative_probe(m) or (ruler and self.dimpo_probe(m) == "hub")]
        kv = any(p.kv != NO_KV for m in long for p in self.projected(m))
        suite = any(self.dimpo_probe(m) == "longctx" for m in long)  # the needle heat map of projections
        return (studies + ("downstream",) + (("long_context",) if long else ()) + (("kv",) if kv else ())
                + (("suite",) if suite else ()) + (("latency",) if self.latency_models else ()))

    @property
    def downstream(self) -> dict:
        return self.dimpo["downstream"]

    def study_models(self, study: str) -> list[str]:
        """The dimpo models a study fits: every one, or those its ``models`` lists."""
        spec = self.dimpo["ablations"].get(study, {})
        return spec.get("models", list(self.dimpo_models))

    def grid(self, model: str, key: str) -> list:
        """Table 1's objectives or d_prime (``key``) for a model: its own, or dimpo's."""
        return self.dimpo_models[model].get(key, self.dimpo[key])

    def model_fits(self, model: str) -> list[Fit]:
        """The fits of one dimpo model: Table 1's grid (its own objectives and d' where it sets
        them), then the studies of dimpo.ablations that fit it."""
        return [
            f for f in self.dimpo_fits
            if model in self.study_models(f.study)
            and (f.study != MAIN_STUDY or (f.objective in self.grid(model, "objectives")
                                           and f.d_prime in self.grid(model, "d_prime")))
        ]

    def dimpo_probe(self, model: str) -> str:
        """How a dimpo model is captured and scored downstream: "recall" (our run on a synthetic
        recall corpus: captured on it, scored on the recall probe through the KV cache),
        "longctx" (our run on the long-context suite: captured on it, scored on the suite at
        each of its lengths, :meth:`longctx_targets`, through the KV cache), "text" (our run on
        text: dimpo.dataset, perplexity and the tasks) or "hub" (the tasks)."""
        spec = self.dimpo_models[model]
        if "run" not in spec:
            return "hub"
        run = self.runs[spec["run"]]
        if not run.synthetic:
            return "text"
        return "longctx" if self.is_longctx(run.dataset) else "recall"

    def generative_probe(self, model: str) -> bool:
        """Scored downstream by generation (the recall probe, the suite): its own corpus captured,
        no lm-eval task."""
        return self.dimpo_probe(model) in ("recall", "longctx")

    def keeps_own_cache(self, model: str) -> bool:
        """A DAR or uniform run of ours: its latent cache (DimAttnCache) is no plain KV cache, so
        KV compression (SnapKV, KIVI) neither applies to it nor is timed on it."""
        spec = self.dimpo_models[model]
        return "run" in spec and self.runs[spec["run"]].model["attention"] != "vanilla"

    def dimpo_layers(self, model: str) -> int | None:
        """The layers of a dimpo model: our run's, or a hub model's num_hidden_layers where the
        config gives it (else None: known once it loads)."""
        spec = self.dimpo_models[model]
        return self.runs[spec["run"]].model["num_hidden_layers"] if "run" in spec else spec.get("num_hidden_layers")

    def dimpo_run_dataset(self, model: str) -> str:
        """The corpus a dimpo model of ours was trained on (a recall run's: its capture and probe)."""
        return self.runs[self.dimpo_models[model]["run"]].dataset

    def capture_split(self, purpose: str) -> str:
        """The split a capture reads: dimpo.capture.fit_split to fit on, the test split to score."""
        return self.dimpo["capture"]["fit_split"] if purpose == "fit" else "test"

    def dimpo_capture(self, model: str) -> dict:
        """dimpo.capture with the model's own overrides."""
        return self.dimpo["capture"] | self.dimpo_models[model].get("capture", {})

    def num_projected(self, model: str) -> list[int]:
        """The l values of a model: its own, or dimpo.downstream.num_projected."""
        return self.dimpo_models[model].get("num_projected", self.downstream["num_projected"])

    def downstream_d_prime(self, model: str) -> list[int]:
        """The d' a model is projected at downstream: its own downstream_d_prime (the paper's
        d'/d = 1/2 at its head dimension), or dimpo.downstream.d_prime."""
        return self.dimpo_models[model].get("downstream_d_prime", self.downstream["d_prime"])

    def projected(self, model: str) -> list[Projected]:
        """The models dimpo.downstream scores for one dimpo model: the base model, then every
        objective x d' x l x fit seed (dimpo.seeds: the spread of Figures 2-3), each without and
        with every KV compression. Compression changes generation only, so it is scored only
        where generation is (the recall probe, a hub model's tasks), and on a plain KV cache (not
        a DAR or uniform model's latent one)."""
        ds = self.downstream
        if not (self.dimpo_enabled and ds["objectives"] and self.num_projected(model)):
            return []  # num_projected: [] of a model: fitted (Table 1), not projected downstream
        generative = self.dimpo_probe(model) != "text" and not self.keeps_own_cache(model)
        kvs = [{"name": NO_KV}] + [kv for kv in ds["kv"] if generative and model in kv.get("models", [model])]
        main = setting_name(self.dimpo["settings"][0])
        projected = [Projected(BASE_OBJECTIVE, 0, 0, kv["name"]) for kv in kvs] + [
            Projected(objective, d, l, kv["name"], seed, main)
            for objective in ds["objectives"]
            for d in self.downstream_d_prime(model)
            for l in self.num_projected(model)
            for kv in kvs
            for seed in self.dimpo["seeds"]
            if objective in kv.get("objectives", [objective]) and l in kv.get("num_projected", [l])
            and d in kv.get("d_prime", [d])
        ]
        for entry in ds["studies"]:  # e.g. Table 6's settings at the depth of its RULER column
            if model not in entry.get("models", self.study_models(entry["study"])):
                continue
            if entry["study"] == MAIN_STUDY:  # Table 1's fits at more l (Table 6's DimPO + KL cell)
                projected += [
                    Projected(objective, d, l, NO_KV, seed, main)
                    for objective in entry.get("objectives", self.grid(model, "objectives"))
                    for d in entry.get("d_prime", self.downstream_d_prime(model))
                    for l in entry["num_projected"]
                    for seed in self.dimpo["seeds"]
                ]
                continue
            study = self.dimpo["ablations"][entry["study"]]
            projected += [
                Projected(objective, d, l, NO_KV, seed, setting_name(overrides), entry["study"])
                for overrides in study["settings"]
                for objective in study["objectives"]
                for d in study["d_prime"]
                for l in entry["num_projected"]
                for seed in self.dimpo["seeds"]
            ]
        return list(dict.fromkeys(projected))

    @property
    def latency(self) -> dict | None:
        """dimpo.latency (its defaults filled by the schema); None when not measured."""
        return self.dimpo.get("latency")

    @property
    def latency_models(self) -> list[str]:
        """The dimpo models whose latency is measured (dimpo.latency): those with a plain KV
        cache, which SnapKV compresses, once Table 1's projections are applied downstream."""
        if self.latency is None or not self.downstream["objectives"]:
            return []
        return [m for m in self.dimpo_models if not self.keeps_own_cache(m) and self.num_projected(m)]

    def latency_projection(self, model: str) -> tuple[str, str, int, int]:
        """(objective, setting, d', seed) of the fit the latency job applies: Table 1's DimPO (or
        the first downstream objective) at the first downstream d' and the first fit seed."""
        objectives = self.downstream["objectives"]
        objective = "dimpo" if "dimpo" in objectives else objectives[0]
        return (objective, setting_name(self.dimpo["settings"][0]), self.downstream_d_prime(model)[0],
                self.dimpo["seeds"][0])

    @property
    def dimpo_projected(self) -> list[Projected]:
        """Every projected model of any dimpo model (:meth:`projected`), each once."""
        return list(dict.fromkeys(p for model in self.dimpo_models for p in self.projected(model)))

    def kv_settings(self, name: str) -> dict:
        """{"kivi": {...}} or {"snapkv": {...}} of a dimpo.downstream.kv name; {} for "none"."""
        if name == NO_KV:
            return {}
        spec = next(k for k in self.downstream["kv"] if k["name"] == name)
        return {method: spec[method] for method in ("kivi", "snapkv") if method in spec}

    @property
    def dimpo_settings(self) -> dict[str, dict]:
        """{setting name: its overrides of dimpo.hparams}."""
        settings = {}
        for spec in [self.dimpo, *self.dimpo["ablations"].values()]:
            settings |= {setting_name(o): o for o in spec["settings"]}
        return settings


def plan(config: dict) -> Plan:
    """The runs of ``config`` (validated, defaults filled) and every cross-reference checked."""
    p = Plan(config)
    check_splits(p)
    check_scales(p)
    p.runs = expand_sweeps(p)
    check_references(p)
    return p


def _as_list(value):
    return value if isinstance(value, list) else [value]


def expand_sweeps(p: Plan) -> dict[str, Run]:
    """pretraining.sweeps -> {run name: Run}; list-valued window/d_down/dilation/seed expand as a
    product. ``seed`` replaces the scale's training.seed: replicates of one setting."""
    need_dataset(p, "pretraining.dataset", p.config["pretraining"]["dataset"])
    scales = p.config["pretraining"]["scales"]
    runs: dict[str, Run] = {}
    for i, sweep in enumerate(p.config["pretraining"]["sweeps"]):
        key = f"pretraining.sweeps[{i}]"
        scale = sweep["scale"]
        if scale not in scales:
            raise ConfigError(f"{key}.scale", f"unknown scale {scale!r}; known: {sorted(scales)}")
        fixed = {k: v for k, v in sweep.items() if k not in variants.SWEPT_KEYS + ("seed", "scale")}
        swept = [(k, _as_list(sweep[k])) for k in variants.SWEPT_KEYS if k in sweep]
        seeds = _as_list(sweep.get("seed", scales[scale]["training"]["seed"]))
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"{key}.seed", f"{seeds} repeats a seed")
        for values, seed in itertools.product(itertools.product(*(v for _, v in swept)), seeds):
            model = {
                **copy.deepcopy(scales[scale]["architecture"]),
                **fixed,
                **dict(zip((k for k, _ in swept), values)),
            }
            for field_, message in variants.check_model(model):
                where = f"pretraining.scales.{scale}.architecture" if field_ == "hidden_size" else key
                raise ConfigError(
                    f"{where}.{field_}", message + (f" (scale {scale!r})" if field_ != "attention" else "")
                )
            name = variants.run_name(scale, model, seed)
            if name in runs:
                raise ConfigError(key, f"run {name!r} is already defined by an earlier sweep")
            dataset = p.scale_dataset(scale)
            runs[name] = Run(
                name=name,
                scale=scale,
                dataset=dataset,
                synthetic=p.is_synthetic(dataset),
                model=model,
                training={**copy.deepcopy(scales[scale]["training"]), "seed": seed},
                resources=copy.deepcopy(scales[scale]["resources"]),
            )
    return runs
