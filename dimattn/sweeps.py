"""From a validated config to the workflow's plan: the pretraining runs of the expanded sweeps
and the cross-references between sections, every error naming the config key that holds the
culprit. No torch, no Snakemake: ``rules/common.smk`` builds its DAG from ``plan(config)`` and
the tests call it in-process.

Defaults live in ``schemas/config.schema.yaml`` alone: ``validate`` fills them in (Snakemake's
own validator), and nothing here falls back to a value of its own.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import variants
from .settings import key_list_length, resolve_top_k

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"
SYNTHETIC_SOURCES = {"synthetic_recall", "synthetic_longctx"}  # generated here: no text
LONGCTX_SOURCE = "synthetic_longctx"  # dimattn.longctx's RULER-style suite


# DimPO fits: Table 1's grid is the study "table1" at the setting "default" (dimpo.hparams as
# they are); dimpo.ablations adds studies whose settings apply over dimpo.hparams.
MAIN_STUDY = "table1"
DEFAULT_SETTING = "default"
CAPTURE_FIELDS = ("capture_dtype", "special_tokens")  # set per capture, so never per fit
# The objectives whose loss reads DimPO's top-k (dimattn.objectives: "k" in Objective.hparams;
# tests/test_sweeps.py holds the two equal).
HEAD_OBJECTIVES = ("dimpo", "dimpo_list")


def setting_name(overrides: dict) -> str:
    """The name (and path component) of a fit setting: "default" for none, else
    "key=value,..." in the given order, values as JSON ("k=64,lam=0.5", "causal=true")."""
    if not overrides:
        return DEFAULT_SETTING
    return ",".join(f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items())


def parse_setting(name: str) -> dict:
    """The overrides of :func:`setting_name`'s ``name``."""
    if name == DEFAULT_SETTING:
        return {}
    out = {}
    for part in name.split(","):
        key, _, value = part.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


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
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe",
               "ruler_qa_squad", "ruler_qa_hotpot")  # fmt: skip
RULER_MIN_LENGTH = 2048
# The lm-eval RULER task each subtask of our long-context suite (dimattn.longctx) stands for.
RULER_TASK = {"niah_single": "niah_single_1", "niah_multikey": "niah_multikey_1", "niah_multivalue": "niah_multivalue",
              "niah_multiquery": "niah_multiquery", "vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe",
              "qa": "ruler_qa_squad"}  # fmt: skip
SUITE_SUBTASKS = tuple(RULER_TASK)  # the suite's subtasks, in dimattn.longctx.SUBTASKS' order
# dimpo.latency's settings where a config sets it (Appendix H's timing; see the schema)
LATENCY_DEFAULTS = {"prompt": 1024, "new": 32, "repeats": 3}
# Runs DimPO can project: vanilla, and DAR or uniform, whose far keys F projects too (both
# reductions composed, dimattn.modeling_projected); a sliding window drops keys F never sees.
PROJECTABLE = ("vanilla", "dar", "uniform")
BASE_OBJECTIVE = "base"  # the unprojected model (l = 0) among the downstream scores
NO_KV = "none"  # no KV-cache compression


@functools.cache
def _lm_eval_task_files() -> dict[Path, str] | None:
    """lm-eval's task YAMLs, and the extensionless bases they include (cruxeval_common_yaml), read
    without importing lm-eval (planning stays light); None where lm-eval is not installed."""
    import importlib.util

    found = importlib.util.find_spec("lm_eval")
    if found is None or not found.submodule_search_locations:
        return None
    root = Path(next(iter(found.submodule_search_locations))) / "tasks"
    return {p.resolve(): p.read_text(errors="replace") for p in root.rglob("*")
            if p.is_file() and (p.suffix == ".yaml" or ("yaml" in p.name and not p.suffix))}  # fmt: skip


def lm_eval_task_names() -> frozenset[str] | None:
    """Every task, group and tag name lm-eval's task files define (what its TaskManager
    resolves); None where lm-eval is not installed."""
    import re

    files = _lm_eval_task_files()
    if files is None:
        return None
    return frozenset(name for text in files.values()
                     for name in re.findall(r"^(?:task|group|tag):\s*['\"]?([\w.-]+)", text, re.M))  # fmt: skip


