"""A video VAE's latent geometry, by its class: ``(latent channels, frames per latent after the first, pixels per
latent side)`` read from its ``config.json`` as the family's diffusers pipeline reads them — shared by the model
registry (:func:`distillery.models.registry.vae_geometry`: a folder's latent shape, nothing loaded) and the data layer
(:mod:`distillery.data.vae_codecs`: a loaded VAE's).

- ``AutoencoderKLWan`` (Wan 2.1 / 2.2, Cosmos Predict 2.5): ``z_dim``, ``scale_factor_temporal`` /
  ``scale_factor_spatial`` — a config without them: ``2 ** sum(temperal_downsample)`` and ``2 ** len(…)``, as
  ``WanPipeline`` computes them;
- ``AutoencoderKLHunyuanVideo15`` (HunyuanVideo 1.5): ``latent_channels``, ``temporal_compression_ratio`` /
  ``spatial_compression_ratio`` (as ``HunyuanVideo15Pipeline``).

Which class a folder's VAE is: ``model_index.json``'s ``vae`` entry (``["diffusers", "<class>"]``), else the
``_class_name`` of ``vae/config.json`` (a folder naming neither: Wan's, as a hand-made Wan folder may). A class no row
knows is one line (:class:`UserError`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError

WAN = "AutoencoderKLWan"
HUNYUAN15 = "AutoencoderKLHunyuanVideo15"


def _wan(config: dict[str, Any]) -> tuple[int, int, int]:
    down = [bool(d) for d in config.get("temperal_downsample", [])]
    return (int(config["z_dim"]), int(config.get("scale_factor_temporal") or 2 ** sum(down)),
            int(config.get("scale_factor_spatial") or 2 ** len(down)))


def _hunyuan15(config: dict[str, Any]) -> tuple[int, int, int]:
    return (int(config.get("latent_channels", 32)), int(config.get("temporal_compression_ratio", 4)),
            int(config.get("spatial_compression_ratio", 16)))


#: VAE class → its geometry from a ``config.json`` mapping (module doc)
GEOMETRY: dict[str, Callable[[dict[str, Any]], tuple[int, int, int]]] = {WAN: _wan, HUNYUAN15: _hunyuan15}


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: no readable VAE config ({type(exc).__name__}); is the base a diffusers model folder?") from None


def vae_class(folder: str | Path) -> str:
    """The VAE's class name of the diffusers model folder ``folder`` (module doc)."""
    root = Path(folder).expanduser()
    index = root / "model_index.json"
    if index.is_file():
        entry = _read(index).get("vae")
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            return entry[1]
    config = _read(root / "vae" / "config.json")
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else WAN


def geometry(class_name: str, config: dict[str, Any], where: str) -> tuple[int, int, int]:
    """``(latent channels, temporal factor, spatial factor)`` of a ``class_name`` VAE of ``config``; one
    :class:`UserError` line (naming ``where``) for a class no row knows or a config without its sizes."""
    read = GEOMETRY.get(class_name)
    if read is None:
        raise UserError(f"{where}: a {class_name} VAE; distillery reads the latents of {', '.join(GEOMETRY)}")
    try:
        return read(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}: no readable {class_name} geometry ({type(exc).__name__}: {exc})") from None


def vae_geometry(folder: str | Path) -> tuple[int, int, int]:
    """The geometry of the VAE of model folder ``folder`` (its ``vae/config.json``, nothing loaded; module doc)."""
    path = Path(folder).expanduser() / "vae" / "config.json"
    return geometry(vae_class(folder), _read(path), str(path))
