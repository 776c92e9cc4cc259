"""dimattn.model.variants: the one vocabulary of attention variants, and everything that must agree
with it (the attention registry, the model config, the schema)."""

from pathlib import Path

import pandas as pd
import pytest
import yaml

from dimattn.model import variants
from dimattn.model.variants import VARIANTS, check_model, check_values, is_plain, run_fields, run_name

REPO = Path(__file__).resolve().parents[2]


def test_the_attention_registry_implements_exactly_these_variants():
    from dimattn.model.attention import ATTENTION_VARIANTS

    assert list(ATTENTION_VARIANTS) == list(VARIANTS)
    for name, impl in ATTENTION_VARIANTS.items():
        assert impl.far == variants.uses_bottleneck(name), name


def test_the_schema_requires_what_each_variant_requires():
    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())
    sweep = schema["properties"]["pretraining"]["properties"]["sweeps"]["items"]
    assert sweep["properties"]["attention"]["enum"] == list(VARIANTS)
    required = {
        rule["if"]["properties"]["attention"]["const"]: set(rule["then"]["required"]) for rule in sweep["allOf"]
    }
    assert required == {name: set(v.requires) for name, v in VARIANTS.items() if v.requires}
    taken = set().union(*(v.takes for v in VARIANTS.values())) | variants.PATTERN_KEYS
    assert taken == set(sweep["properties"]) - {"scale", "attention", "seed"}


@pytest.mark.parametrize("scale,model,name", [
    ("tiny", {"attention": "vanilla"}, "tiny-vanilla"),
    ("tiny", {"attention": "dar", "window": 32, "d_down": 16}, "tiny-dar-w32-d16"),
    ("tiny", {"attention": "uniform", "d_down": 16}, "tiny-uniform-d16"),
    ("tiny", {"attention": "swa", "window": 32, "full_attention_every": 2}, "tiny-swa-w32-full2"),
    ("recall", {"attention": "dilated", "window": 16, "dilation": 4}, "recall-dilated-w16-r4"),
    ("tiny", {"attention": "dar", "window": 32, "d_down": 32, "bottleneck_activation": "sigmoid"},
     "tiny-dar-w32-d32-sigmoid"),
    ("tiny", {"attention": "dar", "window": 32, "d_down": 32, "bottleneck_activation": "linear"}, "tiny-dar-w32-d32"),
    ("recall", {"attention": "dar", "window": 16, "d_down": 16, "attention_layers": [1, 2]},
     "recall-dar-w16-d16-layers1.2"),
])
def test_run_names(scale, model, name):
    assert run_name(scale, model) == name == run_name(scale, model, seed=0)
    assert run_name(scale, model, seed=3) == name + "-s3"


ARCH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.mark.parametrize("model,key", [
    ({"attention": "sparse"}, "attention"),
    ({"attention": "dar", "d_down": 16}, "window"),
    ({"attention": "dar", "window": 8}, "d_down"),
    ({"attention": "dilated", "window": 8}, "dilation"),  # once silently 4, and unnamed in the run name
    ({"attention": "dilated", "dilation": 4}, "window"),
    ({"attention": "swa", "window": 8, "d_down": 16}, "d_down"),
    ({"attention": "vanilla", "window": 8}, "window"),
    ({"attention": "vanilla", "full_attention_every": 2}, "full_attention_every"),
    ({"attention": "uniform", "d_down": 65}, "d_down"),
    ({"attention": "uniform", "d_down": 0}, "d_down"),
    ({"attention": "swa", "window": 0}, "window"),
    ({"attention": "dar", "window": -1, "d_down": 8}, "window"),
    ({"attention": "dilated", "window": 8, "dilation": 0}, "dilation"),
    ({"attention": "dar", "window": 8, "d_down": 8, "bottleneck_activation": "relu"}, "bottleneck_activation"),
    ({"attention": "swa", "window": 8, "full_attention_every": 0}, "full_attention_every"),
    ({"attention": "swa", "window": 8, "attention_layers": [2]}, "attention_layers"),
    ({"attention": "swa", "window": 8, "attention_layers": [1, 1]}, "attention_layers"),
])
def test_check_model_names_the_key(model, key):
    errors = check_model({**ARCH, **model})
    assert errors and errors[0][0] == key, errors


def test_check_model_accepts_every_variant_with_its_keys():
    for model in (
        {"attention": "vanilla"},
        {"attention": "dar", "window": 0, "d_down": 64},
        {"attention": "uniform", "d_down": 1},
        {"attention": "swa", "window": 1},
        {"attention": "dilated", "window": 1, "dilation": 1},
        {"attention": "dar", "window": 8, "d_down": 8, "attention_layers": [0, 1], "full_attention_every": 2},
    ):
        assert check_model({**ARCH, **model}) == []


def test_check_values_ignores_the_defaults_a_variant_does_not_take():
    # a model config holds every key; a vanilla model's stored window or dilation is never read
    config = {**ARCH, "attention": "vanilla", "window": -5, "dilation": 0, "d_down": None,
              "bottleneck_activation": "linear", "full_attention_every": None, "attention_layers": None}
    assert check_values(config) == []
    assert check_values({**config, "attention": "dilated"})[0][0] == "window"


def test_run_fields_keep_only_what_the_variant_takes():
    saved = {**ARCH, "attention": "uniform", "window": 128, "dilation": 4, "d_down": 16,
             "bottleneck_activation": "linear", "full_attention_every": None, "attention_layers": [0, 1]}
    fields = run_fields("tiny-uniform-d16", saved)
    assert list(fields) == variants.RUN_FIELDS
    assert fields == {"run": "tiny-uniform-d16", "attention": "uniform", "hidden_size": 64, "d_down": 16,
                      "window": None, "dilation": None, "bottleneck_activation": "linear",
                      "full_attention_every": None, "attention_layers": "0.1", "seed": 0}
    vanilla = run_fields("v", {**saved, "attention": "vanilla"}, seed=2)
    assert {k for k, v in vanilla.items() if v is not None} == {"run", "attention", "hidden_size", "seed"}
    assert vanilla["seed"] == 2


def test_run_fields_refuse_a_record_without_what_its_variant_needs():
    with pytest.raises(ValueError, match="lacks \\['d_down'\\]"):
        run_fields("x", {**ARCH, "attention": "dar", "window": 4, "d_down": None})
    with pytest.raises(ValueError, match="not a known variant"):
        run_fields("x", {**ARCH, "attention": "sparse"})


def test_is_plain_on_dicts_and_summary_rows():
    assert is_plain({"bottleneck_activation": "linear", "full_attention_every": None, "attention_layers": None})
    assert is_plain(pd.Series({"bottleneck_activation": pd.NA, "full_attention_every": pd.NA,
                               "attention_layers": pd.NA}))
    assert not is_plain({"bottleneck_activation": "sigmoid"})
    assert not is_plain({"full_attention_every": 2})
    assert not is_plain(pd.Series({"attention_layers": "1"}))