def unsafe_lm_eval_tasks() -> frozenset[str]:
    """lm-eval's tasks whose YAML, or a file it includes, says ``unsafe_code: true`` (MBPP,
    HumanEval: they execute the model's code), read from lm-eval's task files without importing
    it (planning stays light); empty where lm-eval is not installed."""
    import re

    files = _lm_eval_task_files()
    if files is None:
        return frozenset()

    def unsafe(path, seen=()):
        text = files.get(path, "")
        if re.search(r"^unsafe_code:\s*true\b", text, re.M):
            return True
        included = ((path.parent / inc).resolve() for inc in re.findall(r"^include:\s*['\"]?([^'\"\s]+)", text, re.M))
        return any(unsafe(inc, (*seen, path)) for inc in included if inc not in seen)

    return frozenset(name for path, text in files.items() if "unsafe_code" in text or "include:" in text
                     for name in re.findall(r"^task:\s*['\"]?([\w.-]+)", text, re.M)
                     if name != "null" and unsafe(path))  # fmt: skip


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
        """Runs trained on the long-context suite: scored on it (dimattn.longctx), no other probe."""
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
        ]  # fmt: skip

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
        """dimpo.latency with its defaults; None when not measured."""
        given = self.dimpo.get("latency")
        return None if given is None else LATENCY_DEFAULTS | given

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
    _check_splits(p)
    _check_scales(p)
    p.runs = expand_sweeps(p)
    check_references(p)
    return p


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _check_splits(p: Plan) -> None:
    """Every Hugging Face corpus's split ranges, as dimattn.data reads them (the schema's
    defaults filled: start 0, stop null for the end): complete, and no two overlapping."""
    from .splits import range_errors

    for name, spec in p.config["datasets"].items():
        if spec["source"] == "huggingface":
            for ours, message in range_errors(spec["splits"])[:1]:
                raise ConfigError(f"datasets.{name}.splits" + (f".{ours}" if ours else ""), message)


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
    """Every dataset, scale, run and objective one section names must exist in another, and
    the folder of the papers' numbers must exist (relative to the working directory)."""
    from .reference import missing

    reference = Path(p.config["reference_dir"])
    if not reference.is_dir():
        raise ConfigError("reference_dir", f"no folder {reference} in {Path.cwd()}: the papers' numbers live there")
    if missing(reference):
        raise ConfigError("reference_dir", f"{reference} lacks {', '.join(str(m) for m in missing(reference))}; "
                                            "restore it from the repository's reference/")
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
    _check_unsafe_tasks(p)
    if p.lm_eval["write_tasks_from"]:
        _need_dataset(p, "evaluation.lm_eval.write_tasks_from", p.lm_eval["write_tasks_from"])
        if p.is_synthetic(p.lm_eval["write_tasks_from"]):
            raise ConfigError("evaluation.lm_eval.write_tasks_from",
                              f"{p.lm_eval['write_tasks_from']!r} is synthetic: it has no text to make tasks of")
    _check_longctx(p)
    if not p.dimpo_enabled:
        return
    for key in ("dataset", "objectives", "d_prime"):
        if not p.dimpo.get(key):
            raise ConfigError(f"dimpo.{key}", "required when dimpo.models names a model")
    _need_dataset(p, "dimpo.dataset", p.dimpo["dataset"])
    for i, spec in enumerate(p.dimpo["models"]):
        if "run" not in spec:
            deep = [l for l in p.num_projected(spec["name"]) if spec.get("num_hidden_layers", l) < l]
            if deep and p.downstream["objectives"]:
                where = f"dimpo.models[{i}].num_projected" if "num_projected" in spec else "dimpo.downstream.num_projected"
                raise ConfigError(where, f"l={deep[0]} exceeds the {spec['num_hidden_layers']} layers of "
                                         f"{spec['hub']!r} (dimpo.models[{i}].num_hidden_layers)")
            continue
        if "num_hidden_layers" in spec:
            raise ConfigError(f"dimpo.models[{i}].num_hidden_layers",
                              f"run {spec['run']!r} has its own layers (its scale's architecture)")
        key = f"dimpo.models[{i}].run"
        if spec["run"] not in p.runs:
            raise ConfigError(key, f"unknown run {spec['run']!r}; known: {sorted(p.runs)}")
        run = p.runs[spec["run"]]
        if run.model["attention"] not in PROJECTABLE:
            raise ConfigError(key, f"DimPO projects a frozen {', '.join(PROJECTABLE)} model, not "
                                   f"{run.model['attention']!r}")
        head_dim = run.model["hidden_size"] // run.model["num_attention_heads"]
        depth = [l for l in p.num_projected(spec["name"]) if l > run.model["num_hidden_layers"]]
        if depth and p.downstream["objectives"]:
            where = f"dimpo.models[{i}].num_projected" if "num_projected" in spec else "dimpo.downstream.num_projected"
            raise ConfigError(where,
                              f"l={depth[0]} exceeds the {run.model['num_hidden_layers']} layers of run {spec['run']!r}")
        if run.synthetic:  # the recall corpus or the long-context suite: captured on its own examples
            _check_recall_capture(p, i, spec, run)
        elif p.dimpo_capture(spec["name"])["seq_len"] > run.training["seq_len"]:
            # our model's positions stop at its training length (max_position_embeddings)
            raise ConfigError(f"dimpo.models[{i}].capture.seq_len" if "seq_len" in spec.get("capture", {})
                              else "dimpo.capture.seq_len",
                              f"{p.dimpo_capture(spec['name'])['seq_len']} is beyond the "
                              f"{run.training['seq_len']}-token context of run {spec['run']!r}")
        own = f"dimpo.models[{i}].d_prime" if "d_prime" in spec else "dimpo.d_prime"
        widths = {own: p.grid(spec["name"], "d_prime")} | {
            f"dimpo.ablations.{study}.d_prime": a["d_prime"] for study, a in p.dimpo["ablations"].items()
            if spec["name"] in p.study_models(study)
        }
        for width_key, d_primes in widths.items():
            too_wide = [d for d in d_primes if d > head_dim]
            if too_wide:
                raise ConfigError(width_key,
                                  f"{too_wide[0]} exceeds the head dimension {head_dim} of run {spec['run']!r}")
    for study, spec in p.dimpo["ablations"].items():  # before the downstream studies read them
        stray = [m for m in spec.get("models", []) if m not in p.dimpo_models]
        if stray:
            raise ConfigError(f"dimpo.ablations.{study}.models", f"{stray[0]!r} is not in dimpo.models "
                                                                 f"({list(p.dimpo_models)})")
    _check_downstream(p)
    _check_top_k(p)
    studies = {"dimpo": p.dimpo} | {f"dimpo.ablations.{s}": a for s, a in p.dimpo["ablations"].items()}
    for prefix, spec in studies.items():
        seen = {}
        for i, overrides in enumerate(spec["settings"]):
            key = f"{prefix}.settings[{i}]"
            capture = [f for f in CAPTURE_FIELDS if f in overrides]
            if capture:
                raise ConfigError(key, f"{capture[0]} is a capture setting, shared by every fit of a model: "
                                       "set it in dimpo.hparams")
            name = setting_name(overrides)
            if name in seen:
                raise ConfigError(key, f"repeats settings[{seen[name]}] ({name})")
            seen[name] = i


