"""The layering docs/architecture.md promises, read from the source's import statements.

Every ``import`` and ``from ... import`` in src/normkit counts, also those inside functions
(a lazy import is still a dependency, and two lazy imports in opposite directions are still
a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "normkit"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """The normkit modules ``path`` imports, resolved to module names that exist."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from normkit.x import y": y may be a submodule or a name in normkit.x
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == "normkit")
    return found


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imports(path, name):
            while target and target not in modules:     # a name inside a module
                target = target.rpartition(".")[0]
            # importing a package runs its __init__, not its siblings: keep the module itself
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


GRAPH = _graph()


def test_the_graph_sees_the_package():
    assert "normkit.functional" in GRAPH and "normkit.backends" in GRAPH["normkit.autograd"]


def test_no_import_cycle():
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def _reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _library():
    tools = ("normkit.cli", "normkit.bench", "normkit.study", "normkit.__main__")
    return [m for m in GRAPH if not m.startswith(tools)]


@pytest.mark.parametrize("tool", ["normkit.cli", "normkit.bench", "normkit.study"])
def test_the_library_never_imports_the_tools(tool):
    offenders = [m for m in _library()
                 if any(d == tool or d.startswith(tool + ".") for d in GRAPH[m])]
    assert not offenders, f"{offenders} import {tool}"


def test_backends_never_import_nn():
    for m in GRAPH:
        if m.startswith("normkit.backends"):
            assert not any(d.startswith("normkit.nn") for d in _reaches(m)), m


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] == "torch" for n in names):
            return True
    return False


def test_scalers_never_import_torch():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    for m in [m for m in GRAPH if m.startswith("normkit.preprocessing")]:
        for dep in {m} | _reaches(m):
            assert not _imports_torch(modules[dep]), f"{m} reaches {dep}, which imports torch"


def test_no_module_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
