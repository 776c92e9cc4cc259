"""The registry of reported outputs: for each table and figure, the summaries it reads, the
function that draws it, its caption and report category, and the predicate deciding whether a
config calls for it.

The DAG alone decides which outputs exist. ``rules/report.smk`` declares exactly
:func:`wanted` (from the planned runs) and renders them with :func:`render`; the ``figures``
target applies the same predicates to the runs the summaries on disk hold
(:func:`render_existing`). A renderer asked for an output its summaries cannot fill raises an
error naming the output and what is missing; nothing writes a placeholder.

A run here is a dict with ``dimattn.model.variants.RUN_FIELDS`` plus ``dataset`` (its training
corpus) and ``synthetic`` (trained on the synthetic recall corpus: no perplexity, recall
scores instead), as ``dimattn.workflow.sweeps.Run.fields`` gives it. Imports neither pandas nor
matplotlib until something is rendered, so the DAG can read this registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from dimattn.workflow import paths
from . import selection


@dataclass(frozen=True)
class Asked:
    """What a config (or a set of summaries) holds: its runs, whether lm-eval runs, and the
    DimPO studies it fits (dimattn.workflow.vocabulary.MAIN_STUDY and the keys of dimpo.ablations; none
    without DimPO), with "downstream" where projected models are scored (dimpo.downstream), and
    whether runs are trained on the long-context suite (dimattn.data.longctx)."""

    runs: list[dict]
    lm_eval: bool
    dimpo: tuple[str, ...]
    longctx: bool = False  # runs trained on the long-context suite (scored by the suite alone)

    @property
    def text(self) -> list[dict]:
        return [r for r in self.runs if not r["synthetic"]]

    @property
    def synthetic(self) -> list[dict]:
        return [r for r in self.runs if r["synthetic"]]


# ----------------------------------------------------------------------------- predicates


def _table1(asked: Asked) -> bool:
    """Seed 000 Table 1: a text scale with a vanilla run beside plain DAR or Uniform runs."""
    return any(selection.compared(selection.table1(s)) for s in selection.scales(asked.text))


def _table2(asked: Asked) -> bool:
    """Seed 000 Table 2: of those, a DAR run at d_down = d/4 (at the main window)."""
    return any(selection.quarter(selection.table1(s)) for s in selection.scales(asked.text))


def _window_sweep(asked: Asked) -> bool:
    """Seed 000 Table 3: plain DAR runs of one scale and d_down at two or more windows, on text
    (beside a vanilla run, for Rel.) or on the recall corpus."""
    text = [s for s in selection.scales(asked.text) if selection.has_vanilla(s)]
    return any(selection.window_sweep(s) is not None for s in text + selection.scales(asked.synthetic))


def _downstream(asked: Asked) -> bool:
    """Seed 000 Table 4: lm-eval scores of a no-bottleneck DAR run (d_down = d)."""
    return asked.lm_eval and bool(selection.no_bottleneck(asked.text))


def _trajectory(asked: Asked) -> bool:
    """Seed 000 Figure 3: Table 1's runs of any scale, text or recall."""
    return any(selection.compared(selection.table1(s)) for s in selection.scales(asked.runs))


def _baselines(asked: Asked) -> bool:
    """Seed 001's SWA, dilated and hybrids, or a DAR variant (sigmoid bottleneck, layer pattern)."""
    return any(selection.is_baseline(selection.kind(r)) for r in asked.runs)


def _study(*names: str) -> Callable[[Asked], bool]:
    """DimPO: any of the studies ``names`` is fitted."""
    return lambda asked: any(name in asked.dimpo for name in names)


# summary -> whether the config produces it
SUMMARIES: dict[str, Callable[[Asked], bool]] = {
    "dar_perplexity": lambda asked: bool(asked.text),
    "dar_trajectory": lambda asked: bool(asked.runs),
    "recall": lambda asked: bool(asked.synthetic),
    "lm_eval": lambda asked: asked.lm_eval,
    "dimpo_fidelity": lambda asked: bool(asked.dimpo),
    "dimpo_downstream": _study("downstream"),
    "dimpo_needle": _study("downstream"),  # summarize_downstream's second file, empty without the suite
    "dimpo_latency": _study("latency"),
    "longctx": lambda asked: asked.longctx,
    "longctx_needle": lambda asked: asked.longctx,
    # every run is scored on perplexity, recall or the suite, each with its cache measured
    "kv_frontier": lambda asked: bool(asked.runs),
}


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Output:
    name: str  # relative to results/: "tables/dar_perplexity.tex"
    summaries: tuple[str, ...]  # the summaries it reads
    optional: tuple[str, ...]  # those of them it can do without
    caption: str  # report/<caption>.rst
    category: str
    wanted: Callable[[Asked], bool]
    draw: str  # "module:function" of this package, imported when first drawn

    @property
    def path(self) -> str:
        """Where the workflow writes it."""
        return f"{paths.RESULTS}/{self.name}"

    @property
    def render(self) -> Callable:
        """draw(frames: {summary: DataFrame}, reference_dir, path) -> path."""
        module, function = self.draw.split(":")
        return getattr(import_module(f"{__package__}.{module}"), function)


