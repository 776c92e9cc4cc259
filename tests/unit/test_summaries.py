"""dimattn.reporting.summaries: raw outputs shaped like the other stages' -> tidy CSV summaries."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from reporting_fixtures import (
    BINS,
    CHANCE,
    D_PRIMES,
    DATASETS,
    FIDELITY_SCALE,
    FIT_SEED_FACTOR,
    FULL,
    N_LAYERS,
    RECALL,
    REL,
    TEXT,
    VANILLA_PPL,
    VANILLA_SEED_FACTOR,
    VANILLA_TEXT_PPL,
    WINDOW,
    replicated,
    run_name,
    summary_path,
    write_eval_jsons,
    write_fidelity_csvs,
    write_full,
    write_full_summaries,
    write_lm_eval_jsons,
    write_model_dirs,
    write_scale_without_vanilla,
)

from dimattn.reporting import summaries


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    raw = write_full(root)
    return root, raw, write_full_summaries(root, raw)


def test_summarize_perplexity_relative_to_vanilla(tmp_path):
    out = tmp_path / "ppl.csv"
    df = summaries.summarize_perplexity(write_eval_jsons(tmp_path), out)
    back = pd.read_csv(out)
    assert list(back.columns) == summaries.COLUMNS["dar_perplexity"]
    assert len(back) == 7 * len(VANILLA_PPL)
    for corpus in VANILLA_PPL:
        rows = df[df["corpus"] == corpus].set_index("run")
        assert rows.loc[run_name("vanilla", None), "rel_to_vanilla"] == pytest.approx(100.0)
        for (attention, d_down), rel in REL.items():
            assert rows.loc[run_name(attention, d_down), "rel_to_vanilla"] == pytest.approx(rel)
    # Vanilla first, then DAR widest first; vanilla has no d_down and no window.
    first = back[back["corpus"] == "shakespeare"]
    assert list(first["attention"][:4]) == ["vanilla", "dar", "dar", "dar"]
    assert list(first["d_down"][1:4]) == [64, 32, 16]
    assert pd.isna(first["d_down"].iloc[0]) and pd.isna(first["window"].iloc[0])
    assert "32.0" not in out.read_text()  # integers stay integers


def test_summarize_perplexity_missing_vanilla_names_corpus(tmp_path):
    paths = write_eval_jsons(tmp_path / "a", corpora=("shakespeare",))
    paths += write_eval_jsons(tmp_path / "b", corpora=("tinystories_val",), with_vanilla=False)
    with pytest.raises(ValueError, match="tinystories_val"):
        summaries.summarize_perplexity(paths, tmp_path / "ppl.csv")
    assert not (tmp_path / "ppl.csv").exists()


def test_summarize_perplexity_scale_without_vanilla_has_no_rel(tmp_path):
    """Seed 000 Table 4's d = 2048 scale trains DAR only: no Rel., and no error."""
    df = summaries.summarize_perplexity(write_scale_without_vanilla(tmp_path), tmp_path / "ppl.csv")
    assert pd.isna(df.set_index("run").loc["big-dar", "rel_to_vanilla"])


def test_summarize_perplexity_keeps_every_run_field(full):
    root, _, summary = full
    df = summaries.read(summary_path(summary, "dar_perplexity"), "dar_perplexity")
    assert list(df.columns) == summaries.COLUMNS["dar_perplexity"]
    rows = df.set_index("run")
    swa, dilated, hybrid = rows.loc["tiny-swa-w32"], rows.loc["tiny-dilated-w32-r4"], rows.loc["tiny-swa-w32-full2"]
    assert swa["window"] == 32 and pd.isna(swa["d_down"]) and pd.isna(swa["bottleneck_activation"])
    assert pd.isna(swa["dilation"])
    assert dilated["dilation"] == 4 and dilated["window"] == 32
    assert hybrid["full_attention_every"] == 2
    assert rows.loc["tiny-dar-w32-d32-layers2.3", "attention_layers"] == "2.3"  # a string, not the number 2.3
    assert rows.loc["tiny-dar-w32-d32-sigmoid", "bottleneck_activation"] == "sigmoid"
    assert rows.loc["tiny-dar-w32-d32", "bottleneck_activation"] == "linear"
    assert pd.isna(rows.loc["tiny-uniform-d32", "window"])
    assert rows.loc["tiny-swa-w32", "rel_to_vanilla"] == pytest.approx(103.25)
    assert rows.loc["micro-dar-w32-d16", "rel_to_vanilla"] == pytest.approx(100.25)  # against micro's vanilla
    assert set(df["corpus"]) == {TEXT}  # synthetic runs have no perplexity: recall.csv scores them


