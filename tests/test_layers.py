"""The house as CONTRIBUTING.md draws it: every package of ``src/distillery`` sits on a floor and
imports only from its own package or from packages on lower floors (lazy imports inside functions
included, relative ones resolved); no two modules import each other, directly or round a longer circle.
The training library (floors 0-6) never imports the pipeline built on it (floors 7 and up, and ``flows``).
The stage layer, the top-level ``stages/`` package, stands on the house: it imports ``distillery`` up to its
``pipeline`` floor, never ``cli`` nor ``flows``; nothing of ``src/distillery`` imports it (the runner looks a
stage up by name, with importlib: the one way in)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "distillery"

# floor -> the packages on it, bottom first (CONTRIBUTING.md, "The house")
FLOORS: list[set[str]] = [
    {"common"},
    {"config"},
    {"components"},
    {"data", "models"},
    {"sampling"},
    {"methods", "callbacks"},
    {"engine"},
    {"lineage", "clips"},
    {"evaluation", "export"},
    {"tinybase", "rewards"},
    {"pipeline"},
    {"cli"},
]
FLOOR = {pkg: i for i, pkgs in enumerate(FLOORS) for pkg in pkgs}
LIBRARY_TOP_FLOOR = 6  # engine: floors 0-6 are the training library, those above it the pipeline
PIPELINE_OUTSIDE = ("flows", "stages")  # top-level packages of the pipeline beside src/ (the Prefect face, the stage layer)
STAGES = PACKAGE.parents[1] / "stages"  # the stage layer: one adapter module per dvc.yaml stage
STAGE_LAYER_TOP_FLOOR = FLOOR["pipeline"]  # what stages/ may import of distillery: up to the pipeline's machinery


def _module(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The absolute module an ``ImportFrom`` names: ``from ..engine import loop`` in
    ``distillery/models/base.py`` is ``distillery.engine`` (level 1 is the module's own package)."""
    if node.level == 0:
        return node.module or ""
    package = _module(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[str, bool]]:
    """(module of ``root``'s package imported, at module level?) for every import of ``path``, lazy ones
    included, relative ones resolved to the absolute module they name."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []
    top = {id(n) for n in tree.body} | {id(n) for n in ast.walk(tree) if isinstance(n, ast.If)
                                          and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, path, root)
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == root.name and _exists(name, root):
                found.append((name, id(node) in top))
    return found


def _outside_imports(path: Path) -> list[str]:
    """The pipeline packages outside ``src/`` (``flows``) that ``path`` imports, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found += [n for n in names if n.split(".")[0] in PIPELINE_OUTSIDE]
    return found


def _exists(module: str, root: Path = PACKAGE) -> bool:
    rel = Path(*module.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _package(module: str, root: Path = PACKAGE) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (root / parts[1]).is_dir() else None


def _sources(root: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "assets" not in p.parts)


def _library_to_pipeline(root: Path = PACKAGE) -> list[str]:
    """Every import by a library module (a package on floors 0-6) of a pipeline module (a package above,
    or ``flows``): absolute or relative, at module level or lazy."""
    wires = []
    for path in _sources(root):
        here = _package(_module(path, root), root)
        if here is None or FLOOR[here] > LIBRARY_TOP_FLOOR:
            continue
        for target, _ in _imports(path, root):
            there = _package(target, root)
            if there is not None and FLOOR[there] > LIBRARY_TOP_FLOOR:
                wires.append(f"{_module(path, root)} -> {target} (library {here} imports pipeline {there})")
        wires += [f"{_module(path, root)} -> {name} (library {here} imports the pipeline's {name})" for name in _outside_imports(path)]
    return wires


def test_every_package_has_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(FLOOR), f"packages without a floor: {packages - set(FLOOR)}; floors naming none: {set(FLOOR) - packages}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at the package root (put each in the package of its job): {loose}"


def _upward(root: Path = PACKAGE) -> list[str]:
    upward = []
    for path in _sources(root):
        here = _package(_module(path, root), root)
        for target, _ in _imports(path, root):
            there = _package(target, root)
            if here and there and there != here and FLOOR[there] >= FLOOR[here]:
                upward.append(f"{_module(path, root)} -> {target} ({here} floor {FLOOR[here]}, {there} floor {FLOOR[there]})")
    return upward


def test_no_package_imports_a_floor_above_it():
    upward = _upward()
    assert not upward, "imports that run up (or sideways on one floor of) the house:\n" + "\n".join(upward)


def test_the_library_never_imports_the_pipeline():
    wires = _library_to_pipeline()
    assert not wires, "the training library imports the pipeline built on it:\n" + "\n".join(wires)


def _house(tmp: Path, files: dict[str, str]) -> Path:
    """A package ``distillery`` under ``tmp`` with an empty module in every package of the house, plus ``files``."""
    root = tmp / "distillery"
    for pkg in FLOOR:
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / "mod.py").write_text("")
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("text", [
    "from distillery.pipeline import mod\n",  # absolute, at module level
    "def f():\n    import distillery.lineage.mod\n",  # absolute, lazy
    "from ..clips import mod\n",  # relative: models/base.py's package is models, .. the house
    "from ...distillery.evaluation.mod import x\n",  # relative, up to the folder above and back in
    "def f():\n    from .. import export\n",  # relative, lazy, a package by name
    "import flows.dag\n",  # the Prefect face outside src/
])
def test_the_checks_see_a_library_module_importing_the_pipeline_however_written(tmp_path, text):
    root = _house(tmp_path, {"models/base.py": text})
    assert _library_to_pipeline(root), text
    assert _upward(root) or text.startswith("import flows"), text


