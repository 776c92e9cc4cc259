"""The conda environments of envs/, checked statically (conda channels are not reachable from the
test machines, so no environment is ever built here):

- every package an env pins has the version requirements.txt pins (names normalised: case,
  ``-``/``_``/``.``), and every env package is one requirements.txt pins;
- every rule (rules/*.smk and the Snakefile, rules made in a for-loop included) names a conda
  env that exists, and its script exists;
- each rule's env holds what its script imports: the script's imports and, transitively, those
  of the ``dimattn`` modules it imports (module level and inside functions alike), mapped to
  distributions with ``importlib.metadata.packages_distributions()`` of this venv, must be a
  package of the env or a dependency that one of them pulls in (``Requires-Dist`` of this venv,
  extras included where the env names them). LAZY lists the few imports a rule never reaches.
"""

import ast
import re
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "envs"
RULE_FILES = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
PACKAGE = "dimattn"
# Not from an env: the standard library, and the names every script job has on its path:
# the repository's own package and workflow_scripts/_workflow.py (_workflow.py puts the
# repository root on sys.path), and snakemake, whose script preamble puts its own source on
# sys.path to unpickle the `snakemake` object (dimattn.workflow.sweeps imports snakemake.utils).
PROVIDED = {PACKAGE, "_workflow", "snakemake"}
# Conda packages without a PyPI namesake, by the PyPI name requirements.txt uses.
CONDA_TO_PYPI = {"pyyaml": "pyyaml", "matplotlib-base": "matplotlib"}
NOT_PYTHON_PACKAGES = {"python", "pip"}  # the interpreter and the installer of the pip section

# (module where a function-level import sits, distribution) -> the rules that never call that
# function (EVERY_RULE: no rule does), and why. A module reached only through such an import is
# charged to it too. Any other lazy import counts as much as a module-level one; an import in a
# `try` that catches ImportError is optional and does not count.
EVERY_RULE = "every rule"
LAZY = {
    # dimattn/__init__.py imports the model classes (torch, transformers) in its module
    # __getattr__, for the package attribute DimAttnConfig; workflow code imports dimattn.model.modeling_dimattn
    # instead, so the torch-free reporting rules can import dimattn.reporting.
    ("dimattn", "torch"): EVERY_RULE,
    ("dimattn", "transformers"): EVERY_RULE,
    # prepare_hf_corpus alone imports datasets (rule prepare_documents, envs/data.yaml); the rules
    # in envs/torch.yaml reach dimattn.data.corpora for load_tokens and read_documents only.
    ("dimattn.data.corpora", "datasets"): {"pretrain", "perplexity", "recall", "capture_qkv"},
    # lm_eval_results imports lm-eval in the function (and dimattn.evaluation.projected's prefetch,
    # which only lm-eval rules reach). rule perplexity shares workflow_scripts/score_text.py with
    # score_text but has params.lm_eval=None, so it never calls run_lm_eval; recall reaches
    # dimattn.evaluation.scoring for evaluate_recall alone.
    ("dimattn.evaluation.scoring", "lm-eval"): {"perplexity", "recall"},
    # the suite's generator (rule generate_recall) never scores: example_score imports lm-eval.
    ("dimattn.data.longctx", "lm-eval"): {"generate_recall"},
}


