"""dimattn.reporting.latex and plots: escaping, number formats, atomic writes."""

import json
import re
from pathlib import Path

import pytest
from reporting_fixtures import REFERENCE, summary_path, write_eval_jsons

from dimattn.reporting import latex, outputs, plots, summaries


def test_latex_escaping(tmp_path):
    assert latex.escape("a_b 50% #1 & $x$ {y} ~^\\") == (
        r"a\_b 50\% \#1 \& \$x\$ \{y\} \textasciitilde{}\textasciicircum{}\textbackslash{}"
    )
    assert latex.escape(latex.Tex(r"$\lambda$")) == r"$\lambda$"
    # A corpus and run names with specials reach the table escaped.
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    for path in paths:
        record = json.loads(path.read_text())
        record["corpus"] = "web_text 10%"
        path.write_text(json.dumps(record))
    summary = tmp_path / "summary"
    summaries.summarize_perplexity(paths, summary_path(summary, "dar_perplexity"))
    tex = outputs.render(["tables/dar_perplexity.tex"], summary, REFERENCE, tmp_path)[0].read_text()
    assert r"web\_text 10\%" in tex
    body = [line for line in tex.splitlines() if line.endswith(r"\\")]
    assert not any(re.search(r"(?<!\\)[_%]", line) for line in body)


def test_small_numbers_formatted_as_powers_of_ten():
    assert latex.fmt_sig(0.000123) == r"$1.23\times10^{-4}$"
    assert latex.fmt_sig(0.0123) == "0.0123"
    assert latex.fmt_sig(12.345) == "12.3"
    assert latex.fmt_sig(float("nan")) == "--"


def test_failed_write_keeps_previous_file(tmp_path):
    table, figure = tmp_path / "table.tex", tmp_path / "figure.png"
    table.write_text("old")
    figure.write_text("old")
    with pytest.raises(TypeError):
        latex.write_text(table, None)  # fails inside the atomic write
    with pytest.raises(RuntimeError):
        with plots.figure(figure, (2, 2)) as fig:
            fig.subplots().plot([0, 1])
            raise RuntimeError("boom")
    assert table.read_text() == "old" and figure.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "table.tex"]


def test_templates_ship_with_the_package():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    shipped = re.search(r'^dimattn = \["(.*)"\]', pyproject, re.M).group(1)
    templates = sorted(Path(latex.__file__).resolve().parents[1].glob(shipped))
    assert [p.name for p in templates] == sorted(p.name for p in latex.TEMPLATE_DIR.glob("*.tex.j2"))
    assert templates
