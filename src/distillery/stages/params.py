"""Reading ``params.yaml`` (the one file a user edits): bounded, parsed, validated whole.

:meth:`Params.load` reads the file within the input bounds of :mod:`distillery.config.limits` (at
most 1 MiB, strict UTF-8, bounded nesting, strings and integers, no duplicate keys, no alias bombs)
and as DVC reads it (:mod:`distillery.stages.params_file`: a scalar YAML 1.1 and DVC's YAML 1.2
read differently is refused), then checks every section against the typed schema of
:mod:`distillery.stages.params_schema` before any stage does work. Every problem is a one-line :class:`UserError` that names the key as the user
wrote it (``params.yaml: teacher.steps: -3: must be ≥ 1``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.config.limits import show_path
from distillery.stages.params_file import read_params_file
from distillery.stages.params_schema import ParamsSchema, to_plain, validate_params


class Params:
    """The validated params.yaml; ``get("pretrain.steps")`` returns a value or raises a UserError.

    ``data`` is the nested mapping of every schema key: the values as written in the file, absent
    keys filled with the schema's defaults. ``typed`` is the same as :class:`ParamsSchema`.
    """

    def __init__(self, data: dict[str, Any], path: Path, typed: ParamsSchema | None = None) -> None:
        self.data = data
        self.path = path
        self.typed = typed

    @classmethod
    def load(cls, path: str | Path = "params.yaml") -> "Params":
        """Read, bound-check and validate the whole file (see the module doc)."""
        p = Path(path)
        source = show_path(p)
        data = read_params_file(
            p, source, "not found; run stages from the pipeline folder (where params.yaml and dvc.yaml are)"
        )
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UserError(f"{source}: the top level must be a mapping")
        typed = validate_params(data, source)
        return cls(to_plain(typed), p, typed)

    def get(self, key: str) -> Any:
        node: Any = self.data
        for i, part in enumerate(key.split(".")):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(key.split(".")[:i]) or "the top level"
                valid = ", ".join(node) if isinstance(node, dict) else "(not a section)"
                raise UserError(f"{self.path}: {key}: missing (valid keys under {where}: {valid})")
            node = node[part]
        return node

    def subset(self, keys: list[str]) -> dict[str, Any]:
        """The named keys and their values (what a stage read: recorded in its lineage)."""
        return {k: self.get(k) for k in keys}


class UndeclaredParam(LookupError):
    """A stage read a params.yaml key that its dvc.yaml ``params:`` list does not name (a code bug:
    DVC would not rerun the stage when that key changes)."""


def covers(declared: list[str], key: str) -> bool:
    """True when ``key`` is one of ``declared`` or lies inside one (``teacher`` covers ``teacher.steps``)."""
    return any(key == d or key.startswith(d + ".") for d in declared)


class StageParams:
    """What one stage may read of params.yaml: exactly the keys its ``dvc.yaml`` ``params:`` list
    names (:func:`distillery.stages.dvcfile.stage_params`), and what it records in its lineage.

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
        if not covers(self.declared, key):
            raise UndeclaredParam(f"stage {self.stage} read params.yaml key {key!r}, which its dvc.yaml params "
                                  f"({', '.join(self.declared)}) do not list; add it to dvc.yaml")
        return self.params.get(key)

    def recorded(self) -> dict[str, Any]:
        """``{declared key: value}`` in dvc.yaml's order: the ``params`` of the stage's lineage."""
        return self.params.subset(self.declared)
