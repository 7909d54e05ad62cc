"""Exponential moving average of trainable roles' weights.

Shadow weights live beside the (sharded) parameters, in fp32, with the same sharding; they are
saved in checkpoints (key ``callback.<name>``) and can be exported instead of the raw weights
(``distillery export-weights --ema``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from distillery.callbacks.base import Callback, CallbackContext


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # the shard itself, no DTensor dispatch


class EMACallback(Callback):
    config_class = EMAConfig

    def __init__(self, config: EMAConfig, name: str) -> None:
        super().__init__(config, name)
        self.shadow: dict[str, dict[str, torch.Tensor]] = {}
        self._params: dict[str, dict[str, torch.nn.Parameter]] = {}

    def on_train_start(self, ctx: CallbackContext) -> None:
        for role in self.config.roles:
            if role not in ctx.method.role_models:
                raise ValueError(f"EMA role {role!r} is not a model role")
            params = {n: p for n, p in ctx.method.role_models[role].transformer.named_parameters() if p.requires_grad}
            self._params[role] = params
            with torch.no_grad():
                self.shadow[role] = {n: p.detach().float().clone() for n, p in params.items()}

    @torch.no_grad()
    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        if step % self.config.update_every:
            return {}
        for role, params in self._params.items():
            names = list(params)
            shadow = [_local(self.shadow[role][n]) for n in names]
            current = [_local(params[n]).float() for n in names]
            if step < self.config.start_step:
                torch._foreach_copy_(shadow, current)
            else:
                torch._foreach_lerp_(shadow, current, 1.0 - self.config.decay)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {role: dict(tensors) for role, tensors in self.shadow.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for role, tensors in state.items():
                for n, t in tensors.items():
                    target = self.shadow[role][n]
                    if t is not target:
                        _local(target).copy_(_local(t))
