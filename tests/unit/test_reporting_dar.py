"""dimattn.reporting.dar: seed 000 Tables 1-4 and Figure 3 from the summaries, the paper beside."""

import json
import re

import pytest
from reporting_fixtures import (
    FULL,
    REFERENCE,
    VANILLA_PPL,
    cells,
    check_tabulars,
    is_png,
    run_name,
    summary_path,
    table_line,
    write_eval_jsons,
    write_full_summaries,
    write_scale_without_vanilla,
    write_summaries,
)

from dimattn.reporting import dar_trajectory, outputs, summaries

DAR = [name for name, out in outputs.OUTPUTS.items() if out.category == "DAR"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small d_down sweep: Table 1 and its figure."""
    root = tmp_path_factory.mktemp("small")
    summary = write_summaries(root)
    outputs.render(["tables/dar_perplexity.tex"], summary, REFERENCE, root / "results")
    return root / "results"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Every DAR output of the full sweep."""
    root = tmp_path_factory.mktemp("full")
    summary = write_full_summaries(root)
    written = outputs.render(DAR, summary, REFERENCE, root / "results")
    return root, summary, written


def test_dar_table_shows_paper_beside_reproduced(small):
    tex = (small / "tables" / "dar_perplexity.tex").read_text()
    for needle in (r"\toprule", r"\midrule", r"\bottomrule", "reproduced", "paper"):
        assert needle in tex

    def paper_cells(*needles):
        """Last cell (Rel. paper) of the rows with every needle, one row per corpus."""
        lines = [line for line in tex.splitlines() if line.endswith(r"\\") and all(n in line for n in needles)]
        assert len(lines) == len(VANILLA_PPL), (needles, lines)
        return {line.rstrip(" \\").split("&")[-1].strip() for line in lines}

    # Matched by d_down/d: ours 32/128 is the paper's 128/512.
    assert paper_cells("& DAR &", "& 1/4 &", "& 100.50 &", "& 32 & 128 &") == {"99.61"}
    assert paper_cells("& Uniform &", "& 1/4 &", "& 106.00 &") == {"105.49"}
    assert paper_cells("& DAR &", "& 1/8 &", "& 103.00 &") == {"101.99"}
    assert paper_cells("& DAR &", "& 1/2 &", "& 99.00 &") == {"98.57"}
    assert paper_cells("& Uniform &", "& 1/8 &", "& 112.50 &") == {"111.30"}
    # The paper has no Uniform at d/2: no number is invented.
    assert paper_cells("& Uniform &", "& 1/2 &", "& 102.00 &") == {"--"}
    assert paper_cells("& Vanilla &", "& 100.00 &") == {"100.00"}
    assert table_line(tex, "shakespeare (test) & Vanilla", "& 60.00 &")
    # Table 2's other scales are quoted in the caption.
    assert "100.88" in tex and "97.98" in tex


def test_dar_window_sweep_rows_stay_out_of_table1(tmp_path):
    """Table 1 is at one window; a DAR run at another window goes to the window sweep instead."""
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    record = json.loads(next(p for p in paths if run_name("dar", 32) in p.name).read_text())
    record.update(run="tiny_dar_w0_d32", window=0, ppl=66.0)
    sweep_path = tmp_path / "w0.json"
    sweep_path.write_text(json.dumps(record))
    summary = tmp_path / "summary"
    summaries.summarize_perplexity(paths + [sweep_path], summary_path(summary, "dar_perplexity"))
    names = ["tables/dar_perplexity.tex", "tables/dar_window.tex", "figures/dar_window.png"]
    outputs.render(names, summary, REFERENCE, tmp_path)
    tex = (tmp_path / "tables" / "dar_perplexity.tex").read_text()
    assert "& 110.00 &" not in tex
    assert table_line(tex, "& DAR & 32 & 32 &").rstrip(" \\").endswith("99.61")
    assert "dar\\_window.tex" in tex
    window = (tmp_path / "tables" / "dar_window.tex").read_text()
    assert cells(table_line(window, "w = 0"))[1] == "110.00"
    assert cells(table_line(window, "w = 32"))[1] == "100.50"
    assert is_png(tmp_path / "figures" / "dar_window.png")


def test_full_writes_every_dar_output(full):
    root, _, written = full
    assert sorted(str(p.relative_to(root / "results")) for p in written) == sorted(DAR)
    for path in written:
        if path.suffix == ".png":
            assert is_png(path, 30_000), path
        else:
            tex = path.read_text()
            check_tabulars(tex)
            assert not re.search(r"(?<!\\)[_%#]", "\n".join(l for l in tex.splitlines() if l.endswith(r"\\")))


def test_table1_only_plain_runs_at_main_window(full):
    root, _, _ = full
    tex = (root / "results" / "tables" / "dar_perplexity.tex").read_text()
    # The d_down sweep at w = 32, with the paper's number at the same ratio; the no-bottleneck control has none.
    assert cells(table_line(tex, "& DAR & 32 & 32 &"))[-2:] == ["99.50", "99.61"]
    assert cells(table_line(tex, "& DAR & 32 & 128 &"))[-2:] == ["99.00", "--"]
    assert cells(table_line(tex, "& Uniform &", "& 1/8 &"))[-2:] == ["112.00", "111.30"]
    body = tex.split(r"\begin{tabular}")[1]
    for absent in ("& DAR & 0 &", "& DAR & 1 &", "& DAR & 64 &", "SWA", "Dilated", "sigmoid", "99.75", "99.25"):
        assert absent not in body
    # Two widths on one corpus: each gets its own labelled group; the recall corpus is not here.
    assert table_line(tex, "shakespeare (test), d = 64 & Vanilla")
    assert "shakespeare (test), d = 128 & Vanilla" in tex
    assert "mqar" not in body
    assert "recall.tex" in tex and "baselines.tex" in tex


def test_table1_leaves_out_widths_without_vanilla(tmp_path):
    """Seed 000 Table 4's d = 2048 scale trains DAR only: it has no Rel., so Table 1 leaves it out."""
    summary = tmp_path / "summary"
    summaries.summarize_perplexity(write_scale_without_vanilla(tmp_path), summary_path(summary, "dar_perplexity"))
    tex = outputs.render(["tables/dar_perplexity.tex"], summary, REFERENCE, tmp_path)[0].read_text()
    assert "big-dar" not in tex and "2048" not in tex.split(r"\begin{tabular}")[1]
    assert "Widths without a Vanilla run (d = 2048)" in tex


def test_table2_each_width_beside_paper(full):
    root, _, _ = full
    tex = (root / "results" / "tables" / "dar_scales.tex").read_text()
    # Ours d = 64, 128 paired by rank with the paper's 512 (70M), 768 (160M); 410M has no partner.
    assert cells(table_line(tex, "& 64 & 16 & 32 &")) == [
        "shakespeare (test)",
        "64",
        "16",
        "32",
        "260.65",
        "260.00",
        "100.25",
        "pythia-70m",
        "512",
        "128",
        "99.61",
    ]
    assert cells(table_line(tex, "& 128 & 32 & 32 &"))[-5:] == ["99.50", "pythia-160m", "768", "192", "100.88"]
    assert cells(table_line(tex, "pythia-410m"))[1:4] == ["--", "--", "--"]
    assert "i-th smallest" in tex


def test_table3_window_sweep_with_recall(full):
    root, _, _ = full
    tex = (root / "results" / "tables" / "dar_window.tex").read_text()
    # Columns: shakespeare d = 128 (d_down = 32), then recall d = 64 (d_down = 8); micro has no sweep.
    assert cells(table_line(tex, "w = 0"))[1:] == ["107.00", "45.0"]
    assert cells(table_line(tex, "w = 16"))[1:] == ["99.80", "70.0"]  # recall's main window is 16
    assert cells(table_line(tex, "w = 32"))[1:] == ["99.50", "--"]
    assert cells(table_line(tex, "w = 64"))[1:] == ["99.40", "--"]
    assert cells(table_line(tex, "Vanilla &"))[1:] == ["100.00", "90.0"]
    assert cells(table_line(tex, "Uniform, same"))[1:] == ["106.50", "50.0"]
    assert cells(table_line(tex, "Chance"))[1:] == ["", "1.6"]
    assert "stays close to Vanilla for w >= 4" in tex  # the paper's finding, quoted
    assert r"d\textsubscript{down} = 8" in tex and r"d\textsubscript{down} = 32" in tex


def test_window_sweep_takes_w0_from_uniform_when_no_dar_run_has_it(tmp_path):
    """DAR at w = 0 is Uniform at the same d_down: without a DAR w = 0 run, the w = 0 row is
    Uniform's (106.50 and 50.0 in FULL), not a dash; with one, the run's own (test above)."""
    runs = [s for s in FULL if not (s["model"]["attention"] == "dar" and s["model"].get("window") == 0)]
    outputs.render(["tables/dar_window.tex"], write_full_summaries(tmp_path, runs=runs), REFERENCE, tmp_path)
    tex = (tmp_path / "tables" / "dar_window.tex").read_text()
    assert cells(table_line(tex, "w = 0"))[1:] == ["106.50", "50.0"]
    assert cells(table_line(tex, "Uniform, same"))[1:] == ["106.50", "50.0"]
    assert cells(table_line(tex, "w = 16"))[1:] == ["99.80", "70.0"]


def test_table3_recall_only(tmp_path):
    """Only the recall scale has a window sweep: one column, no text group."""
    summary = write_full_summaries(tmp_path)
    summary_path(summary, "dar_perplexity").unlink()
    outputs.render(["tables/dar_window.tex"], summary, REFERENCE, tmp_path)
    window = (tmp_path / "tables" / "dar_window.tex").read_text()
    assert "shakespeare" not in window and cells(table_line(window, "w = 0"))[1:] == ["45.0"]
    check_tabulars(window)


def test_table4_relative_to_no_bottleneck(full):
    root, _, _ = full
    tex = (root / "results" / "tables" / "dar_downstream.tex").read_text()
    # acc is 1.02x / 1.04x / 0.9x the d_down = d run at d/2, d/4, d/8; paper 101.09, 102.19, 98.68.
    half = cells(table_line(tex, "& 1/2 &"))
    assert half[:3] == ["64", "1/2", "1024"] and half[-2:] == ["102.00", "101.09"]
    assert cells(table_line(tex, "& 1/4 &"))[-2:] == ["104.00", "102.19"]
    assert cells(table_line(tex, "& 1/8 &"))[-2:] == ["90.00", "98.68"]
    assert cells(table_line(tex, "& 1 & 2048"))[-2:] == ["100.00", "100.00"]
    # bits_per_byte (lower is better) is shown but not averaged: d/4 has 99.5 % of the reference's.
    assert cells(table_line(tex, "& 1/4 &"))[3] == f"{100 * 99.5 / 99.0:.2f}"
    assert r"$\downarrow$" in tex and "score at d" in tex
    assert "micro" not in tex  # micro has no d_down = d run


def test_trajectory_keeps_table1_runs_only(full):
    _, summary, _ = full
    traj = summaries.read(summary_path(summary, "dar_trajectory"), "dar_trajectory")
    kept = set(dar_trajectory.trajectory_runs(traj)["run"])
    assert "tiny-dar-w32-d64" in kept and "tiny-uniform-d16" in kept and "recall-dar-w16-d2" in kept
    assert not kept & {"tiny-dar-w0-d32", "tiny-swa-w32", "tiny-dar-w32-d32-sigmoid", "recall-dar-w0-d8"}
