"""What identifies a run in every raw output: the run fields (``dimattn.model.variants.RUN_FIELDS``)
read from a trained model's saved config.json. Imports neither torch nor transformers, so the
reporting environment can use it."""

import json
from pathlib import Path

from dimattn.model.variants import run_fields


def run_metadata(model_dir: Path) -> dict:
    """The run fields of a model directory: the run is the directory's name, the variant its
    config.json, the seed its training.json (0 for a directory without one)."""
    model_dir = Path(model_dir)
    training = model_dir / "training.json"
    seed = json.loads(training.read_text()).get("seed", 0) if training.is_file() else 0
    return run_fields(model_dir.name, json.loads((model_dir / "config.json").read_text()), seed)
