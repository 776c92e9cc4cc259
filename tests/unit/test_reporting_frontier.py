"""The KV frontier (issue 18 item 5): summarize_frontier's points from every kind of raw output
(a run's perplexity, recall and suite records, a projected model's scores), each relative to its
own base, and the Pareto front against a naive domination check over every pair of points."""

import json
from pathlib import Path

import pandas as pd
import pytest

from dimattn.model import variants
from dimattn.reporting import frontier, summaries

TEXT_RUNS = {  # run -> (model fields, ppl at seed 0 and 1, cache bytes per token)
    "tiny-vanilla": ({"attention": "vanilla"}, (60.0, 62.0), 4096.0),
    "tiny-dar-w32-d32": ({"attention": "dar", "window": 32, "d_down": 32}, (61.0, 63.5), 1280.0),
    "tiny-swa-w32": ({"attention": "swa", "window": 32}, (66.0, 66.0), 512.0),
    "tiny-swa-w32-full2": ({"attention": "swa", "window": 32, "full_attention_every": 2}, (70.0, 70.0), 2304.0),
}
PROJECTED = {  # (objective, l, kv) -> (ppl by fit seed, bytes)
    ("base", 0, "none"): ((50.0,), 4096.0),
    ("kl", 2, "none"): ((52.0, 53.0), 3328.0),
    ("dimpo", 2, "none"): ((51.0, 52.5), 3328.0),
    ("pca", 4, "none"): ((80.0, 81.0), 2560.0),
}