def test_summarize_trajectory_relative_at_same_step(tmp_path):
    out = tmp_path / "traj.csv"
    df = summaries.summarize_trajectory(write_model_dirs(tmp_path), out)
    assert list(pd.read_csv(out).columns) == summaries.COLUMNS["dar_trajectory"]
    vanilla = df[df["attention"] == "vanilla"]
    assert set(vanilla["step"]) == set(range(0, 501, 50)) - {450}
    assert np.allclose(vanilla["rel_to_vanilla"], 100.0)
    assert np.allclose(df["val_ppl"], np.exp(df["val_loss"]))
    dar = df[df["run"] == run_name("dar", 32)].set_index("step")
    assert dar.loc[0, "rel_to_vanilla"] == pytest.approx(100.5 * math.exp(0.08))
    assert dar.loc[500, "rel_to_vanilla"] == pytest.approx(100.5 * math.exp(0.08 * math.exp(-500 / 120)))
    # Vanilla did not evaluate step 450: no baseline, so no relative value rather than a guess.
    assert pd.isna(dar.loc[450, "rel_to_vanilla"])
    # Window is only meaningful for DAR, although every config carries one.
    assert df.loc[df["attention"] == "uniform", "window"].isna().all()
    assert (df.loc[df["attention"] == "dar", "window"] == WINDOW).all()


def test_summarize_trajectory_missing_vanilla(tmp_path):
    with pytest.raises(ValueError, match="vanilla"):
        summaries.summarize_trajectory(write_model_dirs(tmp_path, with_vanilla=False), tmp_path / "t.csv")


def test_summarize_trajectory_per_dataset(full):
    root, raw, summary = full
    df = summaries.read(summary_path(summary, "dar_trajectory"), "dar_trajectory")
    assert list(df.columns) == summaries.COLUMNS["dar_trajectory"]
    # micro and recall both have d = 64: each run is measured against its own dataset's vanilla.
    assert np.allclose(df.loc[df["attention"] == "vanilla", "rel_to_vanilla"], 100.0)
    last = df[df["step"] == 200].set_index("run")
    assert last.loc["micro-dar-w32-d16", "rel_to_vanilla"] == pytest.approx(
        100.25 * math.exp(0.05 * math.exp(-200 / 60)), rel=1e-5
    )
    assert last.loc["recall-swa-w16", "dataset"] == RECALL and last.loc["tiny-swa-w32", "window"] == 32
    assert last.loc["tiny-dar-w32-d32-layers2.3", "attention_layers"] == "2.3"
    assert last.loc["tiny-swa-w32-full2", "full_attention_every"] == 2
    assert set(df["run"]) == set(DATASETS)  # every run, text and synthetic
    with pytest.raises(ValueError, match="more than one vanilla"):
        summaries.summarize_trajectory(raw["models"], root / "t.csv")  # without datasets, two d = 64 vanillas


