"""A reward plugin that returns NaN for every sample after its first call (a broken reward model), for the refusal
tests: the run stops in one line at the rollout that got it, nothing saved after the last checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distillery.methods.rl.rewards import Reward, RewardConfig


@dataclass
class NaNRewardConfig(RewardConfig):
    good_calls: int = 0  # calls that score 0.5 before it returns NaN


class NaNReward(Reward):
    config_class = NaNRewardConfig

    def __init__(self, config: NaNRewardConfig, device="cpu") -> None:
        super().__init__(config, device)
        self.calls = 0

    def score(self, frames: np.ndarray, prompts: list[str]) -> np.ndarray:
        self.calls += 1
        value = 0.5 if self.calls <= self.config.good_calls else float("nan")
        return np.full(len(prompts), value)
