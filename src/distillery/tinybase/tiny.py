"""Make a complete tiny Wan 2.1 text-to-video model in diffusers layout, from scratch.

``make_tiny_base`` writes a folder that stock ``diffusers.WanPipeline.from_pretrained``
loads offline::

    out_dir/
      model_index.json       WanPipeline: tokenizer, text_encoder, vae, scheduler, transformer
      tokenizer/             word-level fast tokenizer (distillery.tinybase.tokenizer)
      text_encoder/          UMT5EncoderModel, tiny
      vae/                   AutoencoderKLWan, tiny (latents_mean/std sized to z_dim)
      transformer/           WanTransformer3DModel, tiny
      scheduler/             FlowMatchEulerDiscreteScheduler (shift read by the library)
      README.md              model card: what it is, config, seed, command

The weights are random (seeded): the folder is a correctly shaped, loadable base model,
not a useful one; a fitting step trains it on the synthetic clips later. The same
config, seed and captions always give byte-identical safetensors files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from distillery.common.errors import UserError
from distillery.common.fsutil import replace_dir

if TYPE_CHECKING:  # heavy imports stay lazy: diffusers alone costs seconds
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

logger = logging.getLogger("distillery")

# Each component gets its own seed, derived from the user's, so components never share a stream.
_SEED_OFFSETS = {"text_encoder": 0, "vae": 1, "transformer": 2}


@dataclass(frozen=True)
class TinyVAEConfig:
    """``AutoencoderKLWan`` arguments (diffusers names). Spatial factor 2**(len(dim_mult)-1)."""

    base_dim: int = 8  # channels of the first encoder stage
    z_dim: int = 8  # latent channels; also the transformer's in/out channels
    dim_mult: tuple[int, ...] = (1, 2, 2)  # per-stage channel multipliers
    num_res_blocks: int = 1  # residual blocks per stage
    temperal_downsample: tuple[bool, ...] = (True, True)  # per down stage: also halve time (diffusers' spelling)
    latents_mean: tuple[float, ...] | None = None  # per-channel latent mean; None → zeros (random init)
    latents_std: tuple[float, ...] | None = None  # per-channel latent std; None → ones (random init)

    def __post_init__(self) -> None:
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise UserError(
                f"vae.temperal_downsample has {len(self.temperal_downsample)} entries; it needs "
                f"len(vae.dim_mult) - 1 = {len(self.dim_mult) - 1}"
            )
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None and len(value) != self.z_dim:
                raise UserError(f"vae.{name} has {len(value)} entries; it needs z_dim = {self.z_dim}")

    @property
    def scale_factor_spatial(self) -> int:
        """Pixels per latent cell along height and width."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def scale_factor_temporal(self) -> int:
        """Frames per latent frame (after the first frame, which maps to its own latent frame)."""
        return 2 ** sum(bool(t) for t in self.temperal_downsample)


@dataclass(frozen=True)
class TinyTextEncoderConfig:
    """``UMT5Config`` arguments for the encoder; vocab_size comes from the tokenizer."""

    d_model: int = 32  # hidden size; also the transformer's text_dim
    num_layers: int = 1  # encoder blocks
    num_heads: int = 4  # attention heads
    d_kv: int = 8  # per-head dimension
    d_ff: int = 64  # feed-forward width
    relative_attention_num_buckets: int = 32  # T5 relative position buckets
    relative_attention_max_distance: int = 128  # distance beyond which buckets saturate
    feed_forward_proj: str = "gated-gelu"  # as umt5-xxl


@dataclass(frozen=True)
class TinyTransformerConfig:
    """``WanTransformer3DModel`` arguments; in/out channels and text_dim are derived."""

    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) latent patch
    num_attention_heads: int = 4  # heads
    attention_head_dim: int = 32  # per-head dimension (hidden = heads × this)
    ffn_dim: int = 512  # feed-forward width
    num_layers: int = 4  # transformer blocks
    freq_dim: int = 256  # sinusoidal timestep embedding width
    cross_attn_norm: bool = True  # norm before cross-attention (Wan 2.1 T2V: True)
    qk_norm: str = "rms_norm_across_heads"  # Wan 2.1's query/key norm
    eps: float = 1e-6  # norm epsilon
    rope_max_seq_len: int = 1024  # RoPE table length per axis

    def __post_init__(self) -> None:
        if self.attention_head_dim % 2 or self.freq_dim % 2:
            raise UserError("transformer.attention_head_dim and transformer.freq_dim must be even")


