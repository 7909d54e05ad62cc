"""A tiny HunyuanVideo 1.5 in diffusers' ``HunyuanVideo15Pipeline`` layout, from tiny configs of the real classes.

``make_tiny_hunyuan15(out)`` writes (``HunyuanVideo15Pipeline.save_pretrained`` of the parts below)::

    out/
      model_index.json   HunyuanVideo15Pipeline: tokenizer, text_encoder, tokenizer_2, text_encoder_2, vae, scheduler,
                         transformer, guider
      tokenizer/         the tiny word-level tokenizer (distillery.tinybase.tokenizer) with a chat template whose system
                         turn is the pipeline's system message padded to the 108 tokens the pipeline crops
      text_encoder/      Qwen2_5_VLTextModel, tiny (3 layers × 16: the pipeline reads the third-from-last hidden state)
      tokenizer_2/       ByT5Tokenizer (bytes: no vocabulary file)
      text_encoder_2/    T5EncoderModel, tiny (the glyph stream, 8 wide)
      vae/               AutoencoderKLHunyuanVideo15, tiny, random (seeded): 8 latent channels, ×16 space, ×4 time
      transformer/       HunyuanVideo15Transformer3DModel, tiny, random (seeded): in_channels 17 = latent 8 + condition
                         latent 8 + mask 1
      scheduler/         FlowMatchEulerDiscreteScheduler with the flow shift
      guider/            ClassifierFreeGuidance (the guidance scale a stock call runs)
      README.md          model card (seed, command, how stock diffusers loads it)

Every weight is random (seeded), the VAE's too: the folder exercises the real classes and the pipeline's conventions,
not pictures. It is not shipped in the package: the ByT5 projection of the real transformer class is 2048 wide
whatever the config (``HunyuanVideo15ByT5TextProjection``), so the tiny transformer alone is 17 MB; the maker writes it
in seconds (``distillery base make-tiny --family hunyuan15 --out DIR``), byte-identical for a seed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyHunyuan15Config:
    """The tiny HunyuanVideo 1.5's shapes (diffusers / transformers argument names)."""

    text_hidden: int = 16  # Qwen2.5-VL hidden size (the first prompt stream's width)
    text_layers: int = 3  # its decoder layers (the pipeline takes hidden_states[-3])
    glyph_width: int = 8  # ByT5's d_model (the second prompt stream's width)
    latent_channels: int = 8  # the VAE's latent channels
    vae_channels: tuple[int, ...] = (8, 8, 16, 16, 16)  # AutoencoderKLHunyuanVideo15 block_out_channels (4 × 2 downsamples)
    num_attention_heads: int = 2  # transformer heads
    attention_head_dim: int = 16  # per head; rope_axes_dim splits it t/h/w
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    num_layers: int = 2  # dual-stream blocks
    num_refiner_layers: int = 1  # the prompt's token refiner
    mlp_ratio: float = 2.0
    image_embed_dim: int = 8  # SigLIP width of the image stream (zeros for text-to-video)
    shift: float = 5.0  # flow shift (scheduler_config.json; the 480p model's)
    guidance_scale: float = 6.0  # the guider's (a stock call's default)


def _chat_template(prefix_tokens: int, system_tokens: int) -> str:
    """A chat template for the word-level tokenizer whose system turn is ``prefix_tokens`` long (the pipeline crops that
    many): the system message, then ``turn`` words up to it; the user turn, then ``.``."""
    filler = " turn" * (prefix_tokens - system_tokens)
    return ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}" + filler
            + " {% else %}{{ message['content'] }} . {% endif %}{% endfor %}")


def make_tiny_hunyuan15(out_dir: Path, seed: int = 0, config: TinyHunyuan15Config = TinyHunyuan15Config(),
                        command: str | None = None) -> Path:
    """Write the tiny HunyuanVideo 1.5 (module doc) to ``out_dir`` (absent or empty), atomically; the same seed gives
    byte-identical weights."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextModel, T5Config, T5EncoderModel
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig

    from distillery.tinybase.family_parts import check_empty_destination, clip_words, qwen_text_config
    from distillery.tinybase.tiny import write_folder_atomically
    from distillery.tinybase.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer

    out_dir = Path(out_dir)
    check_empty_destination(out_dir)
    encode = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    system, crop = encode["system_message"].default, int(encode["crop_start"].default)
    tokenizer = build_tokenizer([*clip_words(), system, "turn"],
                                model_max_length=int(encode["tokenizer_max_length"].default))
    tokenizer.chat_template = _chat_template(crop, len(tokenizer(system, add_special_tokens=False).input_ids))
    glyph_tokenizer = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**qwen_text_config(
            config.text_hidden, config.text_layers, len(tokenizer), 2048, tokenizer.convert_tokens_to_ids(PAD_TOKEN),
            tokenizer.convert_tokens_to_ids(EOS_TOKEN)))).eval()
        torch.manual_seed(seed + 1)
        glyph_encoder = T5EncoderModel(T5Config(vocab_size=len(glyph_tokenizer), d_model=config.glyph_width, d_kv=4,
                                                d_ff=2 * config.glyph_width, num_layers=1, num_heads=2,
                                                feed_forward_proj="gated-gelu")).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLHunyuanVideo15(latent_channels=config.latent_channels, block_out_channels=config.vae_channels,
                                          layers_per_block=1).eval()
        torch.manual_seed(seed + 3)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * config.latent_channels + 1, out_channels=config.latent_channels,
            num_attention_heads=config.num_attention_heads, attention_head_dim=config.attention_head_dim,
            num_layers=config.num_layers, num_refiner_layers=config.num_refiner_layers, mlp_ratio=config.mlp_ratio,
            text_embed_dim=config.text_hidden, text_embed_2_dim=config.glyph_width, image_embed_dim=config.image_embed_dim,
            rope_axes_dim=config.rope_axes_dim, target_size=64, task_type="t2v").eval()
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.shift),
        text_encoder_2=glyph_encoder, tokenizer_2=glyph_tokenizer,
        guider=ClassifierFreeGuidance(guidance_scale=config.guidance_scale))

    def fill(staging: Path) -> None:
        pipeline.save_pretrained(staging, safe_serialization=True)
        (staging / "README.md").write_text(_card(config, seed, command or f"distillery base make-tiny --family hunyuan15 "
                                                                          f"--out {out_dir} --seed {seed}"))

    return write_folder_atomically(out_dir, fill)


def _card(config: TinyHunyuan15Config, seed: int, command: str) -> str:
    from distillery.tinybase.family_parts import made_with

    return f"""---
library_name: diffusers
pipeline_tag: text-to-video
tags: [hunyuanvideo1.5, tiny, distillery, random-weights]
distillery:
  shift: {config.shift}
  seed: {seed}
  weights: random (seeded), every component
---

# Tiny HunyuanVideo 1.5 text-to-video (random weights)

Tiny configs of the real classes in diffusers' `HunyuanVideo15Pipeline` layout, made by `distillery` so that its
pipeline runs a HunyuanVideo 1.5 family offline on a CPU. Every weight is random (seed {seed}): the transformer, the
Qwen2.5-VL and ByT5 text encoders and the VAE.

```python
from diffusers import HunyuanVideo15Pipeline
pipe = HunyuanVideo15Pipeline.from_pretrained("<this folder>")
video = pipe(prompt="a red circle moving left", num_frames=9, height=64, width=64, num_inference_steps=4).frames[0]
```

The guidance scale of a stock call is the guider's (`guider/`, {config.guidance_scale}); set another with
`pipe.guider = pipe.guider.new(guidance_scale=w)`.

{made_with(command, config)}"""
