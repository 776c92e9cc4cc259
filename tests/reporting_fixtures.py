"""Raw outputs shaped like the other stages' (built here), their summaries, and table helpers,
for the tests of dimattn.reporting (tests/unit/test_summaries.py, tests/test_reporting_*.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from dimattn.workflow import paths

from dimattn.model import variants
from dimattn.reporting import latex, summaries
from dimattn.workflow.sweeps import RULER_TASKS

REFERENCE = Path(__file__).resolve().parents[1] / "reference"


def summary_path(summary_dir: Path, name: str) -> Path:
    return summary_dir / Path(paths.summary(name)).name


# ----------------------------------------------------------------------------- a small d_down sweep
#
# One text scale (d = 128): Vanilla, and DAR (w = 32) and Uniform at d_down/d in {1/8, 1/4, 1/2},
# the ratios of seed 000 Table 1 (64, 128, 256 of d = 512), on two corpora.

HIDDEN = 128
WINDOW = 32
D_DOWNS = (16, 32, 64)
VANILLA_PPL = {"shakespeare": 60.0, "tinystories_val": 12.0}
# Relative perplexities (%) the fixtures are built to give, per (attention, d_down).
REL = {
    ("dar", 64): 99.0,
    ("dar", 32): 100.5,
    ("dar", 16): 103.0,
    ("uniform", 64): 102.0,
    ("uniform", 32): 106.0,
    ("uniform", 16): 112.5,
}
HEAD_DIM = 32
D_PRIMES = (2, 4, 8, 16)
N_LAYERS = 4


def run_name(attention: str, d_down: int | None) -> str:
    if attention == "vanilla":
        return f"tiny_vanilla_d{HIDDEN}"
    if attention == "dar":
        return f"tiny_dar_w{WINDOW}_d{d_down}"
    return f"tiny_uniform_d{d_down}"


def sweep():
    yield "vanilla", None
    for attention in ("dar", "uniform"):
        for d_down in D_DOWNS:
            yield attention, d_down


def small_fields(attention: str, d_down: int | None) -> dict:
    """The run fields every raw output carries (dimattn.workflow.runs.run_metadata)."""
    model = {"attention": attention, "hidden_size": HIDDEN, "d_down": d_down, "window": WINDOW}
    return variants.run_fields(run_name(attention, d_down), model)


def write_json(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def write_eval_jsons(root: Path, corpora=tuple(VANILLA_PPL), with_vanilla: bool = True) -> list[Path]:
    paths_ = []
    for attention, d_down in sweep():
        if attention == "vanilla" and not with_vanilla:
            continue
        for corpus in corpora:
            ppl = VANILLA_PPL[corpus] * REL.get((attention, d_down), 100.0) / 100
            record = small_fields(attention, d_down) | {
                "corpus": corpus,
                "split": "test",
                "n_tokens": 123456,
                "loss": math.log(ppl),
                "ppl": ppl,
            }
            paths_.append(write_json(root / "eval" / f"{record['run']}.{corpus}.json", record))
    return paths_


def write_scale_without_vanilla(root: Path) -> list[Path]:
    """The small sweep on shakespeare plus a d = 2048 DAR run (d_down = d) without a Vanilla of its width."""
    paths_ = write_eval_jsons(root, corpora=("shakespeare",))
    record = json.loads(paths_[1].read_text()) | {"run": "big-dar", "hidden_size": 2048, "d_down": 2048}
    return paths_ + [write_json(root / "big.json", record)]


def vanilla_val_loss(step: int) -> float:
    return 4.2 + 3.0 * math.exp(-step / 150)


def write_model_dirs(root: Path, with_vanilla: bool = True) -> list[Path]:
    """config.json + metrics.csv per run; validation every 50 steps, 10 tokens-per-step lines between."""
    dirs = []
    for attention, d_down in sweep():
        if attention == "vanilla" and not with_vanilla:
            continue
        run = root / "models" / run_name(attention, d_down)
        run.mkdir(parents=True)
        config = {
            "model_type": "dimattn",
            "attention": attention,
            "window": 128 if attention != "dar" else WINDOW,  # the config default is kept for every variant
            "d_down": d_down,
            "hidden_size": HIDDEN,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
        }
        (run / "config.json").write_text(json.dumps(config))
        final = REL.get((attention, d_down), 100.0) / 100
        lines = ["step,tokens,lr,train_loss,val_loss"]
        for step in range(0, 501, 10):
            # Early gap above Vanilla that narrows towards the final relative perplexity.
            gap = math.log(final) + 0.08 * math.exp(-step / 120) * (attention != "vanilla")
            val = vanilla_val_loss(step) + gap
            # The vanilla run skips its step-450 evaluation: that step has no baseline.
            evaluated = step % 50 == 0 and not (attention == "vanilla" and step == 450)
            lines.append(f"{step},{step * 8192},0.0006,{val + 0.05:.6f},{f'{val:.6f}' if evaluated else ''}")
        (run / "metrics.csv").write_text("\n".join(lines) + "\n")
        dirs.append(run)
    return dirs


def write_lm_eval_jsons(root: Path) -> list[Path]:
    paths_ = []
    for attention, d_down in sweep():
        rel = REL.get((attention, d_down), 100.0) / 100
        record = small_fields(attention, d_down) | {
            "results": {
                "wikitext": {
                    "alias": "wikitext",
                    "word_perplexity,none": 310.0 * rel,
                    "word_perplexity_stderr,none": "N/A",
                    "byte_perplexity,none": 2.9 * rel,
                    "byte_perplexity_stderr,none": "N/A",
                    "bits_per_byte,none": math.log2(2.9 * rel),
                    "bits_per_byte_stderr,none": "N/A",
                },
                "lambada_openai": {
                    "alias": "lambada_openai",
                    "perplexity,none": 900.0 * rel,
                    "perplexity_stderr,none": 40.0,
                    "acc,none": 0.12 / rel,
                    "acc_stderr,none": 0.0045,
                },
            },
        }
        paths_.append(write_json(root / "lm_eval" / f"{record['run']}.json", record))
    return paths_


FIDELITY_SCALE = {"random": (2.5, 0.02), "pca": (0.9, 0.004), "dimpo": (0.35, 0.0015), "kl": (0.25, 0.0011)}
# A fit's KL and MSE per seed: seed 1 20 % above seed 0, seed 2 as far below. DimPO's fits swing
# the other way, so that KL's fits, 0.7 x DimPO's at seed 0, come out above them at seed 1: the
# difference changes sign, and KL is within DimPO's seed spread.
FIT_SEED_FACTOR = {0: 1.0, 1: 1.2, 2: 0.8}
FIT_SWING = {"dimpo": -1}


def fit_factor(objective: str, seed: int) -> float:
    """What the fit of ``objective`` with ``seed`` multiplies seed 0's KL and MSE by."""
    return 1 + FIT_SWING.get(objective, 1) * (FIT_SEED_FACTOR[seed] - 1)