def normalize(name: str) -> str:
    """PEP 503: case and runs of -, _, . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[normalize(req.name)] = spec.version
    return pins


def env_packages(env: Path) -> dict[str, tuple[str | None, set[str]]]:
    """{normalised PyPI name: (pinned version or None, extras)} of a conda env file, conda and
    pip dependencies alike."""
    spec = yaml.safe_load(env.read_text())
    packages = {}

    def add(name, version, extras=()):
        name = normalize(name)
        assert name not in packages, f"{env.name}: {name} listed twice"
        packages[name] = (version, set(extras))

    for dep in spec["dependencies"]:
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                req = Requirement(line)
                specs = list(req.specifier)
                exact = specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
                add(req.name, exact, req.extras)
            continue
        # conda match spec: name, name=1.2, name==1.2, name 1.2, name>=1.2 (the last unpinned)
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(?:(==?|\s)\s*([0-9][^\s,|*<>=!]*))?(.*)", dep.strip())
        assert m, f"{env.name}: cannot read conda dependency {dep!r}"
        name, _, version, rest = m.groups()
        name = CONDA_TO_PYPI.get(normalize(name), normalize(name))
        add(name, version if not rest.strip() else None)
    return packages


ENV_FILES = sorted(ENVS.glob("*.yaml"))


def test_there_are_envs():
    assert ENV_FILES and all(f.suffix == ".yaml" for f in ENV_FILES)


@pytest.mark.parametrize("env", ENV_FILES, ids=lambda p: p.name)
def test_env_pins_the_versions_of_requirements_txt(env):
    pins = requirements()
    packages = env_packages(env)
    problems = []
    for name, (version, _) in sorted(packages.items()):
        if name in NOT_PYTHON_PACKAGES:
            continue
        if name not in pins:
            problems.append(f"{name}: not in requirements.txt (pin it there, or drop it here)")
        elif version is None:
            problems.append(f"{name}: unpinned, requirements.txt has {pins[name]}")
        elif version != pins[name]:
            problems.append(f"{name}: {version} here, {pins[name]} in requirements.txt")
    assert not problems, f"{env.relative_to(REPO)}:\n  " + "\n  ".join(problems)
    assert packages.get("python", (None,))[0] == f"{sys.version_info.major}.{sys.version_info.minor}", (
        f"{env.name}: python should be pinned to the venv's {sys.version_info.major}.{sys.version_info.minor}")


@pytest.mark.parametrize("env", ENV_FILES, ids=lambda p: p.name)
def test_env_extras_exist(env):
    """An extra the distribution does not declare is only a warning to pip: its packages would be
    missing without an error."""
    for name, (_, extras) in env_packages(env).items():
        if extras:
            declared = {normalize(e) for e in metadata.metadata(name).get_all("Provides-Extra") or []}
            assert {
                normalize(e) for e in extras
            } <= declared, f"{env.name}: {name}{sorted(extras)}, declared {sorted(declared)}"


# --- rules ---------------------------------------------------------------------------------------

RULE_START = re.compile(r"^(\s*)rule(?:\s+(\w+))?\s*:\s*(#.*)?$")
DIRECTIVE = re.compile(r"^(\s*)(\w+)\s*:\s*(.*?)\s*(#.*)?$")


def _literal(text: str) -> str | None:
    try:
        value = ast.literal_eval(text.rstrip(","))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


def parse_rules(path: Path) -> list[dict]:
    """Rules of a Snakefile or .smk file: {name, line, file, conda, script, action}. An anonymous
    rule (``rule:`` with ``name: f"render_{slug}"``, made in a for-loop) is named by its
    ``name:`` expression."""
    lines = path.read_text().splitlines()
    rules = []
    i = 0
    while i < len(lines):
        m = RULE_START.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        rule = {"name": m.group(2), "line": i + 1, "file": path, "conda": None, "script": None, "action": None}
        body, j = [], i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            body.append(lines[j])
            j += 1
        directive_indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=indent + 4)
        for k, b in enumerate(body):
            d = DIRECTIVE.match(b)
            if not d or len(d.group(1)) != directive_indent:
                continue
            key, inline = d.group(2), d.group(3)
            value = inline or next((v.strip() for v in body[k + 1:] if v.strip()), "")
            if key == "name":
                rule["name"] = _literal(value) or value.rstrip(",")
            elif key == "conda":
                rule["conda"] = _literal(value) or value
            elif key in ("script", "shell", "run", "notebook", "wrapper"):
                rule["action"] = key
                if key == "script":
                    rule["script"] = _literal(value) or value
        rules.append(rule)
        i = j
    return rules


@cache
def all_rules() -> list[dict]:
    return [r for f in RULE_FILES for r in parse_rules(f)]


def rule_id(rule) -> str:
    return f"{rule['name']} ({rule['file'].relative_to(REPO)}:{rule['line']})"


def test_rules_are_found():
    names = {r["name"] for r in all_rules()}
    # a sample of every file, the for-loop rule of rules/report.smk among them
    assert {"all", "download_sdist", "pretrain", "recall", "capture_qkv", "summarize_recall", "figures"} <= names
    assert 'f"render_{slug}"' in names, sorted(names)
    assert all(r["name"] for r in all_rules())


def test_every_rule_names_an_existing_conda_env_and_script():
    problems = []
    for rule in all_rules():
        if rule["action"] is None:  # a target rule (all): nothing runs
            assert rule["conda"] is None, rule_id(rule)
            continue
        if not rule["conda"]:
            problems.append(f"{rule_id(rule)}: no conda directive")
        elif not (rule["file"].parent / rule["conda"]).resolve().is_file():
            problems.append(f"{rule_id(rule)}: conda env {rule['conda']} does not exist")
        elif (rule["file"].parent / rule["conda"]).resolve().parent != ENVS:
            problems.append(f"{rule_id(rule)}: conda env {rule['conda']} is not in envs/")
        if rule["action"] == "script" and not (rule["file"].parent / rule["script"]).resolve().is_file():
            problems.append(f"{rule_id(rule)}: script {rule['script']} does not exist")
    assert not problems, "\n".join(problems)


# --- imports -------------------------------------------------------------------------------------


def module_file(name: str) -> Path | None:
    """The file of a repository module (a dotted dimattn module path, or a workflow script by its name)."""
    if name == "_workflow":
        return REPO / "workflow_scripts" / "_workflow.py"
    base = REPO.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _optional_import(node: ast.Try) -> bool:
    """A try whose handler catches ImportError and goes on (does not raise): its imports are
    optional."""
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if {getattr(t, "id", None) for t in types} & {"ImportError", "ModuleNotFoundError"}:
            return not any(isinstance(n, ast.Raise) for n in ast.walk(handler))
    return False


@cache
def direct_imports(path: Path) -> tuple[tuple[str, bool], ...]:
    """(absolute module name, lazy) of every import of a file that is not optional; lazy: inside
    a function; optional: in a ``try`` that catches ImportError. A call to import_module built
    from ``__package__`` may import any module of that package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path) if path.is_relative_to(REPO / PACKAGE) else path.stem
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try) and _optional_import(child):
                for rest in (child.handlers, child.orelse, child.finalbody):  # skip the try body
                    for n in rest:
                        visit(n, lazy)
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                found.append((mod, inner))
                # `from pkg import submodule` imports the submodule
                found.extend((f"{mod}.{a.name}", inner) for a in child.names if module_file(f"{mod}.{a.name}"))
            elif (isinstance(child, ast.Call) and getattr(child.func, "id", getattr(child.func, "attr", None))
                  == "import_module" and "__package__" in ast.unparse(child)):
                pkg_dir = module_file(package).parent
                found.extend((module_name(p), True) for p in sorted(pkg_dir.glob("*.py")))
            visit(child, inner)

    visit(tree, False)
    return tuple(found)