def _output(category: str, path: str, draw: str, wanted, reads, optional=()) -> Output:
    """An output of ``category`` at ``path`` (a ``paths.table``/``paths.figure``), its caption
    ``report/<its stem>.rst``."""
    name = os.path.relpath(path, paths.RESULTS)
    return Output(name, tuple(reads), tuple(optional), Path(path).stem, category, wanted, draw)


_EITHER = ("dar_perplexity", "recall")  # text scales, recall scales, or both
OUTPUTS: dict[str, Output] = {
    out.name: out
    for out in (
        # Seed 000 (DAR): Tables 1-4 and Figure 3
        _output("DAR", paths.table("dar_perplexity"), "dar:perplexity_table", _table1, _EITHER, optional=["recall"]),
        _output("DAR", paths.figure("dar_perplexity"), "dar:perplexity_figure", _table1, ["dar_perplexity"]),
        _output("DAR", paths.table("dar_scales"), "dar:scales_table", _table2, ["dar_perplexity"]),
        _output("DAR", paths.table("dar_window"), "dar:window_table", _window_sweep, _EITHER, optional=_EITHER),
        _output("DAR", paths.figure("dar_window"), "dar:window_figure", _window_sweep, _EITHER, optional=_EITHER),
        _output("DAR", paths.table("dar_downstream"), "dar:downstream_table", _downstream, ["lm_eval"]),
        _output(
            "DAR", paths.figure("dar_trajectory"), "dar_trajectory:trajectory_figure", _trajectory, ["dar_trajectory"]
        ),
        # Seed 001 (sliding-window attention)
        _output("Baselines", paths.table("baselines"), "baselines:table", _baselines, _EITHER, optional=_EITHER),
        # Ours, with no paper numbers: the recall probe and lm-eval
        _output("Recall", paths.table("recall"), "recall:table", SUMMARIES["recall"], ["recall"]),
        _output("Recall", paths.figure("recall"), "recall:figure", SUMMARIES["recall"], ["recall"]),
        _output("lm-eval", paths.table("lm_eval"), "lm_eval:table", SUMMARIES["lm_eval"], ["lm_eval"]),
        # Seed 003 (DimPO): Table 1, Table 6's KL column, Appendix B Figure 4, and the authors' quirks
        _output("DimPO", paths.table("dimpo_fidelity"), "dimpo:table", _study("table1"), ["dimpo_fidelity"]),
        _output("DimPO", paths.figure("dimpo_fidelity"), "dimpo:figure", _study("table1"), ["dimpo_fidelity"]),
        _output(
            "DimPO",
            paths.table("dimpo_ablation"),
            "dimpo:ablation_table",
            _study("table6"),
            ["dimpo_fidelity", "dimpo_downstream"],
            optional=["dimpo_downstream"],
        ),
        _output(
            "DimPO",
            paths.figure("dimpo_pairs"),
            "dimpo:pairs_figure",
            _study("figure4a", "figure4b", "figure4c"),
            ["dimpo_fidelity"],
        ),
        _output("DimPO", paths.table("dimpo_quirks"), "dimpo:quirks_table", _study("quirks"), ["dimpo_fidelity"]),
        # Seed 003 Figures 2-3 and Tables 2-5: projected models at work
        _output(
            "DimPO",
            paths.figure("dimpo_downstream"),
            "dimpo_downstream:figure",
            _study("downstream"),
            ["dimpo_downstream"],
        ),
        _output(
            "DimPO",
            paths.table("dimpo_downstream"),
            "dimpo_downstream:table",
            _study("downstream"),
            ["dimpo_downstream"],
        ),
        _output(
            "DimPO",
            paths.table("dimpo_ruler"),
            "dimpo_downstream:subtask_table",
            _study("long_context"),
            ["dimpo_downstream"],
        ),
        _output("DimPO", paths.table("dimpo_kv"), "dimpo_downstream:kv_table", _study("kv"), ["dimpo_downstream"]),
        _output(
            "DimPO",
            paths.table("dimpo_latency"),
            "dimpo_downstream:latency_table",
            _study("latency"),
            ["dimpo_latency"],
        ),
        # Seed 003's RULER in our mould (dimattn.data.longctx): the needle heat map
        _output(
            "Long-context",
            paths.figure("longctx_needle"),
            "long_context:needle_figure",
            lambda asked: asked.longctx,
            ["longctx_needle"],
        ),
        # ... and of the projected models on it, at the depth where the objectives separate
        _output(
            "DimPO",
            paths.figure("dimpo_needle"),
            "long_context:dimpo_needle_figure",
            _study("suite"),
            ["dimpo_needle", "dimpo_downstream"],
        ),
        # All three seeds in one picture: quality against the measured KV-cache bytes per token
        _output(
            "Frontier",
            paths.figure("kv_frontier"),
            "frontier:frontier_figure",
            SUMMARIES["kv_frontier"],
            ["kv_frontier"],
        ),
    )
}


