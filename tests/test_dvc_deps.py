"""dvc.yaml knows the code its stages run: editing a module a stage uses makes DVC rerun the stage.

- Every ``distillery stage`` of dvc.yaml is a stage of the code and its code deps exist; its
  ``params:`` list is the one list of what it reads (the stage sees only those keys): each training
  stage's table row reads keys inside it, and the params.yaml schema knows every one of them.
- Every stage of dvc.yaml runs for real (the whole DAG of tests/test_pipeline.py, which calls
  :func:`check_stage_imports` on what it recorded) with an import recorder in each Python process
  (the stage process, the launcher and the torchrun workers it starts): the stage's code deps under
  ``src/distillery`` and the stage layer ``stages/*.py`` are exactly what its processes imported (:func:`code_deps`:
  a package folder where every module of it was imported, else the files) — nothing missing, so editing a module a stage runs
  reruns it, and nothing extra, so editing a module it does not run (another stage's, a help text)
  reruns nothing. ``DISTILLERY_WRITE_DVC_DEPS=1`` rewrites dvc.yaml's code deps from the trace.
- What the default DAG cannot run is a dep all the same: a stage's other methods and options (:func:`option_code`), a
  training stage off by default (:func:`off_by_default_code`), a training stage at more than one process, sequence or
  tensor parallelism (:func:`layout_code`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from workspace import shipped_params_text

import distillery
from distillery.models.base import ModelBase
from distillery.models.registry import FAMILIES
from distillery.pipeline.dvcfile import load_dvc_stages, stage_params
from distillery.pipeline.launch.launcher import AGENT_MODULE, WORKER_MODULE
from distillery.pipeline.launch.runner import STAGES
from distillery.pipeline.params.reader import Params, StageParams, UndeclaredParam
from distillery.pipeline.params.schema import TRAINING_STAGES, ParamsSchema
from stages.recipes import registry

ROOT = Path(__file__).resolve().parents[1]

PACKAGE = Path(distillery.__file__).resolve().parent  # where `import distillery` finds the code
PACKAGE_IN_REPO = "src/distillery"  # the same folder as dvc.yaml names it
STAGE_LAYER = ROOT / "stages"  # the stage adapters (the top-level package `stages`): dvc.yaml names each module it imports

# Installed first on sys.path of every traced process (and inherited by the processes it starts):
# records the name of every distillery (and stage-layer ``stages``) module the process imports, one file per process.
RECORDER = '''\
import os, sys

_DIR = os.environ.get("DISTILLERY_TRACE_IMPORTS")


class _RecordDistilleryImports:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if _DIR and name.split(".")[0] in ("distillery", "stages"):
            path = os.path.join(_DIR, "%d.txt" % os.getpid())
            first = not os.path.exists(path)
            with open(path, "a") as fh:
                if first:  # the process's command line: which stage it works for
                    with open("/proc/self/cmdline", "rb") as cmd:
                        fh.write("#cmd " + cmd.read().replace(b"\\0", b" ").decode("utf-8", "replace") + "\\n")
                fh.write(name + "\\n")
        return None  # the real finders import it


sys.meta_path.insert(0, _RecordDistilleryImports)
'''

def _stage_name(cmd: str) -> str | None:
    parts = cmd.split()
    return parts[2] if parts[:2] == ["distillery", "stage"] and len(parts) >= 3 else None


def _is_code(dep: str) -> bool:
    return not dep.startswith(("artifacts/", "metrics/", "plots/")) and dep not in ("artifacts", "params.yaml")


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def _shipped_params() -> Params:
    """The shipped params.yaml (:func:`workspace.shipped_params_text`), validated."""
    import yaml

    from distillery.pipeline.params.loading import as_written, to_plain, validate_params
    from distillery.pipeline.params.recipes import recipe_params

    data = yaml.safe_load(shipped_params_text())
    typed = validate_params(data, "params.yaml", recipe_params(registry()))
    return Params(as_written(data, to_plain(typed)), ROOT / "params.yaml", typed, registry())


def test_dvc_stages_are_the_code_stages():
    stages = load_dvc_stages(ROOT)
    by_code = {_stage_name(s.cmd): s for s in stages.values() if _stage_name(s.cmd)}
    assert sorted(by_code) == sorted(STAGES), "dvc.yaml stages vs distillery.pipeline.launch.runner.STAGES"
    for name, spec in by_code.items():
        assert len(set(spec.params)) == len(spec.params), f"stage {name}: repeated params {spec.params}"
        assert stage_params(name, ROOT) == spec.params  # plain params.yaml keys


def test_training_stages_read_only_their_dvc_params():
    """A training stage's dvc.yaml entry lists its section and ``gpus`` (so DVC reruns it when one changes), its recipe
    folder as one dep (a new recipe is a dep of its stage, of no other), and the input artifacts of every recipe: at the
    shipped params, and an init a key chooses (``<stage>.student_init``, ``critic_init``) as ``artifacts/${<key>}``."""
    import typing

    params = _shipped_params()
    text = (ROOT / "dvc.yaml").read_text()
    stages = load_dvc_stages(ROOT)
    for name, methods in registry().items():
        declared, deps = stage_params(name, ROOT), stages[name].deps
        assert name in declared and "gpus" in declared, (name, declared)
        assert f"stages/recipes/{name}" in deps, f"stage {name}: its recipes' folder is not a dep"
        for method, recipe in methods.items():
            p = dataclasses.replace(params.get(name), method=method) if isinstance(params.get(name), recipe.Params) \
                else recipe.Params(method=method)
            for stage in recipe.inputs(p).values():
                if stage in ("base", "teacher", "pretrain", "distill") and f"artifacts/{stage}" not in deps:
                    keys = [k for k, tp in typing.get_type_hints(recipe.Params).items() if typing.get_origin(tp) is
                            typing.Literal and stage in typing.get_args(tp) and k.endswith("_init")]
                    assert any(f"artifacts/${{{name}.{k}}}" in text for k in keys), \
                        f"stage {name} ({method}): input artifacts/{stage} is not a dep"


def test_params_schema_knows_every_key_a_stage_reads():
    params = _shipped_params()
    for name in STAGES:
        for key in stage_params(name, ROOT):
            params.get(key)  # raises (UserError) on a key the schema lacks


def test_a_stage_sees_only_its_dvc_params():
    params = _shipped_params()
    view = StageParams(params, "teacher", stage_params("teacher", ROOT))
    assert view.get("teacher.steps") == params.get("teacher.steps") and view.get("gpus.nproc_per_node") == 1
    with pytest.raises(UndeclaredParam, match="pretrain.steps"):
        view.get("pretrain.steps")
    assert list(view.recorded()) == ["seed", "gpus", "teacher"]  # lineage: dvc.yaml's order


def test_every_out_is_persist():
    """DVC deletes a stage's outs before running it unless they are ``persist``: a failed run would
    leave no artifact, and no ``metrics/<stage>.json`` or plots file (``D metrics/clips.json`` in
    git). Every out, metrics and plots file of every stage is persist; the stage replaces each when
    it succeeds (case 9.12)."""
    for name, spec in load_dvc_stages(ROOT).items():
        assert spec.all_outs and sorted(spec.persisted) == sorted(spec.all_outs), \
            f"stage {name}: outs without persist: true: {sorted(set(spec.all_outs) - set(spec.persisted))}"


def test_code_deps_exist():
    for name, spec in load_dvc_stages(ROOT).items():
        missing = [d for d in spec.deps if _is_code(d) and not (ROOT / d).exists()]
        assert not missing, f"stage {name}: deps that do not exist: {missing}"


def _module_file(name: str) -> str | None:
    """The repo path (``src/distillery/...``, ``stages/...``) of a distillery or stage-layer module, None if it is not
    a file of either."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.has_location:
        return None
    origin = Path(spec.origin).resolve()
    if name.split(".")[0] == "stages" and STAGE_LAYER in origin.parents:
        return f"stages/{origin.relative_to(STAGE_LAYER).as_posix()}"
    if PACKAGE not in origin.parents:
        return None
    return f"{PACKAGE_IN_REPO}/{origin.relative_to(PACKAGE).as_posix()}"