def write_fidelity_csvs(root: Path, setting: str = "default", seeds=(0,), objectives=None, d_primes=None,
                        folder: str = "dimpo") -> list[Path]:
    """A fidelity CSV per (objective, d', seed) in the format of dimattn.dimpo.projections.fidelity_to_file;
    seed s multiplies seed 0's KL and MSE by ``fit_factor``. ``setting`` applies to DimPO's fits;
    the inference-scale columns are 1.5 x KL and MSE, the top-4 recall 1 - KL / (1 + KL)."""
    rng = np.random.default_rng(0)
    paths_ = []
    for objective, (kl0, mse0) in FIDELITY_SCALE.items():
        if objectives is not None and objective not in objectives:
            continue
        for d_prime in D_PRIMES if d_primes is None else d_primes:
            shrink = (HEAD_DIM / d_prime) ** (0.1 if objective == "random" else 0.35)
            rows = [
                {
                    "model": "tiny_vanilla_d128",
                    "objective": objective,
                    "setting": setting if objective == "dimpo" else "default",
                    "d_prime": d_prime,
                    "head_dim": HEAD_DIM,
                    "layer": layer,
                    "kl": kl0 * shrink * (1 + 0.1 * layer + 0.02 * rng.standard_normal()),
                    "mse": mse0 * shrink * (1 + 0.1 * layer),
                }
                for layer in range(N_LAYERS)
            ]
            frame = pd.DataFrame(rows)
            for seed in seeds:
                factor = fit_factor(objective, seed)
                fit = frame.assign(kl=frame["kl"] * factor, mse=frame["mse"] * factor, seed=seed)
                fit = fit.assign(kl_inference=1.5 * fit["kl"], mse_inference=1.5 * fit["mse"], top_k=4,
                                 topk_recall=(1 - fit["kl"] / (1 + fit["kl"])).clip(0, 1))
                path = root / folder / f"{objective}_{fit['setting'].iloc[0]}_d{d_prime}_s{seed}.csv"
                path.parent.mkdir(parents=True, exist_ok=True)
                fit[summaries.FIDELITY_COLUMNS].to_csv(path, index=False)
                paths_.append(path)
    return paths_