def wanted(runs: Iterable[dict], lm_eval: bool, dimpo: Iterable[str], longctx: bool = False) -> list[str]:
    """The outputs (names relative to results/) the runs call for, in OUTPUTS order.

    ``lm_eval``: some run gets lm-eval scores; ``dimpo``: the DimPO studies fitted (Asked.dimpo);
    ``longctx``: some run is trained on the long-context suite."""
    asked = Asked(list(runs), lm_eval, tuple(dimpo), longctx)
    return [name for name, out in OUTPUTS.items() if out.wanted(asked)]


def wanted_summaries(runs: Iterable[dict], lm_eval: bool, dimpo: Iterable[str], longctx: bool = False) -> list[str]:
    """The summaries (names for ``paths.summary``) the runs produce."""
    asked = Asked(list(runs), lm_eval, tuple(dimpo), longctx)
    return [name for name, produced in SUMMARIES.items() if produced(asked)]


def targets(runs: Iterable[dict], lm_eval: bool, dimpo: Iterable[str], longctx: bool = False) -> list[str]:
    """The paths of every summary and every output the runs call for (the workflow's report)."""
    runs = list(runs)
    return [paths.summary(s) for s in wanted_summaries(runs, lm_eval, dimpo, longctx)] + [
        OUTPUTS[name].path for name in wanted(runs, lm_eval, dimpo, longctx)
    ]


def by_category(names: Iterable[str]) -> dict[str, list[str]]:
    """The outputs ``names`` grouped by report category, in OUTPUTS order: one render rule each."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(OUTPUTS[name].category, []).append(name)
    return groups


def reads(names: Iterable[str], summaries: Iterable[str]) -> list[str]:
    """Of ``summaries`` (those the config produces), the ones the outputs ``names`` read."""
    needed = {s for name in names for s in OUTPUTS[name].summaries}
    return [s for s in summaries if s in needed]


# ----------------------------------------------------------------------------- rendering


class MissingSummary(FileNotFoundError):
    """An output's summary is not there."""


def _summary_path(summary_dir: Path, name: str) -> Path:
    return Path(summary_dir) / Path(paths.summary(name)).name


def render(
    names: Iterable[str],
    summary_dir: os.PathLike | str,
    reference_dir: os.PathLike | str,
    results_dir: os.PathLike | str,
    available: Iterable[str] | None = None,
    processes: int = 1,
) -> list[Path]:
    """Render exactly the outputs ``names`` into ``results_dir``/<name> from the summaries in
    ``summary_dir`` (only those in ``available`` when given: a rule's inputs), in ``processes``
    forked workers where there are several outputs (each output is one file, drawn alone).

    An output whose summary is missing, or whose summaries hold none of the runs it shows, is an
    error naming the output and what it lacks; every output is checked before any is drawn.
    """
    from . import summaries

    names = list(names)
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown:
        raise ValueError(f"unknown output(s) {unknown}; known: {list(OUTPUTS)}")
    available = set(SUMMARIES if available is None else available)
    frames = {}
    for name in dict.fromkeys(s for n in names for s in OUTPUTS[n].summaries):
        path = _summary_path(summary_dir, name)
        if name in available and path.exists():
            frames[name] = summaries.read(path, name)
    jobs = []
    for name in names:
        out = OUTPUTS[name]
        mine = {s: frames[s] for s in out.summaries if s in frames}
        lacking = [s for s in out.summaries if s not in mine and s not in out.optional]
        if lacking or not mine:
            files = ", ".join(str(_summary_path(summary_dir, s)) for s in lacking or out.summaries)
            raise MissingSummary(f"{name} needs {files}, which {'is' if ',' not in files else 'are'} missing")
        jobs.append((name, mine, Path(reference_dir), Path(results_dir) / name))
    if processes <= 1 or len(jobs) < 2:
        return [_render_one(job) for job in jobs]
    import multiprocessing

    # fork: the workers inherit the frames and the imports (matplotlib draws on Agg figures,
    # plots.figure: no GUI state); one output at a time, the figures (the slow ones) first, so
    # that no long figure starts last
    order = sorted(range(len(jobs)), key=lambda i: not jobs[i][0].endswith(".png"))
    with multiprocessing.get_context("fork").Pool(min(processes, len(jobs))) as pool:
        drawn = dict(zip(order, pool.map(_render_one, [jobs[i] for i in order], chunksize=1)))
    return [drawn[i] for i in range(len(jobs))]


