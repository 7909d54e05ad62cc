"""The registry of the training stages' recipes: one module per (stage, method), ``stages/recipes/<stage>/<method>.py``.

A recipe turns its stage's typed ``params.yaml`` section into the typed run config the stage trains with (its
``recipe(p, run)``; the protocol: :class:`distillery.pipeline.params.recipes.Recipe`). The registry is this folder: a
package per training stage, a module per method in it (a module whose name starts with ``_``, and the package's
``__init__`` — the knobs its recipes share —, are not methods). ``<stage>.method`` in ``params.yaml`` names one; its
choices are the modules there, so adding a method is its library module (``src/distillery/methods/``) and its recipe
module here — ``dvc.yaml`` lists each stage's folder as one dep (a new recipe reruns its stage, and only it) and,
among the stage's code deps, the library module (one line).
``src/distillery`` imports this package only by name, from the workspace it runs in
(:func:`distillery.pipeline.params.recipes.recipe_registry`).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def stages() -> list[str]:
    """The training stages that have recipes: the packages of this folder."""
    return sorted(info.name for info in pkgutil.iter_modules([str(HERE)]) if info.ispkg)


def methods(stage: str) -> list[str]:
    """The methods of training stage ``stage``: its folder's modules (those not starting with ``_``)."""
    return sorted(info.name for info in pkgutil.iter_modules([str(HERE / stage)])
                  if not info.ispkg and not info.name.startswith("_"))


def recipe(stage: str, method: str) -> ModuleType:
    """The recipe module of (``stage``, ``method``), imported by name."""
    return importlib.import_module(f"{__name__}.{stage}.{method}")


def registry() -> dict[str, dict[str, ModuleType]]:
    """``{stage: {method: recipe module}}`` of every training stage."""
    return {stage: {method: recipe(stage, method) for method in methods(stage)} for stage in stages()}