# DimPO studies beside Table 1's grid (dimpo.ablations): study -> (settings, d') of DimPO fits.
STUDIES = {
    "quirks": (["preset=authors", "preset=authors,causal=true", "preset=ours"], [4]),
    "table6": (["k=0,lam=0", "k=64,lam=1", "k=64,lam=2"], [16]),
    "figure4a": (["pair_mode=all,num_sampled_keys=2", "pair_mode=all,num_sampled_keys=8"], [4]),
    "figure4b": (["pair_mode=halves,num_pairs=1", "pair_mode=halves,num_pairs=4"], [4]),
    "figure4c": (["pair_mode=distance,pair_distance=1", "pair_mode=distance,pair_distance=64"], [4]),
}


def write_fidelity_summary(root: Path, summary: Path, seeds=(0,)) -> Path:
    """The fidelity summary of Table 1's grid and every study of STUDIES, as summarize_fidelity
    writes it from the workflow's per-fit CSVs."""
    csvs = write_fidelity_csvs(root, seeds=seeds)
    studies = {}
    for study, (settings, d_primes) in STUDIES.items():
        for order, setting in enumerate(settings):
            for path in write_fidelity_csvs(root, setting=setting, seeds=seeds, objectives=["dimpo"],
                                            d_primes=d_primes, folder=f"{study}{order}"):
                csvs.append(path)
                studies[str(path)] = [[study, order]]
    out = summary_path(summary, "dimpo_fidelity")
    summaries.summarize_fidelity(csvs, out, studies=studies)
    return out


# Downstream scores of projected models (dimattn.evaluation.projected.score_projected): per objective, the
# next-line accuracy and perplexity at l = 0 (base), 2 and 4 of 4 layers.
DOWNSTREAM = {
    ("base", 0): (0.40, 50.0),
    ("pca", 2): (0.36, 60.0), ("pca", 4): (0.30, 80.0),
    ("kl", 2): (0.39, 52.0), ("kl", 4): (0.37, 55.0),
    ("dimpo", 2): (0.40, 51.0), ("dimpo", 4): (0.38, 54.0),
}


def write_downstream_jsons(root: Path, seeds=(0,)) -> list[Path]:
    """Fit seed s > 0 scores DOWNSTREAM's accuracy + 0.01 s and perplexity + s (the base model once)."""
    paths_ = []
    for (objective, l), (acc0, ppl0), seed in [(k, v, s) for k, v in DOWNSTREAM.items() for s in seeds]:
        if objective == "base" and seed:
            continue
        acc, ppl = acc0 + 0.01 * seed, ppl0 + seed
        record = {
            "model": "tiny_vanilla_d128", "objective": objective, "setting": "default",
            "d_prime": 0 if objective == "base" else 8,
            "num_projected": l, "n_layers": 4, "scale": "d_prime", "kv": "none", "kv_method": "none", "kv_level": 0,
            "seed": seed,
            "perplexity": {"shakespeare": {"ppl": ppl, "loss": math.log(ppl), "n_tokens": 1000}},
            "results": {"dimattn_next_line": {"alias": "dimattn_next_line", "acc,none": acc, "acc_stderr,none": 0.02}},
            "num_fewshot": {"dimattn_next_line": 0},
        }
        path = root / "downstream" / f"{objective}-l{l}-s{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        paths_.append(path)
    return paths_


# Seed 003 Tables 2-3 and 5: long-context probes, with KV compression
# (objective, l, kv) -> recall accuracy per distance bin [8-20, 21-33]; fit seed s adds 0.01 s
LONG_RECALL = {
    ("base", 0, "none"): (0.90, 0.80), ("base", 0, "kivi2"): (0.88, 0.70), ("base", 0, "snapkv8"): (0.60, 0.50),
    ("kl", 1, "none"): (0.85, 0.75), ("kl", 2, "none"): (0.70, 0.60),
    ("dimpo", 1, "none"): (0.86, 0.74), ("dimpo", 2, "none"): (0.50, 0.40),
    ("dimpo", 2, "kivi2"): (0.45, 0.35), ("dimpo", 2, "snapkv8"): (0.30, 0.20),
}
KV = {"none": ("none", 0), "kivi2": ("kivi", 2), "snapkv8": ("snapkv", 8)}
N_BIN = (30, 10)  # queries per bin: the overall accuracy weighs them


def _record(model, objective, l, kv, seed, n_layers=2):
    method, level = KV[kv]
    return {"model": model, "objective": objective, "setting": "default", "d_prime": 0 if objective == "base" else 4,
            "num_projected": l,
            "n_layers": n_layers, "scale": "d_prime", "kv": kv, "kv_method": method, "kv_level": level, "seed": seed,
            "perplexity": {}, "recall": {}, "results": {}, "num_fewshot": {}}


