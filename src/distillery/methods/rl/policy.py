"""Where a policy is trained by DiffusionNFT: the timesteps its sampler visits and the velocity it samples with there.

DiffusionNFT trains the velocity field a model *samples with*, at the timesteps its sampler visits (the first
``timestep_fraction`` of them, FastVideo's rule): a rollout's clean latent is noised to each of those timesteps and
the policy's velocity there enters the objective (:mod:`distillery.methods.rl.objective`). Both come from the
student's sampling contract (``sampling.json``), so a many-step teacher and a few-step student are trained on their
own schedule:

- ``euler`` (a teacher, a fine-tuned base): the ``num_steps`` timesteps of its Euler grid at the contract's shift;
  the velocity ``predict_noise``;
- ``few_step_x0`` (a DMD2-distilled student): its timestep ladder; the velocity ``predict_noise`` (its sampler's
  x0 is ``x_t − σ v``);
- ``pdd_fused`` (a PDD student): the starts of its ``num_steps`` blocks of the fine grid; the velocity the block's
  fused heads give (``predict_pdd_fused``: the block's mean velocity, what the sampler advances with).

A causal (chunk-by-chunk) student samples with a KV cache of its own earlier chunks, a velocity no full-sequence
forward gives: refused in one line (:func:`train_points`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.models.base import CausalModelBase, ModelBase, PDDModelBase

Velocity = Callable[[ModelBase, torch.Tensor, torch.Tensor, Any], torch.Tensor]  # (model, x_t, t [B], cond) -> v


@dataclass(frozen=True)
class TrainPoint:
    """One timestep a policy is trained at: ``t`` in [0, n] and how its velocity is computed there."""

    t: float
    velocity: Velocity


def _plain(model: ModelBase, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
    return model.predict_noise(x, t, cond, conditional=True)


def _fused(start: int, end: int) -> Velocity:
    def velocity(model: ModelBase, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return model.predict_pdd_fused(x, t, cond, start, end, conditional=True)

    return velocity


def train_points(contract: dict[str, Any], model: ModelBase, num_steps: int | None, fraction: float) -> list[TrainPoint]:
    """The timesteps ``model`` is trained at under ``contract`` with ``num_steps`` sampler steps (None: the
    contract's): the first ``max(1, int(len · fraction))`` of those its sampler visits (module doc)."""
    from distillery.sampling import build_sampler

    sampler = build_sampler(contract)
    name = contract["sampler"]
    if isinstance(model, CausalModelBase) or contract.get("chunk_size") is not None:
        raise UserError(f"method: DiffusionNFT trains the velocity a model samples with; the causal student's "
                        f"({name}) depends on its KV cache of earlier chunks, which no full-sequence forward gives: "
                        "post-train a bidirectional student (DMD2, PDD) or the teacher")
    schedule = sampler.schedule_for(model)
    steps = sampler.resolve_steps(num_steps)
    if name == "euler":
        points = [TrainPoint(float(t), _plain) for t in schedule.inference_timesteps(steps).tolist()]
    elif name == "few_step_x0":
        points = [TrainPoint(float(t), _plain) for t in sampler.ladder(schedule, steps)]
    elif name == "pdd_fused":
        if not isinstance(model, PDDModelBase):
            raise UserError(f"method: the sampling contract is pdd_fused but the student is a {type(model).__name__}, "
                            "not a PDD model (models.student._target_: distillery.models.wan.PDDWanModel)")
        nodes = sampler.partition(steps)
        sigmas = schedule.inference_sigmas(sampler.pdd_steps)
        points = [TrainPoint(float(sigmas[a]) * schedule.num_train_timesteps, _fused(a, b)) for a, b in zip(nodes, nodes[1:])]
    else:
        raise UserError(f"method: DiffusionNFT knows the training timesteps of the euler, few_step_x0 and pdd_fused "
                        f"samplers; the sampling contract names {name!r}")
    keep = max(1, min(len(points), int(math.floor(len(points) * fraction))))
    return points[:keep]
