"""A test method that reads a target network: the student's frozen twin, whose weights are the student's shadow.

Per micro-batch the student learns flow matching on the data plus a pull of its x0 towards the target network's x0
at the same noisy input (computed without gradient, as a consistency model's target); after each optimizer step the
target follows the student, ``shadow ← shadow + (1 − decay) (weights − shadow)`` (:mod:`distillery.components.shadow`).
Small, but it exercises what such a method leans on: the twin built and placed as the student, run in the student's
compute precision, its shadow saved under ``shadows.target`` and resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.methods.base import StepOutput, TrainingMethod, flow_matching_loss
from distillery.models.schedule import x0_from_velocity


@dataclass
class TargetConfig:
    decay: float = 0.5  # the target's EMA decay per optimizer step
    target_weight: float = 1.0  # weight of the pull towards the target's x0


class TargetNetworkMethod(TrainingMethod):
    config_class = TargetConfig

    @classmethod
    def shadow_networks(cls, config: TargetConfig) -> dict[str, str]:
        return {"target": "student"}

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        tb = self.student.prepare_batch(batch, self.rng)
        v = self.student.predict_noise(tb.noisy_latents, tb.timesteps, tb)
        with torch.no_grad():
            target = self.twins["target"].predict_x0(tb.noisy_latents, tb.timesteps, tb)
        x0 = x0_from_velocity(tb.noisy_latents, v, tb.sigmas)
        flow = flow_matching_loss(v, tb, False).mean()
        pull = ((x0 - target) ** 2).mean()
        return StepOutput(losses={"total_loss": flow + self.config.target_weight * pull, "flow_loss": flow.detach(),
                                  "target_loss": pull.detach()})

    def optimizers_step(self, step: int) -> None:
        super().optimizers_step(step)
        self.shadows["target"].lerp_(1.0 - self.config.decay)