def recorder_env(folder: Path, trace: Path) -> dict[str, str]:
    """Environment that makes every Python process started under it record its distillery imports
    into ``trace`` (a ``sitecustomize`` on PYTHONPATH, inherited by the processes it starts)."""
    folder.mkdir(parents=True, exist_ok=True)
    trace.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(RECORDER)
    return {"PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "DISTILLERY_TRACE_IMPORTS": str(trace)}


def imports_by_stage(trace: Path) -> dict[str, set[str]]:
    """{stage: repo paths of the distillery and stage-layer modules its processes imported} from a trace folder: the
    stage process (``distillery stage NAME``), its launcher and workers (``--config runs/NAME/run.yaml``)."""
    import re

    found: dict[str, set[str]] = {}
    for f in trace.glob("*.txt"):
        lines = f.read_text().splitlines()
        cmd = lines[0] if lines and lines[0].startswith("#cmd ") else ""
        m = re.search(r"\bstage (\w+)", cmd) or re.search(r"runs/(\w+)/run\.yaml", cmd)
        if m:
            found.setdefault(m.group(1), set()).update(f for f in map(_module_file, lines[1:]) if f)
    return found


def _package_modules(folder: Path) -> set[str]:
    """Repo paths of every module below ``folder`` of the package (assets aside)."""
    return {f"{PACKAGE_IN_REPO}/{p.relative_to(PACKAGE).as_posix()}" for p in folder.rglob("*.py")
            if "assets" not in p.relative_to(PACKAGE).parts}


def code_deps(files: set[str]) -> list[str]:
    """The fewest dvc.yaml deps that cover exactly ``files`` (repo paths of modules): a folder of the package when
    every module below it is in ``files``, else the files themselves; the stage layer's modules one by one (its
    folder holds every stage's adapter and the templates, listed as deps of their own)."""
    chosen: list[str] = []

    def walk(folder: Path) -> None:
        mine = _package_modules(folder)
        if not mine & files:
            return
        if folder != PACKAGE and mine <= files:
            chosen.append(f"{PACKAGE_IN_REPO}/{folder.relative_to(PACKAGE).as_posix()}")
            return
        for p in sorted(folder.iterdir()):
            if p.is_dir() and p.name not in ("__pycache__", "assets"):
                walk(p)
            elif p.suffix == ".py" and f"{PACKAGE_IN_REPO}/{p.relative_to(PACKAGE).as_posix()}" in files:
                chosen.append(f"{PACKAGE_IN_REPO}/{p.relative_to(PACKAGE).as_posix()}")

    walk(PACKAGE)
    return sorted(chosen + [f for f in files if _is_stage_module(f)])


def _is_stage_module(dep: str) -> bool:
    return dep.startswith("stages/") and dep.endswith(".py")


def _listed_code(deps: list[str]) -> list[str]:
    """The deps that name package or stage-layer code (modules or folders of them; the shipped assets and the
    run-config templates are data)."""
    return sorted(d for d in deps if (d.startswith(PACKAGE_IN_REPO) and not d.startswith(f"{PACKAGE_IN_REPO}/assets"))
                  or _is_stage_module(d))


def write_code_deps(root: Path, derived: dict[str, list[str]]) -> None:
    """Rewrite each stage's package-code deps in ``root/dvc.yaml`` to ``derived[stage]`` (text edit:
    comments, order and every other dep stay as they are)."""
    out: list[str] = []
    stage = None
    for line in (root / "dvc.yaml").read_text().splitlines():
        head = re.match(r"^  ([\w-]+):\s*$", line)  # a stage of `stages:`
        if head:
            stage = head.group(1)
        item = line.strip()[2:] if line.strip().startswith("- ") else None
        if item is not None and stage in derived and item in _listed_code([item]):
            if derived[stage] is not None:
                out.extend(f"      - {d}" for d in derived[stage])
                derived = {**derived, stage: None}
            continue
        out.append(line)
    (root / "dvc.yaml").write_text("\n".join(out) + "\n")


RECIPES = STAGE_LAYER / "recipes"  # stages/recipes/<stage>/: a training stage's recipes, one dep of it (a folder)


def _in_recipe_folder(module_file: str) -> bool:
    """Whether ``module_file`` (a repo path) is a module of a stage's recipe folder, ``stages/recipes/<stage>/``: every
    stage imports them all to check params.yaml whole (their knobs' declarations), and each is a dep of its own stage
    only, as its folder (a new recipe reruns its stage and no other; a recipe cannot change another stage's output)."""
    parts = Path(module_file).parts
    return len(parts) > 3 and parts[:2] == ("stages", "recipes")


def _import_nodes(tree: ast.AST, within: tuple[str, ...] | None) -> Iterator[ast.AST]:
    """The nodes of ``tree``: all of them (``within`` None); those of its functions (methods) named in ``within``; with
    ``within`` empty, those Python runs on importing the module (outside every function and ``if TYPE_CHECKING:``)."""
    if within is None:
        yield from ast.walk(tree)
    elif within:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in within:
                yield from ast.walk(node)
    else:
        todo = [tree]
        while todo:
            node = todo.pop()
            yield node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            todo.extend(ast.iter_child_nodes(node))


def _static_imports(module_file: str, within: tuple[str, ...] | None = None) -> set[str]:
    """Repo paths of the package and stage-layer modules ``module_file`` (a repo path) imports anywhere in it (lazy
    imports too), or only where :func:`_import_nodes` looks with ``within``."""
    path = ROOT / module_file
    inside = Path(module_file).relative_to("stages" if _is_stage_module(module_file) else PACKAGE_IN_REPO)
    package = ".".join(["stages" if _is_stage_module(module_file) else "distillery", *inside.with_suffix("").parts[:-1]])
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), within):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # ``from package import module``
    return {f for f in map(_module_file, (n for n in names if n.split(".")[0] in ("distillery", "stages"))) if f}


