"""``assert_direct_export_is_save_pretrained``: the fast export path's folder is, byte for byte, the one diffusers'
``save_pretrained`` writes of the rebuilt transformer (the path it replaces) — used by the tests that train a role."""

from __future__ import annotations

import json
from pathlib import Path


def save_pretrained_folder(checkpoint: Path, role: str, out: Path, ema: str | None = None) -> Path:
    """``out/transformer`` as export wrote it before the fast path: rebuild, load (EMA shadow), ``save_pretrained``,
    the head bank beside."""
    from distillery.export.weights import export_head_bank, load_role_weights
    from distillery.models.registry import family_of_class

    config = json.loads((checkpoint / "roles" / role / "config.json").read_text())
    loaders = family_of_class(config["_class_name"], "test").loaders()
    module = loaders.build_transformer(config)
    load_role_weights(checkpoint, role, module, ema)
    folder = out / "transformer"
    module.save_pretrained(folder, safe_serialization=True)
    export_head_bank(checkpoint, role, module, folder, loaders, ema)
    return folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_direct_export_is_save_pretrained(checkpoint: Path, role: str, tmp: Path, ema: str | None = None,
                                            direct: bool = True) -> None:
    """``export_weights`` writes every file of ``save_pretrained``'s folder with the same bytes; ``direct``: it took
    the path without diffusers (``direct_config`` vouches for the role's config); the folder loads in diffusers."""
    from diffusers import WanTransformer3DModel

    from distillery.export.direct_weights import direct_config
    from distillery.export.weights import export_weights

    config = json.loads((checkpoint / "roles" / role / "config.json").read_text())
    assert (direct_config(config) is not None) == direct
    new = export_weights(checkpoint, role, tmp / "new", ema=ema)
    old = save_pretrained_folder(checkpoint, role, tmp / "old", ema)
    a, b = folder_bytes(new), folder_bytes(old)
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name] == b[name], f"{name} differs from save_pretrained's"
    if direct:
        WanTransformer3DModel.from_pretrained(new)