def write_long_context_jsons(root: Path, seeds=(0, 1)) -> list[Path]:
    """Projected models of a recall run (LONG_RECALL, with KIVI and SnapKV) and of a hub model on RULER."""
    written = []
    for (objective, l, kv), accs in LONG_RECALL.items():
        for seed in seeds if objective != "base" else (0,):
            record = _record("recall-vanilla", objective, l, kv, seed)
            bins = [{"min_distance": lo, "max_distance": hi, "accuracy": a + 0.01 * seed, "n": n}
                    for (lo, hi), a, n in zip([(8, 20), (21, 33)], accs, N_BIN)]
            overall = sum(b["accuracy"] * b["n"] for b in bins) / sum(N_BIN)
            record["recall"]["recall"] = {"split": "test", "accuracy": overall, "n_queries": sum(N_BIN),
                                          "by_distance": bins, "chance": 1 / 16, "prefill": 16}
            written.append(root / "long" / f"{objective}-l{l}-{kv}-s{seed}.json")
            written[-1].parent.mkdir(parents=True, exist_ok=True)
            written[-1].write_text(json.dumps(record))
    # a hub model on RULER at 4096 (8192 not run: lm-eval writes -1); subtask i scores (50 + i) / 100
    for objective, l, shift in (("base", 0, 40), ("dimpo", 20, 0), ("kl", 20, 10)):
        record = _record("tiny-llama", objective, l, "none", 0, n_layers=32)
        record["results"] = {task: {"alias": task, "4096,none": (50 + i + shift) / 100, "8192,none": -1}
                             for i, task in enumerate(RULER_TASKS)}
        written.append(root / "long" / f"llama-{objective}.json")
        written[-1].write_text(json.dumps(record))
    return written


# ----------------------------------------------------------------------------- the long-context suite

NEEDLE_BINS = [(0.0, 0.5), (0.5, 1.0)]
# niah_multikey scores (%) per (run, seq_len), a value per needle-depth bin
NEEDLE_SCORES = {("long-vanilla", 128): [100.0, 80.0], ("long-vanilla", 256): [60.0, 40.0],
                 ("long-dar-w8-d16", 128): [90.0, 10.0], ("long-dar-w8-d16", 256): [20.0, 0.0]}


def longctx_record(run: str, seq_len: int) -> dict:
    """A longctx job's JSON (dimattn.data.longctx): niah_single 100 in every bin, niah_multikey NEEDLE_SCORES."""
    model = {"attention": "vanilla", "hidden_size": 64} if run == "long-vanilla" else \
        {"attention": "dar", "hidden_size": 64, "d_down": 16, "window": 8}
    bins = [{"depth_lo": lo, "depth_hi": hi, "score": s, "n": 6 + i}
            for i, ((lo, hi), s) in enumerate(zip(NEEDLE_BINS, NEEDLE_SCORES[run, seq_len]))]
    needle = {"niah_single": [b | {"score": 100.0} for b in bins], "niah_multikey": bins}
    return {"run": run, **model, "seed": 0, "corpus": f"suite{seq_len}", "split": "test", "seq_len": seq_len,
            "subtasks": {"niah_single": {"score": 0.0, "exact": 0.0, "n": 13}}, "average": 0.0, "needle": needle}


def write_longctx_jsons(root: Path) -> list[Path]:
    """The suite's JSONs of NEEDLE_SCORES' runs, the DAR run first (a figure still puts the base first)."""
    out = []
    for run, seq_len in NEEDLE_SCORES:
        out.append(write_json(root / "longctx" / f"{run}_{seq_len}.json", longctx_record(run, seq_len)))
    return out[::-1]


# suite averages (%) per (objective, l): the objectives lie furthest apart at l = 2 (20 points)
PROJECTED_AVERAGE = {("base", 0): 70.0, ("kl", 1): 60.0, ("dimpo", 1): 58.0, ("kl", 2): 50.0, ("dimpo", 2): 30.0}
# niah_multikey per needle-depth bin at 128 tokens (seed s adds s); 256 tokens: 10 less
PROJECTED_NEEDLE = {("base", 0): [100.0, 80.0], ("kl", 1): [99.0, 99.0], ("dimpo", 1): [99.0, 99.0],
                    ("kl", 2): [70.0, 50.0], ("dimpo", 2): [40.0, 20.0]}


