"""The workflow's own lm-eval task YAMLs (an lm-eval include path), and its overrides of lm-eval's
RULER QA tasks (ruler_qa.py, imported by lm-eval only)."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent


def own_task_names() -> set[str]:
    """The tasks this folder defines (ours, and the RULER QA overrides)."""
    return {p.stem for p in TASKS_DIR.glob("*.yaml")}
