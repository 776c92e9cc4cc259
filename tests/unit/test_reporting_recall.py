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



def test_distance_panel_shows_the_window_sweep(tmp_path, monkeypatch):
    """The right panel ("accuracy by query distance") has a line per kind of run, and DAR at
    every window of its window sweep (d_down = 8 in the fixture: w = 0, 1, 4 beside the chosen
    w = 16), each through its bins' accuracies."""
    from matplotlib.figure import Figure

    from dimattn.reporting import recall, summaries

    summary = write_full_summaries(tmp_path)
    frames = {"recall": summaries.read(summary / "recall.csv", "recall")}
    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
    recall.figure(frames, REFERENCE, tmp_path / "recall.png")
    (fig,) = saved
    (panel,) = [ax for ax in fig.axes if ax.get_title().endswith("accuracy by query distance")]
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
    dar = sorted(label for label in lines if label.startswith("DAR"))
    label = "DAR (w={}, $d_{{\\mathrm{{down}}}}$=8)".format
    assert dar == sorted(label(w) for w in (0, 1, 4, 16)), dar
    assert {"Vanilla", "chance"} <= set(lines), sorted(lines)
    # w = 4, d_down = 8 (accuracy 0.65): near bin 10 points above it, far bin 10 below (bin_accuracies)
    assert [round(y, 6) for y in lines[label(4)]] == [75.0, 65.0, 65.0, 55.0]
    assert list(panel.get_lines()[0].get_xdata()) == [30.0, 57.0, 84.0, 111.0]  # the bins' midpoints