def write_projected_suite_jsons(root):
    """score_projected records of a suite model (2 layers): base, KL and DimPO at l = 1, 2, fit seeds 0, 1."""
    out = []
    for (objective, l), average in PROJECTED_AVERAGE.items():
        for seed in (0, 1) if objective != "base" else (0,):
            record = _record("long", objective, l, "none", seed)
            for seq_len, shift in ((128, 0.0), (256, -10.0)):
                bins = [{"depth_lo": lo, "depth_hi": hi, "score": s + seed + shift, "n": 5}
                        for (lo, hi), s in zip([(0.0, 0.5), (0.5, 1.0)], PROJECTED_NEEDLE[objective, l])]
                record.setdefault("longctx", {})[f"suite{seq_len}"] = {
                    "split": "test", "seq_len": seq_len, "average": average + shift,
                    "subtasks": {"niah_multikey": {"score": average + shift, "exact": 0.0, "n": 10}},
                    "needle": {"niah_multikey": bins}}
            out.append(write_json(root / "suite" / f"{objective}-l{l}-s{seed}.json", record))
    return out


def write_latency_json(root: Path) -> Path:
    """dimattn.evaluation.latency rows of one model: fixed times, the cache of DimPO at d' = d / 4."""
    rows = []
    for i, (setting, l, kv, cache) in enumerate([("base", 0, "none", 1.0), ("snapkv", 0, "snapkv", 0.25),
                                                ("dimpo l=4", 4, "none", 0.625)]):
        rows.append(
            {
                "model": "tiny_vanilla_d128",
                "d_prime": 8,
                "setting": setting,
                "num_projected": l,
                "kv": kv,
                "device": "cpu",
                "dtype": "float32",
                "prompt": 1024,
                "new": 32,
                "repeats": 3,
                "prefill_s": 0.1 + 0.01 * i,
                "decode_s": 0.01,
                "tokens_per_s": 100.0,
                "cache_bytes": 2**20 * cache,
                "peak_bytes": 2**24 + 2**20 * cache,
                "peak_kind": "weights_plus_cache",
                "prefill_ratio": 1 + 0.1 * i,
                "decode_ratio": 1.0,
                "cache_ratio": cache,
                "peak_ratio": 1.0,
            }
        )
    path = root / "latency" / "tiny.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def write_summaries(root: Path) -> Path:
    """The small sweep's perplexity, trajectory, lm-eval and fidelity summaries."""
    summary = root / "summary"
    summaries.summarize_perplexity(write_eval_jsons(root), summary_path(summary, "dar_perplexity"))
    summaries.summarize_trajectory(write_model_dirs(root), summary_path(summary, "dar_trajectory"))
    summaries.summarize_lm_eval(write_lm_eval_jsons(root), summary_path(summary, "lm_eval"))
    summaries.summarize_fidelity(write_fidelity_csvs(root), summary_path(summary, "dimpo_fidelity"))
    return summary


# ----------------------------------------------------------------------------- the full sweep
#
# The shape of the default config: a text scale "tiny" (d = 128) with seed 000's d_down sweep
# (d_down = d is the no-bottleneck control), a window sweep at d_down = 32 and the seed 001
# variants; a second text scale "micro" (d = 64) for Table 2; a recall scale (d = 64 too, on the
# synthetic corpus) with its own sweeps. Nothing reads run names: only the run fields.

TEXT = "shakespeare"
RECALL = "mqar"
BINS = [(17, 43), (44, 70), (71, 97), (98, 124)]
CHANCE = 1 / 64


def spec(
    scale,
    attention,
    hidden_size,
    d_down=None,
    window=None,
    dilation=None,
    bottleneck_activation="linear",
    full_attention_every=None,
    attention_layers=None,
    rel=100.0,
    acc=None,
    far=None,
    rel_jitter=0.6,
    acc_jitter=0.03,
    swing=1,
):
    """A planned run (seed 0) and what its outputs are built to give: ``rel`` (% of Vanilla's
    perplexity, text) or ``acc`` (recall accuracy; ``far`` of its farthest bin), and how far its
    replicates lie from that (``replicated``): ``rel_jitter``, ``acc_jitter``, and ``swing``, +1
    for seed 1 above and seed 2 below, -1 for the other way round."""
    model = {"attention": attention, "hidden_size": hidden_size}
    for key, value in (("window", window), ("dilation", dilation), ("d_down", d_down),
                       ("full_attention_every", full_attention_every), ("attention_layers", attention_layers)):
        if value is not None:
            model[key] = value
    if bottleneck_activation != "linear":
        model["bottleneck_activation"] = bottleneck_activation
    name = variants.run_name(scale, model)
    return {
        "run": name,
        "scale": scale,
        "model": model,
        "dataset": RECALL if scale == "recall" else TEXT,
        "synthetic": scale == "recall",
        "seed": 0,
        "rel": rel,
        "acc": acc,
        "far": far,
        "rel_jitter": 0.0 if attention == "vanilla" else rel_jitter,  # Vanilla varies through its seed factor
        "acc_jitter": acc_jitter,
        "swing": swing,
    }


