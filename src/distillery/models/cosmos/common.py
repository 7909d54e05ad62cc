"""What every Cosmos Predict 2.5 plugin shares: the config knobs, locating a diffusers Cosmos folder, building and
reading a ``CosmosTransformer3DModel`` config (the family's loaders, :mod:`distillery.models.registry`).

A Cosmos Predict 2.5 folder is diffusers' ``Cosmos2_5_PredictBasePipeline`` layout: ``transformer/``
(``CosmosTransformer3DModel``), ``vae/`` (Wan 2.1's ``AutoencoderKLWan``), ``text_encoder/`` (Qwen2.5-VL, every hidden
layer normalised and concatenated: the transformer projects that width down, ``crossattn_proj``), ``tokenizer/`` (its
chat template) and ``scheduler/`` (``UniPCMultistepScheduler`` with flow sigmas and ``flow_shift``; ours writes a
``FlowMatchEulerDiscreteScheduler`` with the same shift). How its conventions map onto ours: :mod:`.bidirectional`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.models.base import TransformerModelConfig, locate_transformer_folder

TRANSFORMER_CLASS = "CosmosTransformer3DModel"
#: Channels the transformer's input carries besides the latent: the condition mask (1: which latent frames are given).
CONDITION_MASK_CHANNELS = 1


@dataclass
class CosmosModelConfig(TransformerModelConfig):
    """A Cosmos plugin's knobs (:class:`~distillery.models.base.TransformerModelConfig`'s)."""


def locate_transformer(init_from: str | Path) -> tuple[Path, Path | None]:
    """``(transformer folder, scheduler folder or None)`` of a Cosmos model folder or a transformer folder (its
    scheduler in a sibling ``scheduler/``); :class:`UserError` when it holds no ``CosmosTransformer3DModel``."""
    return locate_transformer_folder(init_from, TRANSFORMER_CLASS, "Cosmos")


def build_transformer(config: dict[str, Any]) -> Any:
    """A ``CosmosTransformer3DModel`` of the architecture ``config`` (a ``config.json`` mapping; random weights, to load
    a checkpoint into). :class:`UserError` for a config of another class."""
    from diffusers import CosmosTransformer3DModel

    if config.get("_class_name") != TRANSFORMER_CLASS:
        raise UserError(f"config of a {config.get('_class_name')}, not a {TRANSFORMER_CLASS}")
    return CosmosTransformer3DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def latent_channels(config: dict[str, Any]) -> int:
    """The latent's channels (the VAE's ``z_dim``): the transformer's ``out_channels``; its ``in_channels`` is one more,
    the condition mask the pipeline concatenates (``Cosmos2_5_PredictBasePipeline``: ``in_channels − 1``)."""
    out = config.get("out_channels")
    return int(out if out is not None else int(config.get("in_channels", 17)) - CONDITION_MASK_CHANNELS)


def text_width(config: dict[str, Any]) -> int:
    """The width of the text embeddings the transformer takes: the text encoder's concatenated hidden layers
    (``crossattn_proj_in_channels``) where it projects them (``use_crossattn_projection``), else ``text_embed_dim``."""
    if config.get("use_crossattn_projection"):
        return int(config.get("crossattn_proj_in_channels", 1024))
    return int(config.get("text_embed_dim", 1024))


def input_widths(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(latent channels, text embedding width)`` a Cosmos transformer of ``config`` takes."""
    return latent_channels(config), text_width(config)


def image_conditioning(config: dict[str, Any]) -> None:
    """None: distillery trains Cosmos Predict 2.5 as text-to-world (its image/video-to-world modes condition through
    the same transformer's condition mask; the latents stage makes no such set for it)."""
    in_ch = config.get("in_channels")
    if in_ch is not None and int(in_ch) != latent_channels(config) + CONDITION_MASK_CHANNELS:
        raise UserError(f"a {TRANSFORMER_CLASS} config with in_channels {in_ch}, out_channels {config.get('out_channels')}: "
                        f"not Cosmos Predict 2.5's layout (in_channels = out_channels + {CONDITION_MASK_CHANNELS}, the "
                        "condition mask)")
    return None
