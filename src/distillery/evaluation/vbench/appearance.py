"""VBench's per-frame appearance dimensions of one video, ``uint8 [T, H, W, 3]`` RGB frames, as VBench 0.1.5
computes them (``aesthetic_quality.py``, ``imaging_quality.py``).

- **aesthetic quality** — CLIP ViT-L/14 image embeddings of every frame (VBench's ``clip_transform(224)``, 32 frames a
  forward), unit-normalised, scored by the LAION aesthetic predictor (one linear layer, 768 → 1); the video's score
  is the mean over its frames of ``score / 10``.
- **imaging quality** — MUSIQ (SPAQ) on every frame, frames whose longer side exceeds 512 first resized
  (:func:`~distillery.evaluation.vbench.frames.musiq_pixels`); the video's score is the mean over its frames; the
  dimension is the mean over videos ÷ 100 (:mod:`~distillery.evaluation.vbench.dimensions`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

AESTHETIC_BATCH = 32  # frames per CLIP forward (VBench's batch_size)
MUSIQ_BATCH = 8  # frames per MUSIQ forward (VBench: 1; the score of a frame does not depend on the others)


def aesthetic_quality(clip: torch.nn.Module, head: torch.nn.Linear, frames: np.ndarray, device: torch.device) -> float:
    """The video's aesthetic quality (module doc); ``clip`` a :class:`~transformers.CLIPModel` (ViT-L/14)."""
    from distillery.evaluation.vbench.consistency import clip_image_features
    from distillery.evaluation.vbench.frames import as_tensor, clip_pixels

    scores = []
    with torch.no_grad():
        for start in range(0, frames.shape[0], AESTHETIC_BATCH):
            feats = clip_image_features(clip, clip_pixels(as_tensor(frames[start:start + AESTHETIC_BATCH], device))).float()
            scores.append(head(F.normalize(feats, dim=-1, p=2)).squeeze(dim=-1))
    return float(torch.mean(torch.cat(scores) / 10, dim=0))


def imaging_quality(musiq: torch.nn.Module, frames: np.ndarray, device: torch.device) -> float:
    """The video's imaging quality before VBench's ÷100: the mean MUSIQ score of its frames (module doc)."""
    from distillery.evaluation.vbench.frames import as_tensor, musiq_pixels

    total = 0.0
    with torch.no_grad():
        for start in range(0, frames.shape[0], MUSIQ_BATCH):
            scores = musiq(musiq_pixels(as_tensor(frames[start:start + MUSIQ_BATCH], device)))
            total += sum(float(s) for s in scores)
    return total / frames.shape[0]