# The suite's generator settings a model's vocabulary and layout depend on (dimattn.longctx.vocabulary:
# every subtask's task token is in it whatever the corpus asks): corpora scored together share them.
LONGCTX_VOCABULARY = ("n_keys", "n_values", "n_words", "needles", "question_first")


def _check_longctx(p: Plan) -> None:
    """evaluation.longctx.datasets are suite corpora; each is scored by every long-context run, so
    their vocabulary must be the runs' (the settings of LONGCTX_VOCABULARY alike). The generator's
    own refusals (dimattn.longctx.check_datasets) need numpy: rules/common.smk runs them after
    the plan, still before any job."""
    datasets = p.config["datasets"]
    for i, name in enumerate(p.config["evaluation"]["longctx"]["datasets"]):
        key = f"evaluation.longctx.datasets[{i}]"
        _need_dataset(p, key, name)
        if not p.is_longctx(name):
            raise ConfigError(key, f"{name!r} is not a {LONGCTX_SOURCE} corpus")
        for run in p.longctx_runs:
            own = datasets[p.runs[run].dataset]
            differ = [f for f in LONGCTX_VOCABULARY if datasets[name].get(f) != own.get(f)]
            if differ:
                raise ConfigError(f"datasets.{name}.{differ[0]}",
                                  f"{datasets[name].get(differ[0])!r} differs from {p.runs[run].dataset!r}'s "
                                  f"{own.get(differ[0])!r}, on which run {run!r} is trained: its vocabulary or layout differs")
            # a subtask the run never saw asked of it: its task token was never trained
            unseen = [t for t in datasets[name].get("subtasks", SUITE_SUBTASKS)
                      if t not in own.get("subtasks", SUITE_SUBTASKS)]  # fmt: skip
            if unseen:
                raise ConfigError(f"datasets.{name}.subtasks",
                                  f"asks {unseen}, which run {run!r} never trains on ({p.runs[run].dataset!r} "
                                  f"holds {own.get('subtasks', SUITE_SUBTASKS)})")


