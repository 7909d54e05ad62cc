"""Make a complete tiny Wan 2.1 image-to-video model in diffusers layout, from scratch.

``make_tiny_i2v_base`` writes a folder that stock ``diffusers.WanImageToVideoPipeline.from_pretrained``
loads offline — the tiny text-to-video base's parts (:mod:`distillery.tinybase.tiny`) plus what Wan 2.1
I2V adds::

    out_dir/
      model_index.json       WanImageToVideoPipeline
      image_encoder/         CLIPVisionModel, tiny (its penultimate hidden states are the image embeddings)
      image_processor/       CLIPImageProcessor sized to the encoder's image_size
      transformer/           WanTransformer3DModel: in_channels = 2 z_dim + the VAE's temporal factor (the
                             noisy latent, the first-frame mask, the first-frame latent; Wan 2.1 I2V: 16+4+16),
                             out_channels = z_dim, image_dim = the encoder's width, added_kv_proj_dim = its width
      tokenizer/ text_encoder/ vae/ scheduler/   as the text-to-video tiny base
      README.md              model card

Diffusers' Wan attention takes the last 512 tokens of the cross-attention context as the text (the rest
are image tokens), so an I2V model is used with 512-token prompts: the card says ``max_sequence_length: 512``.
The weights are random (seeded); the same config and seed give byte-identical safetensors files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from distillery.common.errors import UserError
from distillery.tinybase.tiny import (
    TinyBaseConfig,
    _check_destination,
    build_scheduler,
    build_text_encoder,
    build_vae,
    write_folder_atomically,
)

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionModel

logger = logging.getLogger("distillery")

#: Diffusers' Wan attention splits the context as ``[image tokens, the last 512 text tokens]``.
I2V_TEXT_TOKENS = 512
_SEED_OFFSETS = {"text_encoder": 0, "vae": 1, "transformer": 2, "image_encoder": 3}


@dataclass(frozen=True)
class TinyImageEncoderConfig:
    """``CLIPVisionConfig`` arguments of the tiny image encoder."""

    hidden_size: int = 32  # width of the embeddings the transformer takes (its image_dim)
    intermediate_size: int = 64  # MLP width
    num_hidden_layers: int = 2  # the penultimate layer's output is what WanImageToVideoPipeline uses
    num_attention_heads: int = 4  # heads
    image_size: int = 32  # pixels the processor resizes and crops to
    patch_size: int = 8  # pixels per patch: (image_size / patch_size)² + 1 tokens

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise UserError("image_encoder.hidden_size must be a multiple of image_encoder.num_attention_heads")
        if self.image_size % self.patch_size:
            raise UserError("image_encoder.image_size must be a multiple of image_encoder.patch_size")


@dataclass(frozen=True)
class TinyI2VConfig:
    """The tiny I2V base: the text-to-video parts (``base``, its prompts 512 tokens) and the image encoder."""

    base: TinyBaseConfig = field(default_factory=lambda: TinyBaseConfig(max_sequence_length=I2V_TEXT_TOKENS))
    image_encoder: TinyImageEncoderConfig = field(default_factory=TinyImageEncoderConfig)

    def __post_init__(self) -> None:
        if self.base.max_sequence_length != I2V_TEXT_TOKENS:
            object.__setattr__(self, "base", replace(self.base, max_sequence_length=I2V_TEXT_TOKENS))


def build_image_encoder(config: TinyI2VConfig) -> CLIPVisionModel:
    """A randomly initialised tiny ``CLIPVisionModel`` (uses the global torch RNG)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    e = config.image_encoder
    return CLIPVisionModel(CLIPVisionConfig(
        hidden_size=e.hidden_size, intermediate_size=e.intermediate_size, num_hidden_layers=e.num_hidden_layers,
        num_attention_heads=e.num_attention_heads, image_size=e.image_size, patch_size=e.patch_size,
        projection_dim=e.hidden_size,
    )).eval()


