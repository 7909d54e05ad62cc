"""VBench's temporal-consistency dimensions of one video, ``uint8 [T, H, W, 3]`` RGB frames, as VBench 0.1.5
computes them (``subject_consistency.py``, ``background_consistency.py``, ``temporal_flickering.py``).

- **subject consistency** — DINO ViT-B/16 features of every frame (:func:`~distillery.evaluation.vbench.frames.dino_pixels`:
  bilinear to a shorter side of 224, no crop, ImageNet normalisation), unit-normalised; for each frame ``t ≥ 1``
  ``(max(0, cos(f_{t−1}, f_t)) + max(0, cos(f_0, f_t))) / 2``; the video's score is their mean over the ``T − 1``
  frames. Needs ``T ≥ 2``.
- **background consistency** — the same with CLIP ViT-B/32 image embeddings
  (:func:`~distillery.evaluation.vbench.frames.clip_pixels`: bicubic to 224, centre crop, OpenAI normalisation).
- **temporal flickering** — ``(255 − m) / 255`` with ``m`` the mean over the ``T − 1`` consecutive frame pairs of the
  mean absolute difference of all pixels and channels (float32 per pair, as VBench's ``cv2.absdiff``). Needs ``T ≥ 2``.

A dimension's score over many videos (:mod:`~distillery.evaluation.vbench.dimensions`) weighs the two consistency
scores by their ``T − 1`` frame pairs, as VBench's ``sim / cnt``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def pair_similarity(features: torch.Tensor) -> float:
    """Sum over ``t ≥ 1`` of ``(max(0, cos(f_{t−1}, f_t)) + max(0, cos(f_0, f_t))) / 2`` for ``[T, D]`` features
    (VBench's ``video_sim``; divided by ``T − 1`` it is the video's score)."""
    f = F.normalize(features.float(), dim=-1, p=2)
    previous = F.cosine_similarity(f[:-1], f[1:]).clamp(min=0.0)
    first = F.cosine_similarity(f[:1].expand_as(f[1:]), f[1:]).clamp(min=0.0)
    return float(((previous.double() + first.double()) / 2).sum())


def subject_consistency(dino: torch.nn.Module, frames: np.ndarray, device: torch.device, batch: int = 16) -> float:
    """The video's subject consistency (module doc); ``dino`` a :class:`~transformers.ViTModel` with DINO's position
    interpolation (:func:`~distillery.evaluation.vbench.dino.use_dino_position_interpolation`)."""
    from distillery.evaluation.vbench.frames import as_tensor, dino_pixels

    feats = []
    dtype = next(dino.parameters()).dtype
    with torch.no_grad():
        for start in range(0, frames.shape[0], batch):
            x = dino_pixels(as_tensor(frames[start:start + batch], device)).to(dtype)
            feats.append(dino(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0].float())
    return pair_similarity(torch.cat(feats)) / (frames.shape[0] - 1)


def clip_image_features(clip: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """CLIP image embeddings ``[N, D]`` (``visual_projection`` of the pooled class token) of normalised ``[N, 3, S, S]``."""
    out = clip.vision_model(pixel_values=pixels.to(next(clip.parameters()).dtype))
    return clip.visual_projection(out.pooler_output)


def background_consistency(clip: torch.nn.Module, frames: np.ndarray, device: torch.device) -> float:
    """The video's background consistency (module doc); ``clip`` a :class:`~transformers.CLIPModel` (ViT-B/32),
    all the video's frames in one forward as VBench's."""
    from distillery.evaluation.vbench.frames import as_tensor, clip_pixels

    with torch.no_grad():
        feats = clip_image_features(clip, clip_pixels(as_tensor(frames, device)))
    return pair_similarity(feats) / (frames.shape[0] - 1)


def temporal_flickering(frames: np.ndarray) -> float:
    """The video's temporal flickering score (module doc), from the frames alone."""
    maes = []
    for a, b in zip(frames[:-1], frames[1:]):
        maes.append(np.mean(np.abs(a.astype(np.float32) - b.astype(np.float32))))
    return (255.0 - float(np.mean(np.array(maes)))) / 255.0
