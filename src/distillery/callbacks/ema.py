"""Exponential moving average of trainable roles' weights.

Each averaged role's shadow is a :class:`~distillery.components.shadow.ShadowWeights` of its
``trainable_modules()`` (fp32, the role's sharding); the shadows are saved in checkpoints (key
``callbacks.<name>``: ``{role: {module: {param: tensor}}}``) and can be exported instead of the raw
weights (``distillery export-weights --ema``). A role is averaged only at the steps it was updated
(``roles_to_step``): an alternating critic/student schedule does not pull a student's average
towards weights that did not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distillery.callbacks.base import Callback, CallbackContext
from distillery.components.shadow import ShadowWeights


@dataclass
class EMAConfig:
    decay: float = 0.999  # shadow ← decay·shadow + (1 − decay)·weights after each update
    roles: list[str] = field(default_factory=lambda: ["student"])  # trainable roles to average
    start_step: int = 0  # copy weights (no averaging) until this optimizer step
    update_every: int = 1  # optimizer steps between EMA updates

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError("decay must be in [0, 1]")
        if self.update_every < 1 or self.start_step < 0:
            raise ValueError("update_every >= 1 and start_step >= 0 are required")


class EMACallback(Callback):
    config_class = EMAConfig
    role_fields = ("roles",)  # each a role of the run, checked before any model loads

    def __init__(self, config: EMAConfig, name: str) -> None:
        super().__init__(config, name)
        self.shadows: dict[str, ShadowWeights] = {}

    @property
    def shadow(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        """``{role: {module: {param: tensor}}}``: each averaged role's shadow tensors."""
        return {role: shadow.tensors for role, shadow in self.shadows.items()}

    def on_train_start(self, ctx: CallbackContext) -> None:
        for role in self.config.roles:
            if role not in ctx.roles:
                raise ValueError(f"EMA role {role!r} is not a model role")
            self.shadows[role] = ShadowWeights.detached(ctx.roles[role].trainable_modules())

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        if step % self.config.update_every:
            return {}
        stepped = set(ctx.roles_to_step(step))
        for role, shadow in self.shadows.items():
            if role not in stepped:
                continue
            if step < self.config.start_step:
                shadow.copy_()
            else:
                shadow.lerp_(1.0 - self.config.decay)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {role: shadow.state_dict() for role, shadow in self.shadows.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for role, modules in state.items():
            self.shadows[role].load_state_dict(modules)
