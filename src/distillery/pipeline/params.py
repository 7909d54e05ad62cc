"""Reading ``params.yaml`` (the one file a user edits) with one-line errors for missing keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from distillery.errors import UserError


class Params:
    """The parsed params.yaml; ``get("pretrain.steps")`` returns a value or raises a UserError."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        self.data = data
        self.path = path

    @classmethod
    def load(cls, path: str | Path = "params.yaml") -> "Params":
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{p}: not found; run stages from the pipeline folder (where params.yaml and dvc.yaml are)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"{p}: invalid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise UserError(f"{p}: the top level must be a mapping")
        return cls(data, p)

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
