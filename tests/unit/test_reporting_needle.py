"""The needle heat map (dimattn.reporting.long_context): from the runs' suite JSONs through the
longctx_needle summary to a panel per run, the base first, each cell the bin's score."""

import json

import pytest
from matplotlib.collections import QuadMesh

from dimattn.reporting import long_context, summaries
from reporting_fixtures import NEEDLE_SCORES as SCORES
from reporting_fixtures import longctx_record as _record
from reporting_fixtures import write_longctx_jsons, write_projected_suite_jsons

@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The summary and the heat map drawn from it, once for the tests that read them."""
    from matplotlib.figure import Figure

    tmp_path = tmp_path_factory.mktemp("needle")
    summaries.summarize_longctx_needle(write_longctx_jsons(tmp_path), tmp_path / "longctx_needle.csv")
    df = summaries.read(tmp_path / "longctx_needle.csv", "longctx_needle")
    saved, savefig = [], Figure.savefig
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
        long_context.figure(df, tmp_path / "needle.png")
    return df, saved[0]


def test_the_summary_has_a_row_per_run_length_and_bin(drawn):
    df, _ = drawn
    assert len(df) == 16 and list(df["run"][:8]) == ["long-vanilla"] * 4 + ["long-dar-w8-d16"] * 4  # vanilla first
    assert list(df["subtask"][:4]) == ["niah_multikey"] * 2 + ["niah_single"] * 2
    assert list(df["depth_lo"][:2]) == [0.0, 0.5] and list(df["corpus"]) == ["suite128"] * 8 + ["suite256"] * 8
    multikey = df[df["subtask"] == "niah_multikey"]
    row = multikey[
        (multikey["run"] == "long-dar-w8-d16") & (multikey["seq_len"] == 128) & (multikey["depth_lo"] == 0.5)
    ].iloc[0]
    assert (row["score"], row["n"], row["depth_hi"]) == (10.0, 7, 1.0)


def test_a_panel_per_run_and_subtask_base_first_cells_are_the_bins_scores(drawn):
    _, fig = drawn
    panels = [ax for ax in fig.axes if ax.get_title()]
    titles = [ax.get_title().split("\n")[0] for ax in panels]
    assert titles == [
        f"{run}: {task}" for task in ("niah_multikey", "niah_single") for run in ("long-vanilla", "long-dar-w8-d16")
    ]
    for ax in panels[2:]:  # niah_single: every cell the fixture's 100
        (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
        assert mesh.get_array().tolist() == [[100.0, 100.0], [100.0, 100.0]]
    for ax in panels[:2]:
        run = ax.get_title().split(":")[0]
        assert ax.get_xlabel() == "context length (tokens)" and ax.get_ylabel().startswith("needle depth")
        assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0-50%", "50-100%"]  # shallow first
        (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
        cells = mesh.get_array().reshape(2, 2)  # rows: depth bins, columns: lengths
        assert cells.tolist() == [
            [SCORES[run, 128][0], SCORES[run, 256][0]],
            [SCORES[run, 128][1], SCORES[run, 256][1]],
        ]
        assert "6 examples" in ax.get_title()
        assert sorted(t.get_text() for t in ax.texts) == sorted(f"{s:.0f}" for L in (128, 256) for s in SCORES[run, L])


def test_a_record_without_needle_scores_is_refused(tmp_path):
    record = _record("long-vanilla", 128)
    del record["needle"]
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="no needle-depth scores"):
        summaries.summarize_longctx_needle([tmp_path / "r.json"], tmp_path / "n.csv")


def test_the_figures_target_redraws_the_heat_map_from_the_summary_alone(tmp_path):
    """`snakemake figures` (outputs.render_existing): the long-context summaries on disk call for
    the heat map, drawn from them alone; a config with no run on the suite asks for neither."""
    from dimattn.reporting import outputs

    summary_dir, results = tmp_path / "summary", tmp_path / "results"
    summaries.summarize_longctx_needle(write_longctx_jsons(tmp_path), summary_dir / "longctx_needle.csv")
    asked = outputs.runs_in(summary_dir)
    assert asked.longctx and asked.runs == []
    written = outputs.render_existing(summary_dir, tmp_path, results)
    assert written == [results / "figures/longctx_needle.png"] and written[0].stat().st_size > 10_000
    assert "figures/longctx_needle.png" not in outputs.wanted([], False, ())
    assert "longctx_needle" not in outputs.wanted_summaries([], False, ())
    assert outputs.wanted_summaries([], False, (), longctx=True) == ["longctx", "longctx_needle"]


# ----------------------------------------------------------------------------- projected models

@pytest.fixture
def projected(tmp_path):
    jsons = write_projected_suite_jsons(tmp_path)
    summary = tmp_path / "summary"
    summaries.summarize_downstream(jsons, summary / "dimpo_downstream.csv", needle_csv=summary / "dimpo_needle.csv")
    return summary


def test_the_needle_summary_of_projected_models_has_a_row_per_record_length_and_bin(projected):
    needle = summaries.read(projected / "dimpo_needle.csv", "dimpo_needle")
    assert len(needle) == 9 * 2 * 2  # 9 records, 2 lengths, 2 bins
    row = needle[(needle["objective"] == "dimpo") & (needle["num_projected"] == 2) & (needle["seed"] == 1)
                 & (needle["seq_len"] == 256) & (needle["depth_lo"] == 0.0)].iloc[0]
    assert (row["score"], row["n"], row["corpus"], row["subtask"], row["study"]) == (
        31.0,
        5,
        "suite256",
        "niah_multikey",
        "table1",
    )


def test_a_record_off_the_suite_leaves_the_needle_summary_empty(tmp_path):
    from reporting_fixtures import write_downstream_jsons

    summaries.summarize_downstream(write_downstream_jsons(tmp_path), tmp_path / "d.csv", needle_csv=tmp_path / "n.csv")
    assert summaries.read(tmp_path / "n.csv", "dimpo_needle").empty


def test_projections_are_drawn_at_the_separating_l_beside_the_base_seeds_averaged(projected, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    frames = {name: summaries.read(projected / f"{name}.csv", name) for name in ("dimpo_needle", "dimpo_downstream")}
    panels = long_context.projected_panels(frames["dimpo_needle"], frames["dimpo_downstream"])
    assert set(panels["num_projected"]) == {0, 2}  # l = 1 (gap 2 points) is not drawn
    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
    long_context.dimpo_needle_figure(frames, tmp_path, tmp_path / "dimpo_needle.png")
    axes = [ax for ax in saved[0].axes if ax.get_title()]
    titles = [ax.get_title().split("\n")[0] for ax in axes]
    assert titles[0] == "long: Base (l = 0): niah_multikey"  # the base first
    assert sorted(titles[1:]) == ["long: DimPO, l = 2 of 2: niah_multikey", "long: KL, l = 2 of 2: niah_multikey"]
    kl = axes[titles.index("long: KL, l = 2 of 2: niah_multikey")]
    (mesh,) = [c for c in kl.collections if isinstance(c, QuadMesh)]
    # rows: depth bins; columns: 128, 256 tokens; each the mean of seeds 0 and 1 (+0, +1)
    assert mesh.get_array().reshape(2, 2).tolist() == [[70.5, 60.5], [50.5, 40.5]]


def test_the_figures_target_draws_the_projections_heat_map_from_the_summaries(projected, tmp_path):
    from dimattn.reporting import outputs

    asked = outputs.runs_in(projected)
    assert "suite" in asked.dimpo
    assert "figures/dimpo_needle.png" in outputs.wanted([], False, asked.dimpo)
    assert "figures/dimpo_needle.png" not in outputs.wanted([], False, ("table1", "downstream"))