def test_summarize_lm_eval_long_format(tmp_path):
    out = tmp_path / "lm.csv"
    df = summaries.summarize_lm_eval(write_lm_eval_jsons(tmp_path), out)
    assert list(pd.read_csv(out).columns) == summaries.COLUMNS["lm_eval"]
    assert set(df["metric"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity", "acc"}
    assert len(df) == 7 * 5
    acc = df[(df["run"] == run_name("vanilla", None)) & (df["metric"] == "acc")].iloc[0]
    assert acc["task"] == "lambada_openai" and acc["value"] == pytest.approx(0.12) and acc["stderr"] == 0.0045
    assert df.loc[df["task"] == "wikitext", "stderr"].isna().all()  # "N/A" is not a number


def test_summarize_lm_eval_keeps_non_default_filter(tmp_path):
    record = {
        "run": "r",
        "attention": "vanilla",
        "hidden_size": 64,
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,flexible-extract": 0.02,
                "exact_match_stderr,flexible-extract": 0.004,
                "sample_len": 1319,  # lm-eval writes the sample count beside the metrics
            }
        },
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    df = summaries.summarize_lm_eval([path], tmp_path / "lm.csv")
    assert df[["metric", "value", "stderr"]].values.tolist() == [["exact_match,flexible-extract", 0.02, 0.004]]


def test_summarize_recall_tidy(full):
    root, raw, summary = full
    df = pd.read_csv(summary_path(summary, "recall"))
    assert list(df.columns) == summaries.COLUMNS["recall"]
    runs = [s for s in FULL if s["synthetic"]]
    assert len(df) == len(runs) * (1 + len(BINS))
    swa = df[df["run"] == "recall-swa-w16"]
    overall = swa[swa["scope"] == "overall"].iloc[0]
    assert overall["accuracy"] == pytest.approx(0.25) and overall["n"] == 4096 and pd.isna(overall["bin"])
    assert (overall["min_distance"], overall["max_distance"]) == (17, 124)
    dist = swa[swa["scope"] == "distance"].sort_values("bin")
    assert list(dist["bin"]) == [0, 1, 2, 3] and list(dist["min_distance"]) == [lo for lo, _ in BINS]
    assert dist["accuracy"].iloc[-1] == 0.0 and (dist["chance"] == CHANCE).all()
    assert df.loc[df["run"] == "recall-swa-w16", "window"].eq(16).all()
    assert df.loc[df["run"] == "recall-uniform-d8", "window"].isna().all()


def test_summarize_recall_errors(tmp_path):
    good = write_full(tmp_path)["recall"][0]
    record = json.loads(good.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in record.items() if k != "chance"}))
    with pytest.raises(ValueError, match="chance"):
        summaries.summarize_recall([bad], tmp_path / "r.csv")
    bad.write_text(json.dumps(record | {"by_distance": [{"min_distance": 1, "max_distance": 2, "n": 3}]}))
    with pytest.raises(ValueError, match=r"by_distance\[0\].*accuracy"):
        summaries.summarize_recall([bad], tmp_path / "r.csv")
    with pytest.raises(ValueError, match="appears twice"):
        summaries.summarize_recall([good, good], tmp_path / "r.csv")
    bad.write_text(json.dumps(record | {"attention": "dar", "d_down": None, "window": 16}))
    with pytest.raises(ValueError, match=r"bad.json: .*lacks \['d_down'\]"):
        summaries.summarize_recall([bad], tmp_path / "r.csv")
    empty = dict(record, by_distance=[{"min_distance": 1, "max_distance": 2, "accuracy": None, "n": 0}])
    bad.write_text(json.dumps(empty))
    df = summaries.summarize_recall([bad], tmp_path / "r.csv")
    assert pd.isna(df.loc[df["scope"] == "distance", "accuracy"]).all()  # a bin without queries
    assert not (tmp_path / "nothing.csv").exists()
    with pytest.raises(ValueError, match="no recall JSON"):
        summaries.summarize_recall([], tmp_path / "nothing.csv")


def test_summarize_fidelity_concatenates_and_checks_columns(tmp_path):
    paths = write_fidelity_csvs(tmp_path)
    df = summaries.summarize_fidelity(paths, tmp_path / "fid.csv")
    assert list(df.columns) == summaries.COLUMNS["dimpo_fidelity"]
    assert len(df) == len(FIDELITY_SCALE) * len(D_PRIMES) * N_LAYERS
    assert list(dict.fromkeys(df["objective"])) == ["random", "pca", "dimpo", "kl"]  # the paper's order
    bad = tmp_path / "bad.csv"
    pd.read_csv(paths[0]).drop(columns="mse").to_csv(bad, index=False)
    with pytest.raises(ValueError, match="mse"):
        summaries.summarize_fidelity([bad], tmp_path / "fid2.csv")


def test_summarize_perplexity_pairs_replicates_by_seed(tmp_path):
    """Perplexity: each replicate over the Vanilla of its seed; Vanilla lacks seed 2 on d = 128,
    so there seed 2 is divided by the mean of Vanilla's seeds 0 and 1, and vanilla_seed is empty."""
    raw = write_full(tmp_path, [s for s in replicated() if s["run"] != "tiny-vanilla-s2"])
    df = summaries.summarize_perplexity(raw["ppl"], tmp_path / "ppl.csv").set_index("run")
    back = summaries.read(tmp_path / "ppl.csv", "dar_perplexity").set_index("run")
    assert back.loc["tiny-dar-w32-d64-s1", "vanilla_seed"] == 1
    assert pd.isna(back.loc["tiny-dar-w32-d64-s2", "vanilla_seed"])
    assert df.loc["tiny-dar-w32-d64", "rel_to_vanilla"] == pytest.approx(98.5)
    # 98.5 + 0.6: its seed's Vanilla factor cancels.
    assert df.loc["tiny-dar-w32-d64-s1", "rel_to_vanilla"] == pytest.approx(99.1)
    vanilla_mean = VANILLA_TEXT_PPL[128] * (VANILLA_SEED_FACTOR[0] + VANILLA_SEED_FACTOR[1]) / 2
    ppl_s2 = VANILLA_TEXT_PPL[128] * VANILLA_SEED_FACTOR[2] * (98.5 - 0.6) / 100
    assert df.loc["tiny-dar-w32-d64-s2", "rel_to_vanilla"] == pytest.approx(100 * ppl_s2 / vanilla_mean)
    # Micro's Vanilla has every seed: seed 2 lies its jitter below.
    micro = next(s for s in FULL if s["run"] == "micro-dar-w32-d16")
    assert df.loc["micro-dar-w32-d16-s2", "rel_to_vanilla"] == pytest.approx(100.25 - micro["rel_jitter"])
    assert back.loc["micro-dar-w32-d16-s2", "vanilla_seed"] == 2


