"""The synthetic clip set's verifiable reward: does the video show the colour, shape and motion its caption says?

:class:`AdherenceReward` (a reward plugin, :mod:`distillery.methods.rl.rewards`; run config:
``method.rewards.<name>: {_target_: distillery.rewards.adherence.AdherenceReward, folder: <tiny base>}``) reads
each decoded video back with the clip analyzer (:mod:`distillery.clips.analyzer`, with the thresholds the
folder's ``analyzer.json`` holds: a tiny base's, fitted on its VAE) and scores it against its caption: the
fraction of ``attributes`` (colour, shape, direction) read back as the caption says — 0, 1/3, 2/3 or 1 with
all three. It reads every ``frame_stride``-th frame (direction is the centroid's motion over them, colour and
shape their medians), never the first alone. A caption outside the clip grammar scores nothing: it is refused
in one line rather than scored 0.

This is the number validate reports as ``adherence`` when all three must be right (``all``); the reward gives
partial credit so that a group of rollouts where none is fully right still ranks them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distillery.clips.analyzer import AnalyzerConfig, analyze, score_analysis
from distillery.clips.grammar import parse_caption
from distillery.common.errors import UserError
from distillery.methods.rl.rewards import Reward, RewardConfig

ATTRIBUTES = ("colour", "shape", "direction")


@dataclass
class AdherenceRewardConfig(RewardConfig):
    folder: str = ""  # a folder holding analyzer.json (a fitted tiny base: distillery tinybase)
    attributes: list[str] = field(default_factory=lambda: list(ATTRIBUTES))  # what is scored, each a third by default

    def __post_init__(self) -> None:
        if not self.folder:
            raise ValueError("folder is required: a folder holding analyzer.json (a fitted tiny base)")
        path = Path(self.folder) / "analyzer.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist: the folder must hold the analyzer's thresholds (a fitted tiny base)")
        unknown = [a for a in self.attributes if a not in ATTRIBUTES]
        if unknown or not self.attributes or len(set(self.attributes)) != len(self.attributes):
            raise ValueError(f"attributes must be distinct items of {', '.join(ATTRIBUTES)}, got {self.attributes}")
        if self.frames == "first":
            raise ValueError("frames: first cannot be scored: the analyzer reads motion and medians over frames (use all)")


class AdherenceReward(Reward):
    """Fraction of the caption's attributes the analyzer reads back from the video (module doc)."""

    config_class = AdherenceRewardConfig

    def __init__(self, config: AdherenceRewardConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(config, device)
        path = Path(config.folder) / "analyzer.json"
        try:
            self.analyzer = AnalyzerConfig(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"method.rewards: {path} is not the analyzer's thresholds ({str(exc)[:120]})") from None

    @classmethod
    def model_folder(cls, config: AdherenceRewardConfig) -> Path:
        return Path(config.folder)

    def score(self, frames: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = np.zeros(len(prompts))
        for i, (video, prompt) in enumerate(zip(frames, prompts)):
            if parse_caption(prompt) is None:
                raise UserError(f"method.rewards: the adherence reward scores captions of the synthetic clip grammar; "
                                f"{prompt[:80]!r} is not one")
            right = score_analysis(analyze(video, self.analyzer), prompt)
            out[i] = sum(right[a] for a in self.config.attributes) / len(self.config.attributes)
        return out
