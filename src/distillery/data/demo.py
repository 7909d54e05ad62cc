"""A small synthetic latent set for demos and tests (no VAE or text encoder needed).

Each sample is a smooth pattern moving across the latent frames, with a caption and a text
embedding that encode its frequency and direction, so a model can learn the mapping quickly:
``make_demo_latents(root)`` writes ``root/train/*.parquet`` and ``root/empty_prompt.safetensors``
in the format of :mod:`distillery.data.latent_format`. Shapes match the tiny base model
(z_dim 8, text_dim 32, 9×32×32 clips → latents ``[8, 3, 8, 8]``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distillery.data.dataset import write_empty_prompt_embedding
from distillery.data.writer import LatentRecord, write_latent_shards

LATENT_SHAPE = (8, 3, 8, 8)  # [C, T, H, W] of the tiny VAE (z_dim 8) for 9×32×32 clips
TEXT_DIM = 32


def make_demo_latents(root: Path, num_samples: int = 16, seed: int = 0, rows_per_shard: int = 8,
                      channels: int = LATENT_SHAPE[0]) -> Path:
    """A fixed, learnable latent set: smooth moving patterns whose phase/colour the caption encodes; ``channels``
    latent channels (48: a tiny Wan 2.2 TI2V-5B's, :mod:`distillery.tinybase.wan22`)."""
    g = torch.Generator().manual_seed(seed)
    c, t, h, w = channels, *LATENT_SHAPE[1:]
    records = []
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    for i in range(num_samples):
        freq = 1 + (i % 4)
        direction = (i // 4) % 4
        frames = []
        for f in range(t):
            shift = 0.15 * f * (1 if direction % 2 == 0 else -1)
            axis = xx if direction < 2 else yy
            base = torch.sin(2 * math.pi * freq * (axis + shift))
            frames.append(base)
        pattern = torch.stack(frames)  # [T, H, W]
        channel_gain = torch.linspace(-1, 1, c).roll(i % c)[:, None, None, None]
        latent = channel_gain * pattern[None] + 0.05 * torch.randn(c, t, h, w, generator=g)
        length = 4 + (i % 3)
        text = torch.zeros(length, TEXT_DIM)
        text[:, (freq * 4 + direction) % TEXT_DIM] = 1.0
        text += 0.1 * torch.randn(length, TEXT_DIM, generator=g)
        records.append(
            LatentRecord(
                id=f"sample-{i:03d}", caption=f"pattern {freq} moving {direction}", latent=latent.float(),
                text_embedding=text.float(), num_frames=9, height=32, width=32, fps=8.0, source="synthetic-test",
            )
        )
    write_latent_shards(records, root, rows_per_shard=rows_per_shard)
    write_empty_prompt_embedding(root, torch.zeros(1, TEXT_DIM))
    return root