def _check_top_k(p: Plan) -> None:
    """A DimPO fit whose head term keeps every key of its list (k >= keys: KL plus a constant) is
    refused, naming the k or k_share that made it so. The layers merge as
    dimattn.projections.resolve_settings merges them (hparams < per_objective < setting; a k
    given alone clears an earlier share); a fit the config gives no k keeps its objective's
    default (dimpo: the paper's share, 1/64; dimpo_list: k = 0). The list is the capture's
    sequence length, or Appendix B's sampled keys."""
    hp = p.dimpo["hparams"]
    base = {name: value for name, value in hp.items() if name not in ("preset", "per_objective", "setting")}
    for model in p.dimpo_models:
        seq_len = p.dimpo_capture(model)["seq_len"]
        for fit in p.model_fits(model):
            if fit.objective not in HEAD_OBJECTIVES:
                continue
            main = fit.study == MAIN_STUDY
            prefix, study = ("dimpo", p.dimpo) if main else (f"dimpo.ablations.{fit.study}", p.dimpo["ablations"][fit.study])
            per = (hp.get("per_objective") or {}).get(fit.objective) or {}
            layers = [("dimpo.hparams", base), (f"dimpo.hparams.per_objective.{fit.objective}", per),
                      (f"{prefix}.settings[{fit.order}]", study["settings"][fit.order])]  # fmt: skip
            values, source = {}, None
            for key, layer in layers:
                if layer.get("k") is not None and layer.get("k_share") is not None:
                    raise ConfigError(f"{key}.k_share", f"set k ({layer['k']}) or k_share ({layer['k_share']}), not both")
                for name in ("k", "k_share"):
                    if layer.get(name) is not None:
                        values |= {"k": None, "k_share": None, name: layer[name]}
                        source = f"{key}.{name}"
                values |= {name: layer[name] for name in ("lam", "num_sampled_keys") if name in layer}
            if source is None or values.get("lam", 1) == 0:
                continue
            n_keys = key_list_length(seq_len, values.get("num_sampled_keys"))
            k = resolve_top_k(values["k"], values["k_share"], n_keys)
            if k >= n_keys:
                raise ConfigError(source, f"k={k} reaches the {n_keys} keys of {model!r}'s lists (capture seq_len "
                                          f"{seq_len}): DimPO's head term would keep every key, KL plus a constant; "
                                          "choose k < the keys, or k_share (the paper's 64 of 4,096: 0.015625)")