def build_image_processor(config: TinyI2VConfig) -> CLIPImageProcessor:
    """CLIP's preprocessing (resize the short side, centre crop, OpenAI mean/std) at the encoder's ``image_size``."""
    from transformers import CLIPImageProcessor

    size = config.image_encoder.image_size
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def build_i2v_transformer(config: TinyI2VConfig) -> WanTransformer3DModel:
    """A randomly initialised tiny Wan 2.1 I2V ``WanTransformer3DModel`` (diffusers' default init)."""
    from diffusers import WanTransformer3DModel

    b, t = config.base, config.base.transformer
    z = b.vae.z_dim
    return WanTransformer3DModel(
        patch_size=tuple(t.patch_size), num_attention_heads=t.num_attention_heads,
        attention_head_dim=t.attention_head_dim, in_channels=2 * z + b.vae.scale_factor_temporal, out_channels=z,
        text_dim=b.text_encoder.d_model, freq_dim=t.freq_dim, ffn_dim=t.ffn_dim, num_layers=t.num_layers,
        cross_attn_norm=t.cross_attn_norm, qk_norm=t.qk_norm, eps=t.eps, rope_max_seq_len=t.rope_max_seq_len,
        image_dim=config.image_encoder.hidden_size, added_kv_proj_dim=t.num_attention_heads * t.attention_head_dim,
    ).eval()


def make_tiny_i2v_base(out_dir: Path, config: TinyI2VConfig = TinyI2VConfig(), seed: int = 0,
                       captions: Sequence[str] | None = None, *, overwrite: bool = False) -> Path:
    """Write a random-weight tiny Wan 2.1 I2V diffusers folder to ``out_dir``; return its path.

    Built in a temporary sibling and renamed into place (``out_dir`` holds a complete model or is left as it
    was). :class:`UserError` if ``out_dir`` is a file, or a non-empty folder and ``overwrite`` is false."""
    import torch
    from diffusers import WanImageToVideoPipeline

    from distillery.tinybase.tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    _check_destination(out_dir, overwrite)
    captions = list(captions or [])
    tokenizer = build_tokenizer(captions, model_max_length=config.base.max_sequence_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _SEED_OFFSETS["text_encoder"])
        text_encoder = build_text_encoder(config.base, vocab_size=len(tokenizer))
        torch.manual_seed(seed + _SEED_OFFSETS["vae"])
        vae = build_vae(config.base)
        torch.manual_seed(seed + _SEED_OFFSETS["transformer"])
        transformer = build_i2v_transformer(config)
        torch.manual_seed(seed + _SEED_OFFSETS["image_encoder"])
        image_encoder = build_image_encoder(config)
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=build_scheduler(config.base),
        image_processor=build_image_processor(config), image_encoder=image_encoder, transformer=transformer,
    )
    def fill(staging: Path) -> None:
        pipe.save_pretrained(str(staging), safe_serialization=True)
        (staging / "README.md").write_text(_model_card(config, seed), encoding="utf-8")

    write_folder_atomically(out_dir, fill)
    logger.info("wrote tiny Wan I2V base model (seed %d) to %s", seed, out_dir)
    return out_dir


def _model_card(config: TinyI2VConfig, seed: int) -> str:
    size = config.image_encoder.image_size
    return f"""---
library_name: diffusers
pipeline_tag: image-to-video
tags: [wan, tiny, distillery, random-weights, image-to-video]
distillery:
  max_sequence_length: {config.base.max_sequence_length}
  shift: {config.base.shift}
  seed: {seed}
  weights: "random"
---

# Tiny Wan 2.1 image-to-video (random weights)

A complete, tiny Wan 2.1 image-to-video model in diffusers layout, made by `distillery` for CPU tests. It
loads with stock diffusers:

```python
import numpy as np
from PIL import Image
from diffusers import WanImageToVideoPipeline
pipe = WanImageToVideoPipeline.from_pretrained("<this folder>")
frame = Image.fromarray(np.zeros(({size}, {size}, 3), np.uint8))
video = pipe(image=frame, prompt="a red circle", num_frames=9, height={size}, width={size},
             max_sequence_length={config.base.max_sequence_length}, output_type="np").frames
```

**The weights are random** (seed {seed}). Prompts must be {config.base.max_sequence_length} tokens long
(diffusers' Wan attention takes the last 512 context tokens as the text, the rest as the image's).

## Full config

```json
{json.dumps(json.loads(json.dumps(asdict(config))), indent=2)}
```
"""