# Jitters and swings are chosen for the marks "within the seed spread" (replicates.Spread.overlaps:
# paired by seed, a difference that changes sign): runs compared with swings opposed differ by
# their values -/+ the sum of their jitters, so the mark is set where their ranges overlap; runs
# that swing alike differ by -/+ the difference of their jitters, so ranges may overlap unmarked.
FULL = [
    spec("tiny", "vanilla", 128),
    spec("tiny", "dar", 128, 16, 32, rel=104.0),
    spec("tiny", "dar", 128, 32, 32, rel=99.5),
    spec("tiny", "dar", 128, 64, 32, rel=98.5),
    spec("tiny", "dar", 128, 128, 32, rel=99.0),
    spec("tiny", "uniform", 128, 16, rel=112.0),
    spec("tiny", "uniform", 128, 32, rel=106.5),
    spec("tiny", "uniform", 128, 64, rel=102.5, rel_jitter=4.0, swing=-1),  # within DAR's seed spread at d/2
    # The best window (64) swings against w = 16 and 1, alike with w = 4: w = 4's range reaches
    # the best's, but it is worse at every seed.
    *[spec("tiny", "dar", 128, 32, w, rel=r, swing=v)
      for w, r, v in ((0, 107.0, 1), (1, 101.5, 1), (4, 100.2, -1), (16, 99.8, 1), (64, 99.4, -1))],
    spec("tiny", "swa", 128, window=32, rel=103.25),
    spec("tiny", "dilated", 128, window=32, dilation=4, rel=101.75),
    spec("tiny", "swa", 128, window=32, full_attention_every=2, rel=100.75),
    spec("tiny", "dar", 128, 32, 32, bottleneck_activation="sigmoid", rel=99.75),
    spec("tiny", "dar", 128, 32, 32, attention_layers=[2, 3], rel=99.25),
    spec("micro", "vanilla", 64),
    # 0.25 % above Vanilla at every seed, though Vanilla's seed factor spreads both by -/+ 2 %.
    spec("micro", "dar", 64, 16, 32, rel=100.25, rel_jitter=0.2),
    spec("recall", "vanilla", 64, acc=0.9),
    *[spec("recall", "dar", 64, d, 16, acc=a, acc_jitter=j, swing=v)
      for d, a, j, v in ((2, 0.12, 0.02, 1), (4, 0.35, 0.05, 1), (8, 0.7, 0.06, -1), (16, 0.85, 0.1, 1))],
    *[spec("recall", "uniform", 64, d, acc=a) for d, a in ((2, 0.05), (4, 0.2), (8, 0.5))],
    # w = 1 swings against w = 0 and against the best window (16, d_down = 8 above); w = 4 with
    # the best: its range reaches the best's, yet it is below at every seed.
    *[spec("recall", "dar", 64, 8, w, acc=a, acc_jitter=j, swing=v)
      for w, a, j, v in ((0, 0.45, 0.03, -1), (1, 0.6, 0.15, 1), (4, 0.65, 0.03, -1))],
    spec("recall", "swa", 64, window=16, acc=0.25, far=0.0),
    spec("recall", "dilated", 64, window=16, dilation=4, acc=0.4),
    spec("recall", "swa", 64, window=16, full_attention_every=2, acc=0.8, acc_jitter=0.08, swing=-1),
]
VANILLA_TEXT_PPL = {128: 200.0, 64: 260.0}
DATASETS = {s["run"]: s["dataset"] for s in FULL}


# Replicates: seed 1 lies a run's jitter above (below, where it swings the other way), seed 2 as
# far on the other side, so that the mean is seed 0's value (the one-seed fixture) and min/max
# are value -/+ jitter. Every run of a seed shares that seed's Vanilla factor (perplexity times
# it, loss plus its log) and lm-eval factor, which pairing by seed cancels.
SEED_SIGN = {0: 0, 1: 1, 2: -1}
VANILLA_SEED_FACTOR = {0: 1.0, 1: 1.02, 2: 0.98}
LM_ACC_JITTER = 0.02


def replicated(runs=FULL, seeds=(0, 1, 2)) -> list[dict]:
    """Each of ``runs`` trained with each of ``seeds`` (run names ``-s1``, ``-s2``)."""
    out = []
    for s in runs:
        for seed in seeds:
            sign = SEED_SIGN[seed] * s["swing"]
            out.append(s | {"run": variants.run_name(s["scale"], s["model"], seed), "seed": seed,
                            "rel": s["rel"] + sign * s["rel_jitter"],
                            "acc": None if s["acc"] is None else s["acc"] + sign * s["acc_jitter"]})
    return out


def fields(s: dict) -> dict:
    """What dimattn.workflow.sweeps.Run.fields gives the planned run (the run fields, scale, dataset, synthetic)."""
    return variants.run_fields(s["run"], s["model"], s["seed"]) | {k: s[k] for k in ("scale", "dataset", "synthetic")}


