"""The import graph of `parrot_backend`: no cycle between modules, none between packages,
and the layers DESIGN.md draws (kernels a leaf, the engine contract imports no other part).

Read from the source with `ast` (nothing is imported). Imports under `if TYPE_CHECKING:`
are type-only and do not count for module cycles; imports inside functions (lazy ones)
count for the packages' layering.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "parrot_backend"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, *, lazy: bool) -> set[str]:
    """The parrot_backend modules `module` imports: at import time, or (`lazy`) anywhere.
    A package's own ancestors are left out (they are already being imported)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                subs = [f"{name}.{a.name}" for a in node.names]
                found.update(s for s in subs if s in MODULES)
                if not any(s in MODULES for s in subs):
                    found.add(name)
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not lazy:
                continue
            visit(children)

    visit(ast.parse(path.read_text()).body)
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return {m for m in found if m in MODULES and m != module and m not in ancestors}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            connect(v)
    return out


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_back_at_import_time() -> None:
    graph = {m: _imports(m, lazy=False) for m in MODULES}
    assert _cycles(graph) == []


def test_no_package_imports_itself_back_even_lazily() -> None:
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        for t in _imports(m, lazy=True):
            if _package(t) != _package(m):
                graph.setdefault(_package(m), set()).add(_package(t))
    assert _cycles(graph) == []


def _outside(package: str) -> dict[str, set[str]]:
    """What modules of `package` import from the rest of parrot_backend, lazily or not."""
    found = {}
    for m in MODULES:
        if _package(m) == package:
            other = {t for t in _imports(m, lazy=True) if _package(t) != package}
            if other:
                found[m] = other
    return found


def test_kernels_are_a_leaf() -> None:
    assert _outside("parrot_backend.kernels") == {}


def test_the_engine_contract_imports_no_other_part() -> None:
    assert _outside("parrot_backend.contract") == {}
