"""Find import cycles among the modules of a package (default: src/dsv4); exit 1 if there is any.

Two graphs are checked. The import-time graph holds the imports that run when a module is imported: statements
at module level and in class bodies, including those under ``if`` / ``try``. The full graph adds the imports
inside functions: a deferred import that closes a loop hides a cycle rather than removing it (the two modules
still need each other). Both leave out anything under ``if TYPE_CHECKING:`` (annotations only, never run).

An edge goes to the module an import names: ``from pkg import name`` points at ``pkg.name`` when that is a module
of the package, else at ``pkg`` itself. A parent package's ``__init__`` that Python runs on the way is not an edge
of its own.

Every strongly connected component of more than one module is a cycle; the script prints each one with a
shortest loop through it.

    python tools/import_cycles.py [SRC_ROOT] [PACKAGE]      # defaults: the repository's src, dsv4
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path


def module_files(src_root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``src_root / package``."""
    modules: dict[str, Path] = {}
    for path in sorted((src_root / package).rglob("*.py")):
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """True for ``TYPE_CHECKING`` and ``typing.TYPE_CHECKING`` as an ``if`` condition."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(body: list[ast.stmt], deferred: bool):
    """The import statements of ``body``, not under ``if TYPE_CHECKING:``; those inside functions only where
    ``deferred``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from _import_nodes(node.body, deferred)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_nodes(node.body, deferred)
            yield from _import_nodes(node.orelse, deferred)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for c in children:  # except handlers and match cases hold their own bodies
                        if isinstance(c, (ast.ExceptHandler, ast.match_case)):
                            stmts.extend(c.body)
                    yield from _import_nodes(stmts, deferred)


def imports_of(name: str, path: Path, modules: dict[str, Path], deferred: bool = False) -> set[str]:
    """The package modules that module ``name`` (file ``path``) imports directly: when it is imported, or also
    inside its functions (``deferred``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _import_nodes(tree.body, deferred):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
            continue
        base = node.module or ""
        if node.level:  # relative: strip the module itself (unless a package), then level - 1 more parents
            parts = name.split(".") if is_package else name.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                targets.add(sub)
            elif base in modules:
                targets.add(base)
    targets.discard(name)
    return targets


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` with more than one node, each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                loop = [v]
                while loop[-1] != start:
                    loop.append(parent[loop[-1]])
                return [start] + loop[::-1][1:] + [start] if len(loop) > 1 else [start, v, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return component  # unreachable for a strongly connected component


def find_cycles(src_root: Path, package: str, deferred: bool = False
                ) -> tuple[dict[str, set[str]], list[list[str]]]:
    """The import graph of ``package`` under ``src_root`` (with the imports inside functions where ``deferred``)
    and its cycles (strongly connected components of more than one module)."""
    modules = module_files(src_root, package)
    graph = {name: imports_of(name, path, modules, deferred) for name, path in modules.items()}
    return graph, strongly_connected(graph)


def main(argv: list[str]) -> int:
    src_root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src"
    package = argv[2] if len(argv) > 2 else "dsv4"
    found = False
    for deferred, what in ((False, "at import time"), (True, "counting imports inside functions")):
        graph, cycles = find_cycles(src_root, package, deferred)
        if not cycles:
            print(f"no import cycles among {len(graph)} modules of {package} ({what})")
        for component in cycles:
            found = True
            print(f"cycle of {len(component)} modules ({what}): {', '.join(component)}")
            print("  e.g. " + " -> ".join(shortest_loop(graph, component)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
