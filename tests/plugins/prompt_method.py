"""A method that declares ``data_kind = "prompts"``: its batches must hold prompt embeddings only.

It rolls the student out from pure noise for the batch's prompts (one x0 prediction at t = 1000)
and pulls the prediction towards zero: not a useful objective, just a step that never reads a video
latent — and fails loudly if the trainer hands it one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distillery.methods.base import StepOutput, TrainingMethod
from distillery.models.base import Conditioning


@dataclass
class PromptRolloutConfig:
    latent_shape: list[int] = field(default_factory=lambda: [8, 3, 4, 4])  # (C, T, H, W) of the rollouts


class PromptRolloutMethod(TrainingMethod):
    config_class = PromptRolloutConfig
    data_kind = "prompts"

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        if "latents" in batch:
            raise AssertionError("a prompts-only method was handed video latents")
        text = batch["text_embeds"].to(self.student.device).float()
        noise = self.rng.randn((text.shape[0], *self.config.latent_shape)).to(self.student.device)
        t = torch.full((text.shape[0],), 1000.0, device=self.student.device)
        x0 = self.student.predict_x0(noise, t, Conditioning(text_embeds=text))
        loss = x0.pow(2).mean()
        return StepOutput(losses={"total_loss": loss})