def third_party_imports(script: Path) -> dict[str, set[tuple[str, frozenset]]]:
    """{top-level import name: {(repository module importing it, lazy origins)}} over the script
    and, transitively, the repository modules it imports. The lazy origins of an import are the
    repository modules whose function-level imports lie on its way from the script: it happens
    only if each of those functions runs (empty: every import on the way runs at module level)."""
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[tuple[str, frozenset]]] = {}
    seen = set()
    todo = [(script, frozenset())]
    while todo:
        path, origin = todo.pop()
        if (path, origin) in seen:
            continue
        seen.add((path, origin))
        where = module_name(path) if path.is_relative_to(REPO / PACKAGE) else path.name
        for mod, inner in direct_imports(path):
            site_origin = origin | {where} if inner else origin
            top = mod.split(".")[0]
            if top in (PACKAGE, "_workflow"):
                parts = mod.split(".")
                for k in range(1, len(parts) + 1):  # a package's __init__ runs before its module
                    f = module_file(".".join(parts[:k]))
                    if f is not None:
                        todo.append((f, site_origin))
            elif top not in stdlib and top not in PROVIDED:
                found.setdefault(top, set()).add((where, site_origin))
    return found


@cache
def import_to_distributions() -> dict[str, list[str]]:
    return {k: [normalize(d) for d in v] for k, v in metadata.packages_distributions().items()}


@cache
def requires(dist: str, extras: frozenset = frozenset()) -> frozenset:
    """Distributions dist pulls in (this venv's Requires-Dist, with these extras), transitively."""
    out, todo = set(), [(dist, extras)]
    while todo:
        name, extra_set = todo.pop()
        if name in out and not extra_set:
            continue
        out.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in reqs:
            req = Requirement(line)
            env = default_environment()
            active = any(req.marker is None or req.marker.evaluate({**env, "extra": e}) for e in ("", *extra_set))
            if active:
                todo.append((normalize(req.name), frozenset(req.extras)))
    return frozenset(out)


