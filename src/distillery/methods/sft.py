"""Supervised fine-tuning with the rectified-flow loss (student only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distillery.methods.base import StepOutput, TrainingMethod, apply_caption_dropout, flow_matching_loss


@dataclass
class SFTConfig:
    precondition_outputs: bool = False  # loss on x0 = x_t − σ·v instead of on the velocity v
    caption_dropout: float = 0.0  # probability of training a sample on the empty prompt (enables CFG)

    def __post_init__(self) -> None:
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError("caption_dropout must be in [0, 1]")


class SFTMethod(TrainingMethod):
    """Flow-matching SFT: one timestep per sample, MSE between predicted and true velocity."""

    config_class = SFTConfig

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        tb = self.student.prepare_batch(batch, self.rng)
        apply_caption_dropout(tb, self.config.caption_dropout, self.rng)
        pred = self.student.predict_noise(tb.noisy_latents, tb.timesteps, tb, conditional=True)
        loss = flow_matching_loss(pred, tb, self.config.precondition_outputs).mean()
        return StepOutput(losses={"total_loss": loss, "flow_loss": loss.detach()})