def option_code(stage: str) -> set[str]:
    """The code every recipe of ``stage`` imports (``stages/recipes/<stage>/*.py``, lazy imports too), and the modules
    its adapter names in ``OPTION_MODULES`` (``stages/<stage>.py``: what an option runs, e.g. ``validate.vbench``),
    transitively (repo paths): what its non-default methods and options run — ``pretrain.method: ode_init``'s KD and
    trajectories, ``pdd.method: dm_pdd``, validate's VBench scorer — which the default DAG's trace cannot see, so that
    an edit to them reruns the stage too."""
    todo = [f"stages/{p.relative_to(STAGE_LAYER).as_posix()}" for p in sorted((RECIPES / stage).glob("*.py"))]
    adapter = STAGE_LAYER / f"{stage}.py"
    if adapter.is_file():
        todo += [f for f in map(_module_file, importlib.import_module(f"stages.{stage}").__dict__.get("OPTION_MODULES", ())) if f]
    return {m for m in _transitive(todo, _static_imports) if not _in_recipe_folder(m)}


TRAINING_ENTRY = _module_file(WORKER_MODULE)  # what a training stage's workers run (``python -m``)
LAUNCH_AGENT = _module_file(AGENT_MODULE)  # what runs them at more than one process (``gpus.nproc_per_node``, ``nnodes``)
STAGE_RUNNER = f"{PACKAGE_IN_REPO}/pipeline/launch/runner.py"  # what runs a stage in its process (its checks, preflight)


