"""LaTeX for the tables: the jinja2 environment over ``templates/``, escaping, number formats.

Every ``<< x >>`` in a template is escaped unless it is :class:`Tex`, so no cell (a corpus
name with ``_``, a run name, a lm-eval task) can break a table. Tables are written atomically.

Every table fits a page: each tabular sits in ``<< fit >>...}`` (:data:`FIT`), which shrinks it
to the text width only where it is wider, and :func:`grouped_table` splits column groups over
stacked tabulars of at most :data:`TEXT_WIDTH_PT`. Its second line names the packages it needs
(``% requires: booktabs, graphicx``, found in the text itself by :func:`requires`); labels and
comments are written as they are, never escaped.

A cell of a setting trained with several seeds reads ``98.40 [97.90, 99.00]``: the mean, and the
minimum and maximum over seeds (:class:`SpreadCells`, which also writes the caption's note).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from fractions import Fraction
from pathlib import Path

import jinja2
import pandas as pd

from dimattn.model.atomic import atomic_file
from .replicates import Spread, seeds_text

TEMPLATE_DIR = Path(__file__).parent / "templates"
MISSING = "--"


class Tex(str):
    """A string that is already LaTeX and must not be escaped again."""


_TEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_TEX_RE = re.compile("|".join(re.escape(c) for c in _TEX_SPECIALS))


def escape(value) -> str:
    """Escape LaTeX specials in plain text; Tex strings pass through unchanged."""
    if isinstance(value, Tex):
        return value
    return _TEX_RE.sub(lambda m: _TEX_SPECIALS[m.group()], str(value))


def cmidrules(widths, first: int) -> Tex:
    """``\\cmidrule(lr){a-b}`` under each of consecutive multicolumn heads ``widths`` columns
    wide, the first starting at column ``first`` (a template global)."""
    rules = []
    for width in widths:
        rules.append(rf"\cmidrule(lr){{{first}-{first + width - 1}}}")
        first += width
    return Tex("".join(rules))


# Shrink the box to the line width where it is wider, leave it at its own width otherwise (graphicx's
# \width is the box's natural width inside \resizebox's arguments).
FIT = Tex(r"\resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%")
# The text width of an A4 page with 1.5 cm margins (595 pt - 2 x 42.7 pt), which grouped_table splits to.
TEXT_WIDTH_PT = 510.0
# Opens each tabular that continues the columns of the one before it (row i of it goes on row i there).
CONTINUED = Tex("% the columns of the tabular above continue")
PAGE_LINES = 55  # table rows on such a page (757 pt of text height, a row about 12 pt with its spacing)
# package -> the commands of it a table may use.
_PACKAGES = {
    "booktabs": re.compile(r"\\(toprule|midrule|bottomrule|cmidrule|addlinespace)(?![a-zA-Z])"),
    "amsmath": re.compile(r"\\text(?![a-zA-Z])"),
    "graphicx": re.compile(r"\\(resizebox|scalebox|includegraphics)(?![a-zA-Z])"),
}
_LABEL_RE = re.compile(r"[A-Za-z0-9_:.-]+")


def requires(tex: str) -> list[str]:
    """The packages (beyond LaTeX's own) the commands in ``tex`` come from."""
    return [name for name, used in _PACKAGES.items() if used.search(tex)]


def raw(value) -> Tex:
    """A template filter for what is LaTeX syntax, not text: a label, a dotted name in a comment."""
    if not _LABEL_RE.fullmatch(str(value)):
        raise ValueError(f"{value!r} is no LaTeX label or dotted name (letters, digits, _ : . - only)")
    return Tex(value)


def _finalize(value):
    return "" if value is None else escape(value)


_ENV: jinja2.Environment | None = None


def _env() -> jinja2.Environment:
    """LaTeX-friendly delimiters: << x >>, <% block %>, <# comment #>."""
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(
            loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
            block_start_string="<%",
            block_end_string="%>",
            variable_start_string="<<",
            variable_end_string=">>",
            comment_start_string="<#",
            comment_end_string="#>",
            finalize=_finalize,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            undefined=jinja2.StrictUndefined,
            autoescape=False,
        )
        _ENV.globals["cmidrules"] = cmidrules
        _ENV.globals["fit"] = FIT
        _ENV.filters["raw"] = raw
    return _ENV


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a killed job leaves the old file or none."""
    path = Path(path)
    with atomic_file(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path


def render(template: str, path: Path, **context) -> Path:
    """Fill ``templates/<template>`` with ``context`` and write it to ``path``, its first line (``%
    Generated by ...``) followed by the packages it needs."""
    text = _env().get_template(template).render(**context)
    first, _, rest = text.partition("\n")
    if not first.startswith("% Generated by "):
        raise ValueError(f"templates/{template} must open with its '% Generated by' comment line")
    return write_text(path, f"{first}\n% requires: {', '.join(requires(rest))}\n{rest}")


def grouped_table(path: Path, generator: str, groups: list[dict], rows: list[dict], caption, label: str,
                  row_header: str, spread_note="") -> Path:
    """``templates/dimpo_study.tex.j2``: column groups ({"title", "columns"}) over rows ({"label",
    "cells", "space"}); ``generator`` names the function in the file's first comment. Groups too
    wide for one page go to tabulars stacked below (:func:`split_columns`), each with the row labels."""
    flat, parts = [c for g in groups for c in g["columns"]], []
    for part in split_columns(groups, rows, row_header):
        columns = [i for _, indices in part for i in indices]
        parts.append({
            "groups": [{"title": groups[g]["title"], "columns": [flat[i] for i in indices]} for g, indices in part],
            "rows": [row | {"cells": [row["cells"][i] for i in columns]} for row in rows],
            "rules": cmidrules([len(indices) for _, indices in part], 2),
            "n_columns": len(columns),
            "continued": bool(parts),
        })
    height = len(rows) + 4 + sum(row["space"] for row in rows) / 2
    floats = page_floats(parts, [height] * len(parts), str(caption) + str(spread_note))
    return render("dimpo_study.tex.j2", path, floats=floats, function=generator, caption=caption, label=label,
                  row_header=row_header, spread_note=spread_note, continued=CONTINUED)


def page_floats(parts: list, heights: list[float], caption: str) -> list[list]:
    """``parts`` (tabulars ``heights`` lines high) grouped into floats of at most a page
    (:data:`PAGE_LINES`; the caption's lines count with the first), the later floats continuing
    the first table under its number."""
    floats, lines = [[]], len(caption) / 100
    for part, height in zip(parts, heights, strict=True):
        if floats[-1] and lines + height > PAGE_LINES:
            floats.append([])
            lines = 1
        floats[-1].append(part)
        lines += height
    return floats


_COMMAND_RE = re.compile(r"\\[a-zA-Z]+|[{}$]")
_SMALL_RE = re.compile(r"\{\\(?:scriptsize|footnotesize)([^{}]*)\}")


def text_width(cell) -> float:
    """A rough printed width of a cell in pt (10 pt type: about 5 pt a character, 3.5 in
    ``\\scriptsize``): enough to decide where a wide grid splits; :data:`FIT` takes what is left."""
    text = str(cell)
    small = "".join(_SMALL_RE.findall(text))
    normal = _SMALL_RE.sub("", text)
    return 5.0 * len(_COMMAND_RE.sub("", normal)) + 3.5 * len(_COMMAND_RE.sub("", small))


def split_columns(groups: list[dict], rows: list[dict], row_header="", width: float = TEXT_WIDTH_PT,
                  sep: float = 12.0) -> list[list[tuple[int, list[int]]]]:
    """The column groups of a grid split over tabulars no wider than ``width`` pt (estimated by
    :func:`text_width`; ``sep``: a column's padding): [[(group index, [flat column index])]] per
    tabular, in order. A group stays whole unless it is wider than a tabular by itself."""
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g["columns"]))
    columns = [c for g in groups for c in g["columns"]]
    widths = [max([text_width(c)] + [text_width(r["cells"][i]) for r in rows]) + sep for i, c in enumerate(columns)]
    room = width - max([text_width(row_header)] + [text_width(r["label"]) for r in rows]) - sep
    parts, part, used = [], [], 0.0

    def span(g, indices):  # a group's title widens its columns where it is the wider
        return max(sum(widths[i] for i in indices), text_width(groups[g]["title"]) + sep)

    for g in range(len(groups)):
        indices = list(range(starts[g], starts[g + 1]))
        if part and used + span(g, indices) > room:
            parts.append(part)
            part, used = [], 0.0
        if span(g, indices) <= room or len(indices) == 1:
            part.append((g, indices))
            used += span(g, indices)
            continue
        piece = []  # wider than a tabular alone: its columns over several, the title over each
        for i in indices:
            if piece and sum(widths[j] for j in piece) + widths[i] > room:
                parts.append([(g, piece)])
                piece = []
            piece.append(i)
        part, used = [(g, piece)], span(g, piece)
    if part:
        parts.append(part)
    return parts


# ----------------------------------------------------------------------------- numbers


def na(x) -> bool:
    """None, NaN or pandas' NA: a cell without a value."""
    return x is None or (not isinstance(x, (list, tuple, dict)) and bool(pd.isna(x)))


def fmt(x, digits: int = 2) -> str:
    return MISSING if na(x) else f"{x:.{digits}f}"


def fmt_sig(x, sig: int = 3) -> str:
    """``sig`` significant digits; very small numbers as a LaTeX power of ten."""
    if na(x):
        return MISSING
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        mantissa, exponent = f"{x:.{sig - 1}e}".split("e")
        return Tex(rf"${mantissa}\times10^{{{int(exponent)}}}$")
    decimals = sig - 1 - math.floor(math.log10(abs(x)))
    return f"{x:.{max(decimals, 0)}f}"


def pct(x, digits: int = 1) -> str:
    """A fraction as a percentage: 0.5 -> 50.0."""
    return MISSING if na(x) else f"{100 * x:.{digits}f}"


def integer(x) -> str:
    return MISSING if na(x) else str(int(x))


def fraction(num, den) -> Fraction | None:
    if na(num) or na(den) or not den:
        return None
    return Fraction(int(num), int(den))


def fmt_fraction(frac: Fraction | None) -> str:
    """1/4, or 2 for a whole number; ``--`` for none (also used on plot axes)."""
    if frac is None:
        return MISSING
    return str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"


# ----------------------------------------------------------------------------- replicates

# Marks of a comparison within the seed spread; a table's own words say which comparison.
DAGGER, DDAGGER = r"\dagger", r"\ddagger"


class SpreadCells:
    """Formats one table's cells of settings: the mean, and where a setting has n > 1 seeds the
    minimum and maximum in brackets, ``98.40 [97.90, 99.00]``, with ``, n=2`` where n is not
    the table's usual one. One seed prints as a plain number. ``marks``: symbol -> the comparison
    it flags as within the seed spread; :meth:`note` is the caption's sentence on both, empty when
    every setting has one seed.

    ``counts``: ``replicates.seed_counts`` of the frames the table shows.
    """

    def __init__(self, counts: Counter, marks: dict[str, str] | None = None):
        self.counts = counts
        self.usual = counts.most_common(1)[0][0] if counts else None
        self.marks = marks or {}
        self.used: set[str] = set()

    def __call__(self, spread: Spread | None, number: Callable = fmt, marks: Iterable[str] = ()) -> str:
        if spread is None or spread.n <= 1:
            return number(None if spread is None else spread.mean)
        marks = [m for m in self.marks if m in set(marks)]
        self.used.update(marks)
        n = f", n={spread.n}" if spread.n != self.usual else ""
        low, high = escape(number(spread.min)), escape(number(spread.max))
        symbols = "".join(rf"$^{{{m}}}$" for m in marks)
        return Tex(rf"{escape(number(spread.mean))}{symbols} {{\scriptsize[{low}, {high}]{n}}}")

    def note(self) -> str:
        if not self.counts:
            return ""
        text = (
            f"A setting trained with {seeds_text(self.counts)} shows the mean over its seeds and, in brackets, "
            "their minimum and maximum"
        )
        text += f" (and n where it is not {self.usual})." if len(self.counts) > 1 else "."
        for mark, says in self.marks.items():
            if mark in self.used:
                text += (
                    rf" ${mark}$: {says}; the difference is within the seed spread (paired by seed, it does not "
                    "have one sign at every seed; unpaired, the min-max ranges overlap)."
                )
        return Tex(text)
