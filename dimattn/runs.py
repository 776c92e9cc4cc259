"""What identifies a run in every raw output: the run fields (``dimattn.variants.RUN_FIELDS``)
read from a trained model's saved config.json. Imports neither torch nor transformers, so the
reporting environment can use it."""

import json
from pathlib import Path

from .variants import run_fields


def run_metadata(model_dir: Path) -> dict:
    """The run fields of a model directory; the run is the directory's name."""
    return run_fields(Path(model_dir).name, json.loads((Path(model_dir) / "config.json").read_text()))
