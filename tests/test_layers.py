"""The house as CONTRIBUTING.md draws it: every package of ``src/distillery`` sits on a floor and
imports only from its own package or from packages on lower floors (lazy imports inside functions
included); no two modules import each other, directly or round a longer circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "distillery"

# floor -> the packages on it, bottom first (CONTRIBUTING.md, "The house")
FLOORS: list[set[str]] = [
    {"common"},
    {"config", "lineage", "clips"},
    {"components"},
    {"data", "models"},
    {"sampling"},
    {"methods", "callbacks"},
    {"engine"},
    {"evaluation", "export"},
    {"tinybase"},
    {"stages"},
    {"cli"},
]
FLOOR = {pkg: i for i, pkgs in enumerate(FLOORS) for pkg in pkgs}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(distillery module imported, at module level?) for every import of ``path``, lazy ones included."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []
    top = {id(n) for n in tree.body} | {id(n) for n in ast.walk(tree) if isinstance(n, ast.If)
                                          and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "distillery" and _exists(name):
                found.append((name, id(node) in top))
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts)


def test_every_package_has_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(FLOOR), f"packages without a floor: {packages - set(FLOOR)}; floors naming none: {set(FLOOR) - packages}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at the package root (put each in the package of its job): {loose}"


def test_no_package_imports_a_floor_above_it():
    upward = []
    for path in _sources():
        here = _package(_module(path))
        for target, _ in _imports(path):
            there = _package(target)
            if here and there and there != here and FLOOR[there] >= FLOOR[here]:
                upward.append(f"{_module(path)} -> {target} ({here} floor {FLOOR[here]}, {there} floor {FLOOR[there]})")
    assert not upward, "imports that run up (or sideways on one floor of) the house:\n" + "\n".join(upward)


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for path in _sources():
        graph[_module(path)] = {t for t, _ in _imports(path)}
    for name in list(graph):
        for t in list(graph[name]):  # `from pkg import mod`: the module, not the package face
            graph[name].discard(t) if t not in graph else None
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or (node.startswith(nxt + ".") ) :  # a package face's own re-exports
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            raise AssertionError("import circle: " + " -> ".join(circle))
