"""VBench's motion dimensions of one video, ``uint8 [T, H, W, 3]`` RGB frames, as VBench 0.1.5 computes them
(``motion_smoothness.py``, ``dynamic_degree.py``).

- **motion smoothness** — AMT-S interpolates the middle frame (``embt = 0.5``) between each pair of consecutive
  even frames (0, 2, 4, …; frames in [0, 1], replicate-padded to multiples of 16); each prediction, back to uint8
  by ``(x · 255).clip(0, 255)`` and truncation, is compared with the odd frame it stands for (1, 3, …): the video's
  score is ``(255 − m) / 255``, ``m`` the mean over those pairs of the mean absolute uint8 difference. Needs ``T ≥ 3``.
  VBench shrinks the frames for AMT when a CUDA card's memory is small (its ``anchor_resolution`` formula); at
  480×832 the factor is 1 on any card with more than about 3 GB, and on the CPU it is always 1 — a factor below 1
  is refused here rather than approximated. Frames must keep 113+ pixels a side (AMT) and 121+ (RAFT): their 4-level
  correlation pyramids at 1/8 resolution would shrink to one pixel, where the bilinear lookup divides by zero
  (:func:`~distillery.evaluation.vbench.dimensions.check_video`).
- **dynamic degree** — frames taken every ``max(1, round(fps / 8))`` (every 2nd at 16 fps); RAFT (20 iterations,
  frames replicate-padded to multiples of 8) between consecutive taken frames; each pair's score the mean of the
  largest 5 % (``int(0.05 · h · w)``) of the flow magnitudes; the video *moves* (1.0, else 0.0) once
  ``round(4 · n / 16)`` pair scores (``n`` the frames taken) exceed ``6 · min(H, W) / 256``. Needs ``T ≥ 2``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from distillery.common.errors import UserError

AMT_ANCHOR_RESOLUTION = 1024 * 512  # VBench's AMT memory heuristic, CUDA only
AMT_ANCHOR_MEMORY = 1500 * 1024 ** 2
AMT_ANCHOR_MEMORY_BIAS = 2500 * 1024 ** 2
RAFT_ITERS = 20


def amt_scale(height: int, width: int, device: torch.device) -> float:
    """VBench's AMT resize factor for ``height × width`` frames on ``device`` (1 on the CPU)."""
    if device.type != "cuda":
        return 1.0
    memory = torch.cuda.get_device_properties(device).total_memory
    scale = AMT_ANCHOR_RESOLUTION / (height * width) * np.sqrt((memory - AMT_ANCHOR_MEMORY_BIAS) / AMT_ANCHOR_MEMORY)
    scale = 1.0 if scale > 1 else scale
    return float(1 / np.floor(1 / np.sqrt(scale) * 16) * 16)


def motion_smoothness(amt: torch.nn.Module, frames: np.ndarray, device: torch.device) -> float:
    """The video's motion smoothness (module doc)."""
    from distillery.evaluation.vbench.raft import Padder

    h, w = frames.shape[1:3]
    scale = amt_scale(h, w, device)
    if scale < 1:
        raise UserError(f"vbench motion_smoothness: VBench would shrink {h}×{w} frames by {scale:.2f} for AMT on this "
                        "card's memory; run it on a card with more memory or on the CPU")
    even = torch.from_numpy(np.ascontiguousarray(frames[0::2])).permute(0, 3, 1, 2).float() / 255.0
    padder = Padder(h, w, divisor=16)
    embt = torch.full((1, 1, 1, 1), 0.5, device=device)
    diffs = []
    with torch.no_grad():
        for i in range(even.shape[0] - 1):
            a = padder.pad(even[i:i + 1].to(device))
            b = padder.pad(even[i + 1:i + 2].to(device))
            pred = padder.unpad(amt(a, b, embt))[0].permute(1, 2, 0).cpu().numpy()
            pred = (pred * 255.0).clip(0, 255).astype(np.uint8)
            diffs.append(np.mean(np.abs(pred.astype(np.int16) - frames[2 * i + 1].astype(np.int16)).astype(np.uint8)))
    return (255.0 - float(np.mean(np.array(diffs)))) / 255.0


def dynamic_degree(raft: torch.nn.Module, frames: np.ndarray, fps: float, device: torch.device) -> float:
    """The video's dynamic degree, 1.0 (moves) or 0.0 (module doc); ``fps`` the video's frame rate."""
    from distillery.evaluation.vbench.raft import Padder

    interval = max(1, round(fps / 8))
    taken = frames[::interval]
    h, w = taken.shape[1:3]
    threshold = 6.0 * (min(h, w) / 256.0)
    needed = round(4 * (taken.shape[0] / 16.0))
    padder = Padder(h, w, divisor=8)
    count = 0
    with torch.no_grad():
        for i in range(taken.shape[0] - 1):
            pair = torch.from_numpy(np.ascontiguousarray(taken[i:i + 2])).permute(0, 3, 1, 2).float().to(device)
            pair = padder.pad(pair)
            flow = raft(pair[:1], pair[1:], iters=RAFT_ITERS)[0]
            if flow_score(flow) > threshold:
                count += 1
            if count >= needed:
                return 1.0
    return 0.0


def flow_score(flow: torch.Tensor) -> float:
    """The mean of the largest 5 % (``int(0.05 · h · w)``) of the magnitudes of a ``[2, h, w]`` flow (float32, as numpy)."""
    rad = torch.sqrt(flow[0] ** 2 + flow[1] ** 2).flatten().cpu().numpy()
    cut = int(rad.shape[0] * 0.05)
    return float(np.mean(np.abs(np.sort(-rad))[:cut])) if cut else math.nan