def _check_unsafe_tasks(p: Plan) -> None:
    """A task that runs the model's code needs evaluation.lm_eval.allow_unsafe_code; the
    projected models' scoring (dimpo.downstream.tasks) never opts in."""
    lm_tasks, ds_tasks = p.lm_eval["tasks"] if p.lm_eval_runs else [], p.downstream["tasks"] if p.dimpo_enabled else []
    own = {f.stem for f in (Path(__file__).parent / "lm_eval_tasks").glob("*.yaml")}  # never unsafe
    if all(t["name"] in own for t in [*lm_tasks, *ds_tasks]):
        return
    known = lm_eval_task_names()
    for key, tasks in (("evaluation.lm_eval.tasks", lm_tasks), ("dimpo.downstream.tasks", ds_tasks)):
        for i, task in enumerate(tasks):
            if known is not None and task["name"] not in own and task["name"] not in known:
                raise ConfigError(f"{key}[{i}].name",
                                  f"{task['name']!r} is neither a task of dimattn/lm_eval_tasks ({sorted(own)}) "
                                  "nor one lm-eval's task registry holds")
    unsafe = unsafe_lm_eval_tasks()
    for i, task in enumerate(lm_tasks):
        if task["name"] in unsafe and not p.lm_eval["allow_unsafe_code"]:
            raise ConfigError("evaluation.lm_eval.allow_unsafe_code",
                              f"evaluation.lm_eval.tasks[{i}] {task['name']!r} executes the model's code (lm-eval "
                              "unsafe_code): set allow_unsafe_code: true to opt in, or drop the task")
    for i, task in enumerate(ds_tasks):
        if task["name"] in unsafe:
            raise ConfigError(f"dimpo.downstream.tasks[{i}].name",
                              f"{task['name']!r} executes the model's code (lm-eval unsafe_code); only "
                              "evaluation.lm_eval opts in to that (allow_unsafe_code)")


def _check_recall_capture(p: Plan, i: int, spec: dict, run) -> None:
    """A recall or suite run is captured on its own corpus: whole examples, as many as its splits hold."""
    # the schema fills the recall corpus' defaults (seq_len, n_validation, n_test)
    data, capture = p.config["datasets"][run.dataset], p.dimpo_capture(spec["name"])
    if capture["seq_len"] != data["seq_len"]:
        raise ConfigError(f"dimpo.models[{i}].capture.seq_len",
                          f"{capture['seq_len']} is not the example length {data['seq_len']} of {run.dataset!r}, "
                          f"which run {spec['run']!r} is captured on")  # fmt: skip
    for purpose, split in (("fit_sequences", p.capture_split("fit")), ("eval_sequences", "test")):
        if capture[purpose] > data[f"n_{split}"]:
            raise ConfigError(f"dimpo.models[{i}].capture.{purpose}",
                              f"{capture[purpose]} exceeds the {data[f'n_{split}']} {split} examples of "
                              f"{run.dataset!r}")  # fmt: skip


