"""Gradient-norm clipping per role, with the pre-clip norm logged as ``grad_norm/<role>``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from distillery.callbacks.base import Callback, CallbackContext


@dataclass
class GradClipConfig:
    max_grad_norm: float | None = 1.0  # clip each role's global L2 grad norm to this; null: log only
    norm_type: float = 2.0  # p of the p-norm

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("max_grad_norm must be > 0 (or null to only log the norm)")


def total_grad_norm(params: list[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
    """Global grad norm over (possibly FSDP-sharded) parameters, as a plain replicated tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


class GradClipCallback(Callback):
    config_class = GradClipConfig

    def on_before_optimizer_step(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        metrics = {}
        for role, module in ctx.method.grad_clip_targets(step).items():
            params = [p for p in module.parameters() if p.grad is not None]
            norm = total_grad_norm(params, self.config.norm_type)
            if self.config.max_grad_norm is not None and params:
                torch.nn.utils.clip_grads_with_norm_(params, self.config.max_grad_norm, norm.to(params[0].grad.device), foreach=True)
            metrics[f"grad_norm/{role}"] = norm.detach()
        return metrics
