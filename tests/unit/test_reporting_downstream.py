"""dimattn.reporting.dimpo_downstream and summaries.summarize_downstream: projected models' scores
relative to the base model, by share of layers projected (seed 003, Figures 2-3)."""

import json

import pytest
from reporting_fixtures import (
    DOWNSTREAM,
    REFERENCE,
    is_png,
    saved_figures,
    score_labels,
    summary_path,
    table_line,
    write_downstream_jsons,
)

from dimattn.reporting import dimpo_downstream, outputs, summaries

OUTPUTS = ["figures/dimpo_downstream.png", "tables/dimpo_downstream.tex"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    summary = root / "summary"
    df = summaries.summarize_downstream(write_downstream_jsons(root), summary_path(summary, "dimpo_downstream"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        figures = saved_figures(monkeypatch)
        written = outputs.render(OUTPUTS, summary, REFERENCE, root)
    return df, {p.name: p for p in written}, figures[0]


def test_summary_is_long_with_share_and_perplexity(rendered):
    df, _, _ = rendered
    assert list(df.columns) == summaries.COLUMNS["dimpo_downstream"]
    assert len(df) == len(DOWNSTREAM) * 2  # accuracy and perplexity per model
    assert list(dict.fromkeys(df["objective"])) == ["base", "pca", "dimpo", "kl"]  # the paper's order
    ppl = df[df["task"] == "perplexity:shakespeare"]
    assert set(ppl["metric"]) == {"ppl"} and ppl["stderr"].isna().all()
    assert dict(zip(df["num_projected"], df["share"])) == {0: 0.0, 2: 0.5, 4: 1.0}


def test_relative_scores_read_100_for_the_base_and_keep_the_metric_direction(rendered):
    df, _, _ = rendered
    rel = dimpo_downstream.relative(df).set_index(["objective", "num_projected", "task"])["rel"]
    assert rel[("base", 0, "dimattn_next_line")] == pytest.approx(100)
    assert rel[("pca", 4, "dimattn_next_line")] == pytest.approx(100 * 0.30 / 0.40)
    # perplexity: projected / base, never inverted, so a worse (higher) perplexity reads above 100
    assert rel[("pca", 4, "perplexity:shakespeare")] == pytest.approx(100 * 80 / 50)
    assert rel[("pca", 2, "perplexity:shakespeare")] > 100  # 60 against the base's 50
    with pytest.raises(ValueError, match="base-model"):
        dimpo_downstream.relative(df[df["objective"] != "base"])


def test_table_cells_are_relative_scores(rendered):
    _, written, _ = rendered
    tex = written["dimpo_downstream.tex"].read_text()
    cells = [c.strip() for c in table_line(tex, "PCA &").rstrip(" \\").split("&")[1:]]
    assert cells == ["90.0", "75.0", "120.0", "160.0"]  # acc at l = 2, 4; then ppl (60 and 80 of 50)
    assert "(base 0.4)" in tex and r"$l{=}4$ (100\%)" in tex
    # each group says its direction
    assert "acc (base 0.4), higher is better" in tex and "ppl (base 50), lower is better" in tex


def test_figure_is_a_png(rendered):
    _, written, _ = rendered
    assert is_png(written["dimpo_downstream.png"])


def test_each_panel_says_which_way_is_better(rendered):
    *_, fig = rendered
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_visible()]
    # ours (accuracy, perplexity), then the paper's RULER 4k and 8k
    assert labels == ["accuracy, % of the base model\n(higher is better)",
                      "perplexity, % of the base model\n(lower is better)",
                      *["RULER score, % of the base model\n(higher is better)"] * 2]
    assert score_labels(fig) == labels


def test_a_malformed_record_names_its_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"model": "m", "results": {}}))
    with pytest.raises(ValueError, match="x.json: not a score_projected record"):
        summaries.summarize_downstream([path], tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


def test_fit_seeds_give_a_spread(tmp_path):
    summary = tmp_path / "summary"
    summaries.summarize_downstream(write_downstream_jsons(tmp_path, seeds=(0, 1, 2)),
                                   summary_path(summary, "dimpo_downstream"))
    (table,) = outputs.render(["tables/dimpo_downstream.tex"], summary, REFERENCE, tmp_path)
    cells = [c.strip() for c in table_line(table.read_text(), "PCA &").rstrip(" \\").split("&")[1:]]
    # accuracy at l = 2: seeds 0.36, 0.37, 0.38 of 0.40 -> 92.5 [90.0, 95.0]
    assert cells[0].startswith("92.5") and "[90.0, 95.0]" in cells[0]
    assert "minimum and maximum" in table.read_text()
