"""A test method with two trainable roles and a frozen one, updated on alternating schedules.

``critic`` (trainable) learns the flow-matching loss on the data every step; ``student``
(trainable) regresses the frozen ``teacher``'s velocity, but only every
``generator_update_interval`` steps (the DMD2 schedule: the critic steps every step, the
generator every k-th). Small, but it exercises everything a distillation method leans on: per-role
optimizers, ``roles_to_step``, per-role grad clipping/EMA, a frozen role that is not saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.methods.base import StepOutput, TrainingMethod, flow_matching_loss


@dataclass
class TwoRoleConfig:
    generator_update_interval: int = 2  # the student steps at every k-th optimizer step


class TwoRoleMethod(TrainingMethod):
    config_class = TwoRoleConfig
    required_roles = ("student", "critic", "teacher")
    trainable_roles = ("student", "critic")
    frozen_roles = ("teacher",)

    def is_update_step(self, step: int) -> bool:
        return step % self.config.generator_update_interval == 0

    def roles_to_step(self, step: int) -> list[str]:
        return ["critic", "student"] if self.is_update_step(step) else ["critic"]

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        critic = self.role_models["critic"]
        tb = critic.prepare_batch(batch, self.rng)
        critic_loss = flow_matching_loss(critic.predict_noise(tb.noisy_latents, tb.timesteps, tb), tb, False).mean()
        losses = {"critic_loss": critic_loss}
        total = critic_loss
        if self.is_update_step(step):
            with torch.no_grad():
                target = self.role_models["teacher"].predict_noise(tb.noisy_latents, tb.timesteps, tb)
            student_loss = ((self.student.predict_noise(tb.noisy_latents, tb.timesteps, tb) - target) ** 2).mean()
            losses["student_loss"] = student_loss.detach()
            total = total + student_loss
        losses["critic_loss"] = critic_loss.detach()
        return StepOutput(losses={"total_loss": total, **losses})
