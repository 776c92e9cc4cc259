"""Which runs each table and figure shows, read off the run fields alone (never the run names).

One definition serves both sides of the DAG: ``outputs.wanted`` applies it to the runs a config
plans (``dimattn.workflow.sweeps.Run.fields``), the renderers to the runs a summary holds. A *run* here
is a dict with ``dimattn.model.variants.RUN_FIELDS`` (a summary row works too, see :func:`records`).

* a *plain* run is seed 000's: Vanilla, or a variant with the bottleneck (DAR, Uniform) that is
  linear, on every layer, with no full-attention layers (``variants.is_plain``). Seed 000
  Table 1 (``dar_perplexity``), Table 2 (``dar_scales``), Figure 3 (``dar_trajectory``) and the
  d_down sweeps of the recall probe show plain runs only;
* the *main window* of a scale is the window most of its plain DAR runs share;
* a *window sweep* is a set of plain DAR runs at one d_down and two or more windows (seed 000
  Table 3, ``dar_window``);
* the *no-bottleneck* DAR run has d_down = hidden_size (seed 000 Table 4, ``dar_downstream``);
* every other *kind* of run (SWA, dilated, hybrids, a sigmoid bottleneck, DAR on some layers) is
  a seed 001 baseline or a DAR variant (``baselines``).

A *scale* is the runs of one corpus and width: ``(dataset, hidden_size)`` of a run or a
trajectory row, ``(corpus, split, hidden_size)`` of a perplexity or recall row. Replicates (runs
of one setting, ``variants.SETTING_FIELDS``, with different seeds) are selected together and
count once; the renderers aggregate them with ``replicates.settings``.

No pandas, no matplotlib: ``rules/common.smk`` imports this through ``outputs``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from dimattn.model import variants
from dimattn.model.variants import missing

# Seed 000 compares Vanilla with the variants that bottleneck keys (DAR, Uniform).
SEED_000 = frozenset(a for a in variants.VARIANTS if a == "vanilla" or variants.uses_bottleneck(a))
SCALE_KEYS = ["corpus", "split", "hidden_size"]
RUN_SCALE_KEYS = ["dataset", "hidden_size"]


class NoRuns(ValueError):
    """An output was asked for, but its summaries hold none of the runs it shows."""


# ----------------------------------------------------------------------------- runs and frames


def records(df) -> list[dict]:
    """One dict per run of a summary frame (its first row), missing cells as None."""
    rows = df.drop_duplicates("run").to_dict("records")
    return [{k: None if missing(v) else v for k, v in row.items()} for row in rows]


def rows_of(df, runs: Iterable[dict]):
    """The rows of ``df`` that belong to ``runs``, in the frame's order."""
    return df[df["run"].isin({r["run"] for r in runs})]


def frame_scales(df, keys=SCALE_KEYS):
    """(key dict, rows) per scale of a summary frame, in the order the summary lists them."""
    if df is None or df.empty:
        return
    for key, rows in df.groupby(keys, sort=False):
        yield dict(zip(keys, key)), rows


def scale_label(scale: dict) -> str:
    """"shakespeare (test)": a perplexity or recall scale's corpus and split."""
    return scale["corpus"] if not scale["split"] else f"{scale['corpus']} ({scale['split']})"


def scales(runs: Iterable[dict], keys=RUN_SCALE_KEYS) -> list[list[dict]]:
    """The runs grouped by scale, in the order they come."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run)
    return list(groups.values())


def _unique(runs: Iterable[dict]) -> list[dict]:
    """One run per setting (``variants.SETTING_FIELDS``): replicates count once, so a setting
    trained with more seeds than another does not outweigh it."""
    seen, out = set(), []
    for run in runs:
        setting = tuple(None if missing(run.get(f)) else run.get(f) for f in variants.SETTING_FIELDS)
        if setting not in seen:
            seen.add(setting)
            out.append(run)
    return out


# ----------------------------------------------------------------------------- seed 000


def is_plain(run) -> bool:
    return run["attention"] in SEED_000 and variants.is_plain(run)


def plain(runs: Iterable[dict]) -> list[dict]:
    return [r for r in runs if is_plain(r)]


def plain_mask(df):
    """Boolean mask of a summary frame's rows that belong to plain runs."""
    return df["run"].isin({r["run"] for r in plain(records(df))})


def has_vanilla(runs: Iterable[dict]) -> bool:
    return any(r["attention"] == "vanilla" for r in runs)


def main_window(runs: Iterable[dict]):
    """The window most plain DAR runs share (the largest on a tie): the sweep's default, set beside Table 1."""
    windows = Counter(
        r["window"] for r in _unique(runs) if is_plain(r) and r["attention"] == "dar" and not missing(r["window"])
    )
    if not windows:
        return None
    top = max(windows.values())
    return int(max(w for w, n in windows.items() if n == top))


def _closest_to_quarter(d_downs, hidden_size: int):
    """Of several d_down, the one nearest d/4 on a log scale (the larger on a tie)."""
    return max(d_downs, key=lambda d: (-abs(math.log2(4 * int(d) / int(hidden_size))) if d else -math.inf, d))


