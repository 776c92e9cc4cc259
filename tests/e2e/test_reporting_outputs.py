"""dimattn.reporting.outputs: which outputs a config calls for, and rendering exactly those."""

import pandas as pd
import pytest
from reporting_fixtures import (
    FULL,
    REFERENCE,
    STUDIES,
    fields,
    is_png,
    replicated,
    saved_figures,
    score_labels,
    summary_path,
    write_downstream_jsons,
    write_fidelity_csvs,
    write_fidelity_summary,
    write_full_summaries,
    write_latency_json,
    write_long_context_jsons,
    write_longctx_jsons,
    write_projected_suite_jsons,
    write_summaries,
)

from dimattn.model import variants
from dimattn.reporting import outputs, selection, summaries
from dimattn.reporting.selection import NoRuns

FRONTIER = {"figures/kv_frontier.png"}  # every run is a point of it
TEXT_OUTPUTS = {"tables/dar_perplexity.tex", "figures/dar_perplexity.png", "figures/dar_trajectory.png"}


def run(attention, hidden_size=64, synthetic=False, **keys):
    """A planned run as dimattn.workflow.sweeps.Run.fields gives it."""
    model = {"attention": attention, "hidden_size": hidden_size, **keys}
    scale = "recall" if synthetic else "tiny"
    return variants.run_fields(variants.run_name(scale, model), model) | {
        "scale": scale,
        "dataset": "mqar" if synthetic else "shakespeare",
        "synthetic": synthetic,
    }


def wanted(runs, lm_eval=False, dimpo=()):
    return set(outputs.wanted(runs, lm_eval, dimpo))


ALL_STUDIES = ("table1", *STUDIES, "downstream", "long_context", "kv", "latency", "suite")


VANILLA = run("vanilla")
DAR = run("dar", window=16, d_down=16)  # d/4 at the main window


# ----------------------------------------------------------------------------- wanted: each predicate


def test_table1_and_trajectory_need_a_vanilla_run_beside_a_plain_bottleneck_run():
    assert wanted([VANILLA, DAR]) >= TEXT_OUTPUTS
    assert wanted([VANILLA, run("uniform", d_down=8)]) >= TEXT_OUTPUTS
    assert not wanted([VANILLA]) & TEXT_OUTPUTS  # nothing to set against Vanilla
    assert wanted([VANILLA]) == FRONTIER  # but a point of the frontier
    assert not wanted([DAR]) & TEXT_OUTPUTS  # no Rel. without Vanilla
    # A sigmoid bottleneck is a DAR variant, not a Table 1 run.
    assert not wanted([VANILLA, run("dar", window=16, d_down=16, bottleneck_activation="sigmoid")]) & TEXT_OUTPUTS
    # Synthetic runs have no perplexity (no Table 1), but a training trajectory.
    synthetic = wanted([run("vanilla", synthetic=True), run("dar", window=16, d_down=4, synthetic=True)])
    assert "figures/dar_trajectory.png" in synthetic and "tables/dar_perplexity.tex" not in synthetic


def test_table2_needs_dar_at_a_quarter_of_the_width_at_the_main_window():
    assert "tables/dar_scales.tex" in wanted([VANILLA, DAR])
    assert "tables/dar_scales.tex" not in wanted([VANILLA, run("dar", window=16, d_down=32)])
    # d/4 only at a window other than the main one (most DAR runs are at w = 16): not Table 1's run.
    off_main = [VANILLA, run("dar", window=4, d_down=16), run("dar", window=16, d_down=8),
                run("dar", window=16, d_down=32)]
    assert "tables/dar_scales.tex" not in wanted(off_main)
    assert "tables/dar_scales.tex" not in wanted([DAR])


def test_table3_needs_a_window_sweep_at_one_d_down():
    sweep = [run("dar", window=4, d_down=16), run("dar", window=16, d_down=16)]
    names = {"tables/dar_window.tex", "figures/dar_window.png"}
    assert wanted([VANILLA, *sweep]) >= names
    assert not wanted(sweep) & names  # on text, Rel. needs a vanilla run
    assert not wanted([VANILLA, run("dar", window=4, d_down=16), run("dar", window=16, d_down=8)]) & names
    # A window pattern variant is not a window sweep.
    assert not wanted([VANILLA, DAR, run("dar", window=4, d_down=16, attention_layers=[1])]) & names
    recall = [run("dar", window=w, d_down=4, synthetic=True) for w in (0, 16)]
    assert wanted(recall) >= names  # accuracy needs no vanilla run


