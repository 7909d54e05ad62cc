"""``params.yaml: base.path`` → the base model folder it names (the base stage's input, and what preflight
sizes before that stage runs)."""

from __future__ import annotations

from pathlib import Path

from distillery.common.errors import UserError


def resolve_base(path: str) -> Path:
    """``base.path`` → a diffusers model folder (``tiny``: the shipped fitted tiny Wan)."""
    if path == "tiny":
        from distillery.tinybase.shipped import shipped_tiny_base

        return shipped_tiny_base()
    p = Path(path).expanduser()
    if not (p / "model_index.json").is_file():
        raise UserError(f"params.yaml: base.path: {p} is not a diffusers model folder (no model_index.json); use 'tiny' or a Wan2.1 folder")
    return p
