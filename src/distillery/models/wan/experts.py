"""Wan 2.2's folder layouts: per-token timesteps (TI2V-5B) and two experts split by timestep (A14B).

A Wan 2.2 A14B pipeline has two ``WanTransformer3DModel`` of one architecture: ``transformer``, the
high-noise expert, denoises timesteps ``t >= boundary_ratio · 1000``; ``transformer_2``, the low-noise
expert, the ones below (diffusers' ``WanPipeline``). :class:`WanExperts` holds both as one module, so the
trainer treats a role of two experts as it treats one transformer: one FSDP2 root over both experts' blocks,
one compute copy, one optimizer, one checkpoint entry (``roles.<role>.transformer``: keys ``transformer.*``
and ``transformer_2.*``). Which expert a sample goes to is its timestep's (:func:`expert_index`); a training
step trains the experts its samples' timesteps fall to (both, when a batch spans the boundary).

Where the layout is read (:func:`read_wan_layout`): a transformer folder's ``config.json`` key
``_wan_layout`` (``{"expand_timesteps": ..., "boundary_ratio": ...}``; diffusers keeps and ignores keys that
start with ``_``), which the plugin writes into every transformer it trains, so an artifact's
``model/transformer`` (its second expert in ``transformer_2/`` inside it) tells it alone; else the
``model_index.json`` of the diffusers folder the transformer is in (:func:`distillery.models.registry.read_layout`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError

LAYOUT_KEY = "_wan_layout"  # the transformer config.json key holding the layout (module doc)
SECOND_EXPERT = "transformer_2"  # the low-noise expert's folder: beside transformer/ (diffusers) or inside it (ours)


@dataclass(frozen=True)
class WanLayout:
    """``expand_timesteps``: one timestep per token (TI2V-5B); ``boundary_ratio`` with ``second_dir``: two
    experts, the second one's folder (A14B)."""

    expand_timesteps: bool = False
    boundary_ratio: float | None = None
    second_dir: Path | None = None

    def record(self) -> dict[str, Any]:
        """What a transformer's config keeps under :data:`LAYOUT_KEY` (empty: Wan 2.1's layout)."""
        out: dict[str, Any] = {}
        if self.expand_timesteps:
            out["expand_timesteps"] = True
        if self.boundary_ratio is not None:
            out["boundary_ratio"] = self.boundary_ratio
        return out


def read_wan_layout(transformer_dir: Path) -> WanLayout:
    """The layout of the transformer in ``transformer_dir`` (module doc); a one-line :class:`UserError` when
    its second expert is missing."""
    from distillery.models.registry import read_layout

    config = json.loads((transformer_dir / "config.json").read_text())
    own = config.get(LAYOUT_KEY) if isinstance(config, dict) else None
    if isinstance(own, dict):
        ratio = own.get("boundary_ratio")
        second = transformer_dir / SECOND_EXPERT
        if ratio is not None and not (second / "config.json").is_file():
            raise UserError(f"{transformer_dir}: a two-expert transformer (boundary_ratio {ratio}) without its second "
                            f"expert {second}/config.json")
        return WanLayout(bool(own.get("expand_timesteps", False)), float(ratio) if ratio is not None else None,
                         second if ratio is not None else None)
    if (transformer_dir.parent / "model_index.json").is_file():
        folder = read_layout(transformer_dir.parent)
        second = transformer_dir.parent / SECOND_EXPERT if folder.experts == 2 else None
        return WanLayout(folder.expand_timesteps, folder.boundary_ratio, second)
    return WanLayout()


def lay_out_given_model(folder: Path, model_dir: Path, copy: Callable[[Path, Path], Any]) -> None:
    """Lay the transformer of ``folder`` (a diffusers Wan folder, or one ``distillery import-weights`` wrote) out in
    ``model_dir`` as a trained artifact holds it (module doc): ``transformer/`` (copied by ``copy(source, target)``),
    Wan 2.2 A14B's second expert inside it (``transformer/transformer_2/``) and the folder's layout (``boundary_ratio``,
    ``expand_timesteps``) in ``transformer/config.json`` under :data:`LAYOUT_KEY` — so the artifact alone tells its
    layout, as one a stage trained does: a given two-expert teacher keeps both experts and its boundary, a given
    TI2V-5B its per-token timesteps."""
    from distillery.models.registry import read_layout

    folder, model_dir = Path(folder), Path(model_dir)
    copy(folder / "transformer", model_dir / "transformer")
    if not (folder / "model_index.json").is_file():
        return  # an imported Wan 2.1 checkpoint: one transformer, Wan 2.1's layout
    found = read_layout(folder)  # one line for a folder whose experts do not add up
    layout = WanLayout(found.expand_timesteps, found.boundary_ratio)
    if found.experts == 2:
        copy(folder / SECOND_EXPERT, model_dir / "transformer" / SECOND_EXPERT)
    if layout.record():
        config_file = model_dir / "transformer" / "config.json"
        config = json.loads(config_file.read_text())
        config[LAYOUT_KEY] = layout.record()
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def expert_index(timesteps: torch.Tensor, boundary_timestep: float) -> torch.Tensor:
    """Per sample, the expert its timesteps belong to: 0 (``transformer``, high noise) for ``t >= boundary``,
    1 (``transformer_2``) below — ``long [B]``. Per-frame timesteps ``[B, T]`` must all fall to one expert
    (``ValueError`` otherwise: no expert denoises a sample that straddles the boundary)."""
    high = timesteps >= boundary_timestep
    if timesteps.ndim == 2:
        if bool((high.any(dim=1) & ~high.all(dim=1)).any()):
            raise ValueError(f"per-frame timesteps straddle the experts' boundary t = {boundary_timestep:g}")
        high = high[:, 0]
    return (~high).long()


class WanExperts(torch.nn.Module):
    """The two experts of a Wan 2.2 A14B folder as one module (module doc). ``forward(expert, **kwargs)`` runs
    expert ``expert`` (0: ``transformer``, 1: ``transformer_2``) on ``kwargs`` — through this module's own
    ``forward``, so FSDP2's root hooks over both gather what the expert needs."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_ratio: float) -> None:
        super().__init__()
        self.transformer = high
        self.transformer_2 = low
        self.boundary_ratio = float(boundary_ratio)
        self._keep_in_fp32_modules = getattr(high, "_keep_in_fp32_modules", None)

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    @property
    def config(self) -> Any:
        """The high-noise expert's config (both share the architecture)."""
        return self.transformer.config

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """Both experts' blocks, the high-noise expert's first (what FSDP2 shards one by one)."""
        return [*self.transformer.blocks, *self.transformer_2.blocks]

    def forward(self, expert: int, **kwargs: Any) -> Any:
        return self.experts[expert](**kwargs)

    def enable_gradient_checkpointing(self) -> None:
        for module in self.experts:
            module.enable_gradient_checkpointing()

    def set_attention_backend(self, name: str) -> None:
        for module in self.experts:
            module.set_attention_backend(name)

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> None:
        """``path``: the high-noise expert (its config carrying the layout), ``path/transformer_2``: the other."""
        self.transformer.save_pretrained(path, **kwargs)
        self.transformer_2.save_pretrained(Path(path) / SECOND_EXPERT, **kwargs)