def test_table4_needs_lm_eval_and_a_no_bottleneck_dar_run():
    control = run("dar", window=16, d_down=64)
    assert "tables/dar_downstream.tex" in wanted([VANILLA, DAR, control], lm_eval=True)
    assert "tables/dar_downstream.tex" not in wanted([VANILLA, DAR, control], lm_eval=False)
    assert "tables/dar_downstream.tex" not in wanted([VANILLA, DAR], lm_eval=True)
    assert "tables/dar_downstream.tex" not in wanted([run("dar", window=16, d_down=32, synthetic=True, hidden_size=32)],
                                                     lm_eval=True)


@pytest.mark.parametrize(
    "keys",
    [
        {"attention": "swa", "window": 16},
        {"attention": "dilated", "window": 16, "dilation": 4},
        {"attention": "swa", "window": 16, "full_attention_every": 2},
        {"attention": "dar", "window": 16, "d_down": 16, "bottleneck_activation": "sigmoid"},
        {"attention": "dar", "window": 16, "d_down": 16, "attention_layers": [0]},
        {"attention": "uniform", "d_down": 16, "full_attention_every": 2},
    ],
)
def test_baselines_need_a_seed_001_run_or_a_dar_variant(keys):
    assert "tables/baselines.tex" in wanted([VANILLA, run(**keys)])
    assert "tables/baselines.tex" in wanted([run(**keys, synthetic=True)])


def test_no_baselines_among_seed_000_runs():
    assert "tables/baselines.tex" not in wanted([VANILLA, DAR, run("uniform", d_down=16)])


def test_recall_lm_eval_and_dimpo_outputs():
    recall = {"tables/recall.tex", "figures/recall.png"}
    dimpo = {"tables/dimpo_fidelity.tex", "figures/dimpo_fidelity.png"}
    assert wanted([VANILLA, run("vanilla", synthetic=True)]) >= recall
    assert not wanted([VANILLA, DAR]) & recall
    assert "tables/lm_eval.tex" in wanted([VANILLA], lm_eval=True)
    assert "tables/lm_eval.tex" not in wanted([VANILLA])
    assert wanted([VANILLA], dimpo=["table1"]) == dimpo | FRONTIER
    assert not wanted([VANILLA]) & dimpo
    assert wanted([], dimpo=["table1"]) == dimpo
    # Each study of dimpo.ablations brings its own output; Figure 4's three panels share one.
    assert wanted([], dimpo=["table1", "quirks"]) == dimpo | {"tables/dimpo_quirks.tex"}
    assert wanted([], dimpo=["table1", "table6"]) == dimpo | {"tables/dimpo_ablation.tex"}
    assert wanted([], dimpo=["table1", "figure4c"]) == dimpo | {"figures/dimpo_pairs.png"}
    assert wanted([], dimpo=ALL_STUDIES[:-5]) == wanted([], dimpo=["table1", "quirks", "table6", "figure4b"])
    assert wanted([], dimpo=["table1", "downstream"]) == dimpo | {"tables/dimpo_downstream.tex",
                                                                 "figures/dimpo_downstream.png"}
    # Tables 2-3 with a long-context probe (recall or RULER), Table 5 with KV compression on it
    assert wanted([], dimpo=["table1", "downstream", "long_context"]) - wanted([], dimpo=["table1", "downstream"]) == {
        "tables/dimpo_ruler.tex"}
    assert wanted([], dimpo=ALL_STUDIES[:-2]) - wanted([], dimpo=ALL_STUDIES[:-3]) == {"tables/dimpo_kv.tex"}
    assert wanted([], dimpo=ALL_STUDIES[:-1]) - wanted([], dimpo=ALL_STUDIES[:-2]) == {"tables/dimpo_latency.tex"}
    # the projections' needle heat map where a model is scored on the long-context suite
    assert wanted([], dimpo=ALL_STUDIES) - wanted([], dimpo=ALL_STUDIES[:-1]) == {"figures/dimpo_needle.png"}


def test_replicates_count_once():
    """A setting trained with more seeds than the others does not outweigh them."""
    off_main = run("dar", window=4, d_down=16)
    replicates = [off_main | {"run": f"{off_main['run']}-s{seed}", "seed": seed} for seed in (1, 2)]
    runs = [VANILLA, run("dar", window=16, d_down=8), run("dar", window=16, d_down=32), off_main, *replicates]
    assert selection.main_window(runs) == 16  # two settings at w = 16, one (of three runs) at w = 4
    assert "tables/dar_scales.tex" not in wanted(runs)  # d/4 only off the main window
    assert wanted([fields(s) for s in replicated()], True, ALL_STUDIES) == wanted(
        [fields(s) for s in FULL], True, ALL_STUDIES
    )