def _packages_of(module_file: str) -> set[str]:
    """The ``__init__.py`` of every package above ``module_file`` (a repo path): Python runs them on its import."""
    parts = Path(module_file).parts
    found = {Path(*parts[:i], "__init__.py").as_posix() for i in range(2 if parts[0] == "src" else 1, len(parts))}
    return {f for f in found if (ROOT / f).is_file()} - {module_file}


def _transitive(start: Iterable[str], imports: Callable[[str], set[str]]) -> set[str]:
    """``start`` (repo paths of modules) and what ``imports`` says each of them imports, transitively."""
    todo, seen = list(start), set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imports(module) - seen)
    return seen


def _closure(module_file: str) -> set[str]:
    """``module_file`` and the package and stage-layer modules it imports, transitively (lazy imports too), with their
    packages' ``__init__``."""
    return _transitive([module_file], lambda m: _static_imports(m) | _packages_of(m))


def _imported_by_calling(module_file: str, functions: tuple[str, ...]) -> set[str]:
    """The package modules that calling ``functions`` of ``module_file`` (a repo path, imported already) imports: what
    they import, and what importing those runs (their module-level imports, their packages' ``__init__``),
    transitively."""
    return _transitive(_static_imports(module_file, functions), lambda m: _static_imports(m, ()) | _packages_of(m)) \
        - {module_file}


