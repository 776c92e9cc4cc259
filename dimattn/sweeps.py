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
from pathlib import Path

from . import variants

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"
SYNTHETIC_SOURCES = {"synthetic_recall"}


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"config key {key}: {message}")
        self.key = key


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
        return [r for r, run in self.runs.items() if run.synthetic]

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


def plan(config: dict) -> Plan:
    """The runs of ``config`` (validated, defaults filled) and every cross-reference checked."""
    p = Plan(config)
    _check_scales(p)
    p.runs = expand_sweeps(p)
    check_references(p)
    return p


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _check_scales(p: Plan) -> None:
    datasets = p.config["datasets"]
    for scale, spec in p.config["pretraining"]["scales"].items():
        key = f"pretraining.scales.{scale}"
        arch = spec["architecture"]
        if arch["hidden_size"] % arch["num_attention_heads"]:
            raise ConfigError(f"{key}.architecture.hidden_size",
                              f"{arch['hidden_size']} is not divisible by num_attention_heads="
                              f"{arch['num_attention_heads']}")
        if spec.get("dataset") is not None:
            _need_dataset(p, f"{key}.dataset", spec["dataset"])
        dataset = p.scale_dataset(scale)
        if dataset in datasets and p.is_synthetic(dataset):
            example_len = datasets[dataset]["seq_len"]
            if spec["training"]["seq_len"] != example_len:
                raise ConfigError(f"{key}.training.seq_len",
                                  f"{spec['training']['seq_len']} must equal datasets.{dataset}.seq_len="
                                  f"{example_len}: windows are whole examples")


def expand_sweeps(p: Plan) -> dict[str, Run]:
    """pretraining.sweeps -> {run name: Run}; list-valued window/d_down/dilation/seed expand as a
    product. ``seed`` replaces the scale's training.seed: replicates of one setting."""
    _need_dataset(p, "pretraining.dataset", p.config["pretraining"]["dataset"])
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
            model = {**copy.deepcopy(scales[scale]["architecture"]), **fixed, **dict(zip((k for k, _ in swept), values))}
            for field_, message in variants.check_model(model):
                where = f"pretraining.scales.{scale}.architecture" if field_ == "hidden_size" else key
                raise ConfigError(f"{where}.{field_}", message + (f" (scale {scale!r})" if field_ != "attention" else ""))
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


def _need_dataset(p: Plan, key: str, name: str) -> None:
    if name not in p.config["datasets"]:
        raise ConfigError(key, f"unknown dataset {name!r}; known: {sorted(p.config['datasets'])}")


def check_references(p: Plan) -> None:
    """Every dataset, scale, run and objective one section names must exist in another."""
    tok = p.config["tokenizer"]
    if bool(tok.get("train_on")) == bool(tok.get("hub")):
        raise ConfigError("tokenizer", "set exactly one of tokenizer.train_on and tokenizer.hub")
    if tok.get("train_on"):
        _need_dataset(p, "tokenizer.train_on", tok["train_on"])
    for name in p.perplexity_datasets:
        _need_dataset(p, "evaluation.perplexity.datasets", name)
        if p.is_synthetic(name):
            raise ConfigError("evaluation.perplexity.datasets",
                              f"{name!r} is synthetic; the recall probe scores synthetic runs")
    scales = p.config["pretraining"]["scales"]
    for scale in p.lm_eval["scales"] or []:
        if scale not in scales:
            raise ConfigError("evaluation.lm_eval.scales", f"unknown scale {scale!r}; known: {sorted(scales)}")
    if p.lm_eval["write_tasks_from"]:
        _need_dataset(p, "evaluation.lm_eval.write_tasks_from", p.lm_eval["write_tasks_from"])
        if p.is_synthetic(p.lm_eval["write_tasks_from"]):
            raise ConfigError("evaluation.lm_eval.write_tasks_from",
                              f"{p.lm_eval['write_tasks_from']!r} is synthetic: it has no text to make tasks of")
    if not p.dimpo_enabled:
        return
    for key in ("dataset", "objectives", "d_prime"):
        if not p.dimpo.get(key):
            raise ConfigError(f"dimpo.{key}", "required when dimpo.models names a model")
    _need_dataset(p, "dimpo.dataset", p.dimpo["dataset"])
    for i, spec in enumerate(p.dimpo["models"]):
        if "run" not in spec:
            continue
        key = f"dimpo.models[{i}].run"
        if spec["run"] not in p.runs:
            raise ConfigError(key, f"unknown run {spec['run']!r}; known: {sorted(p.runs)}")
        run = p.runs[spec["run"]]
        if run.model["attention"] != "vanilla":
            raise ConfigError(key, "DimPO projects a frozen vanilla model")
        head_dim = run.model["hidden_size"] // run.model["num_attention_heads"]
        too_wide = [d for d in p.dimpo["d_prime"] if d > head_dim]
        if too_wide:
            raise ConfigError("dimpo.d_prime",
                              f"{too_wide[0]} exceeds the head dimension {head_dim} of run {spec['run']!r}")