def env_closure(env: Path) -> set[str]:
    closure = set()
    for name, (_, extras) in env_packages(env).items():
        closure |= requires(name, frozenset(extras))
    return closure


def script_rules() -> list[dict]:
    return [r for r in all_rules() if r["action"] == "script" and r["conda"]]


def test_import_scan_sees_the_dynamic_lazy_and_optional_imports():
    """The scan itself: the render script reaches matplotlib through outputs' import_module;
    download_sdist reaches packaging inside dimattn.data.corpora._check_pinned; _workflow.py's torch is
    optional (every script imports _workflow), dimattn/__init__.py's lazy."""
    render = third_party_imports(REPO / "workflow_scripts" / "render.py")
    assert {"pandas", "matplotlib", "seaborn", "jinja2"} <= set(render)
    assert ("dimattn.reporting.dar_trajectory", frozenset({"dimattn.reporting.outputs"})) in render["seaborn"]
    assert ("dimattn.data.corpora", frozenset({"dimattn.data.corpora"})) in third_party_imports(
        REPO / "workflow_scripts" / "download_sdist.py"
    )["packaging"]
    assert ("dimattn.pretraining.training", frozenset()) in third_party_imports(
        REPO / "workflow_scripts" / "pretrain.py"
    )["torch"]
    summarize = third_party_imports(REPO / "workflow_scripts" / "summarize.py")
    assert all("dimattn" in origins for _, origins in summarize["torch"]), summarize["torch"]


def exempt(rule: dict, origins: frozenset, dists: list[str]) -> bool:
    """Whether the rule never runs one of the functions the import needs."""
    rules = [LAZY.get((origin, d)) for origin in origins for d in dists]
    return any(r == EVERY_RULE or (r and rule["name"] in r) for r in rules)


@pytest.mark.parametrize("rule", script_rules(), ids=lambda r: str(r["name"]).replace('f"render_{slug}"', "render_*"))
def test_rule_env_holds_its_scripts_imports(rule):
    env = (rule["file"].parent / rule["conda"]).resolve()
    closure = env_closure(env)
    direct = set(env_packages(env))
    names = import_to_distributions()
    missing = []
    for top, sites in sorted(third_party_imports((rule["file"].parent / rule["script"]).resolve()).items()):
        dists = names.get(top)
        if not dists:
            missing.append(f"{top}: imported by {sorted(sites)[0][0]}, but no distribution of this venv provides it")
            continue
        if any(d in closure for d in dists):
            continue
        needed = sorted((where, ", ".join(sorted(o))) for where, o in sites if not exempt(rule, o, dists))
        if needed:
            how = "; ".join(f"by {w}" + (f" (inside functions of {o})" if o else "") for w, o in needed)
            missing.append(f"{top} ({'/'.join(dists)}): imported {how}")
    assert not missing, (
        f"{rule_id(rule)} runs {rule['script']} in {env.relative_to(REPO)} (packages: {', '.join(sorted(direct))}), "
        "which lacks:\n  " + "\n  ".join(missing))


def test_lazy_exemptions_are_still_needed():
    """Every LAZY entry names a lazy import that exists, reached by each rule it exempts, and
    missing from that rule's env (else the entry is dead weight)."""
    names = import_to_distributions()
    for (module, dist), exempted in LAZY.items():
        rules = script_rules() if exempted == EVERY_RULE else [r for r in script_rules() if r["name"] in exempted]
        assert exempted == EVERY_RULE or len({r["name"] for r in rules}) == len(exempted), (module, dist, exempted)
        needed = False
        for rule in rules:
            sites = third_party_imports((rule["file"].parent / rule["script"]).resolve())
            reached = {top for top, s in sites.items() if dist in names.get(top, []) and any(module in o for _, o in s)}
            assert reached or exempted == EVERY_RULE, f"{rule_id(rule)} does not reach {dist} lazily from {module}"
            needed |= bool(reached) and dist not in env_closure((rule["file"].parent / rule["conda"]).resolve())
        assert needed, f"LAZY[{module!r}, {dist!r}]: no rule it exempts lacks {dist}"


# --- lm-eval tasks ----------------------------------------------------------------------------------
# The lm_eval rules run lm-eval's task code too: the Python modules a task's YAML names with
# `!function module.fn` import packages that lm-eval only pulls in through extras (RULER:
# wonderwords, nltk; LongBench: jieba, fuzzywuzzy, rouge). Every task a config asks for must
# find them in the env of the rules that run lm-eval.

