"""The results/ layout: every path a rule writes, built here and nowhere else.

Each function takes names or Snakemake wildcard patterns ("{run}") alike, so the rules, the
scripts, the tests and ``make clean`` (``python -m dimattn.workflow.paths``) share one layout. Paths are
relative to the workflow's working directory. No torch.
"""

from __future__ import annotations

import sys
from pathlib import PurePosixPath

RESULTS = "results"
DATA = f"{RESULTS}/data"
MODELS = f"{RESULTS}/models"
CHECKPOINTS = f"{RESULTS}/checkpoints"
EVAL = f"{RESULTS}/eval"
DIMPO = f"{RESULTS}/dimpo"
SUMMARY = f"{RESULTS}/summary"
TABLES = f"{RESULTS}/tables"
FIGURES = f"{RESULTS}/figures"
SHARED_TOKENIZER = f"{RESULTS}/tokenizer"
LM_EVAL_DATA = f"{RESULTS}/lm_eval_data"
DOWNLOADS = "resources/downloads"
LOGS = "logs"
BENCH = "benchmarks/snakemake"
# Which tier (config `tier`) owns this working directory's outputs, and its run record (when it
# started and finished, the merged config's digest, the host): dimattn.workflow.tiers.
TIER_STAMP = f"{RESULTS}/tier.json"
PUBLISHED = "published"
SPLITS = ("train", "validation", "test")

# What a run of the workflow writes; `make clean` removes exactly these.
OUTPUT_DIRS = (DATA, SHARED_TOKENIZER, MODELS, CHECKPOINTS, EVAL, DIMPO, LM_EVAL_DATA, SUMMARY, TABLES,
               FIGURES, LOGS, BENCH, TIER_STAMP)


# --- data ---------------------------------------------------------------------------------------


def download(dataset: str) -> str:
    return f"{DOWNLOADS}/{dataset}.tar.gz"


def documents_dir(dataset: str) -> str:
    return f"{DATA}/{dataset}/documents"


def documents(dataset: str, split: str) -> str:
    return f"{documents_dir(dataset)}/{split}.jsonl"


def tokens(dataset: str, split: str) -> str:
    return f"{DATA}/{dataset}/tokens/{split}.bin"


def tokens_meta(dataset: str, split: str) -> str:
    return f"{DATA}/{dataset}/tokens/{split}.json"


def dataset_dir(dataset: str) -> str:
    return f"{DATA}/{dataset}"


def tokenizer(dataset: str, synthetic: bool) -> str:
    """Text corpora share one tokenizer; a synthetic corpus writes its own vocabulary."""
    return f"{DATA}/{dataset}/tokenizer" if synthetic else SHARED_TOKENIZER


# --- pretraining and evaluation -----------------------------------------------------------------


def model(run: str) -> str:
    return f"{MODELS}/{run}"


def checkpoints(run: str) -> str:
    """Not a Snakemake output: a killed or retried job resumes from here."""
    return f"{CHECKPOINTS}/{run}"


def partial(output: str) -> str:
    """Where a scoring job keeps each lm-eval task's result until ``output`` is written (under
    CHECKPOINTS, as a run's: not a Snakemake output, so a retry finds them)."""
    return f"{CHECKPOINTS}/{PurePosixPath(output).relative_to(RESULTS).with_suffix('')}"


def perplexity(run: str, dataset: str) -> str:
    return f"{EVAL}/{run}/perplexity_{dataset}.json"


def recall(run: str, dataset: str) -> str:
    return f"{EVAL}/{run}/recall_{dataset}.json"


def longctx(run: str, dataset: str) -> str:
    """The long-context suite's scores of a run on one suite corpus (dimattn.data.longctx)."""
    return f"{EVAL}/{run}/longctx_{dataset}.json"


def lm_eval(run: str) -> str:
    return f"{EVAL}/{run}/lm_eval.json"


def lm_eval_data(task: str) -> str:
    """The JSONL a task YAML of dimattn/evaluation/lm_eval_tasks reads (its data_files name this path)."""
    return f"{LM_EVAL_DATA}/{task}.jsonl"


# --- DimPO --------------------------------------------------------------------------------------


def capture(model: str, purpose: str) -> str:
    return f"{DIMPO}/{model}/capture_{purpose}.safetensors"


def projection(model: str, objective: str, setting: str, d_prime, seed) -> str:
    """``setting``: dimattn.workflow.vocabulary.setting_name, "default" for dimpo.hparams as they are."""
    return f"{DIMPO}/{model}/projections/{objective}/{setting}/d{d_prime}-s{seed}.safetensors"


def fidelity(model: str, objective: str, setting: str, d_prime, seed) -> str:
    return f"{DIMPO}/{model}/fidelity/{objective}/{setting}/d{d_prime}-s{seed}.csv"


def fit_partial(model: str, objective: str, setting: str, d_prime) -> str:
    """Where a fit_projection job keeps each seed's fit until all are written (under CHECKPOINTS:
    not a Snakemake output, so a retry finds them)."""
    folder = PurePosixPath(projection(model, objective, setting, d_prime, 0)).parent  # the projections'
    return f"{CHECKPOINTS}/{folder.relative_to(RESULTS)}/d{d_prime}"


def prefetched() -> str:
    """Marker of the prefetch rule: the hub models and lm-eval task data are in the HF cache."""
    return f"{DIMPO}/prefetched.json"


def projected_model(model: str, objective: str, setting: str, d_prime, num_projected, kv: str, seed) -> str:
    """A projected model directory (dimattn.model.modeling_projected) of the fit ``setting`` with
    ``seed``; objective "base": the base model."""
    return f"{DIMPO}/{model}/projected/{objective}/{setting}/d{d_prime}-l{num_projected}-{kv}-s{seed}"


def latency(model: str) -> str:
    """Prefill and decoding latency, cache and peak memory of a dimpo model's settings (Appendix H)."""
    return f"{DIMPO}/{model}/latency.json"


def downstream(model: str, objective: str, setting: str, d_prime, num_projected, kv: str, seed) -> str:
    """Perplexity, recall-probe and lm-eval scores of a projected model."""
    return f"{DIMPO}/{model}/downstream/{objective}/{setting}/d{d_prime}-l{num_projected}-{kv}-s{seed}.json"


# --- reporting ----------------------------------------------------------------------------------


def summary(name: str) -> str:
    return f"{SUMMARY}/{name}.csv"


def published(tier: str) -> str:
    """A tier's shipped summaries, tables and manifest.json (tracked; dimattn.reporting.published)."""
    return f"{PUBLISHED}/{tier}"


def table(name: str) -> str:
    return f"{TABLES}/{name}.tex"


def figure(name: str) -> str:
    return f"{FIGURES}/{name}.png"


# --- logs and Snakemake benchmark files ---------------------------------------------------------


def log(stage: str, name: str) -> str:
    return f"{LOGS}/{stage}/{name}.log"


def bench(rule: str, name: str) -> str:
    """Snakemake's benchmark file of one job, in a folder named after its rule (so that
    benchmarks/training.py --dag-times reads the rule off the path)."""
    return f"{BENCH}/{rule}/{name}.tsv"


if __name__ == "__main__":
    # `python -m dimattn.workflow.paths`: the output folders, one a line, for `make clean`.
    sys.stdout.write("\n".join(OUTPUT_DIRS) + "\n")