def test_the_checks_pass_a_library_house_and_read_relative_imports_within_a_package(tmp_path):
    root = _house(tmp_path, {"models/base.py": "from . import mod\nfrom ..common import mod as m\nfrom .mod import x\n",
                             "pipeline/run.py": "from ..engine import mod\nfrom distillery.models import base\n"})
    assert _library_to_pipeline(root) == [] and _upward(root) == []
    assert {t for t, _ in _imports(root / "models" / "base.py", root)} == {
        "distillery.models", "distillery.models.mod", "distillery.common", "distillery.common.mod"}


def _top_level_imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in ``path``, lazy ones included; relative ones resolved within the
    top-level package ``path`` is in (``stages``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([path.parent.name] + ([base] if base else []))
            found.append((base, node.lineno))
    return found


def _stage_layer_wires(stages: Path = STAGES, package: Path = PACKAGE) -> list[str]:
    """Imports of the stage layer (``stages/*.py``) that leave it: ``flows``, or ``distillery`` above its floor."""
    wires = []
    for path in sorted(stages.rglob("*.py")):
        for name, line in _top_level_imports(path):
            top = name.split(".")[0]
            if top == "flows":
                wires.append(f"{path.relative_to(stages.parent)}:{line} imports {name} (the Prefect face stands beside the stages, not under them)")
            elif top == package.name:
                there = _package(name, package)
                if there is not None and FLOOR[there] > STAGE_LAYER_TOP_FLOOR:
                    wires.append(f"{path.relative_to(stages.parent)}:{line} imports {name} ({there} floor {FLOOR[there]}: above the pipeline)")
    return wires


def _imports_of_the_stage_layer(package: Path = PACKAGE) -> list[str]:
    """Every import of the top-level ``stages`` package by a module of ``src/distillery`` (lazy too): the runner
    reaches it by name only (``importlib``), so the library and the pipeline import without a workspace."""
    return [f"{_module(path, package)}:{line} imports {name}" for path in _sources(package)
            for name, line in _top_level_imports(path) if name.split(".")[0] == "stages"]


def test_the_stage_layer_stands_on_the_pipeline():
    modules = sorted(p.name for p in STAGES.glob("*.py"))
    assert "__init__.py" in modules and "training.py" in modules, modules
    wires = _stage_layer_wires()
    assert not wires, "the stage layer imports what stands beside or above it:\n" + "\n".join(wires)


def test_nothing_in_the_package_imports_the_stage_layer():
    wires = _imports_of_the_stage_layer()
    assert not wires, "src/distillery imports the stage layer (look a stage up through the runner's STAGES):\n" + "\n".join(wires)
    runner = (PACKAGE / "pipeline" / "launch" / "runner.py").read_text()
    assert "importlib.import_module(find_stage(name, workspace))" in runner  # the one way in: by the name in STAGES


@pytest.mark.parametrize("text", [
    "import flows.dag\n",
    "def f():\n    from flows import dag\n",
    "from distillery.cli import main\n",
    "def f():\n    import distillery.cli.stage\n",
])
def test_the_stage_layer_check_sees_an_import_beside_or_above_it(tmp_path, text):
    root = _house(tmp_path, {})
    stages = tmp_path / "stages"
    stages.mkdir()
    (stages / "__init__.py").write_text("")
    (stages / "clips.py").write_text("from distillery.pipeline import mod\nfrom . import base\n" + text)
    assert len(_stage_layer_wires(stages, root)) == 1, text
    (stages / "clips.py").write_text("from distillery.pipeline import mod\nfrom . import base\nfrom stages.base import x\n")
    assert _stage_layer_wires(stages, root) == []


@pytest.mark.parametrize("text", ["import stages.clips\n", "def f():\n    from stages import training\n",
                                  "from stages.base import stage_base\n"])
def test_the_check_sees_the_package_importing_the_stage_layer(tmp_path, text):
    root = _house(tmp_path, {"pipeline/run.py": text})
    assert len(_imports_of_the_stage_layer(root)) == 1, text
    assert _library_to_pipeline(_house(tmp_path / "lib", {"models/base.py": text})), text


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


# Library modules that import (or look up) a module by a name computed at run time: the registered plugin loaders — a
# run config's ``_target_`` under the allowed prefixes, a model family's package from its table row, the package a
# plugin class is exported from. Each takes names from its own table or config, never a pipeline module's.
PLUGIN_LOADERS = {"distillery.config.targets", "distillery.models.registry", "distillery.config.loader"}
PIPELINE_NAMES = tuple(f"distillery.{pkg}" for pkg, floor in FLOOR.items() if floor > LIBRARY_TOP_FLOOR) + PIPELINE_OUTSIDE


def _string_imports(path: Path) -> list[tuple[int, str | None]]:
    """``(line, the name or None when computed)`` of every import by name in ``path``: ``importlib.import_module(...)``,
    ``import_module(...)``, ``__import__(...)``, ``sys.modules[...]`` and ``sys.modules.get(...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            modules_get = isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "modules"
            if name in ("import_module", "__import__") or modules_get:
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules":
            arg = node.slice
        if arg is not None:
            found.append((node.lineno, arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None))
    return found


def _library_string_imports(root: Path = PACKAGE) -> list[str]:
    """Every import by name of a pipeline module (``distillery`` above the engine, ``flows``, ``stages``) by a library
    module, and every import by a computed name outside :data:`PLUGIN_LOADERS`."""
    wires = []
    for path in _sources(root):
        here = _package(_module(path, root), root)
        if here is None or FLOOR[here] > LIBRARY_TOP_FLOOR:
            continue
        for line, name in _string_imports(path):
            where = f"{_module(path, root)}:{line}"
            if name is None and _module(path, root) not in PLUGIN_LOADERS:
                wires.append(f"{where} imports a module by a computed name (not a registered plugin loader)")
            elif name is not None and (name + ".").startswith(tuple(n + "." for n in PIPELINE_NAMES)):
                wires.append(f"{where} imports the pipeline's {name} by name")
    return wires


def test_the_library_imports_no_pipeline_module_by_name():
    wires = _library_string_imports()
    assert not wires, "the training library reaches the pipeline by name:\n" + "\n".join(wires)


@pytest.mark.parametrize("text", [
    "import importlib\nimportlib.import_module('distillery.pipeline.launch.runner')\n",
    "from importlib import import_module\ndef f():\n    return import_module('stages.training')\n",
    "def f():\n    return __import__('flows.dag')\n",
    "import sys\nsys.modules['distillery.cli.main']\n",
    "import sys\ndef f():\n    return sys.modules.get('stages.training')\n",
    "import importlib\ndef f(name):\n    return importlib.import_module(name)\n",
])
def test_the_check_sees_a_library_module_importing_the_pipeline_by_name(tmp_path, text):
    root = _house(tmp_path, {"models/base.py": text})
    assert len(_library_string_imports(root)) == 1, text
    assert not _library_string_imports(_house(tmp_path / "ok", {"models/base.py": "import importlib\n"
                                                                "importlib.import_module('flash_attn.cute')\n"}))
