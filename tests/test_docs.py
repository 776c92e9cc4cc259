"""Pointers in prose stay true: every `dimattn.x.y` a document, docstring, rule or test names
exists, every relative folder a README names exists, and no module keeps a copy of a value
that config.yaml holds."""

import importlib
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
READMES = [REPO / "README.md", *(p for p in sorted(REPO.glob("*/README.md")) if not p.parent.name.startswith("."))]
TEXT_FILES = sorted(
    [*READMES, *REPO.glob("dimattn/**/*.py"), *REPO.glob("rules/*.smk"),
     *REPO.glob("workflow_scripts/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("benchmarks/*.py"),
     *REPO.glob("report/*.rst"), REPO / "schemas/config.schema.yaml", REPO / "Snakefile"]
)
DOTTED = re.compile(r"\bdimattn(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def resolves(dotted: str) -> bool:
    """dimattn.a.b.c names a module, or something defined in the longest module prefix (not
    merely imported there: the pointer must lead to the definition)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        home = getattr(obj, "__module__", None)
        return cut == len(parts) or not isinstance(home, str) or home == module.__name__ or obj is module
    return False


def test_every_dotted_pointer_resolves():
    stale = []
    for path in TEXT_FILES:
        if path == Path(__file__):
            continue
        for dotted in set(DOTTED.findall(path.read_text())):
            if dotted.endswith((".py", ".smk")) or not resolves(dotted):
                if not (dotted.endswith(".py") and (REPO / dotted.replace(".", "/", dotted.count(".") - 1)).exists()):
                    stale.append(f"{path.relative_to(REPO)}: {dotted}")
    assert not stale, stale


@pytest.mark.parametrize("readme", [p.relative_to(REPO).as_posix() for p in READMES])
def test_relative_folders_in_readmes_exist(readme):
    path = REPO / readme
    refs = [(ref, (path.parent / ref).resolve()) for ref in re.findall(r"`(\.\.?/[^`\s]*?/)`", path.read_text())]
    # shared/ lies beside a checkout (the seeds, the recipes), not inside it: checked where it is
    shared = REPO.parent / "shared"
    missing = [ref for ref, target in refs
               if not target.exists() and (shared.exists() or not target.is_relative_to(shared))]
    assert not missing, missing


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, str) and len(obj) >= 12:
        yield obj


def test_no_module_repeats_a_config_value():
    """config.yaml is where the default run's data are named (archive, checksum, members)."""
    datasets = yaml.safe_load((REPO / "config.yaml").read_text())["datasets"]
    values = set(_leaves([{k: v for k, v in spec.items() if k != "source"} for spec in datasets.values()]))
    repeated = [f"{p.relative_to(REPO)}: {v}" for p in sorted(REPO.glob("dimattn/**/*.py"))
                for v in values if f'"{v}"' in p.read_text() or f"'{v}'" in p.read_text()]
    assert not repeated, repeated


def _drawn_rules() -> set[str]:
    """The rule names in the README's DAG drawing: its words outside parentheses (the notes)."""
    readme = (REPO / "README.md").read_text()
    drawing = re.search(r"^## The DAG\n\n```\n(.*?)^```", readme, re.S | re.M).group(1)
    return set(re.findall(r"[a-z][a-z0-9_]*", re.sub(r"\([^)]*\)", "", drawing)))


def test_readme_dag_draws_the_real_rules():
    """Every rule the workflow defines (snakemake --list-rules on the default config and on
    cpu-full, the render rules of their report categories included) is in the README's drawing,
    and every name there is a rule."""
    import subprocess
    import sys

    rules = set()
    for extra in ([], ["--configfile", "configs/cpu-full.yaml"]):  # cpu-full: the suite's render rule too
        out = subprocess.run([sys.executable, "-m", "snakemake", "--list-rules", *extra], cwd=REPO,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        rules |= set(out.stdout.split())
    assert {"all", "pretrain", "render_dar"} <= rules, rules
    drawn = _drawn_rules()
    assert sorted(drawn - rules) == [], "drawn but no such rule"
    assert sorted(rules - drawn) == [], "rules missing from the drawing"
