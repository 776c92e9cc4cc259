"""What identifies a run in every summary, read from its saved config.json. Imports neither
torch nor transformers, so the reporting environment can use it."""

import json
from pathlib import Path


def run_metadata(model_dir: Path) -> dict:
    """The fields that identify a run in every summary; a field a variant does not use is None."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    variant = config["attention"]
    bottleneck = variant in ("dar", "uniform")
    layers = config.get("attention_layers")
    return {
        "run": Path(model_dir).name,
        "variant": variant,
        "d_model": config["hidden_size"],
        "d_down": config["d_down"] if bottleneck else None,
        "window": config["window"] if variant in ("dar", "swa", "dilated") else None,
        "dilation": config.get("dilation") if variant == "dilated" else None,
        "bottleneck": config.get("bottleneck_activation", "linear") if bottleneck else None,
        "full_every": config.get("full_attention_every") if variant != "vanilla" else None,
        "layers": ".".join(map(str, layers)) if layers is not None and variant != "vanilla" else None,
    }
