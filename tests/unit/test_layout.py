"""The package shows the architecture: one subpackage a stage, data flowing one way between them
(no import cycle: tests/unit/test_imports.py), no module over 700 lines, and dimattn/model/ self-contained (it travels beside
every checkpoint, loaded with trust_remote_code in a process that may not have dimattn)."""

import ast
from pathlib import Path

from test_imports import import_graph

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dimattn"
# Each stage may import the stages before it, never one after: data flows one way.
LAYERS = {
    "model": set(),
    "workflow": {"model"},
    "data": {"model", "workflow"},
    "pretraining": {"model", "workflow", "data"},
    "dimpo": {"model", "workflow", "data"},
    "evaluation": {"model", "workflow", "data", "pretraining"},
    "reporting": {"model", "workflow"},
    "testing": set(),  # the stand-in Hub of the tests and the rehearsal, apart from the product
}
MAX_LINES = 700


GRAPH = import_graph()


def stage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_the_top_level_holds_only_the_stages():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)


def test_data_flows_one_way_between_stages():
    wrong = []
    for name, deps in GRAPH.items():
        mine = stage(name)
        for dep in deps:
            theirs = stage(dep)
            if mine and theirs and theirs != mine and theirs not in LAYERS[mine]:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong


def test_the_model_package_imports_only_its_siblings():
    """save_pretrained copies a modeling file and the modules it imports relatively; an absolute
    dimattn import would not resolve beside a checkpoint."""
    for path in (PACKAGE / "model").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("dimattn"), f"{path.name}: from {node.module} import"
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module, f"{path.name}: a relative import beyond model/"


def test_no_module_is_over_700_lines():
    long = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in long.items() if v > MAX_LINES} == {}


WIDTH = 120  # pyproject.toml's [tool.black] and [tool.snakefmt]: one width for the whole code


def _code_lines_over(path: Path, width: int) -> list[int]:
    """Lines of ``path`` over ``width`` characters outside a string (a docstring or a message a
    formatter cannot split)."""
    import io
    import tokenize

    lines = path.read_text().splitlines()
    long = {i + 1 for i, line in enumerate(lines) if len(line) > width}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            long -= set(range(tok.start[0], tok.end[0] + 1))
    return sorted(long)


def test_one_width_and_no_formatter_escapes():
    import tomllib

    tools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    assert tools["black"]["line-length"] == tools["snakefmt"]["line_length"] == WIDTH
    files = [p for d in ("dimattn", "workflow_scripts", "benchmarks", "tests") for p in sorted((REPO / d).rglob("*.py"))]
    over = {str(p.relative_to(REPO)): n for p in files if (n := _code_lines_over(p, WIDTH))}
    assert over == {}, f"code lines over {WIDTH} characters: {over}"
    escapes = [str(p.relative_to(REPO)) for p in files if "fmt: " + "skip" in p.read_text()]
    assert escapes == [], f"formatter escapes in {escapes}"
