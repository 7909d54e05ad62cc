"""What every Wan plugin shares: the config knobs, locating a diffusers Wan folder, building and
reading a ``WanTransformer3DModel`` config (the family's loaders, :mod:`distillery.models.registry`).

``init_from`` names a diffusers model folder (holding ``transformer/`` and ``scheduler/``) or a
transformer folder itself (``config.json`` + safetensors, e.g. an earlier stage's output, with the
scheduler config in a sibling ``scheduler/`` folder). The flow shift is read from that scheduler
config unless given explicitly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from distillery.common.errors import UserError

TRANSFORMER_CLASS = "WanTransformer3DModel"


@dataclass
class WanModelConfig:
    init_from: str  # diffusers model folder (with transformer/) or a transformer folder
    trainable: bool = True  # False: frozen (teacher); no optimizer, no gradients
    random_init: bool = False  # build from config.json only with random weights (benchmarks)
    shift: float | None = None  # flow shift; null: read from the scheduler config beside the weights
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"  # how training σ are drawn
    logit_mean: float = 0.0  # logit-normal location
    logit_std: float = 1.0  # logit-normal scale

    def __post_init__(self) -> None:
        if self.logit_std <= 0:
            raise ValueError("logit_std must be > 0")
        if self.shift is not None and self.shift <= 0:
            raise ValueError("shift must be > 0")


def locate_transformer(init_from: str | Path) -> tuple[Path, Path | None]:
    """Return (transformer folder, scheduler folder or None) for a model or transformer folder."""
    root = Path(init_from).expanduser()
    if not root.exists():
        raise UserError(f"model folder {root} does not exist")
    for candidate in (root / "transformer", root):
        cfg = candidate / "config.json"
        if cfg.is_file():
            try:
                class_name = json.loads(cfg.read_text()).get("_class_name")
            except json.JSONDecodeError as exc:
                raise UserError(f"{cfg}: not valid JSON ({exc.msg})") from None
            if class_name != TRANSFORMER_CLASS:
                raise UserError(f"{cfg}: holds a {class_name}, not a {TRANSFORMER_CLASS}; point init_from at a Wan model")
            for sched in (candidate.parent / "scheduler", root / "scheduler"):
                if (sched / "scheduler_config.json").is_file():
                    return candidate, sched
            return candidate, None
    raise UserError(f"{root}: no transformer/config.json or config.json found; expected a diffusers Wan folder")


def build_transformer(config: dict[str, Any]) -> Any:
    """A ``WanTransformer3DModel`` of the architecture ``config`` (a ``config.json`` mapping; random
    weights, to load a checkpoint into) — its Wan 2.2 layout (``_wan_layout``, :mod:`.experts`) kept in its
    config; two experts (:class:`~distillery.models.wan.experts.WanExperts`) when that layout holds the second
    one's config (``transformer_2``). :class:`UserError` for a config of another class."""
    from diffusers import WanTransformer3DModel

    from distillery.models.wan.experts import LAYOUT_KEY, WanExperts

    if config.get("_class_name") != TRANSFORMER_CLASS:
        raise UserError(f"config of a {config.get('_class_name')}, not a {TRANSFORMER_CLASS}")
    layout = dict(config.get(LAYOUT_KEY) or {})
    second = layout.pop("transformer_2", None)
    module = WanTransformer3DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    if layout:
        module.register_to_config(**{LAYOUT_KEY: layout})
    if second is None:
        return module
    if layout.get("boundary_ratio") is None:
        raise UserError(f"config of two Wan experts without a boundary_ratio ({LAYOUT_KEY})")
    return WanExperts(module, build_transformer(second), layout["boundary_ratio"])


def input_widths(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(latent channels, text embedding width)`` a Wan transformer of ``config`` takes (its
    ``in_channels`` and ``text_dim``; None where the config lacks one)."""
    return config.get("in_channels"), config.get("text_dim")
