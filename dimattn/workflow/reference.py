"""The papers' own numbers in ``reference/``: which files there are and which a run needs, so
that planning (dimattn.workflow.sweeps) can check them before any job starts without the reporting stage
(dimattn.reporting.paper reads them). Imports nothing beyond the standard library.
"""

from pathlib import Path

FILES = {
    "dar": "dar_relative_perplexity.csv",
    "dar_downstream": "dar_downstream_relative.csv",
    "dar_tasks": "dar_task_context_lengths.csv",
    "qualitative": "qualitative_findings.csv",
    "dimpo": "dimpo_fidelity_llama31_8b.csv",
    "dimpo_ablation": "dimpo_ablation.csv",
    "dimpo_ruler_by_layers": "dimpo_ruler_by_layers.csv",
    "dimpo_ruler_subtasks": "dimpo_ruler_subtasks.csv",
    "dimpo_compression": "dimpo_compression_combo.csv",
}
# Files whose readers do without them (dar_task_metrics, finding).
OPTIONAL = ("dar_tasks", "qualitative")


def missing(reference_dir: Path) -> list[Path]:
    """The files of the papers' numbers that reference_dir lacks, the optional ones aside:
    what a run can check before any job starts."""
    paths = [Path(reference_dir) / name for key, name in FILES.items() if key not in OPTIONAL]
    return [path for path in paths if not path.is_file()]
