"""VBench 0.1.5's frame handling — which frames each dimension reads and how they are resized, cropped and
normalised — written with torch ops that compute what its torchvision transforms compute on tensors.

- **Resize to a shorter side** ``S`` (torchvision ``Resize(S)``): the shorter side becomes ``S``, the longer
  ``int(S · long / short)``; :func:`resize` interpolates (``align_corners=False``, no antialiasing, as VBench asks)
  and skips images already at that size. On a float tensor the result stays float (VBench's ``load_video`` hands
  float32 frames to most dimensions); on a uint8 one (ViCLIP's decord reader) a bicubic result is clamped to
  0..255 and rounded back to integers.
- **Centre crop** ``S`` (torchvision ``CenterCrop``): top ``int(round((H − S) / 2))``, left likewise.
- **The 8 frames ViCLIP reads** (:func:`middle_indices`): the video split into 8 equal intervals
  (``numpy.linspace(0, T, 9)`` truncated to integers), the middle of each.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from distillery.evaluation.clip_scores import OPENAI_MEAN, OPENAI_STD

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # DINO's normalisation (VBench's dino_transform)
IMAGENET_STD = (0.229, 0.224, 0.225)


def as_tensor(frames: np.ndarray, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``uint8 [T, H, W, 3]`` RGB → ``[T, 3, H, W]`` of ``dtype`` (values 0..255) on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(frames)).to(device).permute(0, 3, 1, 2).to(dtype)


def shorter_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision's output size for ``Resize(size)``: the shorter side ``size``, the longer ``int(size · long / short)``."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def resize(x: torch.Tensor, size: tuple[int, int], mode: str, integer: bool = False) -> torch.Tensor:
    """``[N, C, H, W]`` (float values 0..255) resized to ``size`` as torchvision's tensor ``resize`` (module doc);
    ``integer``: the input was uint8, so the result is clamped (bicubic) and rounded to integers, as torchvision does."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    y = F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=False)
    if integer:
        if mode == "bicubic":
            y = y.clamp(0, 255)
        y = torch.round(y)
    return y


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's ``CenterCrop(size)`` of ``[..., H, W]`` (at least ``size`` each)."""
    h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top:top + size, left:left + size]


def normalise(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(x / 255 − mean) / std`` per channel of ``[N, 3, H, W]`` 0..255 values."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x.float().div(255.0) - m) / s


def clip_pixels(x: torch.Tensor, size: int = 224, integer: bool = False) -> torch.Tensor:
    """VBench's ``clip_transform(size)``: bicubic resize to a shorter side ``size``, centre crop, OpenAI's normalisation."""
    h, w = x.shape[-2:]
    return normalise(center_crop(resize(x, shorter_side_size(h, w, size), "bicubic", integer), size), OPENAI_MEAN, OPENAI_STD)


def dino_pixels(x: torch.Tensor, size: int = 224) -> torch.Tensor:
    """VBench's ``dino_transform(size)``: bilinear resize to a shorter side ``size`` (no crop), ImageNet's normalisation."""
    h, w = x.shape[-2:]
    return normalise(resize(x, shorter_side_size(h, w, size), "bilinear"), IMAGENET_MEAN, IMAGENET_STD)


def musiq_pixels(x: torch.Tensor, longest: int = 512) -> torch.Tensor:
    """VBench's imaging-quality preprocessing (its default ``longer`` mode): frames whose longer side exceeds
    ``longest`` are resized (bilinear) to ``(int(s·H), int(s·W))`` with ``s = longest / max(H, W)``; then ÷255."""
    h, w = x.shape[-2:]
    if max(h, w) > longest:
        scale = longest / max(h, w)
        x = resize(x, (int(scale * h), int(scale * w)), "bilinear")
    return x / 255.0


def middle_indices(count: int, length: int) -> list[int]:
    """The ``count`` frame indices VBench's ``get_frame_indices(count, length, sample="middle")`` picks: the middle of
    each of ``count`` equal intervals; a video shorter than ``count`` repeats its last pick."""
    picks = min(count, length)
    edges = np.linspace(start=0, stop=length, num=picks + 1).astype(int)
    indices = [int((a + b - 1) // 2) for a, b in zip(edges[:-1], edges[1:])]
    return indices + [indices[-1]] * (count - len(indices))