LM_EVAL_RULES = {"score_text", "score_projected", "prefetch"}
# Import names whose distribution is named otherwise, for packages this venv does not install.
IMPORT_TO_DIST = {"bs4": "beautifulsoup4", "sklearn": "scikit-learn", "yaml": "pyyaml"}


def config_tasks() -> dict[str, set[str]]:
    """{lm-eval task name: configs asking for it} over config.yaml and configs/*.yaml."""
    tasks = {}
    for path in [REPO / "config.yaml", *sorted((REPO / "configs").glob("*.yaml"))]:
        config = yaml.safe_load(path.read_text()) or {}
        lists = [((config.get("evaluation") or {}).get("lm_eval") or {}).get("tasks"),
                 ((config.get("dimpo") or {}).get("downstream") or {}).get("tasks")]
        for task in (t for lst in lists for t in lst or []):
            tasks.setdefault(task["name"], set()).add(path.name)
    return tasks


@cache
def lm_eval_task_index() -> dict[str, set[Path]]:
    """{task, group or tag name: directories of the YAMLs defining it}, lm-eval's and ours."""
    spec = __import__("importlib.util").util.find_spec("lm_eval")
    roots = [Path(spec.origin).parent / "tasks", REPO / PACKAGE / "evaluation" / "lm_eval_tasks"]
    index = {}
    for root in roots:
        for path in root.rglob("*.yaml"):
            text = path.read_text(errors="replace")
            names = re.findall(r"^(?:task|group|tag):\s*['\"]?([\w.\-]+)['\"]?\s*$", text, re.M)
            for block in re.findall(r"^(?:tag|group):\s*\n((?:[ \t]*-[ \t]*\S+[ \t]*\n)+)", text, re.M):
                names += re.findall(r"-\s*(\S+)", block)
            for name in names:
                index.setdefault(name, set()).add(path.parent)
    return index


def task_code_imports(directory: Path) -> dict[str, set[str]]:
    """{third-party import name: {module}} of the modules the YAMLs of a task directory name with
    `!function`, following their imports of modules of the same directory or of lm_eval.tasks."""
    tasks_root = Path(__import__("importlib.util").util.find_spec("lm_eval").origin).parent / "tasks"
    todo = {directory / f"{m}.py" for y in directory.glob("*.yaml")
            for m in re.findall(r"!function\s+([\w]+)\.\w+", y.read_text(errors="replace"))}
    found, seen = {}, set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and _optional_import(t)
                    for b in t.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
            else:
                continue
            for mod in mods:
                if mod.startswith("."):
                    todo.add(path.parent / f"{mod.lstrip('.').split('.')[0]}.py")
                elif mod.startswith("lm_eval.tasks."):
                    todo.add(tasks_root.joinpath(*mod.split(".")[2:]).with_suffix(".py"))
                elif (path.parent / f"{mod.split('.')[0]}.py").is_file():  # a sibling module
                    todo.add(path.parent / f"{mod.split('.')[0]}.py")
                elif mod.split(".")[0] not in sys.stdlib_module_names and mod.split(".")[0] != "lm_eval":
                    found.setdefault(mod.split(".")[0], set()).add(path.name)
    return found


@pytest.mark.parametrize("task", sorted(config_tasks()))
def test_lm_eval_env_holds_the_imports_of_each_configured_task(task):
    index = lm_eval_task_index()
    assert task in index, f"lm-eval has no task, group or tag {task!r} (asked by {sorted(config_tasks()[task])})"
    rules = [r for r in script_rules() if r["name"] in LM_EVAL_RULES]
    assert {r["name"] for r in rules} == LM_EVAL_RULES
    names = import_to_distributions()
    for env in sorted({(r["file"].parent / r["conda"]).resolve() for r in rules}):
        closure = env_closure(env)
        missing = []
        for directory in sorted(index[task]):
            for top, modules in sorted(task_code_imports(directory).items()):
                dists = names.get(top) or [normalize(IMPORT_TO_DIST.get(top, top))]
                if not any(d in closure for d in dists):
                    missing.append(
                        f"{top} ({'/'.join(dists)}), imported by {', '.join(sorted(modules))} in {directory.name}/"
                    )
        assert not missing, (
            f"lm-eval task {task} (asked by {', '.join(sorted(config_tasks()[task]))}) needs, in "
            f"{env.relative_to(REPO)}:\n  " + "\n  ".join(missing))
