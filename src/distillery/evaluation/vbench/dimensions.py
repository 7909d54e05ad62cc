"""VBench's dimensions over many videos: :class:`VBenchScorer` scores one video on the dimensions its prompt serves
(the models loaded once), :func:`aggregate` turns the videos' scores into each dimension's raw score as VBench
does — subject and background consistency weighted by each video's ``T − 1`` frame pairs (VBench's ``sim / cnt``),
the others the mean over videos, imaging quality then ÷ 100, dynamic degree the fraction of videos that move.

Precision is VBench's: every model in float32, except the CLIP towers on a CUDA device, which VBench's ``clip.load``
turns to half precision there (its mixed fp16/fp32 arrangement is not reproduced bit for bit: differences of order
1e-3 in a CLIP embedding's cosines; on the CPU both are float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distillery.common.errors import UserError
from distillery.evaluation.vbench.models import LoadedModel, check_folders, load_model

MIN_FRAMES = {"subject_consistency": 2, "background_consistency": 2, "temporal_flickering": 2, "motion_smoothness": 3,
              "dynamic_degree": 2, "aesthetic_quality": 1, "imaging_quality": 1, "overall_consistency": 1}
# RAFT and AMT pad frames to multiples of these and look correlations up in a 4-level pyramid at 1/8 resolution: its
# coarsest level must keep 2 pixels a side (at 1 pixel the bilinear lookup divides by zero: NaN, in VBench's code too)
PADDING = {"dynamic_degree": 8, "motion_smoothness": 16}
PYRAMID_MIN = 2 * 8 * 8  # padded pixels a side: 1/8 resolution, then 3 halvings, leaves 2
PAIR_WEIGHTED = ("subject_consistency", "background_consistency")


def check_video(frames: int, height: int, width: int, dimensions, name: str) -> None:
    """One line when a video of ``frames`` frames of ``height × width`` is shorter or smaller than a dimension needs."""
    for d in dimensions:
        if frames < MIN_FRAMES[d]:
            raise UserError(f"vbench {d}: video {name} has {frames} frame(s); the dimension needs at least {MIN_FRAMES[d]}")
        if d in PADDING:
            pad = PADDING[d]
            padded = min(-(-height // pad) * pad, -(-width // pad) * pad)
            if padded < PYRAMID_MIN:
                raise UserError(f"vbench {d}: video {name} is {height}×{width}; its optical flow needs frames of at least "
                                f"{PYRAMID_MIN - pad + 1} pixels a side (smaller ones give NaN, in VBench's code too)")


@dataclass
class VideoScore:
    """One video's score on one dimension, and its weight in the dimension's score (frame pairs or 1)."""

    name: str
    dimension: str
    value: float
    weight: float = 1.0


@dataclass
class VBenchScorer:
    """The models ``dimensions`` need, from ``models`` (key → folder), on ``device`` (module doc); ``loaded``: models
    already built (a benchmark's), used instead of folders."""

    models: dict[str, str]
    dimensions: tuple[str, ...]
    device: str = "cpu"
    where: str = "vbench.models"
    loaded: dict[str, LoadedModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.torch_device = torch.device("cpu")
        if not self.loaded:
            from distillery.common.log import quiet_library_progress

            quiet_library_progress()
            folders = check_folders(self.models, self.dimensions, self.where)  # every folder before any weight loads
            # the checkpoints of our modules first: their strict key checks refuse a wrong file before the large loads
            for key in sorted(folders, key=lambda k: k in ("dino", "clip_b32", "clip_l14")):
                self.loaded[key] = load_model(key, Path(folders[key]), self.torch_device, self.where)
        self.to(self.device)
        if "aesthetic" in self.loaded:
            head, clip = self.loaded["aesthetic"].module, self.loaded["clip_l14"].module
            if head.in_features != clip.config.projection_dim:
                raise UserError(f"{self.where}.aesthetic: the head reads {head.in_features}-dimensional embeddings but "
                                f"{self.where}.clip_l14 gives {clip.config.projection_dim}: not the CLIP ViT-L/14 it was trained on")
        self._text = None
        if "viclip" in self.loaded:
            from distillery.evaluation.vbench.overall import TextEmbeddings

            self._text = TextEmbeddings(self.loaded["viclip"].module, self.loaded["viclip"].extra)

    def to(self, device: str | torch.device) -> "VBenchScorer":
        """Every model moved to ``device``: float32, the CLIP towers in half precision on a CUDA device (module doc).
        The validate stage loads the models on the CPU before it samples (a wrong file refused before any work) and
        moves them to the device once the candidates are sampled."""
        self.torch_device = torch.device(device)
        self.device = str(self.torch_device)
        for key, model in self.loaded.items():
            half = key in ("clip_b32", "clip_l14") and self.torch_device.type == "cuda"
            model.module = model.module.to(self.torch_device, torch.float16 if half else torch.float32)
        return self

    @property
    def published(self) -> bool:
        """Whether every model is the published one (architecture, and weights where a digest is known)."""
        return all(m.published for m in self.loaded.values())

    def describe(self) -> dict:
        return {key: m.describe() for key, m in self.loaded.items()}

    def score(self, frames: np.ndarray, fps: float, prompt: str, dimensions, name: str) -> list[VideoScore]:
        """``uint8 [T, H, W, 3]`` frames of one video sampled for ``prompt`` at ``fps``, scored on ``dimensions``."""
        from distillery.evaluation.vbench import appearance, consistency, motion, overall

        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise UserError(f"vbench: video {name} is not uint8 [T, H, W, 3] RGB frames ({frames.dtype}{frames.shape})")
        check_video(frames.shape[0], frames.shape[1], frames.shape[2], dimensions, name)
        dev, m, out = self.torch_device, self.loaded, []
        for d in dimensions:
            if d == "subject_consistency":
                value = consistency.subject_consistency(m["dino"].module, frames, dev)
            elif d == "background_consistency":
                value = consistency.background_consistency(m["clip_b32"].module, frames, dev)
            elif d == "temporal_flickering":
                value = consistency.temporal_flickering(frames)
            elif d == "motion_smoothness":
                value = motion.motion_smoothness(m["amt"].module, frames, dev)
            elif d == "dynamic_degree":
                value = motion.dynamic_degree(m["raft"].module, frames, fps, dev)
            elif d == "aesthetic_quality":
                value = appearance.aesthetic_quality(m["clip_l14"].module, m["aesthetic"].module, frames, dev)
            elif d == "imaging_quality":
                value = appearance.imaging_quality(m["musiq"].module, frames, dev)
            else:
                value = overall.overall_consistency(m["viclip"].module, self._text, frames, prompt, dev)
            out.append(VideoScore(name, d, value, float(frames.shape[0] - 1) if d in PAIR_WEIGHTED else 1.0))
        return out


def aggregate(rows: list[VideoScore]) -> dict[str, float]:
    """Each dimension's raw VBench score from its videos' scores (module doc)."""
    out: dict[str, float] = {}
    for d in dict.fromkeys(r.dimension for r in rows):
        mine = [r for r in rows if r.dimension == d]
        if d in PAIR_WEIGHTED:
            value = sum(r.value * r.weight for r in mine) / sum(r.weight for r in mine)
        else:
            value = float(np.mean([r.value for r in mine]))
        out[d] = value / 100.0 if d == "imaging_quality" else value
    return out
