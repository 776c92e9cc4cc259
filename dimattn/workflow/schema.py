"""The config schema, ``schemas/config.schema.yaml``: the only home of every default and
description. The settings classes of the stages (dimattn.data.recall.RecallSettings,
dimattn.data.longctx.LongContextSettings, dimattn.workflow.sweeps' latency block) read their
defaults from here and restate none (tests/e2e/test_sweeps.py fails on a restated one). No torch.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


@functools.cache
def _schema() -> dict:
    import yaml

    return yaml.safe_load(SCHEMA.read_text())


def schema() -> dict:
    """The schema, parsed (a copy: callers may fill it)."""
    return copy.deepcopy(_schema())


def dataset_defaults(source: str) -> dict:
    """{key: default} of a dataset source's branch (datasets.<name> with ``source``)."""
    branches = _schema()["properties"]["datasets"]["additionalProperties"]["allOf"]
    for branch in branches:
        if branch["if"]["properties"]["source"]["const"] == source:
            return {k: copy.deepcopy(v["default"]) for k, v in branch["then"]["properties"].items() if "default" in v}
    raise KeyError(f"no dataset source {source!r} in {SCHEMA}")


def defaults_at(*keys: str) -> dict:
    """{key: default} of the properties of the schema object at ``keys`` (properties path)."""
    node = _schema()
    for key in keys:
        node = node["properties"][key]
    return {k: copy.deepcopy(v["default"]) for k, v in node["properties"].items() if "default" in v}