# The model plugin's hooks a training run calls only under sequence or tensor parallelism (``gpus.sp_size`` /
# ``gpus.tp_size``, or the stage's own, > 1), named by the attributes of the base class every plugin overrides
PARALLEL_HOOKS = tuple(hook.__name__ for hook in (ModelBase.sequence_parallel_problem, ModelBase.enable_sequence_parallel,
                                                   ModelBase.tensor_parallel_problem, ModelBase.enable_tensor_parallel))
MODELS = f"{PACKAGE_IN_REPO}/models/"


def layout_code(stage: str, files: set[str]) -> set[str]:
    """The code a training stage runs only at a launch layout the default DAG (one process, sp 1, tp 1) does not have,
    which its trace cannot see: what the :data:`PARALLEL_HOOKS` of the model plugins among ``files`` (repo paths: the
    modules the stage imports) import, transitively — the Wan family's Ulysses all-to-all
    (``models/wan/sequence_parallel.py``) and DTensor plan (``models/wan/tensor_parallel.py``) —, and the torchrun
    agent of a launch of more than one process (:data:`LAUNCH_AGENT`) with what it imports. A user whose
    ``params.yaml`` sets ``gpus.nproc_per_node: 2, gpus.sp_size: 2`` runs it in every training stage, so an edit to it
    reruns them. Empty for a stage that trains nothing (its model is never split)."""
    if stage not in TRAINING_STAGES:
        return set()
    hooks = set().union(*(_imported_by_calling(f, PARALLEL_HOOKS) for f in files if f.startswith(MODELS)))
    return hooks | _closure(LAUNCH_AGENT)


REGISTRY = f"{PACKAGE_IN_REPO}/models/registry.py"
WAN = f"{PACKAGE_IN_REPO}/models/wan/"  # the default DAG's base family: the trace lists the Wan modules each stage runs


def family_packages() -> dict[str, set[str]]:
    """Each registered model family's name and the repo paths of every module of its package (``FAMILIES``)."""
    return {family.name: _package_modules(PACKAGE.joinpath(*family.package.split(".")[1:])) for family in FAMILIES}


def family_code(files: set[str]) -> set[str]:
    """The code of the model families a stage that imports the family registry (:data:`REGISTRY`, among ``files``: repo
    paths) loads by name when ``base.path`` (or a given model) is of that family — the default DAG's tiny Wan loads
    only Wan's, so its trace cannot see Cosmos' or HunyuanVideo 1.5's: every module of each family package the trace
    did not enter, with what it imports outside Wan's package (the families share some of Wan's modules — its head
    bank, its causal attention —; which of those a stage runs, the Wan base's trace says). A user whose base is a
    Cosmos folder runs them in every such stage, so an edit to them reruns it. Empty for a stage that does not import
    the registry."""
    if REGISTRY not in files:
        return set()
    unseen = [modules for modules in family_packages().values() if not modules & files]
    code = set().union(*(_closure(m) for modules in unseen for m in modules))
    return {m for m in code if m in files or not m.startswith(WAN)}  # Wan's modules: the trace of its own base decides


def off_by_default_code(stage: str) -> set[str]:
    """The code a training stage that is off in the shipped params (``posttrain.enabled: false``) runs once switched on
    — the stage process's runner (:data:`STAGE_RUNNER`: the preflight that sizes a training run) and its adapter's
    training path (``stages/training.py``), its workers' entry (:data:`TRAINING_ENTRY`), with everything they import
    —, which the default DAG's trace cannot see (the stage publishes its off record without training): empty for any
    other stage."""
    section = getattr(ParamsSchema(), stage, None)
    if stage not in TRAINING_STAGES or not section.off():
        return set()
    code = _closure(STAGE_RUNNER) | _closure("stages/training.py") | _closure(TRAINING_ENTRY)
    code |= set().union(*map(_packages_of, option_code(stage)))  # its method's packages run when it imports it
    return {m for m in code if not _in_recipe_folder(m)}


def uncovered(files: set[str], deps: list[str]) -> list[str]:
    """The modules of ``files`` (repo paths a stage imported) that ``deps`` (its dvc.yaml deps) do not cover, its recipe
    folder's aside (:func:`_in_recipe_folder`: the folder is the dep)."""
    return sorted(f for f in files if not _covered(f, deps) and not _in_recipe_folder(f))


