"""Callback interface: hooks the trainer calls around each optimizer step.

Hook order per optimizer step: ``on_before_optimizer_step`` (after all micro-batch backwards,
before ``optimizer.step``) → ``on_training_step_end`` (after the step). Hooks return metric
tensors; the trainer reads them with one host sync per step. ``state_dict`` holds tensors that go
into the DCP checkpoint (DTensors are resharded on load); ``load_state_dict`` restores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from distillery.methods.base import TrainingMethod


@dataclass
class CallbackContext:
    """What callbacks may see: the method (and through it the role models) and the rank."""

    method: "TrainingMethod"
    rank: int
    world_size: int
    max_train_steps: int


class Callback:
    config_class: ClassVar[type]

    def __init__(self, config: Any, name: str) -> None:
        self.config = config
        self.name = name

    def on_train_start(self, ctx: CallbackContext) -> None: ...

    def on_before_optimizer_step(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        return {}

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        return {}

    def on_validation_begin(self, ctx: CallbackContext, step: int) -> None: ...

    def on_validation_end(self, ctx: CallbackContext, step: int) -> None: ...

    def on_train_end(self, ctx: CallbackContext, step: int) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
