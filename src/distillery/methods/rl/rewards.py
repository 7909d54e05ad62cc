"""Rewards: plugins that score decoded videos, one number per sample, for reward-driven post-training.

A reward is a class with ``component_kind = "reward"`` and a ``config_class`` (a :class:`RewardConfig`
subclass). A method that takes rewards lists them in its config as ``rewards: {name: {_target_: ..., knobs}}``;
the run config builds each entry as a component, under the allowed ``_target_`` prefixes like every target
(:func:`distillery.config.loader.resolve_plugins`), so an unknown or disallowed reward is one line before
anything loads, and the library never imports the reward's own module (the shipped ones: :mod:`distillery.rewards`).

Contract of a reward (:class:`Reward`):

- ``Reward(config, device)`` loads what it scores with (a model folder on ``device``); a folder that does not
  load is a one-line :class:`UserError` (its layout is checked when the config is built, its weights here);
- ``reward(videos, prompts)``: ``videos`` uint8 ``[B, T, H, W, 3]`` RGB (decoded frames), ``prompts`` B strings
  → float64 ``[B]``, one number per sample. The base selects the frames the reward reads — ``frames``:
  ``first`` (frame 0 only), ``all`` (every ``frame_stride``-th frame from 0) — and hands them to
  :meth:`Reward.score`; every reward's config says which (its class's default, where it has a choice);
- ``model_folder(config)``: the folder its model comes from (None: no model); its digest is recorded with the
  run (a changed reward model is refused on resume, like a changed teacher) and in the lineage.

:class:`RewardSet` is what a method holds: the run's rewards, their weighted sum (``weight`` of each entry;
the aggregation is the method's, the reward never reads its weight), and the refusal of a non-finite score.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded


@dataclass
class RewardConfig:
    """The knobs every reward has; a reward's own config extends it."""

    weight: float = bounded(1.0, -1000.0, 1000.0)  # its weight in the method's sum of rewards
    frames: Literal["first", "all"] = "all"  # which decoded frames it reads: frame 0, or every frame_stride-th
    frame_stride: int = bounded(1, 1, 1000)  # with frames: all, every this-many-th frame from frame 0


class Reward:
    """Base class of a reward plugin (module doc): selects its frames, scores them, one number per sample."""

    component_kind: ClassVar[str] = "reward"
    config_class: ClassVar[type] = RewardConfig

    def __init__(self, config: RewardConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)

    def select_frames(self, videos: np.ndarray) -> np.ndarray:
        """The frames this reward reads of uint8 ``[B, T, H, W, 3]`` videos: ``[B, T', H, W, 3]``."""
        if videos.ndim != 5 or videos.shape[-1] != 3:
            raise ValueError(f"rewards read videos as uint8 [B, T, H, W, 3], got {videos.dtype}{list(videos.shape)}")
        if self.config.frames == "first":
            return videos[:, :1]
        return videos[:, :: self.config.frame_stride]

    def score(self, frames: np.ndarray, prompts: list[str]) -> np.ndarray:
        """float ``[B]`` for the selected frames uint8 ``[B, T', H, W, 3]`` and their prompts (subclasses)."""
        raise NotImplementedError

    def __call__(self, videos: np.ndarray, prompts: list[str]) -> np.ndarray:
        if len(prompts) != videos.shape[0]:
            raise ValueError(f"{len(prompts)} prompts for {videos.shape[0]} videos")
        values = np.asarray(self.score(self.select_frames(videos), list(prompts)), dtype=np.float64)
        if values.shape != (videos.shape[0],):
            raise ValueError(f"{type(self).__name__} returned shape {list(values.shape)}, expected [{videos.shape[0]}]")
        return values

    @classmethod
    def model_folder(cls, config: RewardConfig) -> Path | None:
        """The folder ``config`` loads its model from (its digest goes with the run); None: it loads none."""
        del config
        return None


class RewardSet:
    """A method's rewards by name, from the run config's reward components (``components``: name → component);
    :meth:`load` builds them on a device."""

    def __init__(self, components: dict[str, Any]) -> None:
        if not components:
            raise UserError("config error: method.rewards: name at least one reward ({name: {_target_: ..., knobs}})")
        for name, comp in components.items():
            if not (isinstance(comp.cls, type) and issubclass(comp.cls, Reward)):
                raise UserError(f"config error: method.rewards.{name}._target_: {comp.target} is not a distillery reward (Reward)")
        self.components = dict(components)
        self.weights = {name: float(comp.config.weight) for name, comp in components.items()}
        self.rewards: dict[str, Reward] = {}

    def load(self, device: torch.device | str) -> None:
        """Build every reward on ``device`` (a folder that does not load: one :class:`UserError` line)."""
        self.rewards = {name: comp.cls(comp.config, device) for name, comp in self.components.items()}

    def score(self, videos: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
        """Each reward's float64 ``[B]`` and ``total`` (their weighted sum) for uint8 ``[B, T, H, W, 3]`` videos."""
        scores = {name: reward(videos, prompts) for name, reward in self.rewards.items()}  # after load()
        scores["total"] = sum(self.weights[name] * scores[name] for name in self.rewards)
        return scores

    @staticmethod
    def nonfinite(scores: dict[str, np.ndarray], prompts: list[str]) -> str | None:
        """What is not finite in ``scores`` (the first reward and prompt that gave NaN/Inf), or None."""
        for name, values in scores.items():
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size and name != "total":
                i = int(bad[0])
                return f"reward {name} returned {float(values[i])} for the sample of prompt {prompts[i][:80]!r}"
        return None

    def sources(self) -> dict[str, dict[str, Any]]:
        """``reward.<name>`` → ``{path, sha256}`` of its model's folder (its files, name and content), for the
        rewards that load one: known before any is loaded."""
        from distillery.common.hashcache import folder_sha256

        out = {}
        for name, comp in self.components.items():
            folder = comp.cls.model_folder(comp.config)
            if folder is not None:
                out[f"reward.{name}"] = {"path": str(folder), "sha256": folder_sha256(Path(folder))}
        return out