def test_wanted_summaries():
    assert outputs.wanted_summaries([VANILLA], False, ()) == ["dar_perplexity", "dar_trajectory", "kv_frontier"]
    assert outputs.wanted_summaries([run("vanilla", synthetic=True)], True, ["table1"]) == [
        "dar_trajectory", "recall", "lm_eval", "dimpo_fidelity", "kv_frontier"]
    assert outputs.wanted_summaries([], False, ["table1"]) == ["dimpo_fidelity"]


def test_registry_paths_captions_and_categories():
    for name, out in outputs.OUTPUTS.items():
        assert out.path == f"results/{name}"
        assert (REFERENCE.parent / "report" / f"{out.caption}.rst").exists(), name
        assert set(out.optional) <= set(out.summaries) <= set(outputs.SUMMARIES)
        assert callable(out.render)
    groups = outputs.by_category(outputs.OUTPUTS)
    assert list(groups) == ["DAR", "Baselines", "Recall", "lm-eval", "DimPO", "Long-context", "Frontier"]
    assert outputs.reads(groups["Recall"], list(outputs.SUMMARIES)) == ["recall"]
    assert outputs.reads(groups["DAR"], ["dar_perplexity", "dar_trajectory"]) == ["dar_perplexity", "dar_trajectory"]
    targets = outputs.targets([VANILLA, DAR], False, ())
    assert targets[:2] == ["results/summary/dar_perplexity.csv", "results/summary/dar_trajectory.csv"]
    assert "results/tables/dar_scales.tex" in targets


# ----------------------------------------------------------------------------- config and summaries agree


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    summary = write_full_summaries(root)
    write_fidelity_summary(root, summary)
    jsons = write_downstream_jsons(root) + write_long_context_jsons(root) + write_projected_suite_jsons(root)
    summaries.summarize_downstream(jsons, summary_path(summary, "dimpo_downstream"),
                                   needle_csv=summary_path(summary, "dimpo_needle"))
    summaries.summarize_latency([write_latency_json(root)], summary_path(summary, "dimpo_latency"))
    suite = write_longctx_jsons(root)
    summaries.summarize_longctx(suite, summary_path(summary, "longctx"))
    summaries.summarize_longctx_needle(suite, summary_path(summary, "longctx_needle"))
    return root, summary


def test_the_summaries_call_for_what_the_config_called_for(full):
    root, summary = full
    planned = outputs.wanted([fields(s) for s in FULL], lm_eval=True, dimpo=ALL_STUDIES, longctx=True)
    assert planned == list(outputs.OUTPUTS)  # the full sweep has every table and figure
    asked = outputs.runs_in(summary)
    assert outputs.wanted(asked.runs, asked.lm_eval, asked.dimpo, asked.longctx) == planned
    assert {r["run"] for r in asked.runs if r["synthetic"]} == {s["run"] for s in FULL if s["synthetic"]}
    written = outputs.render_existing(summary, REFERENCE, root / "results")
    assert [str(p.relative_to(root / "results")) for p in written] == planned
    for path in written:
        assert is_png(path) if path.suffix == ".png" else r"\begin{tabular}" in path.read_text()
    # Atomic writes leave no temporary files behind.
    assert not [p for p in (root / "results").rglob(".*")]


def test_every_figure_says_which_way_is_better_on_each_score_axis(full, tmp_path, monkeypatch):
    _, summary = full
    saved = saved_figures(monkeypatch)
    labels = {}
    for name in (n for n in outputs.OUTPUTS if n.endswith(".png")):
        outputs.render([name], summary, REFERENCE, tmp_path)
        (fig,) = saved[len(labels):]
        labels[name] = score_labels(fig)
    assert len(labels) >= 10 and all(labels.values())  # every figure of the full sweep, each with score axes
    assert {name: [x for x in mine if "is better" not in x] for name, mine in labels.items()} == dict.fromkeys(
        labels, [])


def test_without_recall_runs_nothing_recall_is_rendered(tmp_path):
    text_only = [s for s in FULL if not s["synthetic"] and s["model"]["hidden_size"] == 128][:8]  # the d_down sweep
    summary = write_full_summaries(tmp_path, runs=text_only)
    names = {str(p.relative_to(tmp_path / "results"))
             for p in outputs.render_existing(summary, REFERENCE, tmp_path / "results")}
    assert names == TEXT_OUTPUTS | FRONTIER | {
        "tables/dar_scales.tex",
        "tables/dar_downstream.tex",
        "tables/lm_eval.tex",
    }
    assert outputs.wanted([fields(s) for s in text_only], lm_eval=True, dimpo=()) == sorted(
        names, key=list(outputs.OUTPUTS).index)


