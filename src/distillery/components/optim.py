"""Per-role optimizers and LR schedules.

``training.optimizer`` is every trainable role's default; ``models.<role>.optimizer`` overrides it
field by field (a DMD critic typically runs ``learning_rate: 2.0e-6, betas: [0.0, 0.999]`` beside a
student at another rate). :func:`role_optimizer_configs` resolves every role's once per run, from the
config before any weights load (:func:`distillery.engine.builder.check_roles_early`, whose result the
method is built with); :func:`resolve_optimizer_config` merges the two for one role;
:func:`build_role_optimizer` makes the AdamW and its LR schedule over the parameters of a role's
trainable modules.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from distillery.common.errors import UserError
from distillery.config.schema import OptimizerConfig, OptimizerOverride, RunConfig


def role_optimizer_configs(config: RunConfig) -> dict[str, OptimizerConfig]:
    """Trainable role → its optimizer config (``models.<role>.optimizer`` over ``training.optimizer``);
    an optimizer given to a frozen role is a config error."""
    out = {}
    for role, comp in config.models.items():
        if not getattr(comp.config, "trainable", False):
            if comp.optimizer is not None:
                raise UserError(f"config error: models.{role}.optimizer: the {role} is frozen (trainable: false); "
                                "remove its optimizer or make it trainable")
            continue
        out[role] = resolve_optimizer_config(config.training.optimizer, comp.optimizer, role)
    return out


def resolve_optimizer_config(default: OptimizerConfig, override: OptimizerOverride | None, role: str) -> OptimizerConfig:
    """``default`` with every field ``override`` sets replaced (each override field holds its
    :class:`OptimizerConfig` field's own rule, so the merge holds them all)."""
    if override is None:
        return default
    changes = {f.name: getattr(override, f.name) for f in dataclasses.fields(override) if getattr(override, f.name) is not None}
    if "betas" in changes:
        changes["betas"] = tuple(changes["betas"])
    return dataclasses.replace(default, **changes)


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


@dataclass
class RoleOptimizer:
    """One trainable role's optimizer, LR schedule and the config they were built from."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    config: OptimizerConfig


def build_role_optimizer(modules: dict[str, torch.nn.Module], cfg: OptimizerConfig, max_steps: int) -> RoleOptimizer:
    """AdamW over the trainable parameters of ``modules`` (in name order), with the LR schedule of
    ``cfg`` over ``max_steps`` optimizer steps. Fused kernels when the parameters are on CUDA."""
    params = [p for name in sorted(modules) for p in modules[name].parameters() if p.requires_grad]
    fused = bool(params) and params[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(cfg, max_steps))
    return RoleOptimizer(optimizer, scheduler, cfg)
