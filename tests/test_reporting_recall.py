"""dimattn.reporting.recall: the multi-query associative recall table and figure."""

import pytest
from reporting_fixtures import REFERENCE, cells, check_tabulars, is_png, table_line, write_full_summaries

from dimattn.reporting import outputs


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("recall")
    summary = write_full_summaries(root)
    outputs.render(["tables/recall.tex", "figures/recall.png"], summary, REFERENCE, root)
    return root


def test_recall_table(rendered):
    tex = (rendered / "tables" / "recall.tex").read_text()
    check_tabulars(tex)
    assert "17--43" in tex and "98--124" in tex
    assert cells(table_line(tex, "Chance &"))[3:] == ["1.6"] * 5
    assert cells(table_line(tex, r"DAR & w=16, d\textsubscript{down}=8")) == [
        "DAR",
        r"w=16, d\textsubscript{down}=8",
        "1/8",
        "70.0",
        "80.0",
        "70.0",
        "70.0",
        "60.0",
    ]
    assert cells(table_line(tex, r"DAR & w=0, d\textsubscript{down}=8"))[3] == "45.0"
    assert cells(table_line(tex, r"Uniform & d\textsubscript{down}=2"))[2:4] == ["1/32", "5.0"]
    assert cells(table_line(tex, "SWA &"))[-1] == "0.0"
    assert "4096 test queries" in tex


def test_recall_figure_is_a_png(rendered):
    assert is_png(rendered / "figures" / "recall.png", 30_000)