def test_recall_sweeps_beside_a_text_scale_without_one(tmp_path):
    """Only the recall scale has a window sweep and seed 001 variants; no text run is at d/4."""
    runs = [s for s in FULL if s["synthetic"] or s["run"] in ("tiny-vanilla", "tiny-dar-w32-d64")]
    expected = TEXT_OUTPUTS | FRONTIER | {"tables/dar_window.tex", "figures/dar_window.png", "tables/baselines.tex",
                                          "tables/recall.tex", "figures/recall.png"}
    assert wanted([fields(s) for s in runs]) == expected
    summary = write_full_summaries(tmp_path, runs=runs)
    summary_path(summary, "lm_eval").unlink()
    written = outputs.render_existing(summary, REFERENCE, tmp_path / "results")
    assert {str(p.relative_to(tmp_path / "results")) for p in written} == expected


def test_render_existing_on_dimpo_alone(tmp_path):
    summary = tmp_path / "summary"
    summaries.summarize_fidelity(write_fidelity_csvs(tmp_path), summary_path(summary, "dimpo_fidelity"))
    written = outputs.render_existing(summary, REFERENCE, tmp_path)
    assert sorted(p.name for p in written) == ["dimpo_fidelity.png", "dimpo_fidelity.tex"]


def test_render_existing_empty_dir_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        outputs.render_existing(tmp_path, REFERENCE, tmp_path / "results")
    for name in outputs.SUMMARIES:
        assert f"{name}.csv" in str(err.value)
    assert "run the workflow" in str(err.value)
    assert not (tmp_path / "results").exists()


def test_render_existing_needs_the_trajectory_to_know_the_runs(tmp_path):
    summary = write_summaries(tmp_path)
    summary_path(summary, "dar_trajectory").unlink()
    with pytest.raises(FileNotFoundError, match="dar_trajectory.csv"):
        outputs.render_existing(summary, REFERENCE, tmp_path / "results")


# ----------------------------------------------------------------------------- errors: no placeholders


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small d_down sweep: no window sweep, no no-bottleneck run, no seed 001 run, no recall."""
    return write_summaries(tmp_path_factory.mktemp("small"))


@pytest.mark.parametrize(
    "name, lacking",
    [
        ("tables/dar_window.tex", "no scale has plain DAR runs at one d_down and two or more windows"),
        ("figures/dar_window.png", "no scale has plain DAR runs at one d_down and two or more windows"),
        ("tables/dar_downstream.tex", "no plain DAR run with d_down = hidden_size"),
        ("tables/baselines.tex", "no SWA, dilated, hybrid or patterned DAR run"),
    ],
)
@pytest.mark.parametrize("processes", [1, 2])
def test_a_declared_output_without_its_runs_is_an_error(small, tmp_path, name, lacking, processes):
    """Drawn alone or beside an output that renders (in a worker process when two), the error names it."""
    names = [name] if processes == 1 else ["tables/dar_perplexity.tex", name]
    with pytest.raises(NoRuns, match=f"^{name}: {lacking}"):
        outputs.render(names, small, REFERENCE, tmp_path, processes=processes)
    assert not (tmp_path / name).exists()


def test_a_declared_output_without_its_summary_is_an_error(small, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tables/recall.tex needs .*recall.csv, which is missing"):
        outputs.render(["tables/recall.tex"], small, REFERENCE, tmp_path)
    # A summary on disk that is not among the rule's inputs does not count.
    with pytest.raises(FileNotFoundError, match="lm_eval.csv"):
        outputs.render(["tables/lm_eval.tex"], small, REFERENCE, tmp_path, available=["dar_perplexity"])
    with pytest.raises(ValueError, match="unknown output"):
        outputs.render(["tables/nope.tex"], small, REFERENCE, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "summary, column, name",
    [
        ("dar_perplexity", "rel_to_vanilla", "tables/dar_perplexity.tex"),
        ("dar_perplexity", "attention_layers", "tables/dar_scales.tex"),
        ("lm_eval", "metric", "tables/dar_downstream.tex"),
        ("dar_trajectory", "dataset", "figures/dar_trajectory.png"),
        ("recall", "chance", "tables/recall.tex"),
    ],
)
def test_a_malformed_summary_names_the_file_and_the_column(full, tmp_path, summary, column, name):
    _, good = full
    bad = tmp_path / "summary"
    bad.mkdir()
    for s in outputs.SUMMARIES:
        frame = pd.read_csv(summary_path(good, s))
        frame.drop(columns=column if s == summary else []).to_csv(summary_path(bad, s), index=False)
    with pytest.raises(ValueError, match=rf"{summary}.csv: missing column\(s\) \['{column}'\]"):
        outputs.render([name], bad, REFERENCE, tmp_path / "results")
    assert not (tmp_path / "results").exists()
