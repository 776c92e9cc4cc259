"""The import graph of dimattn: no cycle, and the torch-free core imports nothing from reporting.

Edges come from the source (ast), not from importing it: every ``import`` of a dimattn module
and every ``from .x import y``, at module level or inside a function, is an edge. A
function-level import counts because it is a cycle all the same, only one that bites later
(when the function runs first in a fresh process) and that a reader has to chase across both
files. ``from package import submodule`` is an edge to the submodule. The implicit import of a
package's ``__init__`` is not an edge: ``dimattn/__init__.py`` defers its imports to a module
``__getattr__`` and ``dimattn/reporting/__init__.py`` imports nothing.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dimattn"
# The torch-free core: what planning (the DAG) and the reporting stage's inputs import.
CORE = [
    "dimattn.workflow.sweeps",
    "dimattn.model.variants",
    "dimattn.workflow.paths",
    "dimattn.workflow.reference",
    "dimattn.workflow.formats",
    "dimattn.workflow.runs",
    "dimattn.workflow.settings",
    "dimattn.model.atomic",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    edges.add(sub if sub in modules else source)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_walk_sees_function_level_imports():
    graph = import_graph()
    assert "dimattn.data.recall" in graph["dimattn.evaluation.projected"]  # score_projected imports it in the function
    assert "dimattn.reporting.dimpo_downstream" in graph["dimattn.reporting.dimpo"]  # _table6_long_context
    assert "dimattn.reporting.paper" in graph["dimattn.reporting.dimpo"]  # from . import paper
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_torch_free_core_imports_nothing_from_reporting():
    graph = import_graph()
    for module in CORE:
        assert module in graph, module
        bad = sorted(m for m in reachable(graph, module) if m.startswith("dimattn.reporting"))
        assert not bad, (module, bad)
    # projections' fidelity CSV columns come from the core, not from the summaries that read them
    assert "dimattn.workflow.formats" in graph["dimattn.dimpo.projections"]
    assert not [m for m in graph["dimattn.dimpo.projections"] if m.startswith("dimattn.reporting")]
