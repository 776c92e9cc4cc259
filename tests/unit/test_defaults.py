"""One home for defaults: the schema (schemas/config.schema.yaml) and DimPO's presets file beside
it (schemas/dimpo_presets.yaml). The settings classes read their defaults from there, and no code
restates one, as a literal class default, a ``.get(key, default)`` fallback or a keyword default of a
function a job calls."""

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from dimattn.workflow.schema import dataset_defaults, dimpo_presets, schema

REPO = Path(__file__).resolve().parents[2]
# The product's code: the package and the jobs' scripts (benchmarks and tests set their own).
CODE = sorted([*(REPO / "dimattn").rglob("*.py"), *(REPO / "workflow_scripts").glob("*.py")])


def _schema_defaults(node, out):
    """{key: [default, ...]} of every property of ``node`` (a schema) that gives a default."""
    if isinstance(node, dict):
        for key, sub in (node.get("properties") or {}).items():
            if isinstance(sub, dict) and "default" in sub:
                out.setdefault(key, []).append(sub["default"])
        for value in node.values():
            _schema_defaults(value, out)
    elif isinstance(node, list):
        for value in node:
            _schema_defaults(value, out)
    return out


DEFAULTED = _schema_defaults(schema(), {}) | {k: [v] for k, v in dimpo_presets()["defaults"].items()}


def _same(key, value) -> bool:
    """``value`` is a default the schema gives ``key`` (a key's name alone collides too often)."""
    return any(type(value) is type(d) and value == d for d in DEFAULTED.get(key, ()))


def _keyword_defaults(node: ast.FunctionDef):
    """(parameter, default) of each parameter of ``node`` that has a default."""
    a = node.args
    positional = a.posonlyargs + a.args
    yield from zip(positional[len(positional) - len(a.defaults):], a.defaults)
    yield from ((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)


def _entry_points() -> dict[Path, set[str]]:
    """{module file: names} of the functions the jobs' scripts call: a name imported from a module
    of the package, or an attribute of such a module imported by name (``scoring.evaluate_recall``)."""
    out: dict[Path, set[str]] = {}
    for script in (REPO / "workflow_scripts").glob("*.py"):
        tree, modules = ast.parse(script.read_text()), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dimattn"):
                base = REPO.joinpath(*node.module.split("."))
                for alias in node.names:
                    if base.joinpath(alias.name).with_suffix(".py").exists():
                        modules[alias.asname or alias.name] = base.joinpath(alias.name).with_suffix(".py")
                    else:
                        out.setdefault(base.with_suffix(".py"), set()).add(alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                out.setdefault(modules[node.value.id], set()).add(node.attr)
    return out


ENTRY_POINTS = _entry_points()


def _restated(path: Path, root: Path = REPO, entry_points=ENTRY_POINTS) -> list[str]:
    """``.get("key", <literal>)``, class-level ``key: T = <literal>``, and a keyword default
    ``key=<literal>`` of a function a job calls, restating a default. (The jobs pass such a function
    every value the config holds, so a default there is a second home; other functions' keyword
    defaults are their API's, and dimattn/model/ is self-contained: it loads beside a checkpoint,
    where there is no schema.)"""
    found, called = [], entry_points.get(path, set())
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name in called:
            found += [f"{path.relative_to(root)}:{node.lineno} {node.name}({arg.arg}={d.value!r})"
                      for arg, d in _keyword_defaults(node)
                      if isinstance(d, ast.Constant) and _same(arg.arg, d.value)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[1], ast.Constant) and _same(node.args[0].value, node.args[1].value)):
            found.append(f"{path.relative_to(root)}:{node.lineno} .get({node.args[0].value!r}, {node.args[1].value!r})")
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and isinstance(item.value, ast.Constant) and _same(item.target.id, item.value.value)):
                    found.append(f"{path.relative_to(root)}:{item.lineno} {node.name}.{item.target.id} = "
                                 f"{item.value.value!r}")
    return found


# Fields that share a name and value with a schema key but are no config's default.
NOT_CONFIG = {
    "dimattn/workflow/sweeps.py": "Projected.seed = 0",  # the base model's identity: no fit seed
    "dimattn/workflow/runs.py": ".get('seed', 0)",  # a Hub model directory has no training.json
}


def test_no_code_restates_a_schema_default():
    restated = [hit for path in CODE for hit in _restated(path)
                if not hit.endswith(NOT_CONFIG.get(str(path.relative_to(REPO)), "\0"))]
    assert restated == [], "defaults written outside the schema:\n" + "\n".join(restated)


