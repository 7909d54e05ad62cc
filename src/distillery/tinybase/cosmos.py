"""A tiny Cosmos Predict 2.5 in diffusers' ``Cosmos2_5_PredictBasePipeline`` layout, from tiny configs of the real classes.

``make_tiny_cosmos(out)`` writes::

    out/
      model_index.json   Cosmos2_5_PredictBasePipeline: tokenizer, text_encoder, vae, scheduler, transformer
                         (safety_checker [null, null]: NVIDIA's guardrail is the caller's, below)
      tokenizer/         the tiny word-level tokenizer (distillery.tinybase.tokenizer) with a chat template: the shipped
                         tiny Wan's words (the synthetic clips' captions), the system turn's, ``captions``'
      text_encoder/      Qwen2_5_VLForConditionalGeneration, tiny (2 layers × 16: prompt embeddings 32 wide)
      vae/               the shipped fitted tiny Wan's AutoencoderKLWan (Cosmos Predict 2.5's VAE is Wan 2.1's)
      transformer/       CosmosTransformer3DModel, tiny, random (seeded)
      scheduler/         FlowMatchEulerDiscreteScheduler with the flow shift
      analyzer.json      the shipped tiny Wan's analyzer thresholds (calibrated on that same VAE)
      README.md          model card (max_sequence_length, seed, command, how stock diffusers loads it)

Two choices differ from the released Cosmos Predict 2.5 and are the config's, not the code's: ``concat_padding_mask``
is false (diffusers resizes that mask with torchvision, which this CPU image cannot load: a real folder with it is
refused in one line where torchvision is missing, :mod:`distillery.models.cosmos.bidirectional`), and the scheduler is
the flow-matching Euler one (the released folder's UniPC with flow sigmas has the same ``flow_shift``; distillery's σ
grids are the Euler scheduler's, so an export samples as validate does). Stock diffusers loads the folder offline:
``Cosmos2_5_PredictBasePipeline.from_pretrained(out, safety_checker=<checker>)`` (the pipeline refuses to run without
one; ``cosmos_guardrail``'s ``CosmosSafetyChecker`` is NVIDIA's, and it fetches its own models).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: What ``Cosmos2_5_PredictBasePipeline._get_prompt_embeds`` puts around a prompt (its system turn's words join the
#: tokenizer's vocabulary, so the tiny tokenizer gives them ids of their own).
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."
#: A chat template for the word-level tokenizer: ``role : text .`` per turn (Qwen's special tokens do not exist here).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} : {% for part in message['content'] %}"
                 "{{ part['text'] }}{% endfor %} . {% endfor %}")


@dataclass(frozen=True)
class TinyCosmosConfig:
    """The tiny Cosmos' shapes (diffusers / transformers argument names)."""

    text_hidden: int = 16  # Qwen2.5-VL hidden size
    text_layers: int = 2  # its decoder layers: the prompt embedding is text_layers × text_hidden wide
    num_attention_heads: int = 4  # transformer heads
    attention_head_dim: int = 16  # per head (RoPE splits it t/h/w)
    num_layers: int = 2  # transformer blocks
    mlp_ratio: float = 2.0  # feed-forward width / hidden
    adaln_lora_dim: int = 16  # AdaLN's low-rank width
    text_embed_dim: int = 64  # cross-attention context width after crossattn_proj
    max_size: tuple[int, int, int] = (32, 64, 64)  # latent (T, H, W) the RoPE tables cover
    shift: float = 3.0  # flow shift (scheduler_config.json)
    max_sequence_length: int = 48  # prompt tokens the pipeline pads to (the chat turns included)

    @property
    def text_width(self) -> int:
        return self.text_hidden * self.text_layers