def _render_one(job) -> Path:
    name, frames, reference_dir, dest = job
    try:
        return OUTPUTS[name].render(frames, reference_dir, dest)
    except selection.NoRuns as e:
        raise selection.NoRuns(f"{name}: {e} (in {', '.join(frames)})") from None


def runs_in(summary_dir: os.PathLike | str) -> Asked:
    """The runs the summaries in ``summary_dir`` hold, whether lm-eval ran, and the DimPO studies
    fitted: the trajectory summary has every run with its training dataset; a run is synthetic
    when the recall summary has it; the long-context suite's runs are there when its summaries
    are."""
    from . import summaries

    on_disk = {s for s in SUMMARIES if _summary_path(summary_dir, s).exists()}
    if not on_disk:
        raise MissingSummary(
            f"no summary CSV in {summary_dir}: expected at least one of "
            f"{', '.join(Path(paths.summary(s)).name for s in SUMMARIES)}; "
            "run the workflow first (snakemake) to produce them, then regenerate the report"
        )
    runs = []
    if on_disk & {"dar_perplexity", "recall", "lm_eval", "dar_trajectory"}:
        if "dar_trajectory" not in on_disk:
            raise MissingSummary(
                f"{_summary_path(summary_dir, 'dar_trajectory')} is missing: it lists the runs (with their "
                "training dataset) that the other summaries score"
            )
        synthetic = set()
        if "recall" in on_disk:
            synthetic = set(summaries.read(_summary_path(summary_dir, "recall"), "recall")["run"])
        trajectory = summaries.read(_summary_path(summary_dir, "dar_trajectory"), "dar_trajectory")
        for run in selection.records(trajectory):
            fields = {k: run[k] for k in summaries.RUN_FIELDS + ["dataset"]}
            runs.append(fields | {"synthetic": run["run"] in synthetic})
    studies = ()
    if "dimpo_fidelity" in on_disk:
        fidelity = summaries.read(_summary_path(summary_dir, "dimpo_fidelity"), "dimpo_fidelity")
        studies = tuple(dict.fromkeys(fidelity["study"]))
    if "dimpo_latency" in on_disk:
        studies += ("latency",)
    if "dimpo_downstream" in on_disk:
        from .dimpo_downstream import long_context

        scores = long_context(summaries.read(_summary_path(summary_dir, "dimpo_downstream"), "dimpo_downstream"))
        studies += ("downstream",) + (("long_context",) if len(scores) else ())
        studies += ("kv",) if (scores["kv"] != "none").any() else ()
        if "dimpo_needle" in on_disk and len(
            summaries.read(_summary_path(summary_dir, "dimpo_needle"), "dimpo_needle")
        ):
            studies += ("suite",)
    return Asked(runs, "lm_eval" in on_disk, studies, bool(on_disk & {"longctx", "longctx_needle"}))


def render_existing(
    summary_dir: os.PathLike | str, reference_dir: os.PathLike | str, results_dir: os.PathLike | str,
    processes: int = 1,
) -> list[Path]:
    """The ``figures`` target: every output the summaries on disk call for (``wanted`` applied to
    :func:`runs_in`), re-rendered from them alone, with no training."""
    asked = runs_in(summary_dir)
    names = wanted(asked.runs, asked.lm_eval, asked.dimpo, asked.longctx)
    return render(names, summary_dir, reference_dir, results_dir, processes=processes)
