"""dimattn.reporting.dimpo: seed 003 Table 1 (attention fidelity), ours beside the paper's."""

import re

import pandas as pd
import pytest
from reporting_fixtures import REFERENCE, is_png, summary_path, table_line, write_fidelity_csvs, write_summaries

from dimattn.reporting import outputs, summaries

DIMPO = ["tables/dimpo_fidelity.tex", "figures/dimpo_fidelity.png"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("dimpo")
    summary = write_summaries(root)
    outputs.render(DIMPO, summary, REFERENCE, root)
    return root, summary


def test_dimpo_table_matches_paper_by_ratio(rendered):
    root, summary = rendered
    tex = (root / "tables" / "dimpo_fidelity.tex").read_text()
    # Columns widest first: ours d' = 16, 8, 4, 2 of d = 32 are the paper's 64, 32, 16, 8 of d = 128.
    assert re.search(r"d\$'\$ ours \(d = 32\)\}.*\{16\}.*\{8\}.*\{4\}.*\{2\}", tex)
    assert re.search(r"d\$'\$ paper \(d = 128\)\}.*\{64\}.*\{32\}.*\{16\}.*\{8\}", tex)
    kl_paper = table_line(tex, "KL & paper")
    assert kl_paper.split("&")[2:4] == [" 0.26 ", " 0.001 "]  # paper d' = 64, as printed
    random_paper = table_line(tex, "Random & paper")
    assert random_paper.rstrip(" \\").split("&")[-2:] == [" 16.58 ", " 0.112"]  # paper d' = 8
    # Both paper DimPO settings, and paper-only objectives, are there; ours is one unlabelled setting.
    assert "DimPO ($k{=}0$, $\\lambda{=}0$) & paper" in tex
    assert "DimPO ($k{=}64$, $\\lambda{=}1$) & paper" in tex
    assert "DimPO & ours" in tex
    for objective in ("Triplet", "CPO", "SimPO", "ORPO"):
        assert f"{objective} & paper" in tex and f"{objective} & ours" not in tex
    # Our cells are layer means of the fixture.
    fid = pd.read_csv(summary_path(summary, "dimpo_fidelity"))
    mean = fid[(fid["objective"] == "kl") & (fid["d_prime"] == 16)]["kl"].mean()
    assert table_line(tex, "KL & ours").split("&")[2].strip() == f"{mean:.3g}"


def test_dimpo_figure_is_a_png(rendered):
    root, _ = rendered
    assert is_png(root / "figures" / "dimpo_fidelity.png")


def test_dimpo_table_optional_setting_column(tmp_path):
    summary = tmp_path / "summary"
    path = summary_path(summary, "dimpo_fidelity")
    summaries.summarize_fidelity(write_fidelity_csvs(tmp_path, setting="k=64,lambda=1"), path)
    table, figure = outputs.render(DIMPO, summary, REFERENCE, tmp_path)
    assert "DimPO ($k{=}64$, $\\lambda{=}1$) & ours" in table.read_text()
    assert is_png(figure)