def test_the_check_finds_a_restated_default(tmp_path):
    """The scan above is not vacuous: a restated class default, ``.get`` fallback and keyword default
    of a job's function are caught, and the keyword default of a function no job calls is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("class S:\n    n_pairs: int = 8\n\ndef f(c):\n    return c.get('streaming', True)\n\n"
                   "def job(x, device='cpu', *, seed=0):\n    pass\n")
    assert sorted(_restated(bad, tmp_path, {bad: {"job"}})) == [
        "bad.py:2 S.n_pairs = 8", "bad.py:5 .get('streaming', True)", "bad.py:7 job(device='cpu')", "bad.py:7 job(seed=0)"]
    assert sorted(_restated(bad, tmp_path, {})) == ["bad.py:2 S.n_pairs = 8", "bad.py:5 .get('streaming', True)"]


def test_the_jobs_entry_points_are_found():
    """The scan above sees the functions the scripts call, by either form of import."""
    found = {path.relative_to(REPO).as_posix(): names for path, names in ENTRY_POINTS.items()}
    assert {"evaluate_recall", "evaluate_longctx"} <= found["dimattn/evaluation/scoring.py"]  # as module.attr
    assert {"fit_seeds_to_files"} <= found["dimattn/dimpo/projections.py"]
    assert {"pretrain", "launch_command"} <= found["dimattn/pretraining/training.py"]


@pytest.mark.parametrize("module, cls, source", [("dimattn.data.recall", "RecallSettings", "synthetic_recall"),
                                                 ("dimattn.data.longctx", "LongContextSettings", "synthetic_longctx")])
def test_the_generators_defaults_are_the_schemas(module, cls, source):
    import importlib

    settings = getattr(importlib.import_module(module), cls)
    expected = dataset_defaults(source)
    got = {f.name: f.default for f in fields(settings) if f.name in expected}
    got = {k: list(v) if isinstance(v, tuple) else v for k, v in got.items()}  # YAML has lists
    assert got == {k: v for k, v in expected.items() if k in got} and len(got) >= 10


def test_fit_settings_are_the_presets_file():
    from dimattn.dimpo.fit_settings import PRESETS, FitSettings
    from dimattn.dimpo.objectives import OBJECTIVES

    source = dimpo_presets()
    described = schema()["$defs"]["fit_fields"]["properties"]
    assert [f.name for f in fields(FitSettings)] == ["preset", *described]
    assert {f.name: f.default for f in fields(FitSettings)} == source["defaults"]
    assert all(f.default is not MISSING for f in fields(FitSettings))
    assert {n: dict(o.defaults) for n, o in OBJECTIVES.items() if o.defaults} == source["objectives"]
    assert set(PRESETS) == set(source["presets"]) == {"ours", "authors"}
    # every field's description gives the authors' value and ours
    vague = [n for n, f in described.items() if "Authors" not in f["description"] or "Ours" not in f["description"]]
    assert vague == []


def _outside(rule: dict):
    """(a value the field's schema refuses, one at its bound that it takes) for each bound it has."""
    if "enum" in rule:
        yield "none of them", rule["enum"][0]
    if "minimum" in rule:
        yield rule["minimum"] - 1, rule["minimum"]
    if "exclusiveMinimum" in rule:
        yield rule["exclusiveMinimum"], rule["exclusiveMinimum"] + 0.5
    if "exclusiveMaximum" in rule:
        yield rule["exclusiveMaximum"], rule["exclusiveMaximum"] - 0.5


FIT_BOUNDS = [(name, bad, good) for name, rule in schema()["$defs"]["fit_fields"]["properties"].items()
              for bad, good in _outside(rule)]


@pytest.mark.parametrize("name, bad, good", FIT_BOUNDS, ids=[f"{n}={b}" for n, b, _ in FIT_BOUNDS])
def test_fit_settings_hold_the_schemas_bounds(name, bad, good):
    """FitSettings built in code are held to the bounds and choices the schema gives a config's
    hparams (checked against the schema itself, so no bound is written twice)."""
    from dimattn.dimpo.fit_settings import FitSettings

    assert getattr(FitSettings(**{name: good}), name) == good
    with pytest.raises(ValueError, match=f"fit setting {name}: "):
        FitSettings(**{name: bad})


def test_the_fit_bounds_cover_every_bounded_field():
    assert len(FIT_BOUNDS) >= 25 and {"k_share", "steps", "lr", "init"} <= {n for n, _, _ in FIT_BOUNDS}


@pytest.mark.parametrize(
    "text, named",
    [
        ("defaults: {lr: fast}\npresets: {ours: {}, authors: {}}\nobjectives: {}\n", "defaults.lr"),
        ("presets: [\n", "cannot be read"),
        ("defaults: {preset: ours}\npresets: {ours: {}, authors: {}}\nobjectives: {}\n", "defaults lacks"),
    ],
)
def test_a_broken_presets_file_is_refused_naming_it(tmp_path, monkeypatch, text, named):
    from dimattn.workflow import schema as module

    broken = tmp_path / "dimpo_presets.yaml"
    broken.write_text(text)
    monkeypatch.setattr(module, "PRESETS", broken)
    module._presets.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=named) as err:
            module.dimpo_presets()
        assert str(broken) in str(err.value)
    finally:
        module._presets.cache_clear()
