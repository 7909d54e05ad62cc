"""Reading ``params.yaml`` (the one file a user edits): bounded, parsed, validated whole, handed out
typed.

:meth:`Params.load` reads the file within the input bounds of :mod:`distillery.config.limits` (at
most 1 MiB, strict UTF-8, bounded nesting, strings and integers, no duplicate keys, no alias bombs)
and as DVC reads it (:mod:`distillery.pipeline.params.file`: a scalar YAML 1.1 and DVC's YAML 1.2
read differently is refused), then converts every section to the typed schema of
:mod:`distillery.pipeline.params.schema` (:func:`distillery.pipeline.params.loading.validate_params`) before any
stage does work. Every problem is a one-line
:class:`UserError` that names the key as the user wrote it (``params.yaml: teacher.steps: -3: must
be ≥ 1``).

A training section is read by the recipe its ``method`` names (the workspace's registry,
:mod:`distillery.pipeline.params.recipes`): ``get("distill")`` is that recipe's ``Params`` (a
:class:`~distillery.pipeline.params.schema.DistillParams` with the method's own knobs),
``get("distill.learning_rate")`` a float; :attr:`StageParams.typed` is the same values by attribute
(``typed.distill.learning_rate``), held to the stage's ``dvc.yaml`` keys. What a stage records in
its lineage is the values as the file wrote them (:meth:`Params.subset`), as DVC records them in
``dvc.lock``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.config.limits import show_path
from distillery.pipeline.params.file import read_params_file
from distillery.pipeline.params.loading import as_written, to_plain, validate_params
from distillery.pipeline.params.recipes import Recipe, recipe_params, recipe_registry
from distillery.pipeline.params.schema import ParamsSchema


class Params:
    """The validated params.yaml; ``get("pretrain.steps")`` returns its typed value or raises a
    UserError.

    ``typed`` is the whole file as :class:`ParamsSchema` (absent keys at the schema's defaults);
    ``data`` the nested mapping of every schema key with the values as written in the file (absent
    keys at the defaults).
    """

    def __init__(self, data: dict[str, Any], path: Path, typed: ParamsSchema,
                 recipes: Mapping[str, Mapping[str, Recipe]]) -> None:
        self.data = data
        self.path = path
        self.typed = typed
        self.recipes = recipes

    @classmethod
    def load(cls, path: str | Path = "params.yaml", recipes: Mapping[str, Mapping[str, Recipe]] | None = None) -> "Params":
        """Read, bound-check and validate the whole file (see the module doc); ``recipes``: the
        training stages' (None: the registry of the workspace holding ``path``)."""
        p = Path(path)
        source = show_path(p)
        data = read_params_file(
            p, source, "not found; run stages from the pipeline folder (where params.yaml and dvc.yaml are)"
        )
        if recipes is None:
            recipes = recipe_registry(p.parent)
        typed = validate_params(data, source, recipe_params(recipes))
        return cls(as_written(data, to_plain(typed)), p, typed, recipes)

    def recipe(self, stage: str) -> Recipe:
        """The recipe training stage ``stage``'s ``method`` names
        (``stages/recipes/<stage>/<method>.py``)."""
        return self.recipes[stage][getattr(self.typed, stage).method]

    def get(self, key: str) -> Any:
        """The typed value of the dotted ``key``: a section's dataclass, or a value."""
        node: Any = self.typed
        for i, part in enumerate(key.split(".")):
            names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else None
            if names is None or part not in names:
                self._missing(key, i, names)
            node = getattr(node, part)
        return node

    def written(self, key: str) -> Any:
        """The value of the dotted ``key`` as the file wrote it (a section: a mapping)."""
        node: Any = self.data
        for i, part in enumerate(key.split(".")):
            if not isinstance(node, dict) or part not in node:
                self._missing(key, i, list(node) if isinstance(node, dict) else None)
            node = node[part]
        return node

    def _missing(self, key: str, depth: int, valid: list[str] | None) -> None:
        where = ".".join(key.split(".")[:depth]) or "the top level"
        raise UserError(f"{self.path}: {key}: missing (valid keys under {where}: {', '.join(valid) if valid is not None else '(not a section)'})")

    def subset(self, keys: list[str]) -> dict[str, Any]:
        """The named keys and their values as written (what a stage read: recorded in its lineage).
        """
        return {k: self.written(k) for k in keys}


class UndeclaredParam(LookupError):
    """A stage read a params.yaml key that its dvc.yaml ``params:`` list does not name (a code bug:
    DVC would not rerun the stage when that key changes)."""


def undeclared(stage: str, key: str, declared: list[str]) -> UndeclaredParam:
    return UndeclaredParam(f"stage {stage} read params.yaml key {key!r}, which its dvc.yaml params "
                           f"({', '.join(declared)}) do not list; add it to dvc.yaml")


def covers(declared: list[str], key: str) -> bool:
    """True when ``key`` is one of ``declared`` or lies inside one (``teacher`` covers
    ``teacher.steps``)."""
    return any(key == d or key.startswith(d + ".") for d in declared)


class StageParams:
    """What one stage may read of params.yaml: exactly the keys its ``dvc.yaml`` ``params:`` list
    names (:func:`distillery.pipeline.dvcfile.stage_params`), and what it records in its lineage.

    ``get`` of a key outside that list raises :class:`UndeclaredParam`, so a stage cannot depend on
    a value whose change DVC would not notice.
    """

    def __init__(self, params: Params, stage: str, declared: list[str]) -> None:
        self.params = params
        self.stage = stage
        self.declared = list(declared)

    @property
    def path(self) -> Path:
        return self.params.path

    def get(self, key: str) -> Any:
        """The typed value of ``key`` (:meth:`Params.get`), which the stage's dvc.yaml ``params:`` must
        cover."""
        if not covers(self.declared, key):
            raise undeclared(self.stage, key, self.declared)
        return self.params.get(key)

    def recipe(self) -> Recipe:
        """The recipe of this training stage: the module its ``method`` names (:meth:`Params.recipe`).
        """
        return self.params.recipe(self.stage)

    @property
    def typed(self) -> "ParamsView":
        """The typed params by attribute (``typed.distill.learning_rate``), each key held to the
        declared list."""
        return ParamsView(self.params.typed, self.declared, self.stage)

    def recorded(self) -> dict[str, Any]:
        """``{declared key: value}`` in dvc.yaml's order: the ``params`` of the stage's lineage."""
        return self.params.subset(self.declared)


class ParamsView:
    """Typed params read by attribute, a key at a time held to a stage's declared keys
    (:class:`StageParams`): a section the declared list covers whole is handed out as it is (its
    dataclass); one it covers in part is a view of it; a key outside the list is
    :class:`UndeclaredParam`."""

    def __init__(self, node: Any, declared: list[str], stage: str, prefix: str = "") -> None:
        self._node, self._declared, self._stage, self._prefix = node, declared, stage, prefix

    def __getattr__(self, name: str) -> Any:
        key = f"{self._prefix}.{name}" if self._prefix else name
        value = getattr(self._node, name)
        if covers(self._declared, key):
            return value
        if dataclasses.is_dataclass(value) and any(d.startswith(key + ".") for d in self._declared):
            return ParamsView(value, self._declared, self._stage, key)
        raise undeclared(self._stage, key, self._declared)