def bin_accuracies(s):
    """Near bins above the overall accuracy, far ones below; the far value when given."""
    acc = s["acc"]
    near = min(1.0, acc + 0.1)
    far = s["far"] if s["far"] is not None else max(0.0, acc - 0.1)
    return [near, acc, acc, far]


def cache_bytes(model: dict) -> float:
    """What a run's cache would hold a token (4 layers, float32): full keys and values, d_down
    wide on a bottleneck, a window's share of 256 tokens on a sliding one."""
    width = 2 * model["hidden_size"] if model.get("d_down") is None else model["d_down"] + 2 * model["hidden_size"] / 8
    share = min(1.0, model["window"] / 256) if model["attention"] == "swa" else 1.0
    return 4 * 4 * width * share


def write_full(root: Path, runs=FULL) -> dict[str, list[Path]]:
    """Raw outputs of ``runs``: perplexity and lm-eval JSON of text runs, recall JSON of synthetic
    ones, and every run's model directory."""
    out = {"ppl": [], "recall": [], "models": [], "lm": []}
    for s in runs:
        seed, sign = s["seed"], SEED_SIGN[s["seed"]]
        meta = variants.run_fields(s["run"], s["model"], seed)
        hidden, d_down = s["model"]["hidden_size"], s["model"].get("d_down")
        run_dir = root / "eval" / s["run"]
        run_dir.mkdir(parents=True)
        if s["synthetic"]:
            rec = meta | {
                "corpus": RECALL,
                "split": "test",
                "accuracy": s["acc"],
                "n_queries": 4096,
                "by_distance": [
                    {"min_distance": lo, "max_distance": hi, "accuracy": a, "n": 1024}
                    for (lo, hi), a in zip(BINS, bin_accuracies(s))
                ],
                "chance": CHANCE,
                "cache_bytes_per_token": cache_bytes(s["model"]),
            }
            (run_dir / f"recall_{RECALL}.json").write_text(json.dumps(rec))
            out["recall"].append(run_dir / f"recall_{RECALL}.json")
        else:
            ppl = VANILLA_TEXT_PPL[hidden] * VANILLA_SEED_FACTOR[seed] * s["rel"] / 100
            record = meta | {"corpus": TEXT, "split": "test", "n_tokens": 1000, "loss": math.log(ppl), "ppl": ppl,
                             "cache_bytes_per_token": cache_bytes(s["model"])}
            (run_dir / f"perplexity_{TEXT}.json").write_text(json.dumps(record))
            out["ppl"].append(run_dir / f"perplexity_{TEXT}.json")
            # Downstream: accuracy follows the bottleneck like seed 000 Table 4; bits per byte the perplexity.
            ratio = (d_down or hidden) / hidden
            acc = 0.25 * {1: 1.0, 0.5: 1.02, 0.25: 1.04, 0.125: 0.9}.get(ratio, 1.0) * (1 + sign * LM_ACC_JITTER)
            lm = meta | {
                "results": {
                    "dimattn_next_line": {"acc,none": acc, "acc_stderr,none": 0.02},
                    "dimattn_heldout": {
                        "bits_per_byte,none": 2.5 * s["rel"] / 100,
                        "bits_per_byte_stderr,none": "N/A",
                        "word_perplexity,none": 900.0,
                    },
                },
            }
            (run_dir / "lm_eval.json").write_text(json.dumps(lm))
            out["lm"].append(run_dir / "lm_eval.json")

        model = root / "models" / s["run"]
        model.mkdir(parents=True)
        config = {
            "dilation": 4,
            "num_hidden_layers": 4,
            "window": 128,
            "d_down": None,
            "bottleneck_activation": "linear",
            "full_attention_every": None,
            "attention_layers": None,
        } | s["model"]
        (model / "config.json").write_text(json.dumps(config))
        (model / "training.json").write_text(json.dumps({"seed": seed}))  # dimattn.workflow.runs.run_metadata reads it
        final = math.log(s["rel"] / 100) if not s["synthetic"] else 0.5 - s["acc"] / 2
        base = (5.0 if not s["synthetic"] else 2.0) + math.log(VANILLA_SEED_FACTOR[seed])
        lines = ["step,tokens,lr,train_loss,val_loss"]
        for step in range(0, 201, 25):
            gap = 0.0 if s["model"]["attention"] == "vanilla" else final + 0.05 * math.exp(-step / 60)
            lines.append(f"{step},{step * 2048},0.001,{base + 1:.4f},{base + math.exp(-step / 80) + gap:.6f}")
        (model / "metrics.csv").write_text("\n".join(lines) + "\n")
        out["models"].append(model)
    return out


