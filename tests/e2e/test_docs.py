"""Pointers in prose stay true: every `dimattn.x.y` a document, docstring, rule or test names
exists, every relative folder a README names exists, and no module keeps a copy of a value
that config.yaml holds."""

import importlib
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", *(p for p in sorted(REPO.glob("*/README.md")) if not p.parent.name.startswith("."))]
TEXT_FILES = sorted(
    [*READMES, *REPO.glob("dimattn/**/*.py"), *REPO.glob("rules/*.smk"),
     *REPO.glob("workflow_scripts/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/*.py"),
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


def test_readme_dag_draws_the_real_rules(tier_dir):
    """Every rule the workflow defines (snakemake --list-rules on the default config and on
    cpu-full, the render rules of their report categories included) is in the README's drawing,
    and every name there is a rule."""
    import subprocess
    import sys

    rules = set()
    for extra in ([], ["--configfile", "configs/cpu-full.yaml"]):  # cpu-full: the suite's render rule too
        out = subprocess.run([sys.executable, "-m", "snakemake", "--list-rules", "--snakefile", str(REPO / "Snakefile"),
                              "--directory", str(tier_dir), *extra], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        rules |= set(out.stdout.split())
    assert {"all", "pretrain", "render_dar"} <= rules, rules
    drawn = _drawn_rules()
    assert sorted(drawn - rules) == [], "drawn but no such rule"
    assert sorted(rules - drawn) == [], "rules missing from the drawing"


# ----------------------------------------------------------------------------- README and docs/

DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
REQUIRED_PAGES = ["running", "configuration", "model", "long-context", "dimpo", "outputs", "testing", "benchmarks",
                  "findings"]
TOP = ("dimattn/", "rules/", "envs/", "workflow_scripts/", "tests/", "benchmarks/", "configs/", "schemas/",
       "profiles/", "reference/", "report/", "docs/", "published/")
SCHEMA = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())


def test_the_readme_is_a_front_door():
    """At most 250 lines, at most two with a date, each page of docs/ linked from it."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    dated = [line for line in readme.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert len(dated) <= 2, dated
    assert sorted(p.stem for p in DOCS) == sorted(REQUIRED_PAGES)
    assert all(f"`docs/{p.name}`" in readme for p in DOCS), [p.name for p in DOCS if f"`docs/{p.name}`" not in readme]


def test_the_readme_tiers_are_read_from_the_manifests():
    from dimattn.reporting import published

    readme = (REPO / "README.md").read_text()
    assert published.readme_with_tiers(readme) == readme, "run python -m dimattn.reporting.published readme"


def test_docs_benchmarks_is_what_the_records_give():
    import importlib.util

    spec = importlib.util.spec_from_file_location("records", REPO / "benchmarks/records.py")
    records = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(records)
    assert (REPO / "docs/benchmarks.md").read_text() == records.render(), "run python benchmarks/records.py"


def _backticked(page: Path) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", page.read_text()))


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_path_a_page_names_exists(page):
    named = {t.split()[0].rstrip(",:;") for t in _backticked(REPO / page)}
    paths = [t for t in named if t.startswith(TOP) and not re.search(r"[*<>{}]", t)]
    outputs = ("benchmarks/snakemake",)  # what a run writes (dimattn.workflow.paths), not in a checkout
    missing = [t for t in paths if not (REPO / t).exists() and not t.startswith(outputs)]
    assert not missing, missing


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_make_target_a_page_names_exists(page):
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", (REPO / page).read_text()))
    assert named <= targets, sorted(named - targets)


def _schema_has(node: dict, parts: list[str]) -> bool:
    """Whether the config key ``parts`` (``<x>`` a placeholder, ``[i]`` an item) is in the schema."""
    if not parts:
        return True
    if "$ref" in node:  # the referenced schema, and the node's own properties beside it
        here = {k: v for k, v in node.items() if k != "$ref"}
        return _schema_has(SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]], parts) or _schema_has(here, parts)
    branches = [b.get("then", b) for b in node.get("oneOf", []) + node.get("anyOf", []) + node.get("allOf", [])]
    for alt in branches:
        if _schema_has(alt, parts):
            return True
    head, rest = parts[0], parts[1:]
    if head.startswith("<"):  # a placeholder: any key of this mapping
        subs = [*node.get("properties", {}).values(), *node.get("patternProperties", {}).values()]
        subs += [node["additionalProperties"]] if isinstance(node.get("additionalProperties"), dict) else []
        return any(_schema_has(sub, rest) for sub in subs)
    if head.endswith("]"):
        name = re.sub(r"\[[^]]*\]$", "", head)
        return _schema_has(node, [name]) and _schema_has(
            node.get("properties", {}).get(name, {}).get("items", {}), rest
        )
    props = node.get("properties", {})
    if head in props:
        return _schema_has(props[head], rest)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        return _schema_has(extra, rest)
    return any(_schema_has(sub, rest) for sub in node.get("patternProperties", {}).values())


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_config_key_a_page_names_is_in_the_schema(page):
    tops = tuple(f"{k}." for k in SCHEMA["properties"])
    keys = {t.split(":")[0].split()[0] for t in _backticked(REPO / page) if t.startswith(tops)}
    keys = {k for k in keys if re.fullmatch(r"[a-z_]+(\.[a-z_<>\[\]]+)+", k)}
    unknown = [k for k in sorted(keys) if not _schema_has(SCHEMA, k.split("."))]
    assert not unknown, unknown


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_rule_a_page_names_exists(page):
    """`rule x`, `x` rule and the rules in a `snakemake ... <target>` command are rules."""
    text = (REPO / page).read_text()
    rules = set(re.findall(r"^rule ([a-z_]+):", "\n".join(p.read_text() for p in (REPO / "rules").glob("*.smk"))
                           + (REPO / "Snakefile").read_text(), re.M))
    rules |= {"render_dar", "render_baselines", "render_recall", "render_lm_eval", "render_dimpo", "render_frontier",
              "render_long_context"}  # the report categories' rules (rules/report.smk's loop)
    named = set(re.findall(r"rule `([a-z_]+)`", text)) | set(re.findall(r"`([a-z_]+)` rules?\b", text))
    assert named <= rules, sorted(named - rules)


def test_ci_runs_the_test_command_and_the_rehearsal():
    """.ci/run runs the README's test command and the paper DAG's dress rehearsal."""
    ci = [
        line.strip()
        for line in (REPO / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "make test" in ci and "make rehearsal" in ci and ci.index("make test") < ci.index("make rehearsal")
    assert "make test" in (REPO / "README.md").read_text()
