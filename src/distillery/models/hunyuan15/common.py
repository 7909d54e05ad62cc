"""What every HunyuanVideo 1.5 plugin shares: the config knobs, locating a diffusers HunyuanVideo 1.5 folder, building
and reading a ``HunyuanVideo15Transformer3DModel`` config (the family's loaders, :mod:`distillery.models.registry`).

A HunyuanVideo 1.5 folder is diffusers' ``HunyuanVideo15Pipeline`` layout: ``transformer/``
(``HunyuanVideo15Transformer3DModel``), ``vae/`` (``AutoencoderKLHunyuanVideo15``), ``text_encoder/`` + ``tokenizer/``
(Qwen2.5-VL's language model), ``text_encoder_2/`` + ``tokenizer_2/`` (ByT5, the glyph stream), ``scheduler/``
(``FlowMatchEulerDiscreteScheduler`` with its ``shift``) and ``guider/`` (``ClassifierFreeGuidance``). How its
conventions map onto ours: :mod:`.bidirectional`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.models.base import TransformerModelConfig, locate_transformer_folder
from distillery.models.registry import HUNYUAN15_CAUSAL_REFUSAL

TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
#: Channels the transformer's input carries besides the noisy latent: the condition latent (a given first frame's,
#: zeros for text-to-video) and its 1-channel mask — ``in_channels = 2 · latent + 1`` (65 for the released 32).
MASK_CHANNELS = 1
#: Image tokens ``HunyuanVideo15Pipeline`` feeds the transformer (zeros for text-to-video: its
#: ``vision_num_semantic_tokens``, SigLIP's 27 × 27; a test reads it from a stock pipeline).
IMAGE_TOKENS = 729
CAUSAL_REFUSAL = HUNYUAN15_CAUSAL_REFUSAL  # why no causal student is built (the family's row in the registry says it)


@dataclass
class HunyuanVideo15ModelConfig(TransformerModelConfig):
    """A HunyuanVideo 1.5 plugin's knobs (:class:`~distillery.models.base.TransformerModelConfig`'s)."""


def locate_transformer(init_from: str | Path) -> tuple[Path, Path | None]:
    """``(transformer folder, scheduler folder or None)`` of a HunyuanVideo 1.5 model folder or a transformer folder
    (its scheduler in a sibling ``scheduler/``); :class:`UserError` when it holds no ``HunyuanVideo15Transformer3DModel``."""
    return locate_transformer_folder(init_from, TRANSFORMER_CLASS, "HunyuanVideo 1.5")


def build_transformer(config: dict[str, Any]) -> Any:
    """A ``HunyuanVideo15Transformer3DModel`` of the architecture ``config`` (a ``config.json`` mapping; random weights,
    to load a checkpoint into). :class:`UserError` for a config of another class."""
    from diffusers import HunyuanVideo15Transformer3DModel

    if config.get("_class_name") != TRANSFORMER_CLASS:
        raise UserError(f"config of a {config.get('_class_name')}, not a {TRANSFORMER_CLASS}")
    return HunyuanVideo15Transformer3DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def latent_channels(config: dict[str, Any]) -> int:
    """The latent's channels (the VAE's ``latent_channels``): the transformer's ``out_channels``."""
    return int(config.get("out_channels") or 32)


def stream_widths(config: dict[str, Any]) -> tuple[int, int]:
    """The prompt streams' widths the transformer takes: Qwen2.5-VL's (``text_embed_dim``) and ByT5's (``text_embed_2_dim``)."""
    return int(config.get("text_embed_dim", 3584)), int(config.get("text_embed_2_dim", 1472))


def input_widths(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(latent channels, prompt width)`` a HunyuanVideo 1.5 transformer of ``config`` takes: the two prompt streams
    side by side (:mod:`distillery.components.prompt_streams`)."""
    return latent_channels(config), sum(stream_widths(config))


def image_conditioning(config: dict[str, Any]) -> None:
    """None: distillery trains HunyuanVideo 1.5 as text-to-video (its image-to-video mode conditions through the same
    transformer's condition latent, mask and image tokens: ``HunyuanVideo15ImageToVideoPipeline``, not built here). A
    config of another layout (``in_channels`` ≠ ``2 · out_channels + 1``) is one line."""
    in_ch = config.get("in_channels")
    if in_ch is not None and int(in_ch) != 2 * latent_channels(config) + MASK_CHANNELS:
        raise UserError(f"a {TRANSFORMER_CLASS} config with in_channels {in_ch}, out_channels {config.get('out_channels')}: "
                        f"not HunyuanVideo 1.5's layout (in_channels = 2 · out_channels + {MASK_CHANNELS}: the noisy "
                        "latent, the condition latent, its mask)")
    return None
