"""Training-method interface: losses, optimizers, LR schedules and backward routing.

A method receives its role models (``{"student": ..., "teacher": ...}``) already built and owns
nothing else it did not get: teachers and critics come in through ``role_models``. The trainer
calls, per optimizer step::

    for each micro-batch:  out = method.single_train_step(batch, step); method.backward(out, rounds)
    callbacks.on_before_optimizer_step; method.optimizers_step(step); method.zero_grad(step)

Randomness: ``self.rng`` (a :class:`~distillery.engine.rng.BatchRNG` on the student's device) is the only
source of random draws in methods, models and samplers; its per-sample draws do not depend on
the number of ranks.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from distillery.config.schema import OptimizerConfig, TrainingConfig
from distillery.errors import UserError
from distillery.models.base import ModelBase
from distillery.engine.rng import BatchRNG


@dataclass
class StepOutput:
    """What one micro-batch step returns: losses (``total_loss`` is backpropagated), the context the
    backward needs, and extra scalar metrics (tensors; read on the host once per optimizer step)."""

    losses: dict[str, torch.Tensor]
    backward_ctx: Any = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def lr_lambda_for(cfg: OptimizerConfig, max_steps: int):
    """LR multiplier per optimizer step: linear warmup, then constant / cosine / linear decay."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        span = max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_scheduler == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor


class TrainingMethod(ABC):
    """Base class of SFT, DFSFT, DMD2, Self-Forcing, PDD.

    Class attributes: ``config_class`` (knobs dataclass), ``required_roles`` (must be present),
    ``optional_roles``, ``trainable_roles`` (must be trainable), ``frozen_roles`` (must be frozen).
    """

    config_class: ClassVar[type]
    required_roles: ClassVar[tuple[str, ...]] = ("student",)
    optional_roles: ClassVar[tuple[str, ...]] = ()
    trainable_roles: ClassVar[tuple[str, ...]] = ("student",)
    frozen_roles: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        config: Any,
        role_models: dict[str, ModelBase],
        training: TrainingConfig,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.training = training
        self.rank = rank
        self.check_roles(role_models)
        self.role_models = dict(role_models)
        self.student = role_models["student"]
        self.rng = BatchRNG(training.loop.seed)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.lr_schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler] = {}

    @classmethod
    def check_roles(cls, role_models: dict[str, Any]) -> None:
        """Raise a UserError unless the roles fit this method (names and trainability)."""
        name = cls.__name__
        missing = [r for r in cls.required_roles if r not in role_models]
        allowed = set(cls.required_roles) | set(cls.optional_roles)
        extra = [r for r in role_models if r not in allowed]
        if missing or extra:
            raise UserError(
                f"config error: models: {name} needs roles {', '.join(cls.required_roles)}"
                + (f" (optional: {', '.join(cls.optional_roles)})" if cls.optional_roles else "")
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unexpected {', '.join(extra)}" if extra else "")
            )
        for role in cls.trainable_roles:
            if role in role_models and not _is_trainable(role_models[role]):
                raise UserError(f"config error: models.{role}.trainable: {name} trains the {role}; set it to true")
        for role in cls.frozen_roles:
            if role in role_models and _is_trainable(role_models[role]):
                raise UserError(f"config error: models.{role}.trainable: {name} keeps the {role} frozen; set it to false")

    # -- set-up ---------------------------------------------------------------------------
    def on_train_start(self, device: torch.device, world_size: int = 1) -> None:
        """Create the random stream on ``device`` (seeded with the run seed, sliced by rank)."""
        self.rng = BatchRNG(self.training.loop.seed, self.rank, world_size, device)

    def build_optimizers(self) -> None:
        """AdamW + LR schedule per trainable role; call after the transformers are sharded."""
        opt_cfg = self.training.optimizer
        for role, model in self.role_models.items():
            if not model.trainable:
                continue
            params = [p for p in model.transformer.parameters() if p.requires_grad]
            fused = bool(params) and params[0].device.type == "cuda"
            optimizer = torch.optim.AdamW(
                params, lr=opt_cfg.learning_rate, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
                weight_decay=opt_cfg.weight_decay, fused=fused or None,
            )
            self.optimizers[role] = optimizer
            self.lr_schedulers[role] = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda_for(opt_cfg, self.training.loop.max_train_steps)
            )

    # -- per step -------------------------------------------------------------------------
    @abstractmethod
    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        """Forward one micro-batch and return its losses (``total_loss`` required)."""

    def backward(self, output: StepOutput, grad_accum_rounds: int = 1) -> None:
        """Default routing: the student's backward on ``total_loss``."""
        self.student.backward(output.losses["total_loss"], output.backward_ctx, grad_accum_rounds)

    def roles_to_step(self, step: int) -> list[str]:
        """Trainable roles whose optimizers step at ``step`` (override for alternating updates)."""
        del step
        return list(self.optimizers)

    def optimizers_step(self, step: int) -> None:
        for role in self.roles_to_step(step):
            self.optimizers[role].step()
            self.lr_schedulers[role].step()

    def zero_grad(self, step: int) -> None:
        del step
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def grad_clip_targets(self, step: int) -> dict[str, torch.nn.Module]:
        """Modules whose gradients are clipped (and whose grad norm is logged) at ``step``."""
        return {role: self.role_models[role].transformer for role in self.roles_to_step(step)}

    def learning_rates(self) -> dict[str, float]:
        return {role: sched.get_last_lr()[0] for role, sched in self.lr_schedulers.items()}

    # -- state (per rank, not DCP) ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.load_state_dict(state["rng"])


def _is_trainable(model: Any) -> bool:
    if isinstance(model, ModelBase):
        return model.trainable
    return bool(getattr(getattr(model, "config", model), "trainable", False))


def flow_matching_loss(
    pred_velocity: torch.Tensor,
    batch: Any,
    precondition_outputs: bool,
) -> torch.Tensor:
    """Per-element squared error ``[B, C, T, H, W]`` of the velocity (or of x0 when preconditioned)."""
    if precondition_outputs:
        from distillery.models.schedule import FlowMatchSchedule

        sigma = FlowMatchSchedule.broadcast(batch.sigmas, pred_velocity.ndim)
        pred_x0 = batch.noisy_latents.float() - sigma * pred_velocity
        return (pred_x0 - batch.latents.float()) ** 2
    target = batch.noise.float() - batch.latents.float()
    return (pred_velocity - target) ** 2


def apply_caption_dropout(batch: Any, probability: float, rng: BatchRNG) -> None:
    """Replace each sample's prompt embedding by the empty prompt's with ``probability`` (in place)."""
    if probability <= 0:
        return
    b = batch.text_embeds.shape[0]
    drop = rng.rand((b,)).to(batch.text_embeds.device) < probability
    empty = batch.negative_text_embeds if batch.negative_text_embeds is not None else torch.zeros_like(batch.text_embeds)
    batch.text_embeds = torch.where(drop[:, None, None], empty.to(batch.text_embeds.dtype), batch.text_embeds)
