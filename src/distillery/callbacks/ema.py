"""Exponential moving average of trainable roles' weights.

Shadow weights live beside the (sharded) parameters of each role's ``trainable_modules()``, in
fp32, with the same sharding; they are saved in checkpoints (key ``callbacks.<name>``:
``{role: {module: {param: tensor}}}``) and can be exported instead of the raw weights
(``distillery export-weights --ema``). A role is averaged only at the steps it was updated
(``roles_to_step``): an alternating critic/student schedule does not pull a student's average
towards weights that did not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distillery.callbacks.base import Callback, CallbackContext
from distillery.components.distributed import local_shard


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
        self.shadow: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._params: dict[str, dict[str, dict[str, torch.nn.Parameter]]] = {}

    def on_train_start(self, ctx: CallbackContext) -> None:
        for role in self.config.roles:
            if role not in ctx.roles:
                raise ValueError(f"EMA role {role!r} is not a model role")
            self._params[role], self.shadow[role] = {}, {}
            for module_name, module in ctx.roles[role].trainable_modules().items():
                params = {n: p for n, p in module.named_parameters() if p.requires_grad}
                self._params[role][module_name] = params
                with torch.no_grad():
                    self.shadow[role][module_name] = {n: p.detach().float().clone() for n, p in params.items()}

    @torch.no_grad()
    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        if step % self.config.update_every:
            return {}
        stepped = set(ctx.roles_to_step(step))
        for role, modules in self._params.items():
            if role not in stepped:
                continue
            for module_name, params in modules.items():
                names = list(params)
                shadow = [local_shard(self.shadow[role][module_name][n]) for n in names]
                current = [local_shard(params[n]).float() for n in names]
                if step < self.config.start_step:
                    torch._foreach_copy_(shadow, current)
                else:
                    torch._foreach_lerp_(shadow, current, 1.0 - self.config.decay)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {role: {m: dict(tensors) for m, tensors in modules.items()} for role, modules in self.shadow.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for role, modules in state.items():
                for module_name, tensors in modules.items():
                    for n, t in tensors.items():
                        target = self.shadow[role][module_name][n]
                        if t is not target:
                            local_shard(target).copy_(local_shard(t))