@dataclass(frozen=True)
class TinyBaseConfig:
    """Everything that shapes the tiny base model (defaults: the recipe that learns on a CPU)."""

    vae: TinyVAEConfig = field(default_factory=TinyVAEConfig)  # video autoencoder
    text_encoder: TinyTextEncoderConfig = field(default_factory=TinyTextEncoderConfig)  # prompt encoder
    transformer: TinyTransformerConfig = field(default_factory=TinyTransformerConfig)  # denoiser
    shift: float = 3.0  # flow-matching sigma shift, written to scheduler_config.json
    num_train_timesteps: int = 1000  # scheduler timestep range [0, num_train_timesteps]
    max_sequence_length: int = 32  # prompt tokens (incl. </s>) the pipeline should use

    def __post_init__(self) -> None:
        if self.max_sequence_length < 2:
            raise UserError("max_sequence_length must be at least 2 (one word and </s>)")
        if self.shift <= 0:
            raise UserError(f"shift must be positive, got {self.shift}")

    def to_dict(self) -> dict:
        """A JSON-ready view (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def build_text_encoder(config: TinyBaseConfig, vocab_size: int) -> UMT5EncoderModel:
    """A randomly initialised tiny ``UMT5EncoderModel`` (uses the global torch RNG)."""
    from transformers import UMT5Config, UMT5EncoderModel

    te = config.text_encoder
    umt5 = UMT5Config(
        vocab_size=vocab_size,
        d_model=te.d_model,
        d_kv=te.d_kv,
        d_ff=te.d_ff,
        num_layers=te.num_layers,
        num_heads=te.num_heads,
        relative_attention_num_buckets=te.relative_attention_num_buckets,
        relative_attention_max_distance=te.relative_attention_max_distance,
        feed_forward_proj=te.feed_forward_proj,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(umt5).eval()


def build_vae(config: TinyBaseConfig) -> AutoencoderKLWan:
    """A randomly initialised tiny ``AutoencoderKLWan`` whose config matches its real scale factors."""
    from diffusers import AutoencoderKLWan

    v = config.vae
    return AutoencoderKLWan(
        base_dim=v.base_dim,
        z_dim=v.z_dim,
        dim_mult=list(v.dim_mult),
        num_res_blocks=v.num_res_blocks,
        temperal_downsample=list(v.temperal_downsample),
        latents_mean=list(v.latents_mean) if v.latents_mean is not None else [0.0] * v.z_dim,
        latents_std=list(v.latents_std) if v.latents_std is not None else [1.0] * v.z_dim,
        # diffusers' defaults (4, 8) describe the real Wan VAE; WanPipeline sizes latents from these.
        scale_factor_spatial=v.scale_factor_spatial,
        scale_factor_temporal=v.scale_factor_temporal,
    ).eval()


def build_transformer(config: TinyBaseConfig) -> WanTransformer3DModel:
    """A randomly initialised tiny ``WanTransformer3DModel`` (diffusers' default init)."""
    from diffusers import WanTransformer3DModel

    t = config.transformer
    return WanTransformer3DModel(
        patch_size=tuple(t.patch_size),
        num_attention_heads=t.num_attention_heads,
        attention_head_dim=t.attention_head_dim,
        in_channels=config.vae.z_dim,
        out_channels=config.vae.z_dim,
        text_dim=config.text_encoder.d_model,
        freq_dim=t.freq_dim,
        ffn_dim=t.ffn_dim,
        num_layers=t.num_layers,
        cross_attn_norm=t.cross_attn_norm,
        qk_norm=t.qk_norm,
        eps=t.eps,
        rope_max_seq_len=t.rope_max_seq_len,
    ).eval()


def build_scheduler(config: TinyBaseConfig) -> FlowMatchEulerDiscreteScheduler:
    """The flow-matching Euler scheduler with the model's shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps, shift=config.shift)


def make_tiny_base(
    out_dir: Path,
    config: TinyBaseConfig = TinyBaseConfig(),
    seed: int = 0,
    captions: Sequence[str] | None = None,
    *,
    overwrite: bool = False,
    command: str | None = None,
) -> Path:
    """Write a random-weight tiny Wan 2.1 T2V diffusers folder to ``out_dir``; return its path.

    ``captions`` extend the tokenizer's built-in vocabulary. ``command`` is recorded in
    the model card (default: the equivalent ``distillery base make-tiny`` line).
    The folder is built in a temporary sibling and renamed into place, so ``out_dir``
    either holds a complete model or is left as it was. Raises ``UserError`` if
    ``out_dir`` is a file, or a non-empty folder and ``overwrite`` is false.
    """
    import torch
    from diffusers import WanPipeline

    from distillery.tinybase.tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    _check_destination(out_dir, overwrite)
    captions = list(captions or [])
    if command is None:
        command = f"distillery base make-tiny --out {out_dir} --seed {seed}" + (" --overwrite" if overwrite else "")

    tokenizer = build_tokenizer(captions, model_max_length=config.max_sequence_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _SEED_OFFSETS["text_encoder"])
        text_encoder = build_text_encoder(config, vocab_size=len(tokenizer))
        torch.manual_seed(seed + _SEED_OFFSETS["vae"])
        vae = build_vae(config)
        torch.manual_seed(seed + _SEED_OFFSETS["transformer"])
        transformer = build_transformer(config)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=build_scheduler(config),
        transformer=transformer,
    )

    def fill(staging: Path) -> None:
        pipe.save_pretrained(str(staging), safe_serialization=True)
        card = _model_card(config, seed, command, captions, len(tokenizer), _parameter_counts(pipe))
        (staging / "README.md").write_text(card, encoding="utf-8")

    write_folder_atomically(out_dir, fill)
    logger.info("wrote tiny Wan base model (seed %d) to %s", seed, out_dir)
    return out_dir


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a folder; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} already exists and is not empty; choose another --out or pass --overwrite")


def write_folder_atomically(out_dir: Path, fill) -> Path:
    """Make ``out_dir`` by ``fill(staging)`` on a temporary sibling folder, then give it ordinary modes and rename it
    into place: ``out_dir`` either holds the complete folder or is left as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        fill(staging)
        _make_readable(staging)
        replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _make_readable(root: Path) -> None:
    """Give the staged tree ordinary modes (mkdtemp and safetensors write owner-only files)."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _parameter_counts(pipe) -> dict[str, int]:
    return {
        name: sum(p.numel() for p in getattr(pipe, name).parameters())
        for name in ("text_encoder", "vae", "transformer")
    }


def _model_card(
    config: TinyBaseConfig,
    seed: int,
    command: str,
    captions: list[str],
    vocab_size: int,
    parameters: dict[str, int],
) -> str:
    settings = {
        "max_sequence_length": config.max_sequence_length,
        "shift": config.shift,
        "seed": seed,
        "weights": "random",
    }
    front = "\n".join(f"  {key}: {json.dumps(value)}" for key, value in settings.items())
    v = config.vae
    counts = "\n".join(f"| {name} | {count:,} |" for name, count in parameters.items())
    return f"""---
library_name: diffusers
pipeline_tag: text-to-video
tags: [wan, tiny, distillery, random-weights]
distillery:
{front}
---

# Tiny Wan 2.1 text-to-video (random weights)

A complete, tiny Wan 2.1 text-to-video model in diffusers layout, made by `distillery` so that
the whole pipeline runs offline on a CPU. It loads with stock diffusers:

```python
from diffusers import WanPipeline
pipe = WanPipeline.from_pretrained("<this folder>")
video = pipe("a red circle moving left on a black background", num_frames=9, height=32, width=32,
             max_sequence_length={config.max_sequence_length}, output_type="np").frames
```

**The weights are random** (seed {seed}): the shapes and configs are right, the outputs are noise.
A fitting step (`distillery base make-tiny --fit`) trains them on the synthetic clips.

Made with:

```
{command}
```

## Components

| part | class | notes |
|---|---|---|
| tokenizer | word-level `tokenizers` model (`PreTrainedTokenizerFast`) | {vocab_size} tokens; `<pad>`=0, `</s>`=1, `<unk>`=2; {len(set(captions))} captions given |
| text_encoder | `UMT5EncoderModel` | d_model {config.text_encoder.d_model}, {config.text_encoder.num_layers} layer(s) |
| vae | `AutoencoderKLWan` | z_dim {v.z_dim}, {v.scale_factor_temporal}× time, {v.scale_factor_spatial}× space; latents_mean/std {"set" if v.latents_mean is not None else "zeros/ones"} |
| transformer | `WanTransformer3DModel` | {config.transformer.num_layers} layers, {config.transformer.num_attention_heads}×{config.transformer.attention_head_dim} heads, patch {tuple(config.transformer.patch_size)} |
| scheduler | `FlowMatchEulerDiscreteScheduler` | shift {config.shift} |

Use prompts of `max_sequence_length={config.max_sequence_length}` tokens (including `</s>`) with this model.
Frame counts must be 1 + {v.scale_factor_temporal}k; height and width multiples of
{math.lcm(16, v.scale_factor_spatial * config.transformer.patch_size[1])} (WanPipeline checks 16; patches need {v.scale_factor_spatial * config.transformer.patch_size[1]}).

| part | parameters |
|---|---|
{counts}

## Full config

```json
{json.dumps(config.to_dict(), indent=2)}
```
"""
