"""The workspace's stage layer, found by name: its stage adapters and its recipe registry.

A pipeline workspace holds ``dvc.yaml``, ``params.yaml`` and the top-level ``stages/`` package: one
adapter module per ``dvc.yaml`` stage and, in ``stages/recipes/``, the training stages' recipes —
one module per (stage, method), ``stages/recipes/<stage>/<method>.py``, listed by the one registry,
``stages/recipes/__init__.py``. Nothing of ``src/distillery`` imports that package: this module
imports it by name from the workspace (:func:`workspace_module`), the one way in
(``tests/test_layers.py``).

A recipe module (the :class:`Recipe` protocol) declares ``Params`` — its stage's section of
``params.yaml`` (:class:`~distillery.pipeline.params.schema.TrainingStageParams`' subclass for the
stage) with the method's own knobs — ``inputs(p)`` (role → the stage whose artifact it starts from)
and ``recipe(p, run)``: the typed run config; optionally ``prepare(p, params)`` (a data set it makes
before training, e.g. the teacher's ODE trajectories), ``given_contract(p)`` (what a given model
standing in for its student samples with), ``reads(p)`` (what else the run reads: the base, a
reward model's folder — lineage inputs and parts of the resume key) and ``STUDENT``, the kind of
student it trains: ``causal`` or ``bidirectional`` (absent: bidirectional; what preflight holds a
sparse student's tiles to, :mod:`~distillery.pipeline.launch.sparse_preflight`). :func:`recipe_params` gives
:func:`~distillery.pipeline.params.loading.validate_params` each stage's choices of ``method``: the
registry's, so a new method is its library module, its recipe module and the library module's line
among its stage's ``dvc.yaml`` code deps.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from distillery.common.errors import UserError

REGISTRY_MODULE = "stages.recipes"  # the workspace's recipe registry: registry() -> {stage: {method: module}}


class Recipe(Protocol):
    """One (stage, method): a module ``stages/recipes/<stage>/<method>.py`` (module doc; the types it
    names, ``TrainingStageParams``, ``RunInputs``, ``RunConfig``, live above and below this module:
    here they are ``Any``)."""

    Params: type  # its stage's TrainingStageParams subclass, with the method's own knobs

    def inputs(self, p: Any) -> dict[str, str]:
        """Role → the stage whose artifact (``artifacts/<stage>/model``) it starts from, in the run
        config's order."""

    def recipe(self, p: Any, run: Any) -> Any:
        """The typed run config (a ``RunConfig``) of the stage for ``p`` (its section, this recipe's
        ``Params``) and ``run`` (the stage's ``RunInputs``)."""


def prepared_data(recipe: Recipe, p: Any, params: Any) -> Any:
    """The data set ``recipe`` makes before training (its ``prepare``), None when it trains on the
    stage's data."""
    prepare = getattr(recipe, "prepare", None)
    return None if prepare is None else prepare(p, params)


def given_contract(recipe: Recipe, p: Any) -> dict[str, Any]:
    """What a given model standing in for ``recipe``'s student samples with beyond the many-step Euler
    defaults (its ``given_contract``: a causal student's ``chunk_size``), {} for a recipe without
    one."""
    contract = getattr(recipe, "given_contract", None)
    return {} if contract is None else dict(contract(p))


def recipe_reads(recipe: Recipe, p: Any) -> dict[str, Path]:
    """What ``recipe``'s run reads beside its roles' inits and its data (its ``reads``: lineage name → an artifact
    folder, or a folder outside ``artifacts/`` such as a reward model's), {} for a recipe without one."""
    reads = getattr(recipe, "reads", None)
    return {} if reads is None else {name: Path(path) for name, path in reads(p).items()}


def student_kind(recipe: Recipe) -> str:
    """The kind of model ``recipe`` trains (:data:`distillery.models.registry.STUDENT_KINDS`): its ``STUDENT`` (a
    pretrain or PDD recipe's), else its ``PRETRAIN_STUDENT`` (a distill recipe trains the kind it starts from), else
    ``bidirectional``. Its frozen teacher and critic are bidirectional: every family builds those."""
    return getattr(recipe, "STUDENT", None) or getattr(recipe, "PRETRAIN_STUDENT", None) or "bidirectional"


def _on_path(workspace: Path) -> str:
    root = str(Path(workspace).resolve())
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)
    return root


def find_module(module: str, workspace: Path, what: str) -> str:
    """Put ``workspace`` first on ``sys.path`` and check that ``module`` of its ``stages/`` package is
    there (found, not run: only the package's ``__init__`` executes); return its name. None there
    (run outside a workspace) is one line naming ``what`` needed it (:class:`UserError`)."""
    root = _on_path(workspace)
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no package ``stages`` at all
        found = False
    if not found:
        raise UserError(f"{what}: no module {module} in {root} (the stages/ package beside dvc.yaml and params.yaml): "
                        "run it in the pipeline workspace")
    return module


def workspace_module(module: str, workspace: Path, what: str) -> ModuleType:
    """The module ``module`` of ``workspace``'s ``stages/`` package, imported by name
    (:func:`find_module`)."""
    return importlib.import_module(find_module(module, workspace, what))


def recipe_registry(workspace: Path = Path(".")) -> Mapping[str, Mapping[str, Recipe]]:
    """Every training stage's recipes, ``{stage: {method: module}}``, from ``workspace``'s registry
    (each recipe module imported: they import no more than their knobs' declarations until a recipe
    runs)."""
    return workspace_module(REGISTRY_MODULE, workspace, "params.yaml's recipes").registry()


def recipe_params(registry: Mapping[str, Mapping[str, Recipe]] | None = None) -> dict[str, dict[str, type]]:
    """``{stage: {method: Params}}`` of ``registry`` (None: the current workspace's): what
    :func:`~distillery.pipeline.params.loading.validate_params` reads a training section with."""
    found = recipe_registry() if registry is None else registry
    return {stage: {method: module.Params for method, module in methods.items()} for stage, methods in found.items()}


def chain_notes(typed: Any, registry: Mapping[str, Mapping[str, Recipe]]) -> list[str]:
    """One line per stage chain that runs but no recipe describes (the params ``typed``, the ``registry``'s recipes): a
    distill recipe whose student starts from a pretrain student of another kind than its recipe's — each distill
    recipe's ``PRETRAIN_STUDENT``, each pretrain recipe's ``STUDENT`` (``causal`` or ``bidirectional``): DMD2 from the
    causal DFSFT student trains those causal weights as a bidirectional student. Empty for the recipes' chains; a given
    student (``pretrain.source: given``) is the user's to say."""
    pretrain = registry["pretrain"]
    wanted = getattr(registry["distill"][typed.distill.method], "PRETRAIN_STUDENT", None)
    kind = getattr(pretrain[typed.pretrain.method], "STUDENT", None)
    if wanted is None or kind is None or kind == wanted or typed.pretrain.source != "train":
        return []
    fix = next((method for method, recipe in pretrain.items() if getattr(recipe, "STUDENT", None) == wanted), None)
    return [f"distill.method: {typed.distill.method} starts from pretrain.method: {typed.pretrain.method} (a {kind} "
            f"student), not its recipe's init: add -S pretrain.method={fix} (docs/training.md)"]
