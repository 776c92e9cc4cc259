"""The first stage of reporting: raw outputs of the other stages -> tidy CSV summaries.

Each ``summarize_*`` reads one kind of raw output and writes ``paths.summary(<name>)``:

* ``dar_perplexity``: the perplexity JSON of every text run (``dimattn.evaluation.scoring``), for seed
  000 Tables 1-3 and the baselines;
* ``dar_trajectory``: each trained model's ``metrics.csv`` and ``config.json``, for seed 000
  Figure 3 (it lists every run, text and synthetic, with its training dataset);
* ``lm_eval``: lm-eval's results JSON per run, for seed 000 Table 4 and the lm-eval table;
* ``recall``: the recall-probe JSON of every synthetic run (``dimattn.data.recall``);
* ``dimpo_fidelity``: the fidelity CSV per (model, objective, d'), for seed 003 Table 1;
* ``kv_frontier``: every scored model's quality beside the KV-cache bytes per token its own
  cache measured (runs and projected models alike), for the accuracy-against-bytes frontier.

Every row of a run carries its run fields (``dimattn.model.variants.RUN_FIELDS``: the config's names,
a field its variant does not take left empty), so the renderers select runs by what they are.
Summaries stay tidy, one row per replicate (training seed); a value relative to Vanilla is
paired by seed (``replicates.relative``), and ``vanilla_seed`` says which Vanilla replicate it
was divided by (empty: the mean of Vanilla's replicates, which lack that seed).
:func:`read` reads a summary back, checking that it has every column. Nothing here draws.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from dimattn.model import variants
from dimattn.model.atomic import atomic_file
from dimattn.workflow.formats import FIDELITY_COLUMNS
from dimattn.workflow.runs import run_metadata
from dimattn.workflow.sweeps import BASE_OBJECTIVE, MAIN_STUDY, RULER_TASKS
from .lm_eval import lower_is_better
from .paper import objective_rank
from .replicates import relative

RUN_FIELDS = variants.RUN_FIELDS
# A projected model of dimpo.downstream (dimattn.workflow.sweeps.Projected); share = l / n_layers.
# kv: the compression's name in dimpo.downstream.kv; kv_method and kv_level what it is (kivi and
# its bits, snapkv and its budget; none and 0), so that Table 5 can be drawn from the CSV alone.
DOWNSTREAM_FIELDS = ["model", "objective", "setting", "d_prime", "num_projected", "n_layers", "share", "scale", "kv",
                     "kv_method", "kv_level", "seed"]
COLUMNS = {
    "dar_perplexity": RUN_FIELDS + ["corpus", "ppl", "rel_to_vanilla", "vanilla_seed", "split", "n_tokens", "loss"],
    "dar_trajectory": RUN_FIELDS
    + ["dataset", "step", "tokens", "val_loss", "val_ppl", "rel_to_vanilla", "vanilla_seed"],
    "lm_eval": RUN_FIELDS + ["task", "metric", "value", "stderr"],
    "recall": RUN_FIELDS
    + ["corpus", "split", "scope", "bin", "min_distance", "max_distance", "accuracy", "n", "chance"],
    # dimattn.data.longctx.score_suite: a row per subtask and one "average" (RULER's), scores in %
    "longctx": RUN_FIELDS + ["corpus", "split", "seq_len", "subtask", "score", "exact", "n"],
    # the needle heat map: niah_single, niah_multikey by needle-depth bin (dimattn.data.longctx.needle_scores)
    "longctx_needle": RUN_FIELDS + ["corpus", "split", "seq_len", "subtask", "depth_lo", "depth_hi", "score", "n"],
    # study: Table 1's (MAIN_STUDY: Figures 2-3, Tables 2-5) or one of dimpo.downstream.studies
    # (table6: Table 6's RULER column); a model scored for two has rows in both.
    "dimpo_downstream": ["study"] + DOWNSTREAM_FIELDS + ["task", "metric", "value", "stderr"],
    # the needle heat map of projected models on the suite: their records' needle-depth bins, as
    # longctx_needle's of the runs
    "dimpo_needle": ["study"] + DOWNSTREAM_FIELDS + ["corpus", "seq_len", "subtask", "depth_lo", "depth_hi", "score",
                                                     "n"],
    # dimattn.evaluation.latency.measure: medians over paired repeats, ratios to the base model's
    "dimpo_latency": ["model", "d_prime", "setting", "num_projected", "kv", "device", "dtype", "prompt", "new",
                      "repeats", "prefill_s", "decode_s", "tokens_per_s", "cache_bytes", "peak_bytes", "peak_kind",
                      "prefill_ratio", "decode_ratio", "cache_ratio", "peak_ratio"],
    # A point of the frontier: one scored model (a run, or a projected model of dimpo.downstream)
    # on one probe, its value and what its cache measured (cache_bytes_per_token); rel_to_base:
    # 100 x value / its base's under the same protocol (a run: the vanilla run of its width; a
    # projected model: its own base model, l = 0, uncompressed), paired by seed as rel_to_vanilla.
    "kv_frontier": ["source", "probe", "metric", "higher_is_better", "family", "reference"] + RUN_FIELDS
    + [f for f in DOWNSTREAM_FIELDS if f not in ("share", "seed", "scale")]
    + ["value", "cache_bytes_per_token", "rel_to_base", "base_seed"],
    # study: dimattn.workflow.vocabulary.MAIN_STUDY (Table 1) or a dimpo.ablations key; setting_order: the
    # setting's place in that study's list. A fit in two studies has rows in both.
    "dimpo_fidelity": ["study", "setting_order"] + FIDELITY_COLUMNS,
}
INT_COLUMNS = [
    "hidden_size",
    "seed",
    "vanilla_seed",
    "d_down",
    "window",
    "dilation",
    "full_attention_every",
    "step",
    "tokens",
    "n_tokens",
    "bin",
    "min_distance",
    "max_distance",
    "n",
    "d_prime",
    "head_dim",
    "layer",
    "setting_order",
    "num_projected",
    "n_layers",
    "base_seed",
    "kv_level",
]
# attention_layers "2.3" is a string, not the number 2.3.
STR_COLUMNS = ["run", "attention", "bottleneck_activation", "attention_layers", "corpus", "split", "dataset", "scope",
               "setting", "study", "kv", "task", "metric", "source", "probe", "family", "reference", "objective",
               "kv_method", "model"]


# ----------------------------------------------------------------------------- reading back


def _as_int(df: pd.DataFrame) -> pd.DataFrame:
    """Nullable integers, so that 32 stays 32 in a CSV even when a column has NaN."""
    for col in INT_COLUMNS:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce").round().astype("Int64")
    return df


class BadSummary(ValueError):
    """A summary file that is not a whole CSV: empty, binary, or cut mid-row."""


def csv_rows(path: os.PathLike | str) -> int:
    """The data rows of the CSV at ``path``, after checking it is one whole: UTF-8 text, a header,
    every row ending in a newline and holding the header's number of fields. pandas reads a file
    cut mid-row as a row of NaN, and an empty or binary one with an error that names no file."""
    path = Path(path)
    if not path.is_file():
        raise BadSummary(f"{path}: no such summary")
    data = path.read_bytes()
    if not data.strip():
        raise BadSummary(f"{path}: empty; it should hold a header and a row per result")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSummary(f"{path}: not a CSV (not UTF-8 text at byte {e.start})") from None
    if "\0" in text:
        raise BadSummary(f"{path}: not a CSV (binary: a NUL byte at {text.index(chr(0))})")
    if not text.endswith("\n"):
        raise BadSummary(f"{path}: cut mid-row (the last row has no newline): a write was interrupted")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise BadSummary(f"{path}: not a CSV ({e})") from None
    header = rows[0]
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise BadSummary(f"{path}: line {i} has {len(row)} fields, the header {len(header)}: "
                             "the file is cut or is not this summary")
    return len(rows) - 1


def read(path: os.PathLike | str, name: str) -> pd.DataFrame:
    """The summary ``name`` (a key of COLUMNS) at ``path``, typed, once :func:`csv_rows` found it
    whole; a ValueError names the file and any column it lacks."""
    csv_rows(path)
    df = _as_int(pd.read_csv(path, dtype={c: "string" for c in STR_COLUMNS}))
    missing = [c for c in COLUMNS[name] if c not in df.columns]
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {missing}; expected at least {COLUMNS[name]}. "
            "Regenerate the summaries with snakemake."
        )
    for col in STR_COLUMNS:
        if col in df.columns:
            df[col] = df[col].astype("string")
    for col in ("split", "dataset"):  # "" (no split, no dataset given) reads back as NA
        if col in df.columns:
            df[col] = df[col].fillna("")
    return _as_int(df)


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    with atomic_file(Path(path)) as tmp:
        df.to_csv(tmp, index=False)


# ----------------------------------------------------------------------------- run fields


def _run_fields(record: dict, source) -> dict:
    """The run fields of a raw output (each carries ``dimattn.workflow.runs.run_metadata``), or a
    ValueError naming the file."""
    if record.get("run") is None:
        raise ValueError(f"{source}: no 'run'; expected the fields of dimattn.workflow.runs.run_metadata")
    try:
        return variants.run_fields(record["run"], record, record.get("seed") or 0)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def _sort_runs(df: pd.DataFrame, head: list[str], tail: list[str] = ()) -> pd.DataFrame:
    """Vanilla first, then DAR, Uniform, SWA, dilated; plain runs before patterned ones; widest bottleneck first."""
    df = df.assign(
        _v=df["attention"].map(variants.VARIANT_ORDER.index),
        _p=[not variants.is_plain(r) for r in df.to_dict("records")],
        _dd=-df["d_down"].astype("Float64"),
    )
    order = head + ["hidden_size", "_v", "_p", "_dd", "window", "run", *tail]
    df = df.sort_values(order, na_position="first", kind="stable")
    return df.drop(columns=[c for c in df.columns if c.startswith("_")]).reset_index(drop=True)


def _check_one_vanilla(vanilla: pd.DataFrame, keys: list[str]) -> None:
    dup = vanilla[vanilla.duplicated(keys + ["seed"], keep=False)]
    if not dup.empty:
        raise ValueError(
            f"more than one vanilla run for the same {', '.join(keys)} and seed: {sorted(dup['run'].unique())}; "
            "rel_to_vanilla needs exactly one baseline per seed"
        )


def _relative_to_vanilla(
    df: pd.DataFrame, value: str, keys: list[str], scale: list[str], what: str, pair_within: list[str]
) -> pd.DataFrame:
    """df[rel_to_vanilla] = 100 * value / value(vanilla run with the same keys and seed), or over
    the mean of the vanilla replicates where none of them has the seed within ``pair_within``
    (``replicates.relative``); df[vanilla_seed] = the seed of the vanilla run divided by, empty
    for the mean.

    A scale (the ``scale`` columns, a subset of keys) without any vanilla run is allowed (seed 000
    Table 4 trains a d = 2048 scale with DAR only): its rel_to_vanilla stays empty. A scale that
    has a vanilla run for some keys but not for others is an error naming what lacks one.
    """
    is_vanilla = df["attention"] == "vanilla"
    vanilla = df.loc[is_vanilla, keys + ["run", "seed"]]
    _check_one_vanilla(vanilla, keys)
    df = df.copy()
    df["rel_to_vanilla"], df["vanilla_seed"] = relative(df, value, is_vanilla, keys, pair_within)
    has_vanilla = df[scale].apply(tuple, axis=1).isin(set(vanilla[scale].apply(tuple, axis=1)))
    has_keys = df[keys].apply(tuple, axis=1).isin(set(vanilla[keys].apply(tuple, axis=1)))
    lacking = df[~has_keys & has_vanilla]
    if what == "corpus" and not lacking.empty:
        first = lacking.iloc[0]
        raise ValueError(
            f"no vanilla run for corpus {first['corpus']!r} (hidden_size={first['hidden_size']}, "
            f"split={first['split']!r}); runs {sorted(lacking['run'].unique())} need one to compute rel_to_vanilla"
        )
    return df


# ----------------------------------------------------------------------------- summarize_*


def summarize_perplexity(eval_jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """One row per (text run, corpus); rel_to_vanilla = 100 * ppl / ppl(Vanilla, same hidden_size,
    corpus and seed; the mean of Vanilla's replicates where none has the seed)."""
    rows = []
    for path in eval_jsons:
        record = json.loads(Path(path).read_text())
        missing = [k for k in ("corpus", "ppl") if k not in record]
        if missing:
            raise ValueError(f"{path}: perplexity record lacks {missing}")
        rows.append(
            _run_fields(record, path)
            | {
                "corpus": record["corpus"],
                "ppl": float(record["ppl"]),
                "split": record.get("split"),
                "n_tokens": record.get("n_tokens"),
                "loss": record.get("loss"),
            }
        )
    if not rows:
        raise ValueError("summarize_perplexity got no evaluation JSON files")
    df = _as_int(pd.DataFrame(rows))
    df["split"] = df["split"].fillna("")
    keys = ["hidden_size", "corpus", "split"]
    df = _relative_to_vanilla(df, "ppl", keys, ["hidden_size"], "corpus", pair_within=keys)
    df = _sort_runs(df, ["corpus", "split"])[COLUMNS["dar_perplexity"]]
    _write_csv(df, out_csv)
    return df


def summarize_trajectory(
    model_dirs: Iterable[os.PathLike | str], out_csv: os.PathLike | str, datasets: dict | None = None
) -> pd.DataFrame:
    """Validation perplexity per evaluated step, relative to Vanilla at the same step and seed
    (seed 000 Fig. 3; the mean of Vanilla's replicates where none has the seed).

    datasets: run -> the dataset it trained on (``Run.dataset``); the baseline is the vanilla
    run of the same dataset and hidden_size. Without it, of the same hidden_size.
    """
    datasets = datasets or {}
    frames = []
    for model_dir in map(Path, model_dirs):
        try:
            fields = run_metadata(model_dir)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{model_dir}: {e}") from None
        metrics = pd.read_csv(model_dir / "metrics.csv")
        missing = [c for c in ("step", "tokens", "val_loss") if c not in metrics.columns]
        if missing:
            raise ValueError(f"{model_dir / 'metrics.csv'} lacks column(s) {missing}")
        metrics["val_loss"] = pd.to_numeric(metrics["val_loss"], errors="coerce")
        # A resumed run may log a step twice; the later line is the one that counts.
        metrics = metrics.dropna(subset=["val_loss"]).drop_duplicates("step", keep="last")
        fields["dataset"] = datasets.get(fields["run"], "")
        frames.append(metrics[["step", "tokens", "val_loss"]].assign(**fields))
    if not frames:
        raise ValueError("summarize_trajectory got no model directories")
    df = _as_int(pd.concat(frames, ignore_index=True))
    df["val_ppl"] = np.exp(df["val_loss"])

    scale = ["dataset", "hidden_size"]
    missing = sorted(
        set(map(tuple, df[scale].drop_duplicates().values))
        - set(map(tuple, df.loc[df["attention"] == "vanilla", scale].drop_duplicates().values))
    )
    if missing and not datasets:
        raise ValueError(
            f"no vanilla run with hidden_size={missing[0][1]} among the model directories; rel_to_vanilla needs one"
        )
    # Steps the paired vanilla run did not evaluate stay NaN rather than being matched to a
    # neighbour or to another seed; so does a scale without a vanilla run (the config names each
    # run's dataset, so none is lost).
    df = _relative_to_vanilla(df, "val_ppl", scale + ["step"], scale, "step", pair_within=scale)
    df = _sort_runs(df, ["dataset"], tail=["step"])[COLUMNS["dar_trajectory"]]
    _write_csv(df, out_csv)
    return df


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _lm_eval_rows(results: dict) -> list[dict]:
    """{task, metric, value, stderr} of every numeric metric in lm-eval's ``results``."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            # lm-eval names metrics "metric,filter"; plain keys (alias, name, sample_len) are bookkeeping
            if "," not in key:
                continue
            name, _, filt = key.partition(",")
            filt = filt or "none"
            if name.endswith("_stderr") or _number(value) is None:
                continue
            if task in RULER_TASKS and value == -1:  # lm-eval's RULER: -1 for a length not run
                continue
            stderr = _number(metrics.get(f"{name}_stderr,{filt}"))
            metric = name if filt == "none" else f"{name},{filt}"
            rows.append({"task": task, "metric": metric, "value": float(value), "stderr": stderr})
    return rows


def summarize_lm_eval(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Long table of lm-eval's ``results``: one row per (run, task, metric) with its stderr."""
    rows = []
    for path in jsons:
        record = json.loads(Path(path).read_text())
        fields = _run_fields(record, path)
        if "results" not in record:
            raise ValueError(f"{path}: lm-eval record lacks 'results'")
        rows += [fields | row for row in _lm_eval_rows(record["results"])]
    if not rows:
        raise ValueError("summarize_lm_eval found no numeric metrics in its inputs")
    df = _sort_runs(_as_int(pd.DataFrame(rows)), [], tail=["task", "metric"])[COLUMNS["lm_eval"]]
    _write_csv(df, out_csv)
    return df


RECALL_KEYS = ("corpus", "accuracy", "n_queries", "by_distance", "chance")
RECALL_BIN_KEYS = ("min_distance", "max_distance", "accuracy", "n")


def _record(path, keys: tuple[str, ...], kind: str) -> dict:
    """The JSON record at ``path``; a ValueError names the ``keys`` it lacks."""
    record = json.loads(Path(path).read_text())
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{path}: {kind} record lacks {missing}; expected {list(keys)}")
    return record


def summarize_recall(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Tidy recall accuracy: per (run, corpus) one ``scope = overall`` row and one row per distance bin.

    Columns: the run fields, corpus, split, scope ("overall" | "distance"), bin (0-based index of
    the distance bin; empty on the overall row), min_distance and max_distance (query-to-key
    distance, inclusive; the overall row spans every bin), accuracy (fraction of queries answered
    correctly; empty for a bin without queries), n (queries), chance (1 / number of values).
    """
    rows, seen = [], {}
    for path in jsons:
        record = _record(path, RECALL_KEYS, "recall")
        fields = _run_fields(record, path) | {"corpus": record["corpus"], "split": record.get("split") or ""}
        key = (fields["run"], fields["corpus"], fields["split"])
        if key in seen:
            raise ValueError(f"run {key[0]!r} on corpus {key[1]!r} appears twice: {seen[key]} and {path}")
        seen[key] = path
        bins = record["by_distance"]
        for i, b in enumerate(bins):
            lacks = [k for k in RECALL_BIN_KEYS if k not in b]
            if lacks:
                raise ValueError(f"{path}: by_distance[{i}] lacks {lacks}; expected {list(RECALL_BIN_KEYS)}")
        chance = float(record["chance"])
        rows.append(
            fields
            | {
                "scope": "overall",
                "bin": None,
                "min_distance": min((b["min_distance"] for b in bins), default=None),
                "max_distance": max((b["max_distance"] for b in bins), default=None),
                "accuracy": float(record["accuracy"]),
                "n": record["n_queries"],
                "chance": chance,
            }
        )
        for i, b in enumerate(bins):
            rows.append(
                fields
                | {
                    "scope": "distance",
                    "bin": i,
                    "min_distance": b["min_distance"],
                    "max_distance": b["max_distance"],
                    "accuracy": None if b["accuracy"] is None else float(b["accuracy"]),
                    "n": b["n"],
                    "chance": chance,
                }
            )
    if not rows:
        raise ValueError("summarize_recall got no recall JSON files")
    df = _as_int(pd.DataFrame(rows))
    df["accuracy"] = pd.to_numeric(df["accuracy"], errors="coerce")
    df = _sort_runs(df, ["corpus", "split"], tail=["bin"])[COLUMNS["recall"]]
    _write_csv(df, out_csv)
    return df


LONGCTX_KEYS = ("corpus", "seq_len", "subtasks", "average")


def _longctx_records(jsons: Iterable[os.PathLike | str]) -> list[tuple[dict, dict]]:
    """(run fields with corpus, split and seq_len; the record) of each long-context JSON, a run
    on a corpus once."""
    out, seen = [], {}
    for path in jsons:
        record = _record(path, LONGCTX_KEYS, "long-context")
        fields = _run_fields(record, path) | {"corpus": record["corpus"], "split": record.get("split") or "",
                                              "seq_len": record["seq_len"]}
        key = (fields["run"], fields["corpus"])
        if key in seen:
            raise ValueError(f"run {key[0]!r} on corpus {key[1]!r} appears twice: {seen[key]} and {path}")
        seen[key] = path
        out.append((fields, record))
    if not out:
        raise ValueError("summarize_longctx got no long-context JSON files")
    return out


def summarize_longctx(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """Tidy long-context suite scores: per (run, corpus) a row per subtask (score: lm-eval's
    RULER string match in %, exact: whole-answer matches in %, n: examples) and one row
    ``subtask = average`` (the mean score over subtasks, n the examples of all)."""
    rows = []
    for fields, record in _longctx_records(jsons):
        subtasks = record["subtasks"]
        rows += [fields | {"subtask": name, "score": v["score"], "exact": v["exact"], "n": v["n"]}
                 for name, v in subtasks.items()]
        rows.append(fields | {"subtask": "average", "score": record["average"], "exact": None,
                              "n": sum(v["n"] for v in subtasks.values())})
    df = _sort_runs(_as_int(pd.DataFrame(rows)), ["corpus", "split"])[COLUMNS["longctx"]]
    _write_csv(df, out_csv)
    return df


def needle_rows(needle: dict) -> list[dict]:
    """A suite result's needle-depth bins (dimattn.data.longctx.needle_scores), a row per subtask and bin."""
    return [{"subtask": task} | row for task, bins in needle.items() for row in bins]


def summarize_longctx_needle(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """The needle heat map's data: per (run, corpus) a row per subtask (niah_single,
    niah_multikey) and needle-depth bin [depth_lo, depth_hi) (dimattn.data.longctx.needle_scores:
    score in %, n examples)."""
    rows = []
    for fields, record in _longctx_records(jsons):
        if "needle" not in record:
            raise ValueError(f"run {fields['run']!r} on {fields['corpus']!r}: no needle-depth scores (scored "
                             "without niah_single, or by an older dimattn.data.longctx)")
        rows += [fields | row for row in needle_rows(record["needle"])]
    df = _sort_runs(_as_int(pd.DataFrame(rows, columns=COLUMNS["longctx_needle"])), ["corpus", "split"],
                    tail=["subtask", "depth_lo"])[COLUMNS["longctx_needle"]]
    _write_csv(df, out_csv)
    return df


def summarize_fidelity(csvs: Iterable[os.PathLike | str], out_csv: os.PathLike | str,
                       studies: dict[str, list] | None = None) -> pd.DataFrame:
    """Concatenate the per-fit fidelity CSVs, one copy of a fit's rows per study it belongs to.

    ``studies``: {csv path: [[study, setting_order], ...]} (rules/common.smk fidelity_studies);
    a CSV it does not list is Table 1's (dimattn.workflow.vocabulary.MAIN_STUDY, order 0).
    """

    frames = []
    for path in csvs:
        frame = pd.read_csv(path, dtype={"setting": str}, keep_default_na=False, na_values=[""])
        missing = [c for c in FIDELITY_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{path} lacks column(s) {missing}; expected {FIDELITY_COLUMNS}")
        for study, order in (studies or {}).get(str(path), [[MAIN_STUDY, 0]]):
            frames.append(frame.assign(study=study, setting_order=int(order)))
    if not frames:
        raise ValueError("summarize_fidelity got no CSV files")
    df = _as_int(pd.concat(frames, ignore_index=True))
    df = df.sort_values(
        ["study", "model", "setting_order", "objective", "d_prime", "seed", "layer"],
        key=lambda s: s.map(objective_rank) if s.name == "objective" else s,
        kind="stable",
    )
    df = df[COLUMNS["dimpo_fidelity"]].reset_index(drop=True)
    _write_csv(df, out_csv)
    return df


def recall_metrics(probe: dict) -> dict[str, float | None]:
    """{"acc": overall accuracy, "acc,d<lo>-<hi>": accuracy of each distance bin} of a recall
    probe result (dimattn.data.recall.score_queries): the bins are the probe's RULER subtasks."""
    return {"acc": probe["accuracy"]} | {
        f"acc,d{b['min_distance']}-{b['max_distance']}": b["accuracy"] for b in probe["by_distance"]
    }


def suite_metrics(suite: dict) -> dict[str, float]:
    """{"score": the suite's average, "score,<subtask>": each subtask's} of a long-context suite
    result (dimattn.data.longctx.score_suite), as fractions (lm-eval's RULER scale, as the recall
    probe's accuracies)."""
    return {"score": suite["average"] / 100} | {f"score,{name}": v["score"] / 100
                                                for name, v in suite["subtasks"].items()}


def summarize_downstream(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str,
                         studies: dict[str, list[str]] | None = None,
                         needle_csv: os.PathLike | str | None = None) -> pd.DataFrame:
    """Projected models' scores (dimattn.evaluation.projected.score_projected), long: one row per (study,
    model, objective, setting, d', l, kv, task, metric); held-out perplexity as task
    "perplexity:<corpus>", metric "ppl"; the recall probe as task "recall:<corpus>", metrics of
    :func:`recall_metrics`; the long-context suite as task "longctx:<corpus>", metrics of
    :func:`suite_metrics`. ``studies``: {json path: [study, ...]} (rules/common.smk
    downstream_studies); a path it does not list is Table 1's. ``needle_csv``: where to write the
    suite records' needle-depth bins (COLUMNS["dimpo_needle"], empty without suite records)."""
    rows, needle_table = [], []
    for path in jsons:
        record = json.loads(Path(path).read_text())
        missing = [k for k in DOWNSTREAM_FIELDS if k not in record and k != "share"]
        if missing or "results" not in record or "perplexity" not in record:
            raise ValueError(f"{path}: not a score_projected record (lacks {missing or 'results/perplexity'})")
        fields = {k: record[k] for k in DOWNSTREAM_FIELDS if k != "share"}
        fields["share"] = record["num_projected"] / record["n_layers"]
        scores = [{"task": f"perplexity:{corpus}", "metric": "ppl", "value": ppl["ppl"], "stderr": None}
                  for corpus, ppl in record["perplexity"].items()]
        for corpus, probe in record.get("recall", {}).items():
            scores += [{"task": f"recall:{corpus}", "metric": metric, "value": value, "stderr": None}
                       for metric, value in recall_metrics(probe).items()]
        for corpus, suite in record.get("longctx", {}).items():
            scores += [{"task": f"longctx:{corpus}", "metric": metric, "value": value, "stderr": None}
                       for metric, value in suite_metrics(suite).items()]
        scores += _lm_eval_rows(record["results"])
        needles = [{"corpus": corpus, "seq_len": suite["seq_len"]} | row
                   for corpus, suite in record.get("longctx", {}).items()
                   for row in needle_rows(suite.get("needle", {}))]
        for study in (studies or {}).get(str(path), [MAIN_STUDY]):
            rows += [{"study": study} | fields | score for score in scores]
            needle_table += [{"study": study} | fields | row for row in needles]
    if not rows:
        raise ValueError("summarize_downstream found no scores in its inputs")
    df = _as_int(pd.DataFrame(rows)).sort_values(
        ["study", "model", "objective", "setting", "d_prime", "num_projected", "kv", "seed", "task", "metric"],
        key=lambda s: s.map(objective_rank) if s.name == "objective" else s, kind="stable",
    )
    df = df[COLUMNS["dimpo_downstream"]].reset_index(drop=True)
    _write_csv(df, out_csv)
    if needle_csv is not None:
        _write_csv(_as_int(pd.DataFrame(needle_table, columns=COLUMNS["dimpo_needle"])), needle_csv)
    return df


def summarize_latency(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """The latency rows of every dimpo model (dimattn.evaluation.latency.latency_to_file), in file order."""
    rows = []
    for path in jsons:
        records = json.loads(Path(path).read_text())
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{path}: not a latency record (a list of settings)")
        missing = sorted({c for r in records for c in COLUMNS["dimpo_latency"] if c not in r})
        if missing:
            raise ValueError(f"{path}: latency record lacks {missing}")
        rows += records
    if not rows:
        raise ValueError("summarize_latency found no latency rows in its inputs")
    df = pd.DataFrame(rows)[COLUMNS["dimpo_latency"]]
    _write_csv(df, out_csv)
    return df


# ----------------------------------------------------------------------------- the frontier

# probe kind -> (metric, the record key that marks a run's record of it, its value in a record):
# the keys a run's and a projected model's records share per probe; the metric's direction is
# lm_eval.lower_is_better's
FRONTIER_PROBES = {
    "perplexity": ("ppl", "ppl", lambda r: r["ppl"]),
    "recall": ("accuracy", "by_distance", lambda r: r["accuracy"]),
    "longctx": ("score", "subtasks", lambda r: r["average"] / 100),
}


def _bytes(entry: dict, path, probe: str) -> float:
    found = entry.get("cache_bytes_per_token")
    if found is None:
        raise ValueError(f"{path}: its {probe} score lacks cache_bytes_per_token (written before the KV frontier "
                         "measured caches): re-run the job that wrote it, e.g. snakemake --forcerun <rule>")
    return float(found)


def _run_family(fields: dict) -> str:
    """A run's compression family: its attention, "+full" where full layers are mixed in."""
    patterned = not variants.missing(fields.get("full_attention_every")) or not variants.missing(
        fields.get("attention_layers"))
    return fields["attention"] + ("+full" if patterned and fields["attention"] != "vanilla" else "")


def _projected_family(record: dict) -> str:
    """A projected model's: its objective (none for the base), "+<kv method>" under KV compression."""
    objective = None if record["objective"] == BASE_OBJECTIVE else record["objective"]
    kv = None if record.get("kv_method") in (None, "none", "") else record["kv_method"]
    return "+".join(x for x in (objective, kv) if x) or "vanilla"


def _frontier_rows(path, record: dict) -> list[dict]:
    """The frontier's rows of one raw output, whichever kind it is: a run's perplexity, recall
    or long-context record (dimattn.evaluation.scoring), or a projected model's (score_projected)."""
    if "objective" in record and "num_projected" in record:  # a projected model: {probe kind: {corpus: score}}
        fields = {k: record.get(k) for k in DOWNSTREAM_FIELDS if k not in ("share", "scale")}
        scored = [(kind, corpus, entry) for kind in FRONTIER_PROBES for corpus, entry in record.get(kind, {}).items()]
        common = {"source": "projected", "family": _projected_family(record), "reference": f"model={record['model']}",
                  **fields, "attention": None}
    else:
        fields = _run_fields(record, path)
        kinds = [kind for kind, (_, marker, _) in FRONTIER_PROBES.items() if marker in record]
        if not kinds:
            raise ValueError(f"{path}: neither a perplexity, recall, long-context nor score_projected record")
        scored = [(kinds[0], record["corpus"], record)]
        common = {"source": "run", "family": _run_family(fields), "reference": f"hidden_size={fields['hidden_size']}",
                  **fields}
    rows = []
    for kind, corpus, entry in scored:
        metric, _, value_of = FRONTIER_PROBES[kind]
        rows.append(common | {"probe": f"{kind}:{corpus}", "metric": metric,
                              "higher_is_better": not lower_is_better(metric), "value": float(value_of(entry)),
                              "cache_bytes_per_token": _bytes(entry, path, kind)})
    return rows


def summarize_frontier(jsons: Iterable[os.PathLike | str], out_csv: os.PathLike | str) -> pd.DataFrame:
    """The accuracy-against-bytes frontier's points (COLUMNS["kv_frontier"]): every run's
    perplexity, recall and long-context record and every projected model's scores, each beside
    the bytes per token its cache held (cache_bytes_per_token); lm-eval's scores carry no cache
    measure and stay out. rel_to_base is paired by seed with the base of the same ``reference``
    and probe: the vanilla run of a width, a projected model's l = 0 model."""
    rows = [row for path in jsons for row in _frontier_rows(path, json.loads(Path(path).read_text()))]
    if not rows:
        raise ValueError("summarize_frontier got no scores with a measured cache")
    df = _as_int(pd.DataFrame(rows).reindex(columns=COLUMNS["kv_frontier"]))
    base = (df["attention"] == "vanilla") | ((df["source"] == "projected") & (df["family"] == "vanilla"))
    keys = ["probe", "reference"]
    df["rel_to_base"], df["base_seed"] = relative(df, "value", base, keys, keys)
    df = df.sort_values(["probe", "source", "reference", "family", "cache_bytes_per_token", "seed"],
                        ascending=[True, False, True, True, False, True], kind="stable")[COLUMNS["kv_frontier"]]
    df = df.reset_index(drop=True)
    _write_csv(df, out_csv)
    return df