def write(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def run_record(run, model, seed, **scores):
    fields = variants.run_fields(run, {"hidden_size": 128, **model}, seed)
    return fields | {"corpus": "shakespeare", "split": "test"} | scores


def projected_record(objective, l, kv, seed, ppl, nbytes, **extra):
    return {"model": "tiny-vanilla", "objective": objective, "setting": "default", "d_prime": 0 if l == 0 else 4,
            "num_projected": l, "n_layers": 4, "scale": "d_prime", "kv": kv, "kv_method": kv, "kv_level": 0,
            "seed": seed, "perplexity": {"shakespeare": {"ppl": ppl, "cache_bytes_per_token": nbytes}},
            "recall": {}, "results": {"dimattn_next_line": {"acc,none": 0.3}}, "num_fewshot": {}} | extra


@pytest.fixture
def raw(tmp_path):
    files = []
    for run, (model, ppls, nbytes) in TEXT_RUNS.items():
        for seed, ppl in enumerate(ppls):
            files.append(write(tmp_path / f"{run}-s{seed}.json",
                               run_record(run, model, seed, ppl=ppl, cache_bytes_per_token=nbytes)))
    for (objective, l, kv), (ppls, nbytes) in PROJECTED.items():
        for seed, ppl in enumerate(ppls):
            files.append(write(tmp_path / f"p-{objective}-{l}-s{seed}.json",
                               projected_record(objective, l, kv, seed, ppl, nbytes)))
    # the recall probe: a vanilla and a DAR run, one seed each
    for run, model, acc, nbytes in (("recall-vanilla", {"attention": "vanilla"}, 0.98, 512.0),
                                    ("recall-dar-w4-d2", {"attention": "dar", "window": 4, "d_down": 2}, 0.5, 80.0)):
        record = run_record(run, model, 0, accuracy=acc, by_distance=[], chance=1 / 16, n_queries=8,
                            cache_bytes_per_token=nbytes) | {"corpus": "recall", "hidden_size": 64}
        files.append(write(tmp_path / f"{run}.json", record))
    # a hub model scored by lm-eval alone: no cache measured, no point
    files.append(write(tmp_path / "hub.json", projected_record("kl", 2, "none", 0, 1.0, 1.0, perplexity={})))
    return files


def test_every_scored_model_is_a_point_relative_to_its_own_base(raw, tmp_path):
    df = summaries.summarize_frontier(raw, tmp_path / "kv_frontier.csv")
    assert list(df.columns) == summaries.COLUMNS["kv_frontier"]
    assert len(df) == 2 * len(TEXT_RUNS) + 7 + 2  # every replicate, and not the hub model
    text = df[(df["probe"] == "perplexity:shakespeare") & (df["source"] == "run")].set_index(["run", "seed"])
    # paired by seed with the vanilla run of the same width
    assert text.loc[("tiny-dar-w32-d32", 1), "rel_to_base"] == pytest.approx(100 * 63.5 / 62.0)
    assert text.loc[("tiny-swa-w32-full2", 0), "family"] == "swa+full"
    projected = df[df["source"] == "projected"].set_index(["objective", "seed"])
    # a projected model against its own base (l = 0), whose only seed is 0: the mean for seed 1
    assert projected.loc[("kl", 1), "rel_to_base"] == pytest.approx(100 * 53.0 / 50.0)
    assert projected.loc[("base", 0), "family"] == "vanilla" and projected.loc[("kl", 0), "family"] == "kl"
    recall = df[df["probe"] == "recall:recall"].set_index("run")
    assert recall.loc["recall-dar-w4-d2", "rel_to_base"] == pytest.approx(100 * 0.5 / 0.98)
    assert not df["higher_is_better"][df["metric"] == "ppl"].any() and recall["higher_is_better"].all()
    back = summaries.read(tmp_path / "kv_frontier.csv", "kv_frontier")
    assert len(back) == len(df)


def test_the_front_is_every_undominated_point(raw, tmp_path):
    pts = frontier.points(summaries.summarize_frontier(raw, tmp_path / "kv_frontier.csv"))
    for probe, part in pts.groupby("probe"):
        sign = 1 if part["higher_is_better"].iloc[0] else -1
        rows = part.to_dict("records")
        for p in rows:  # naive: p is on the front iff no other point is at least as good on both, better on one
            q_p = sign * p["rel_to_base"]
            dominated = any(
                sign * q["rel_to_base"] >= q_p
                and q["cache_bytes_per_token"] <= p["cache_bytes_per_token"]
                and (sign * q["rel_to_base"] > q_p or q["cache_bytes_per_token"] < p["cache_bytes_per_token"])
                for q in rows
                if q is not p
            )
            assert p["pareto"] == (not dominated), (probe, frontier.label(p))
    text = pts[pts["probe"] == "perplexity:shakespeare"]
    on_front = set(text.loc[text["pareto"], "family"])
    # SWA holds the fewest bytes, DAR is better at more; DimPO (103.5 % at 3,328 bytes) is beaten
    # by DAR (102 % at 1,280), the hybrid by DAR too; the two vanilla points tie at 100 %
    assert on_front == {"vanilla", "dar", "swa"}
    # seeds averaged: one point per setting, the spread beside
    dar = text[text["family"] == "dar"].iloc[0]
    assert dar["rel_to_base_spread"].n == 2 and dar["cache_bytes_per_token"] == 1280.0


def test_a_record_without_a_measured_cache_is_named(raw, tmp_path):
    stale = json.loads(raw[0].read_text())
    del stale["cache_bytes_per_token"]
    write(raw[0], stale)
    with pytest.raises(ValueError, match=f"{raw[0].name}: its perplexity score lacks cache_bytes_per_token"):
        summaries.summarize_frontier(raw, tmp_path / "kv_frontier.csv")
    assert not (tmp_path / "kv_frontier.csv").exists()


def test_the_figure_draws_a_panel_per_probe(raw, tmp_path):
    df = summaries.summarize_frontier(raw, tmp_path / "kv_frontier.csv")
    path = frontier.frontier_figure({"kv_frontier": df}, Path("."), tmp_path / "kv_frontier.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="kv_frontier summary's rows; it is empty"):
        frontier.points(pd.DataFrame(columns=df.columns))


def test_a_point_is_named_once_by_objective_sizes_and_compression():
    """The figure's key: the compression named once (not in the family and again after it), the
    base model as "base", compressed or not."""
    row = {"source": "projected", "family": "kl+kivi", "objective": "kl", "d_prime": 16, "num_projected": 3,
           "n_layers": 6, "kv_method": "kivi", "kv_level": 2}
    assert frontier.label(row) == "kl d'=16 l=3/6 kivi 2"
    base = row | {"family": "snapkv", "objective": "base", "kv_method": "snapkv", "kv_level": 32}
    assert frontier.label(base) == "base snapkv 32"
    assert frontier.label(base | {"family": "vanilla", "kv_method": None}) == "base"
    run = {"source": "run", "family": "dar", "d_down": 16.0, "window": 32.0, "dilation": float("nan")}
    assert frontier.label(run) == "dar d_down=16 w=32"
