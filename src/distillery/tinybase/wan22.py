"""Tiny Wan 2.2 diffusers folders (random weights, real diffusers classes) in the two layouts of Wan 2.2.

``make_tiny_wan22(out, "ti2v")`` — TI2V-5B's layout: ``model_index.json`` with ``expand_timesteps: true``, the
Wan 2.2 VAE (``AutoencoderKLWan`` with ``is_residual``, a patchify of 2 inside it, ``z_dim`` 48: the
transformer's in/out channels), one transformer. ``make_tiny_wan22(out, "a14b")`` — A14B's: two transformers of
one architecture (``transformer``: the high-noise expert, ``transformer_2``: the low-noise one) and
``boundary_ratio`` (A14B's T2V: 0.875), the Wan 2.1 VAE. The tokenizer, text encoder and scheduler are the tiny
Wan 2.1 base's (:mod:`distillery.tinybase.tiny`). Stock ``WanPipeline.from_pretrained`` loads both offline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from distillery.common.errors import UserError

A14B_BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B-Diffusers' model_index.json
TI2V_Z_DIM = 48  # the Wan 2.2 VAE's latent channels

Layout = Literal["ti2v", "a14b"]


def build_wan22_vae(z_dim: int = TI2V_Z_DIM):
    """A tiny Wan 2.2 VAE: residual down/up blocks, pixels patchified 2x2 (12 channels) before the encoder —
    spatial factor 4 · 2 = 8, temporal 4 (9 frames → 3 latent frames); random weights, zero mean, unit std."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[True, True], is_residual=True, in_channels=12, out_channels=12,
                            patch_size=2, scale_factor_spatial=8, scale_factor_temporal=4,
                            latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim).eval()


def make_tiny_wan22(out_dir: Path, layout: Layout, seed: int = 0, captions: Sequence[str] | None = None) -> Path:
    """Write a tiny Wan 2.2 folder of ``layout`` (module doc) to ``out_dir`` (absent or empty), atomically."""
    import torch
    from diffusers import WanPipeline

    from distillery.tinybase.tiny import (
        TinyBaseConfig,
        build_scheduler,
        build_text_encoder,
        build_transformer,
        build_vae,
        write_folder_atomically,
    )
    from distillery.tinybase.tokenizer import build_tokenizer

    if layout not in ("ti2v", "a14b"):
        raise UserError(f"tiny Wan 2.2 layout {layout!r}; valid: ti2v, a14b")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not an empty folder")
    base = TinyBaseConfig()
    tokenizer = build_tokenizer(list(captions or []), model_max_length=base.max_sequence_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = build_text_encoder(base, vocab_size=len(tokenizer))
        torch.manual_seed(seed + 1)
        if layout == "ti2v":
            from dataclasses import replace

            vae = build_wan22_vae()
            arch = replace(base, vae=replace(base.vae, z_dim=TI2V_Z_DIM))
        else:
            vae, arch = build_vae(base), base
        torch.manual_seed(seed + 2)
        transformer = build_transformer(arch)
        second = None
        if layout == "a14b":
            torch.manual_seed(seed + 3)
            second = build_transformer(arch)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=build_scheduler(base),
                       transformer=transformer, transformer_2=second,
                       boundary_ratio=A14B_BOUNDARY_RATIO if layout == "a14b" else None,
                       expand_timesteps=layout == "ti2v")
    return write_folder_atomically(out_dir, lambda staging: pipe.save_pretrained(str(staging), safe_serialization=True))
