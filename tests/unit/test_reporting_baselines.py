"""dimattn.reporting.baselines: seed 001's SWA, dilated and hybrid attention beside Vanilla and DAR."""

from reporting_fixtures import REFERENCE, cells, check_tabulars, table_line, write_full_summaries

from dimattn.reporting import outputs


def test_baselines_table(tmp_path):
    summary = write_full_summaries(tmp_path)
    tex = outputs.render(["tables/baselines.tex"], summary, REFERENCE, tmp_path)[0].read_text()
    check_tabulars(tex)
    row = cells(table_line(tex, "SWA &"))
    assert row == ["SWA", "w=32", "103.25", "w=16", "25.0", "0.0"]
    assert cells(table_line(tex, "SWA + full every 2nd layer"))[1:] == ["w=32", "100.75", "w=16", "80.0", "70.0"]
    assert cells(table_line(tex, "Dilated"))[1:] == ["w=32, r=4", "101.75", "w=16, r=4", "40.0", "30.0"]
    # DAR at the d_down most DAR runs share (32 on text, 8 on recall), at the main window.
    dar = cells(table_line(tex, r"DAR & w=32, d\textsubscript{down}=32"))
    assert dar[2] == "99.50" and dar[3:6] == [r"w=16, d\textsubscript{down}=8", "70.0", "60.0"]
    assert (
        cells(table_line(tex, "DAR, sigmoid bottleneck"))[1:]
        == [r"w=32, d\textsubscript{down}=32", "99.75"] + ["--"] * 3
    )
    assert cells(table_line(tex, "DAR on layers 2, 3 only"))[2] == "99.25"
    assert cells(table_line(tex, "Vanilla &"))[1:] == ["--", "100.00", "--", "90.0", "80.0"]
    assert r"d $\geq$ 98" in tex
    # Seed 001's ordering: Vanilla, SWA, Dilated, hybrid, then DAR.
    order = [tex.index(s) for s in ("\nVanilla &", "\nSWA &", "\nDilated &", "\nSWA + full", "\nDAR &")]
    assert order == sorted(order)


def test_baselines_on_the_recall_corpus_only(tmp_path):
    """Without a text summary the table has recall columns only, and no Rel. perplexity."""
    summary = write_full_summaries(tmp_path)
    (summary / "dar_perplexity.csv").unlink()
    tex = outputs.render(["tables/baselines.tex"], summary, REFERENCE, tmp_path)[0].read_text()
    assert "Rel." not in tex.split(r"\midrule")[0].split("Attention")[-1]
    assert "shakespeare" not in tex
    check_tabulars(tex)
