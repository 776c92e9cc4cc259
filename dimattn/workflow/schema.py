"""The config schema, ``schemas/config.schema.yaml``, and DimPO's presets beside it
(``schemas/dimpo_presets.yaml``, which the schema validates): the only home of every default and
description. The settings classes of the stages (dimattn.data.recall.RecallSettings,
dimattn.data.longctx.LongContextSettings, dimattn.dimpo.fit_settings.FitSettings, the objectives'
own settings, dimattn.workflow.sweeps' latency block) read their defaults from here and restate
none (tests/unit/test_defaults.py fails on a restated one). No torch.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"
PRESETS = SCHEMA.with_name("dimpo_presets.yaml")


def _load_yaml(text: str):
    """yaml.safe_load through libyaml where PyYAML has it: the schema is read on the import path
    of most jobs, and the C loader parses it in about an eighth of the time, to the same data."""
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _schema() -> dict:
    return _load_yaml(SCHEMA.read_text())


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


def task_defaults() -> dict:
    """{key: default} of an lm-eval task entry (dimpo.downstream.tasks[]: num_fewshot, batch_size,
    chat_template, dtype; evaluation.lm_eval.tasks[] gives its batch_size and dtype once a block)."""
    return defaults_at("dimpo", "downstream", "tasks", "[]")


def defaults_at(*keys: str) -> dict:
    """{key: default} of the properties of the schema object at ``keys``: a path of property
    names, "*" for any key of a mapping (additionalProperties), "[]" for an array's items."""
    node = _schema()
    for key in keys:
        node = node["additionalProperties"] if key == "*" else node["items"] if key == "[]" else node["properties"][key]
    return {k: copy.deepcopy(v["default"]) for k, v in node["properties"].items() if "default" in v}


@functools.cache
def _validator(definition: str):
    import jsonschema

    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{definition}", "$defs": _schema()["$defs"]})


def violation(definition: str, data) -> str | None:
    """Why ``data`` breaks the schema's ``$defs/<definition>`` ("where: what", jsonschema's best
    match), or None where it holds: settings built in code meet the bounds a config is held to."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(definition).iter_errors(data))
    if error is None:
        return None
    return f"{'.'.join(map(str, error.absolute_path)) or 'the top level'}: {error.message}"


@functools.cache
def _presets() -> dict:
    import yaml

    try:
        data = _load_yaml(PRESETS.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise RuntimeError(f"{PRESETS}: cannot be read ({e})") from None
    problem = violation("dimpo_presets", data)
    if problem is not None:
        raise RuntimeError(f"{PRESETS}: {problem}")
    missing = sorted(set(_schema()["$defs"]["fit_fields"]["properties"]) - set(data["defaults"]))
    if missing:
        raise RuntimeError(f"{PRESETS}: defaults lacks {missing}: every fit field needs a value")
    return data


def dimpo_presets() -> dict:
    """``schemas/dimpo_presets.yaml``, validated: {"defaults": {field: value}, "presets": {name:
    {field: value}}, "objectives": {objective: {field: value}}} (a copy)."""
    return copy.deepcopy(_presets())