def write_full_summaries(root: Path, raw=None, runs=FULL) -> Path:
    """The summaries of ``runs`` (``raw``: their outputs, written when not given)."""
    raw = raw or write_full(root, runs)
    summary = root / "summary"
    if raw["ppl"]:
        summaries.summarize_perplexity(raw["ppl"], summary_path(summary, "dar_perplexity"))
        summaries.summarize_lm_eval(raw["lm"], summary_path(summary, "lm_eval"))
    summaries.summarize_trajectory(raw["models"], summary_path(summary, "dar_trajectory"),
                                   datasets={s["run"]: s["dataset"] for s in runs})
    if raw["recall"]:
        summaries.summarize_recall(raw["recall"], summary_path(summary, "recall"))
    summaries.summarize_frontier(raw["ppl"] + raw["recall"], summary_path(summary, "kv_frontier"))
    return summary


# ----------------------------------------------------------------------------- reading tables


def rows(tex: str) -> list[str]:
    """The rows of a table (lines ending in ``\\\\``), a grid split over tabulars joined back: the
    i-th row of a tabular opened by ``latex.CONTINUED`` goes on the i-th row of the one before."""
    first, *continued = tex.split(latex.CONTINUED + "\n")
    out = [line for line in first.splitlines() if line.endswith(r"\\")]
    for segment in continued:
        tabular = segment[: segment.index(r"\end{tabular}")]
        spec = re.search(r"\\begin\{tabular\}\{([^}]*)\}", tabular).group(1)
        labels = len(spec) - len(spec.lstrip("l"))  # the leading label columns, repeated in each part
        more = [line for line in tabular.splitlines() if line.endswith(r"\\")]
        start = len(out) - len(more)
        for i, line in enumerate(more):
            rest, span = cells(line), 0
            while span < labels:
                head = re.match(r"\\multicolumn\{(\d+)\}", rest.pop(0))
                span += int(head.group(1)) if head else 1
            out[start + i] = " & ".join([out[start + i].rstrip(" \\")] + rest) + r" \\"
        after = segment[segment.index(r"\end{tabular}"):]  # the tabulars that follow, of their own
        out += [line for line in after.splitlines() if line.endswith(r"\\")]
    return out


def table_line(tex: str, *needles: str) -> str:
    """The one body row of a table that contains every needle."""
    lines = [line for line in rows(tex) if all(n in line for n in needles)]
    assert len(lines) == 1, (needles, lines)
    return lines[0]


def cells(line: str) -> list[str]:
    """The cells of a table row, stripped."""
    return [c.strip() for c in line.rstrip(" \\").split("&")]


def check_tabulars(tex: str) -> None:
    """Every body row of every tabular has as many cells as its column spec (multicolumns counted)."""
    assert tex.count("{") - tex.count(r"\{") == tex.count("}") - tex.count(r"\}")
    blocks = re.findall(r"\\begin\{tabular\}\{([^}]*)\}(.*?)\\end\{tabular\}", tex, re.S)
    assert blocks, "no tabular"
    for spec_, body in blocks:
        n = len(re.findall(r"[lrc]", spec_))
        for line in body.splitlines():
            if not line.rstrip().endswith(r"\\"):
                continue
            spans = sum(int(k) - 1 for k in re.findall(r"\\multicolumn\{(\d+)\}", line))
            amps = len(re.findall(r"(?<!\\)&", line))
            assert amps + 1 + spans == n, (spec_, line)


def is_png(path: Path, min_size: int = 20_000) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > min_size


# ----------------------------------------------------------------------------- figures


def saved_figures(monkeypatch) -> list:
    """Every matplotlib Figure saved from now on (dimattn.reporting.plots.figure saves each once)."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1])
    return saved


def score_labels(fig) -> list[str]:
    """The label each score axis of ``fig`` carries: every drawn panel's y label (an unlabelled
    panel reads its row's last labelled one to its left: a shared y), every colorbar's label; a
    heat map's own y is a setting, its score on the colorbar."""
    from matplotlib.collections import QuadMesh

    labels, row_label = [], {}
    for ax in fig.axes:  # panels in creation order: row by row, left to right; colorbars after
        if not ax.get_visible():
            continue
        if hasattr(ax, "_colorbar"):  # before the heat maps: a colorbar is drawn as a QuadMesh too
            labels.append(ax.get_ylabel() or ax.get_xlabel())
            continue
        if any(isinstance(c, QuadMesh) for c in ax.collections):
            continue
        spec = ax.get_subplotspec()
        row = (id(spec.get_gridspec()), spec.rowspan.start)
        row_label[row] = ax.get_ylabel() or row_label.get(row, "")
        labels.append(row_label[row])
    return labels