def build_text_encoder(config: TinyCosmosConfig, vocab_size: int, pad_id: int, eos_id: int):
    """A random tiny ``Qwen2_5_VLForConditionalGeneration`` (its vision tower as small as its config allows; text only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from distillery.tinybase.family_parts import qwen_text_config

    text = qwen_text_config(config.text_hidden, config.text_layers, vocab_size, 4 * config.max_sequence_length, pad_id,
                            eos_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=config.text_hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=eos_id, eos_token_id=eos_id,
                           pad_token_id=pad_id)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def build_transformer(config: TinyCosmosConfig, latent_channels: int):
    """A random tiny ``CosmosTransformer3DModel`` in Cosmos Predict 2.5's layout (condition-mask channel, Qwen
    projection, no learnable position embedding) but ``concat_padding_mask`` false (module doc)."""
    from diffusers import CosmosTransformer3DModel

    return CosmosTransformer3DModel(
        in_channels=latent_channels + 1, out_channels=latent_channels, num_attention_heads=config.num_attention_heads,
        attention_head_dim=config.attention_head_dim, num_layers=config.num_layers, mlp_ratio=config.mlp_ratio,
        text_embed_dim=config.text_embed_dim, adaln_lora_dim=config.adaln_lora_dim, max_size=config.max_size,
        patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False, extra_pos_embed_type=None,
        use_crossattn_projection=True, crossattn_proj_in_channels=config.text_width,
        encoder_hidden_states_channels=config.text_embed_dim).eval()


def make_tiny_cosmos(out_dir: Path, seed: int = 0, captions: Sequence[str] | None = None,
                     config: TinyCosmosConfig = TinyCosmosConfig(), command: str | None = None) -> Path:
    """Write the tiny Cosmos (module doc) to ``out_dir`` (absent or empty), atomically; the same seed and captions give
    byte-identical weights."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    from distillery.tinybase.family_parts import check_empty_destination, clip_words
    from distillery.tinybase.shipped import shipped_tiny_base
    from distillery.tinybase.tiny import write_folder_atomically
    from distillery.tinybase.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer

    out_dir = Path(out_dir)
    check_empty_destination(out_dir)
    shipped = shipped_tiny_base()
    tokenizer = build_tokenizer([*clip_words(), *(captions or []), SYSTEM_PROMPT, "system user"],
                                model_max_length=config.max_sequence_length)
    tokenizer.chat_template = CHAT_TEMPLATE
    vae = AutoencoderKLWan.from_pretrained(shipped / "vae")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = build_text_encoder(config, len(tokenizer), tokenizer.convert_tokens_to_ids(PAD_TOKEN),
                                          tokenizer.convert_tokens_to_ids(EOS_TOKEN))
        torch.manual_seed(seed + 2)
        transformer = build_transformer(config, int(vae.config.z_dim))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.shift)

    def fill(staging: Path) -> None:
        tokenizer.save_pretrained(staging / "tokenizer")
        text_encoder.save_pretrained(staging / "text_encoder", safe_serialization=True)
        vae.save_pretrained(staging / "vae", safe_serialization=True)
        transformer.save_pretrained(staging / "transformer", safe_serialization=True)
        scheduler.save_pretrained(staging / "scheduler")
        shutil.copy2(shipped / "analyzer.json", staging / "analyzer.json")
        (staging / "model_index.json").write_text(json.dumps(model_index(), indent=2) + "\n")
        (staging / "README.md").write_text(_card(config, seed, command or f"distillery base make-tiny --family cosmos "
                                                                          f"--out {out_dir} --seed {seed}"))

    return write_folder_atomically(out_dir, fill)


def model_index() -> dict:
    """The tiny Cosmos' ``model_index.json``: diffusers' layout of ``Cosmos2_5_PredictBasePipeline``."""
    import diffusers

    return {"_class_name": "Cosmos2_5_PredictBasePipeline", "_diffusers_version": diffusers.__version__,
            "safety_checker": [None, None], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            "transformer": ["diffusers", "CosmosTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}


def _card(config: TinyCosmosConfig, seed: int, command: str) -> str:
    from distillery.tinybase.family_parts import made_with

    return f"""---
library_name: diffusers
pipeline_tag: text-to-video
tags: [cosmos, tiny, distillery, random-weights]
distillery:
  max_sequence_length: {config.max_sequence_length}
  shift: {config.shift}
  seed: {seed}
  weights: random transformer and text encoder; the fitted tiny Wan VAE
---

# Tiny Cosmos Predict 2.5 text-to-world (random transformer)

Tiny configs of the real classes in diffusers' `Cosmos2_5_PredictBasePipeline` layout, made by `distillery` so that
its pipeline runs a Cosmos family offline on a CPU. The transformer and the Qwen2.5-VL text encoder are random
(seed {seed}); the VAE is the fitted tiny Wan's (Cosmos Predict 2.5's VAE is Wan 2.1's `AutoencoderKLWan`).

```python
from diffusers import Cosmos2_5_PredictBasePipeline
pipe = Cosmos2_5_PredictBasePipeline.from_pretrained("<this folder>", safety_checker=checker)
video = pipe(prompt="a red circle moving left", negative_prompt="", num_frames=9, height=32, width=32,
             max_sequence_length={config.max_sequence_length}, guidance_scale=1.0).frames[0]
```

`checker` is NVIDIA's guardrail (`cosmos_guardrail.CosmosSafetyChecker`, which downloads its own models) or your own
object with `to(device)` and `check_text_safety(prompt)`: the pipeline does not run without one. Two settings differ
from the released model: `concat_padding_mask` is false (diffusers needs torchvision for that mask) and the scheduler
is flow-matching Euler with the same shift ({config.shift}).

{made_with(command, config)}"""
