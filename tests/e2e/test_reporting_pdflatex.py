"""Every kind of table compiles in a paper: rendered from the reporting fixtures (one seed, and
three seeds with their bracketed spreads, the widest cells), ``\\input`` into a plain article (A4,
1.5 cm margins, with the packages its ``% requires:`` line names) and compiled twice with pdflatex,
so that its label is read back from the .aux. Fails on an error, an undefined reference, an
overfull hbox over a few points or a float taller than the page.

Needs pdflatex (Debian's texlive-latex-recommended); installs it with apt-get when missing and
root, skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from system_packages import apt_install_or_skip
from reporting_fixtures import (
    FULL,
    REFERENCE,
    replicated,
    summary_path,
    write_downstream_jsons,
    write_fidelity_summary,
    write_full_summaries,
    write_latency_json,
    write_long_context_jsons,
)

from dimattn.reporting import latex, outputs, summaries

PACKAGES = ["texlive-latex-recommended"]  # booktabs; geometry, amsmath and graphicx come with latex-base
STYLES = ["geometry.sty", "booktabs.sty", "amsmath.sty", "graphicx.sty"]
ALLOWED = {"booktabs", "amsmath", "graphicx"}  # the plain article's packages
TABLES = [name for name in outputs.OUTPUTS if name.endswith(".tex")]
OVERFULL_PT = 3.0  # "a few points": rounding in a column no one sees
# latex.FIT may shrink a tabular to the text width by at most a quarter (still readable); grids
# wider than that are split into tabulars that fit (latex.split_columns).
MAX_SHRINK = 0.25
TEXT_WIDTH_PT = 510.0  # A4 less 2 x 1.5 cm


def _missing() -> list[str]:
    if shutil.which("pdflatex") is None or shutil.which("kpsewhich") is None:
        return ["pdflatex"]
    found = subprocess.run(["kpsewhich", *STYLES], capture_output=True, text=True).stdout.split()
    return [s for s in STYLES if not any(f.endswith("/" + s) for f in found)]


def _install_or_skip() -> None:
    if _missing() and (sys.platform != "linux" or os.geteuid() != 0):
        pytest.skip(f"LaTeX is not installed ({', '.join(_missing())} missing) and installing it needs root")
    apt_install_or_skip(PACKAGES, _missing, "LaTeX", timeout=1200)


@pytest.fixture(scope="module", params=[(0,), (0, 1, 2)], ids=["one_seed", "three_seeds"])
def tables(request, tmp_path_factory) -> dict[str, Path]:
    """Every table of the full fixture sweep, rendered: {name: path}."""
    seeds = request.param
    root = tmp_path_factory.mktemp("tables")
    summary = write_full_summaries(root, runs=FULL if seeds == (0,) else replicated(FULL, seeds))
    write_fidelity_summary(root, summary, seeds=seeds)
    jsons = write_downstream_jsons(root, seeds=seeds) + write_long_context_jsons(root, seeds=(0, 1))
    summaries.summarize_downstream(jsons, summary_path(summary, "dimpo_downstream"))
    summaries.summarize_latency([write_latency_json(root)], summary_path(summary, "dimpo_latency"))
    written = outputs.render(TABLES, summary, REFERENCE, root / "results")
    return {name: path for name, path in zip(TABLES, written)}


def _compile(tex: str, workdir: Path) -> str:
    """``tex`` in a plain article with the packages it requires, compiled twice: the log."""
    required = re.search(r"^% requires: (.*)$", tex, re.M)
    assert required, "no '% requires:' line"
    packages = [p.strip() for p in required.group(1).split(",") if p.strip()]
    assert set(packages) <= ALLOWED, packages
    label = re.search(r"\\label\{([^}]*)\}", tex).group(1)
    (workdir / "table.tex").write_text(tex)
    (workdir / "paper.tex").write_text(
        "\\documentclass{article}\n\\usepackage[a4paper,margin=1.5cm]{geometry}\n"
        + "".join(f"\\usepackage{{{p}}}\n" for p in packages)
        + f"\\begin{{document}}\n\\input{{table}}\nAs Table~\\ref{{{label}}} shows.\n\\end{{document}}\n"
    )
    for _ in range(2):
        out = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=workdir,
                             capture_output=True, text=True, timeout=120)
    log = (workdir / "paper.log").read_text(errors="replace")
    assert out.returncode == 0, log[-3000:]
    return log


@pytest.mark.parametrize("name", TABLES)
def test_table_compiles_within_the_page(tables, name, tmp_path):
    _install_or_skip()
    log = _compile(tables[name].read_text(), tmp_path)
    assert not re.findall(r"^! .*", log, re.M)
    assert "undefined" not in log.lower(), re.findall(r".*undefined.*", log, re.I)
    overfull = [float(pt) for pt in re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log)]
    assert max(overfull, default=0.0) <= OVERFULL_PT, overfull
    assert "Float too large" not in log


@pytest.mark.parametrize("name", TABLES)
def test_no_table_is_shrunk_by_more_than_a_quarter(tables, name, tmp_path):
    """Compiled at its natural size (latex.FIT's box replaced by a plain group), a tabular
    exceeds the text width by at most what FIT may shrink."""
    _install_or_skip()
    tex = tables[name].read_text()
    assert tex.count(latex.FIT) == tex.count(r"\begin{tabular}")  # every tabular is boxed
    log = _compile(tex.replace(latex.FIT, "{%"), tmp_path)
    overfull = [float(pt) for pt in re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log)]
    widest = TEXT_WIDTH_PT + max(overfull, default=0.0)
    assert (
        TEXT_WIDTH_PT / widest >= 1 - MAX_SHRINK
    ), f"{name}: {widest:.0f} pt wide, shrunk to {TEXT_WIDTH_PT / widest:.2f}"


def test_labels_and_comments_are_not_escaped(tables):
    for name, path in tables.items():
        tex = path.read_text()
        first, second = tex.splitlines()[:2]
        stem = Path(name).stem
        assert first.startswith("% Generated by dimattn.reporting.") and "\\_" not in first, first
        assert second.startswith("% requires: booktabs"), second
        assert f"\\label{{tab:{stem}}}" in tex
    downstream = tables["tables/dimpo_downstream.tex"].read_text()
    assert "% Generated by dimattn.reporting.dimpo_downstream.table;" in downstream
    assert "% requires: booktabs, amsmath, graphicx" in tables["tables/dimpo_quirks.tex"].read_text()  # \text


def test_requires_names_the_packages_of_the_commands_used():
    assert latex.requires(r"\toprule a \\ \bottomrule") == ["booktabs"]
    assert latex.requires(r"KL$_\text{inf}$ \textsubscript{down} \textit{x}") == ["amsmath"]
    assert latex.requires(r"\resizebox{1pt}{!}{x}") == ["graphicx"]
    with pytest.raises(ValueError, match="label"):
        latex.raw("tab:a b")


def test_wide_grids_split_into_tabulars_within_the_text_width():
    cell = latex.Tex(r"92.5 {\scriptsize[90.0, 95.0]}")
    groups = [{"title": f"task {g}", "columns": [f"l={i}" for i in range(4)]} for g in range(6)]
    rows = [{"label": "DimPO, d'=4", "cells": [cell] * 24, "space": False}]
    parts = latex.split_columns(groups, rows, "Objective")
    assert [g for part in parts for g, _ in part] == list(range(6))  # every group once, in order
    assert [i for part in parts for _, cols in part for i in cols] == list(range(24))
    assert len(parts) > 1
    label = latex.text_width("DimPO, d'=4") + 12
    for part in parts:
        width = label + sum(latex.text_width(cell) + 12 for _, cols in part for _ in cols)
        assert width <= latex.TEXT_WIDTH_PT
    # A single group wider than the page is split over several tabulars, its title over each part.
    wide = [{"title": "KV-cache compression", "columns": [f"c{i}" for i in range(12)]}]
    parts = latex.split_columns(wide, [{"label": "x", "cells": [cell] * 12, "space": False}])
    assert len(parts) > 1 and all(len(part) == 1 and part[0][0] == 0 for part in parts)