def _ref_d_down(runs: list[dict]):
    """The d_down most DAR runs of a scale share (patterned ones included): the variants' comparison point."""
    d_downs = Counter(r["d_down"] for r in _unique(runs) if r["attention"] == "dar" and not missing(r["d_down"]))
    if not d_downs:
        return None
    top = max(d_downs.values())
    return int(_closest_to_quarter([int(d) for d, n in d_downs.items() if n == top], int(runs[0]["hidden_size"])))


def table1(runs: list[dict]) -> list[dict]:
    """Seed 000 Table 1's runs of one scale: plain Vanilla, Uniform, and DAR at the main window.

    None without a vanilla run: Rel. needs it (seed 000 Table 4's d = 2048 scale has none)."""
    if not has_vanilla(runs):
        return []
    kept = plain(runs)
    window = main_window(kept)
    return [r for r in kept if r["attention"] != "dar" or r["window"] == window]


def compared(runs: Iterable[dict]) -> list[dict]:
    """The runs set against Vanilla."""
    return [r for r in runs if r["attention"] != "vanilla"]


def quarter(runs: Iterable[dict]) -> list[dict]:
    """Seed 000 Table 2's runs: DAR at d_down = d/4 (of Table 1's runs)."""
    return [
        r for r in runs if r["attention"] == "dar" and not missing(r["d_down"]) and 4 * r["d_down"] == r["hidden_size"]
    ]


def window_sweep(runs: list[dict]):
    """Seed 000 Table 3: the d_down at which a scale's plain DAR runs cover the most windows (two or
    more), nearest d/4 on a tie; None when there is no such sweep."""
    windows: dict[int, set[int]] = {}
    for r in plain(runs):
        if r["attention"] == "dar" and not missing(r["d_down"]) and not missing(r["window"]):
            windows.setdefault(int(r["d_down"]), set()).add(int(r["window"]))
    candidates = [d for d, w in windows.items() if len(w) >= 2]
    if not candidates:
        return None
    most = max(len(windows[d]) for d in candidates)
    return _closest_to_quarter([d for d in candidates if len(windows[d]) == most], int(runs[0]["hidden_size"]))


def no_bottleneck(runs: Iterable[dict]) -> list[dict]:
    """Seed 000 Table 4's reference: plain DAR with d_down = hidden_size (the same architecture
    without reduction)."""
    return [r for r in plain(runs) if r["attention"] == "dar" and r["d_down"] == r["hidden_size"]]


# ----------------------------------------------------------------------------- kinds (seed 001)


def kind(run) -> tuple:
    """What a run is, up to its numbers (window, d_down, dilation): one row of the baselines table."""
    bottleneck, every, layers = run["bottleneck_activation"], run["full_attention_every"], run["attention_layers"]
    return (
        run["attention"],
        "" if missing(bottleneck) or bottleneck == variants.DEFAULT_BOTTLENECK else str(bottleneck),
        0 if missing(every) else int(every),
        "" if missing(layers) else str(layers),
    )


def kind_rank(kind_: tuple) -> tuple:
    attention, bottleneck, every, layers = kind_
    v = variants.VARIANT_ORDER.index(attention)
    # Seed 001 first (vanilla, SWA, dilated, hybrids), then DAR and its variants, then Uniform.
    group = {"vanilla": 0, "swa": 1, "dilated": 2, "dar": 4, "uniform": 5}.get(attention, 6)
    if attention in ("swa", "dilated") and every:
        group = 3
    return (group, v, bool(bottleneck), bool(every), bool(layers), bottleneck, every, layers)


def is_baseline(kind_: tuple) -> bool:
    """Runs seed 000 does not have: seed 001's SWA/dilated/hybrids and the DAR variants."""
    attention, bottleneck, every, layers = kind_
    return attention not in SEED_000 or bool(bottleneck or every or layers)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def kind_label(kind_: tuple) -> str:
    """Plain text (no LaTeX): "SWA + full every 2nd layer", "DAR, sigmoid bottleneck", ..."""
    attention, bottleneck, every, layers = kind_
    label = variants.VARIANTS[attention].label
    if bottleneck:
        label += f", {bottleneck} bottleneck"
    if layers:
        label += f" on layers {', '.join(layers.split('.'))} only"
    if every:
        label += " + full attention in every layer" if every == 1 else f" + full every {_ordinal(every)} layer"
    return label


def representatives(runs: list[dict]) -> dict[tuple, dict]:
    """One run per kind of a scale, ordered as the baselines table lists kinds: at the d_down
    most of the scale's DAR runs share, then nearest its main window."""
    runs = _unique(runs)
    window, d_down = main_window(runs), _ref_d_down(runs)

    def score(run):
        off_d = 0 if missing(run["d_down"]) or d_down is None or run["d_down"] == d_down else 1
        off_w = 0 if missing(run["window"]) or window is None else abs(int(run["window"]) - window)
        return (off_d, off_w, str(run["run"]))

    kinds: dict[tuple, list[dict]] = {}
    for run in runs:
        kinds.setdefault(kind(run), []).append(run)
    return {k: min(rs, key=score) for k, rs in sorted(kinds.items(), key=lambda kv: kind_rank(kv[0]))}
