"""The vocabulary of attention variants (seeds 000 and 001): which keys each variant takes and
needs, the checks on their values, run names, and the run fields every summary carries.

One home for all of it: the sweeps (``dimattn.workflow.sweeps``), the model config's validation
(``DimAttnConfig.validate_dimattn``), the summaries and the renderers import it. It imports no
torch and nothing else from ``dimattn``, so the reporting environment can use it and
``save_pretrained`` can copy it beside the model code.

Names are the config's, from the sweep entry to the summary column: ``attention``, ``window``,
``d_down``, ``dilation``, ``bottleneck_activation``, ``full_attention_every``,
``attention_layers``, and the architecture's ``hidden_size`` (the papers' d).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """``takes``: the sweep keys the variant reads; ``requires``: those it cannot run without.
    How it attends is ``dimattn.model.attention.ATTENTION_VARIANTS``, under the same names."""

    takes: frozenset[str]
    requires: frozenset[str]
    label: str


def _variant(takes=(), requires=(), *, label):
    return Variant(frozenset(takes), frozenset(requires), label)


VARIANTS: dict[str, Variant] = {
    "vanilla": _variant(label="Vanilla"),
    # Seed 000, Eq. 3-4: full keys/values inside the window, the d_down bottleneck beyond it.
    "dar": _variant(("window", "d_down", "bottleneck_activation"), ("window", "d_down"), label="DAR"),
    # Seed 000's uniform reduction: every token through the bottleneck.
    "uniform": _variant(("d_down", "bottleneck_activation"), ("d_down",), label="Uniform"),
    # Seed 001: a sliding window, and a window plus absolute positions 0, r, 2r, ...
    "swa": _variant(("window",), ("window",), label="SWA"),
    "dilated": _variant(("window", "dilation"), ("window", "dilation"), label="Dilated"),
}
VARIANT_ORDER = list(VARIANTS)

# Layer patterns, open to every variant but vanilla: seed 001's "Combined Sliding + Full" (every
# N-th layer full attention) and a variant on a subset of layers.
PATTERN_KEYS = frozenset({"full_attention_every", "attention_layers"})
# Sweep keys whose list values expand as a cartesian product, in run-name order.
SWEPT_KEYS = ("window", "d_down", "dilation")
BOTTLENECK_ACTIVATIONS = ("linear", "sigmoid")
DEFAULT_BOTTLENECK = (
    "linear"  # seed 000's choice: the model's own default (DimAttnConfig), which travels without the schema
)

# The columns that identify a run in every summary; a field its variant does not take is empty.
RUN_FIELDS = [
    "run",
    "attention",
    "hidden_size",
    "d_down",
    "window",
    "dilation",
    "bottleneck_activation",
    "full_attention_every",
    "attention_layers",
    "seed",
]
# Runs that agree on these are replicates of one setting, differing only in their training seed:
# the tables print their mean and spread.
SETTING_FIELDS = [f for f in RUN_FIELDS if f not in ("run", "seed")]


def takes(attention: str) -> frozenset[str]:
    """Every sweep key the variant reads, its layer patterns included."""
    return VARIANTS[attention].takes | (PATTERN_KEYS if attention != "vanilla" else frozenset())


def uses_bottleneck(attention: str) -> bool:
    """The variant reads keys/values through the d_down bottleneck (h W_down W_up)."""
    return "d_down" in VARIANTS[attention].requires


def check_model(model: dict) -> list[tuple[str, str]]:
    """(key, message) for every key of a sweep's model spec (architecture plus the variant's
    keys) that is missing, not taken by the variant, or cannot run; empty when it can run. The
    sweeps prefix each key with the config path that holds it."""
    attention = model["attention"]
    if attention not in VARIANTS:
        return [("attention", f"{attention!r} is not a known variant; choose one of {VARIANT_ORDER}")]
    errors = [
        (k, f"missing: attention={attention!r} needs {k}") for k in sorted(VARIANTS[attention].requires - set(model))
    ]
    errors += [(k, f"attention={attention!r} takes no {k}") for k in sorted(_variant_keys(model) - takes(attention))]
    return errors + check_values(model)


def check_values(model: dict) -> list[tuple[str, str]]:
    """(key, message) for every value that cannot run, among the keys the variant takes. A model
    config (``DimAttnConfig``) holds every key with its default, so only those taken count."""
    attention = model["attention"]
    if attention not in VARIANTS:
        return [("attention", f"{attention!r} is not a known variant; choose one of {VARIANT_ORDER}")]
    model = {k: v for k, v in model.items() if k not in _variant_keys(model) or k in takes(attention)}
    errors = []
    if uses_bottleneck(attention) and model.get("d_down") is None:
        errors.append(("d_down", f"missing: attention={attention!r} needs d_down"))
    d, heads, layers = model.get("hidden_size"), model.get("num_attention_heads"), model.get("num_hidden_layers")
    if d is not None and heads and d % heads:
        errors.append(("hidden_size", f"{d} is not divisible by num_attention_heads={heads}"))
    if model.get("d_down") is not None and d is not None and not 0 < model["d_down"] <= d:
        errors.append(("d_down", f"{model['d_down']} must satisfy 0 < d_down <= hidden_size={d} "
                                 "(d_down = hidden_size is the no-bottleneck control)"))
    minimum = 1 if attention in ("swa", "dilated") else 0
    if model.get("window") is not None and model["window"] < minimum:
        errors.append(("window", f"{attention} needs window >= {minimum} (its own token), got {model['window']}"))
    if model.get("dilation") is not None and model["dilation"] < 1:
        errors.append(("dilation", f"must be >= 1, got {model['dilation']}"))
    if model.get("bottleneck_activation", DEFAULT_BOTTLENECK) not in BOTTLENECK_ACTIVATIONS:
        errors.append(("bottleneck_activation",
                       f"{model['bottleneck_activation']!r}; choose one of {list(BOTTLENECK_ACTIVATIONS)}"))
    every = model.get("full_attention_every")
    if every is not None and every < 1:
        errors.append(("full_attention_every", f"must be >= 1, got {every}"))
    chosen = model.get("attention_layers")
    if chosen is not None and layers is not None:
        bad = [i for i in chosen if not 0 <= i < layers]
        if bad:
            errors.append(("attention_layers", f"layer {bad[0]} does not exist: the model has {layers} layers"))
        elif len(set(chosen)) != len(chosen):
            errors.append(("attention_layers", f"{chosen} repeats a layer"))
    return errors


def _variant_keys(model: dict) -> set[str]:
    every = set().union(*(v.takes for v in VARIANTS.values())) | PATTERN_KEYS
    return {k for k in model if k in every}


def run_name(scale: str, model: dict, seed: int = 0) -> str:
    """tiny-dar-w32-d16, tiny-swa-w32-full2, recall-dilated-w16-r4, tiny-dar-w32-d32-sigmoid,
    tiny-dar-w32-d16-s1 (training seed 1; seed 0 has no suffix), ..."""
    name = f"{scale}-{model['attention']}"
    for key, tag in (("window", "w"), ("dilation", "r"), ("d_down", "d")):
        if key in model:
            name += f"-{tag}{model[key]}"
    if model.get("bottleneck_activation", DEFAULT_BOTTLENECK) != DEFAULT_BOTTLENECK:
        name += f"-{model['bottleneck_activation']}"
    if model.get("full_attention_every"):
        name += f"-full{model['full_attention_every']}"
    if model.get("attention_layers") is not None:
        name += "-layers" + ".".join(map(str, model["attention_layers"]))
    if seed:
        name += f"-s{seed}"
    return name


def run_fields(run: str, model: dict, seed: int = 0) -> dict:
    """The RUN_FIELDS of a run, from its model spec or its saved config.json (same keys), and
    its training seed.

    A field the variant does not take is None, so that a vanilla model's stored default window
    never reaches a table; ``attention_layers`` is written "1.2" (a CSV cell, not a list).
    """
    attention = model["attention"]
    if attention not in VARIANTS:
        raise ValueError(f"run {run!r}: attention={attention!r} is not a known variant; choose one of {VARIANT_ORDER}")
    if model.get("hidden_size") is None:
        raise ValueError(f"run {run!r}: no hidden_size")
    keys = takes(attention)
    missing = sorted(k for k in VARIANTS[attention].requires if model.get(k) is None)
    if missing:
        raise ValueError(f"run {run!r} (attention={attention!r}) lacks {missing}")
    layers = model.get("attention_layers")
    if isinstance(layers, (list, tuple)):
        layers = ".".join(map(str, layers))
    fields = {
        "run": run,
        "attention": attention,
        "hidden_size": model["hidden_size"],
        "d_down": model.get("d_down"),
        "window": model.get("window"),
        "dilation": model.get("dilation"),
        "bottleneck_activation": model.get("bottleneck_activation") or DEFAULT_BOTTLENECK,
        "full_attention_every": model.get("full_attention_every") or None,
        "attention_layers": str(layers) if layers not in (None, "") else None,
        "seed": seed,
    }
    return {
        k: (v if k in ("run", "attention", "hidden_size", "seed") or k in keys else None) for k, v in fields.items()
    }


def missing(value) -> bool:
    """None, "", NaN or pandas' NA: a field the run does not set (a summary cell or a dict value)."""
    if value is None or type(value).__name__ == "NAType":
        return True
    return value != value or value == ""


def is_plain(fields) -> bool:
    """A linear bottleneck (or none) and no layer pattern: the runs of seed 000's Tables 1-4.
    ``fields``: a dict or a summary row with the RUN_FIELDS."""
    bottleneck = fields.get("bottleneck_activation")
    return (
        (missing(bottleneck) or bottleneck == DEFAULT_BOTTLENECK)
        and (missing(fields.get("full_attention_every")) or not fields.get("full_attention_every"))
        and missing(fields.get("attention_layers"))
    )
