"""LaTeX for the tables: the jinja2 environment over ``templates/``, escaping, number formats.

Every ``<< x >>`` in a template is escaped unless it is :class:`Tex`, so no cell (a corpus
name with ``_``, a run name, a lm-eval task) can break a table. Tables are written atomically.

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

from ..atomic import atomic_file
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
    return _ENV


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a killed job leaves the old file or none."""
    path = Path(path)
    with atomic_file(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path


def render(template: str, path: Path, **context) -> Path:
    """Fill ``templates/<template>`` with ``context`` and write it to ``path``."""
    return write_text(path, _env().get_template(template).render(**context))


def grouped_table(path: Path, generator: str, groups: list[dict], rows: list[dict], caption, label: str,
                  row_header: str, spread_note="") -> Path:
    """``templates/dimpo_study.tex.j2``: column groups ({"title", "columns"}) over rows ({"label",
    "cells", "space"}); ``generator`` names the function in the file's first comment."""
    return render("dimpo_study.tex.j2", path, groups=groups, rows=rows, function=generator, caption=caption,
                  label=label, row_header=row_header, rules=cmidrules([len(g["columns"]) for g in groups], 2),
                  spread_note=spread_note)  # fmt: skip


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