def check_stage_imports(imported: dict[str, set[str]], root: Path) -> None:
    """Fail unless each stage's package-code deps in dvc.yaml are exactly what it imported, plus the code its
    non-default methods run (:func:`option_code`), for a training stage off by default the code its training runs
    (:func:`off_by_default_code`), and what a training stage runs only at a launch layout the default DAG does not have
    (:func:`layout_code`: several processes, sequence or tensor parallelism), and the model families a stage that
    imports the registry loads for a base of that family (:func:`family_code`); the recipe folders are deps of their own stage, as folders
    (:func:`_in_recipe_folder`, ``test_training_stages_read_only_their_dvc_params``)."""
    imported = {name: {f for f in files if not _in_recipe_folder(f)} | option_code(name) | off_by_default_code(name)
                for name, files in imported.items()}
    imported = {name: files | layout_code(name, files) | family_code(files) for name, files in imported.items()}
    stages = load_dvc_stages(root)
    assert set(imported) == set(stages), f"traced stages {sorted(imported)} != dvc.yaml stages {sorted(stages)}"
    derived = {name: code_deps(files) for name, files in imported.items()}
    if os.environ.get("DISTILLERY_WRITE_DVC_DEPS"):
        write_code_deps(root, derived)
        stages = load_dvc_stages(root)
    missing = {name: uncovered(files, stages[name].deps) for name, files in imported.items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, "dvc.yaml: stages import code their deps do not list (add it to the stage's deps):\n" + "\n".join(
        f"  {name}: {', '.join(files)}" for name, files in missing.items())
    extra = {name: sorted(set(_listed_code(stages[name].deps)) - set(derived[name])) for name in stages}
    extra = {k: v for k, v in extra.items() if v}
    assert not extra, "dvc.yaml: stages list code they never import (editing it would rerun them for nothing; " \
        "DISTILLERY_WRITE_DVC_DEPS=1 rewrites the deps):\n" + "\n".join(f"  {name}: {', '.join(d)}" for name, d in extra.items())
    # the training stages' workers were traced too: their method and trainer are among the imports
    for name, module in (("teacher", "methods/sft.py"), ("pretrain", "methods/dfsft.py")):
        if name in imported:
            assert {f"{PACKAGE_IN_REPO}/{module}", f"{PACKAGE_IN_REPO}/engine/loop.py"} <= imported[name], name


def test_no_dep_is_an_empty_file():
    """DVC warns ``WARNING: '<dep>' is empty.`` for every empty file (or folder) a stage depends on, on every
    ``dvc repro``: 42–52 lines for the empty ``__init__.py`` files the import trace names, burying what matters.
    Every package module says what it is (a docstring), so no code dep is empty."""
    empty = sorted({d for spec in load_dvc_stages(ROOT).values() for d in spec.deps if _is_code(d) and (ROOT / d).exists()
                    and ((ROOT / d).is_file() and (ROOT / d).stat().st_size == 0
                         or (ROOT / d).is_dir() and not any(p.is_file() for p in (ROOT / d).rglob("*")))})
    assert not empty, f"dvc.yaml deps DVC would warn about as empty: {empty}"
    assert not [p for p in PACKAGE.rglob("*.py") if p.stat().st_size == 0]  # a module a stage starts importing later, too


@pytest.mark.slow
def test_dvc_repro_of_the_default_workspace_prints_no_warning(tmp_path):
    """``dvc repro`` of a stage of the default workspace (a clone, as a user's) prints no ``WARNING``: none
    is about the user's own change, so none may be there."""
    from workspace import make_workspace, sh

    repo = make_workspace(tmp_path / "ws")
    out = sh(["dvc", "repro", "base"], repo)  # the cheapest stage: it depends on most of the package's folders
    warnings = [ln for ln in (out.stdout + out.stderr).splitlines() if "WARNING" in ln]
    assert "Running stage 'base'" in out.stdout and not warnings, warnings


def test_every_method_is_a_dep_of_a_training_stage():
    """A method that only a non-default option selects (``pdd.method: dm_pdd``, ``pretrain.method: ode_init``, the
    posttrain stage's DiffusionNFT while the stage is off) still reruns its stage when edited: the default DAG's trace
    cannot see it, its recipe's imports (:func:`option_code`) name it — the RL family (``methods/rl/``) and the rewards
    it scores with (``rewards/``) too, and, for the stage off by default, the trainer (:func:`off_by_default_code`)."""
    stages = load_dvc_stages(ROOT)
    for module in sorted([*(PACKAGE / "methods").rglob("*.py"), *(PACKAGE / "rewards").rglob("*.py")]):
        rel = f"{PACKAGE_IN_REPO}/{module.relative_to(PACKAGE).as_posix()}"
        assert any(_covered(rel, stages[name].deps) for name in TRAINING_STAGES if name in stages), rel
    assert {f"{PACKAGE_IN_REPO}/methods/rl/nft.py", f"{PACKAGE_IN_REPO}/rewards/clip.py"} <= option_code("posttrain")
    assert f"{PACKAGE_IN_REPO}/engine/loop.py" in off_by_default_code("posttrain") and not off_by_default_code("pdd")
    assert _covered(f"{PACKAGE_IN_REPO}/engine/loop.py", stages["posttrain"].deps)
    assert {f"{PACKAGE_IN_REPO}/methods/kd.py", "stages/trajectories.py"} <= option_code("pretrain")
    assert f"{PACKAGE_IN_REPO}/sampling/base.py" in option_code("pretrain")  # what the trajectories import, transitively
    assert f"{PACKAGE_IN_REPO}/methods/dm_pdd.py" in option_code("pdd") and "stages/trajectories.py" not in option_code("pdd")
    assert not any(_in_recipe_folder(m) for m in option_code("distill"))


def _listed_modules(deps: list[str]) -> set[str]:
    """The package modules ``deps`` (a stage's dvc.yaml deps) name: its module deps and every module of its folder
    deps."""
    found: set[str] = set()
    for dep in _listed_code(deps):
        if dep.endswith(".py"):
            found.add(dep)
        elif dep.startswith(PACKAGE_IN_REPO):
            found |= _package_modules(PACKAGE / Path(dep).relative_to(PACKAGE_IN_REPO))
    return found


def test_code_a_training_stage_runs_only_at_another_launch_layout_is_its_dep():
    """A user's ``gpus.sp_size: 2`` (``tp_size``, or a stage's own) makes every training stage call its model plugin's
    parallelism hooks (:data:`PARALLEL_HOOKS`), and ``gpus.nproc_per_node: 2`` start its workers through the torchrun
    agent (:data:`LAUNCH_AGENT`), code the default DAG (one process, sp 1, tp 1) never imports — the Wan family's
    Ulysses all-to-all and DTensor plan: each training stage lists it all the same (:func:`layout_code`), so that
    editing it reruns them instead of leaving their artifacts stale (issue 62); a stage that trains nothing does not.
    ``tests/test_sp_stage.py`` traces a stage run at 2 processes, sp 2, and holds its imports to its deps."""
    stages = load_dvc_stages(ROOT)
    unseen = {f"{PACKAGE_IN_REPO}/models/wan/{name}.py" for name in ("sequence_parallel", "tensor_parallel")} | {LAUNCH_AGENT}
    for name in TRAINING_STAGES:
        code = layout_code(name, _listed_modules(stages[name].deps))
        assert unseen <= code, (name, sorted(code))
        assert not uncovered(code, stages[name].deps), (name, uncovered(code, stages[name].deps))
    assert not layout_code("validate", _listed_modules(stages["validate"].deps))


def test_every_registered_family_is_a_dep_of_each_stage_that_loads_families():
    """A stage whose deps cover the family registry lists every registered family's whole package (``family_code``):
    an edit to ``models/cosmos/`` reruns the stages of a user whose base is a Cosmos folder, though the default DAG
    (the tiny Wan) never imports it."""
    stages = load_dvc_stages(ROOT)
    loading = {name: stage for name, stage in stages.items() if _covered(REGISTRY, stage.deps)}
    assert {"teacher", "distill", "validate", "export"} <= set(loading), sorted(loading)
    others = [modules for family, modules in family_packages().items()
              if not family.startswith("wan")]  # the default DAG's base is a tiny Wan 2.1: its trace lists Wan's modules
    assert len(others) >= 2, sorted(family_packages())
    missing = {name: sorted(f for modules in others for f in modules if not _covered(f, stage.deps))
               for name, stage in loading.items()}
    assert not {k: v for k, v in missing.items() if v}, missing