def test_summarize_trajectory_pairs_replicates_by_seed(tmp_path):
    runs = replicated()
    raw = write_full(tmp_path, runs)
    datasets = {s["run"]: s["dataset"] for s in runs}
    df = summaries.summarize_trajectory(raw["models"], tmp_path / "t.csv", datasets=datasets)
    last = df[df["step"] == 200].set_index("run")
    # Every run of seed s carries its seed's Vanilla offset in the loss; pairing removes it.
    assert last.loc["tiny-dar-w32-d64-s2", "rel_to_vanilla"] == pytest.approx(
        (98.5 - 0.6) * math.exp(0.05 * math.exp(-200 / 60)), rel=1e-5
    )
    assert set(df["vanilla_seed"].dropna()) == {0, 1, 2}
    assert (df["vanilla_seed"] == df["seed"]).all()


def test_summarize_fidelity_orders_fits_by_seed(tmp_path):
    df = summaries.summarize_fidelity(write_fidelity_csvs(tmp_path, seeds=(1, 0)), tmp_path / "f.csv")
    assert list(df.columns) == summaries.COLUMNS["dimpo_fidelity"]
    first = df[(df["objective"] == "kl") & (df["d_prime"] == 2)]
    assert list(first["seed"]) == [0] * 4 + [1] * 4  # each fit's layers together, seeds in order
    assert first["kl"].iloc[4] == pytest.approx(first["kl"].iloc[0] * FIT_SEED_FACTOR[1])


def test_summarize_fidelity_copies_a_fit_into_each_of_its_studies(tmp_path):
    """A fit in Table 1's grid and in a study (the same setting, d' and seed) has rows in both;
    a CSV the studies map does not list is Table 1's."""
    main = write_fidelity_csvs(tmp_path, objectives=["dimpo", "kl"])
    ablation = write_fidelity_csvs(tmp_path, setting="k=0,lam=0", objectives=["dimpo"], folder="k0")
    shared = next(p for p in main if p.name.startswith("dimpo_default_d4_"))
    studies = {str(p): [["table6", 0]] for p in ablation} | {str(shared): [["table1", 0], ["table6", 1]]}
    df = summaries.summarize_fidelity(main + ablation, tmp_path / "f.csv", studies=studies)
    table6 = df[df["study"] == "table6"]
    assert set(zip(table6["setting"], table6["setting_order"])) == {("k=0,lam=0", 0), ("default", 1)}
    assert set(table6.loc[table6["setting"] == "default", "d_prime"]) == {4}
    table1 = df[df["study"] == "table1"]
    assert len(table1) == 2 * len(D_PRIMES) * N_LAYERS and set(table1["setting"]) == {"default"}
    back = summaries.read(tmp_path / "f.csv", "dimpo_fidelity")
    assert back["setting"].dtype == "string" and set(back["study"]) == {"table1", "table6"}


@pytest.mark.parametrize(
    "name, column",
    [("dar_perplexity", "rel_to_vanilla"), ("dar_perplexity", "window"), ("recall", "scope"), ("recall", "chance"),
     ("lm_eval", "metric"), ("dar_trajectory", "step"), ("dar_trajectory", "dataset")],
)
def test_read_names_the_file_and_the_missing_column(full, tmp_path, name, column):
    """No summary "written before" a column existed is filled in: a missing column is an error."""
    _, _, summary = full
    path = tmp_path / Path(summary_path(summary, name)).name
    pd.read_csv(summary_path(summary, name)).drop(columns=column).to_csv(path, index=False)
    with pytest.raises(ValueError, match=rf"{path.name}: missing column\(s\) \['{column}'\]"):
        summaries.read(path, name)