def _check_downstream(p: Plan) -> None:
    ds = p.downstream
    if not ds["objectives"]:
        return
    if not ds["d_prime"]:
        raise ConfigError("dimpo.downstream.d_prime", "required when dimpo.downstream.objectives names one")
    bare = [m for m, spec in p.dimpo_models.items() if "num_projected" not in spec and not p.num_projected(m)]
    if bare:
        raise ConfigError("dimpo.downstream.num_projected", f"required when dimpo.downstream.objectives names one "
                                                            f"and a model sets none ({bare[0]!r})")
    for key in ("objectives", "d_prime"):
        for i, model in enumerate(p.dimpo_models):
            if not p.num_projected(model):
                continue  # fitted only
            asked, culprit = ds[key], f"dimpo.downstream.{key}"
            if key == "d_prime" and "downstream_d_prime" in p.dimpo_models[model]:
                asked, culprit = p.downstream_d_prime(model), f"dimpo.models[{i}].downstream_d_prime"
            unknown = [v for v in asked if v not in p.grid(model, key)]
            if unknown:
                where = f"dimpo.models[{i}].{key}" if key in p.dimpo_models[model] else f"dimpo.{key}"
                raise ConfigError(culprit, f"{unknown[0]!r} is not fitted for {model!r} ({where}: {p.grid(model, key)})")
    ruler = [t["name"] for t in ds["tasks"] if t["name"] in RULER_TASKS]
    short = [n for n in ds["metadata"].get("max_seq_lengths", []) if n < RULER_MIN_LENGTH]
    if ruler and (short or not ds["metadata"].get("max_seq_lengths")):
        raise ConfigError("dimpo.downstream.metadata.max_seq_lengths",
                          f"RULER tasks ({ruler[0]}, ...) need lengths of at least {RULER_MIN_LENGTH}, got "
                          f"{ds['metadata'].get('max_seq_lengths')}: shorter, ruler_vt never ends")
    for i, task in enumerate(ds["tasks"]):
        stray = [d for d in task.get("d_prime", []) if d not in ds["d_prime"]]
        if stray:
            raise ConfigError(f"dimpo.downstream.tasks[{i}].d_prime",
                              f"{stray[0]} is not among dimpo.downstream.d_prime {ds['d_prime']}: no projected model "
                              "of that width is made")  # fmt: skip
    for i, entry in enumerate(ds["studies"]):
        key = f"dimpo.downstream.studies[{i}]"
        if entry["study"] == MAIN_STUDY:
            for model in entry.get("models", p.dimpo_models):
                for name, known in (("objectives", p.grid(model, "objectives")), ("d_prime", p.grid(model, "d_prime"))):
                    stray = [v for v in entry.get(name, []) if v not in known]
                    if stray:
                        raise ConfigError(f"{key}.{name}", f"{stray[0]!r} is not fitted for {model!r} ({known})")
        elif entry["study"] not in p.dimpo["ablations"]:
            raise ConfigError(f"{key}.study", f"{entry['study']!r} is not a study of dimpo.ablations "
                                              f"({sorted(p.dimpo['ablations'])}) nor {MAIN_STUDY}")
        else:
            extra = [k for k in ("objectives", "d_prime") if k in entry]
            if extra:
                raise ConfigError(f"{key}.{extra[0]}", f"only a {MAIN_STUDY} entry chooses its {extra[0]}; "
                                                       f"{entry['study']!r} projects its own")
        fitted = list(p.dimpo_models) if entry["study"] == MAIN_STUDY else p.study_models(entry["study"])
        for model in entry.get("models", fitted):
            if model not in fitted:
                raise ConfigError(f"{key}.models", f"{model!r} is not fitted in {entry['study']!r} ({fitted})")
            layers = p.dimpo_layers(model)
            deep = [l for l in entry["num_projected"] if layers is not None and l > layers]
            if deep:
                raise ConfigError(f"{key}.num_projected", f"l={deep[0]} exceeds the {layers} layers of {model!r}")
    names = [k["name"] for k in ds["kv"]]
    for i, spec in enumerate(ds["kv"]):
        key = f"dimpo.downstream.kv[{i}]"
        depths = {l for model in p.dimpo_models for l in p.num_projected(model)}
        widths = list(dict.fromkeys(d for model in p.dimpo_models for d in p.downstream_d_prime(model)))
        for name, known in (("objectives", ds["objectives"]), ("num_projected", depths), ("d_prime", widths)):
            stray = [v for v in spec.get(name, []) if v not in known]
            if stray:
                raise ConfigError(f"{key}.{name}", f"{stray[0]!r} is not among the downstream {name} "
                                                   f"({sorted(known) if name == 'num_projected' else known})")
        stray = [m for m in spec.get("models", []) if m not in p.dimpo_models]
        if stray:
            raise ConfigError(f"{key}.models", f"{stray[0]!r} is not in dimpo.models ({list(p.dimpo_models)})")
        if spec["name"] in names[:i] or spec["name"] == NO_KV:
            raise ConfigError(f"{key}.name", f"{spec['name']!r} is taken")
        if "snapkv" in spec:
            window = spec["snapkv"]["window"]
            if spec["snapkv"]["budget"] <= window:
                raise ConfigError(f"{key}.snapkv.budget", f"{spec['snapkv']['budget']} must exceed the window, {window}")
        if "kivi" in spec:
            group, residual = spec["kivi"]["group_size"], spec["kivi"]["residual"]
            if residual % group:
                raise ConfigError(f"{key}.kivi.residual", f"{residual} is not a multiple of group_size {group}")
