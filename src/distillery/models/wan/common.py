"""What every Wan plugin shares: the config knobs, locating a diffusers Wan folder, building and
reading a ``WanTransformer3DModel`` config (the family's loaders, :mod:`distillery.models.registry`).

``init_from`` names a diffusers model folder (holding ``transformer/`` and ``scheduler/``) or a
transformer folder itself (``config.json`` + safetensors, e.g. an earlier stage's output, with the
scheduler config in a sibling ``scheduler/`` folder). The flow shift is read from that scheduler
config unless given explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.config.attention import DEFAULT_SPARSITY, DEFAULT_TILE, MAX_SPARSITY, MAX_TILE_SIDE, Attention, three_sizes
from distillery.config.typed import bounded
from distillery.models.base import TransformerModelConfig, locate_transformer_folder
from distillery.models.wan.sparse_attention import RECORD_KEY as SPARSE_RECORD_KEY

TRANSFORMER_CLASS = "WanTransformer3DModel"


@dataclass
class WanModelConfig(TransformerModelConfig):
    """A Wan plugin's knobs: :class:`~distillery.models.base.TransformerModelConfig`'s and how its self-attention runs."""

    # self-attention: sparse (trained block-sparse video attention, models/wan/sparse.py) | dense | auto (as the folder's
    # transformer trained: its config.json's record, dense without one)
    attention: Attention = "auto"
    sparsity: float = bounded(DEFAULT_SPARSITY, 0.0, MAX_SPARSITY)  # sparse: the share of the key tiles a query tile may attend that it skips
    sparse_tile: list[int] = bounded(default_factory=lambda: list(DEFAULT_TILE), low=1, high=MAX_TILE_SIDE,
                                     check=three_sizes)  # sparse: a tile's tokens in frames, rows, columns


def locate_transformer(init_from: str | Path) -> tuple[Path, Path | None]:
    """Return (transformer folder, scheduler folder or None) for a model or transformer folder."""
    return locate_transformer_folder(init_from, TRANSFORMER_CLASS, "Wan")


def build_transformer(config: dict[str, Any]) -> Any:
    """A ``WanTransformer3DModel`` of the architecture ``config`` (a ``config.json`` mapping; random
    weights, to load a checkpoint into) — its Wan 2.2 layout (``_wan_layout``, :mod:`.experts`) and its sparse
    attention (``_sparse_attention``, :mod:`.sparse`) kept in its config; two experts
    (:class:`~distillery.models.wan.experts.WanExperts`) when that layout holds the second one's config
    (``transformer_2``). :class:`UserError` for a config of another class."""
    from diffusers import WanTransformer3DModel

    from distillery.models.wan.experts import LAYOUT_KEY, WanExperts

    if config.get("_class_name") != TRANSFORMER_CLASS:
        raise UserError(f"config of a {config.get('_class_name')}, not a {TRANSFORMER_CLASS}")
    layout = dict(config.get(LAYOUT_KEY) or {})
    second = layout.pop("transformer_2", None)
    module = WanTransformer3DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    if layout:
        module.register_to_config(**{LAYOUT_KEY: layout})
    if SPARSE_RECORD_KEY in config:  # how it trained to attend travels with the weights (null: dense)
        module.register_to_config(**{SPARSE_RECORD_KEY: config[SPARSE_RECORD_KEY]})
    if second is None:
        return module
    if layout.get("boundary_ratio") is None:
        raise UserError(f"config of two Wan experts without a boundary_ratio ({LAYOUT_KEY})")
    return WanExperts(module, build_transformer(second), layout["boundary_ratio"])


def input_widths(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(latent channels, text embedding width)`` a Wan transformer of ``config`` takes (its
    ``in_channels`` and ``text_dim``; None where the config lacks one). An image-to-video transformer's
    latent channels are its ``out_channels``: the rest of its input is the first-frame condition
    (:func:`image_conditioning`)."""
    i2v = image_conditioning(config)
    return (i2v.latent_channels if i2v is not None else config.get("in_channels")), config.get("text_dim")


@dataclass(frozen=True)
class ImageConditioning:
    """How a Wan 2.1 image-to-video transformer is conditioned on a first frame (diffusers'
    ``WanImageToVideoPipeline``): its input is ``concat(noisy latent, mask, first-frame latent)`` on the
    channel axis — ``latent_channels + mask_channels + latent_channels`` = ``in_channels`` (Wan 2.1 I2V:
    16 + 4 + 16 = 36; ``mask_channels`` is the VAE's temporal factor) — and, when ``image_dim`` is set,
    the image encoder's penultimate hidden states ``[N, image_dim]`` go in as ``encoder_hidden_states_image``."""

    latent_channels: int  # the noisy latent's channels (the transformer's out_channels, the VAE's z_dim)
    mask_channels: int  # the first-frame mask's channels (frames per latent frame)
    image_dim: int | None  # width of the image encoder's embeddings; None: the base has no image encoder

    @property
    def condition_channels(self) -> int:
        """Channels of the stored condition: the mask then the first-frame latent."""
        return self.mask_channels + self.latent_channels


def image_conditioning(config: dict[str, Any]) -> ImageConditioning | None:
    """The first-frame conditioning a Wan transformer ``config`` (a ``config.json`` mapping) takes; None for
    text-to-video (``in_channels == out_channels``). :class:`UserError` for channel counts no Wan I2V layout has."""
    in_ch, out_ch = config.get("in_channels"), config.get("out_channels")
    if in_ch is None or out_ch is None or int(in_ch) == int(out_ch):
        if config.get("image_dim") is not None:
            raise UserError(f"a {TRANSFORMER_CLASS} config with image_dim {config['image_dim']} but in_channels == "
                            "out_channels: not a Wan 2.1 image-to-video transformer")
        return None
    in_ch, out_ch = int(in_ch), int(out_ch)
    mask = in_ch - 2 * out_ch
    if mask <= 0:
        raise UserError(f"a {TRANSFORMER_CLASS} config with in_channels {in_ch}, out_channels {out_ch}: neither "
                        f"text-to-video (equal) nor image-to-video (2 × out_channels + the mask's channels)")
    image_dim = config.get("image_dim")
    return ImageConditioning(latent_channels=out_ch, mask_channels=mask,
                             image_dim=None if image_dim is None else int(image_dim))
