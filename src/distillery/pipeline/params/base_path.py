"""``params.yaml: base.path`` → the base model folder it names (the base stage's input, and what preflight
sizes before that stage runs)."""

from __future__ import annotations

from pathlib import Path

from distillery.common.errors import UserError


def resolve_base(path: str) -> Path:
    """``base.path`` → a diffusers model folder (the default, ``src/distillery/assets/tiny-wan``: the fitted tiny Wan the
    package ships — the clone's own folder under an editable install, as the README's is)."""
    from distillery.pipeline.params.schema import SHIPPED_TINY_BASE, given_path

    if given_path(path, SHIPPED_TINY_BASE) is None:  # the package's own copy (a workspace need not hold src/)
        from distillery.tinybase.shipped import shipped_tiny_base

        return shipped_tiny_base()
    p = Path(path).expanduser()
    if not (p / "model_index.json").is_file():
        raise UserError(f"params.yaml: base.path: {p} is not a diffusers model folder (no model_index.json); use "
                        f"{SHIPPED_TINY_BASE} (the shipped tiny Wan) or a Wan2.1 folder")
    return p
