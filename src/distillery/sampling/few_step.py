"""``few_step_x0`` — DMD-style few-step sampling: predict x0, re-noise to the next timestep, repeat.

At each of K timesteps ``t_0 > t_1 > … > t_{K−1}`` (in ``[0, num_train_timesteps]``, already
shifted: σ_k = t_k / num_train_timesteps) the model's guided velocity gives
``x0 = x_t − σ_k v(x_t, t_k)``; except after the last step, ``x0`` is re-noised to
``x_{t_{k+1}} = (1 − σ_{k+1}) x0 + σ_{k+1} ε`` with fresh ε from the noise source (``renoise: sde``, the default) —
or, ``renoise: ode``, the Euler step ``x_{t_{k+1}} = x_t + (σ_{k+1} − σ_k) v`` (no draw: Phased DMD's students). The
initial ``x_{t_0}`` is the initial noise, used as is whatever ``t_0`` is (normally 1000). Returns the last x0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distillery.common.errors import UserError
from distillery.models.schedule import FlowMatchSchedule, euler_step, renoise, x0_from_velocity
from distillery.sampling.base import LatentShape, Sampler, check_inputs, conditioning_on, guided_velocity
from distillery.sampling.noise import NoiseLike, as_noise_source
from distillery.sampling.registry import register_sampler

if TYPE_CHECKING:
    from distillery.models.base import Conditioning, ModelBase


def default_ladder(schedule: FlowMatchSchedule, num_steps: int) -> list[float]:
    """The default K-step ladder: the K timesteps of the K-step Euler grid (starts at 1000)."""
    return [float(t) for t in schedule.inference_timesteps(num_steps)]


class LadderSampler(Sampler):
    """A sampler over a descending timestep ladder: the contract's ``timesteps``, else
    :func:`default_ladder` of the step count. Subclasses call :meth:`configure_ladder` from
    ``configure``; messages name the registered sampler."""

    def configure_ladder(self, options: dict[str, Any]) -> None:
        ts = options.get("timesteps")
        self.timesteps: list[float] | None = None
        if ts is None:
            return
        try:
            ts = [float(t) for t in ts]
        except (TypeError, ValueError):
            raise UserError(f"sampler {self.name}: timesteps must be a list of numbers, got {ts!r}") from None
        scale = self.num_train_timesteps or 1000
        if not ts or any(not 0.0 <= t <= scale for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
            raise UserError(f"sampler {self.name}: timesteps must be non-empty and strictly descending in [0, {scale}], got {ts}")
        self.timesteps = ts

    def resolve_steps(self, num_steps: int | None) -> int:
        if self.timesteps is None:
            return super().resolve_steps(num_steps)
        if num_steps is not None and int(num_steps) != len(self.timesteps):
            raise UserError(f"sampler {self.name}: {num_steps} steps asked of a {len(self.timesteps)}-timestep ladder")
        return len(self.timesteps)

    def ladder(self, schedule: FlowMatchSchedule, num_steps: int | None = None) -> list[float]:
        """The timesteps of a call: the contract's ladder, else :func:`default_ladder` of the step count."""
        steps = self.resolve_steps(num_steps)
        return list(self.timesteps) if self.timesteps is not None else default_ladder(schedule, steps)


@register_sampler("few_step_x0")
class FewStepX0Sampler(LadderSampler):
    """Contract: ``{"sampler": "few_step_x0", "shift", "num_train_timesteps"[, "timesteps": [t_0, …],
    "num_steps", "guidance_scale", "guidance_scale_2", "renoise"]}``; without ``timesteps`` the ladder is
    :func:`default_ladder`; ``renoise``: ``sde`` (default) or ``ode`` (module doc).

    NFE per video: K × (2 with CFG, else 1). Runs under the caller's grad mode (training rollouts
    backpropagate through it; wrap inference in ``torch.no_grad()``).
    """

    option_keys = ("timesteps", "renoise")
    default_num_steps = 4

    def configure(self, options: dict[str, Any]) -> None:
        self.configure_ladder(options)
        mode = options.get("renoise", "sde")
        if mode not in ("sde", "ode"):
            raise UserError(f"sampler few_step_x0: renoise must be 'sde' or 'ode', got {mode!r}")
        self.renoise_mode = mode

    def sample(
        self,
        model: "ModelBase",
        cond: "Conditioning",
        latent_shape: LatentShape,
        noise: NoiseLike,
        *,
        num_steps: int | None = None,
        guidance_scale: float | None = None,
        initial: torch.Tensor | None = None,
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        batch = check_inputs(cond, latent_shape, initial)
        guidance = self.expert_guidance(model, guidance_scale, guidance_scale_2)
        schedule = self.schedule_for(model)
        ts = self.ladder(schedule, num_steps)
        scale = schedule.num_train_timesteps
        if any(t > scale for t in ts):
            raise UserError(f"sampler few_step_x0: timesteps {ts} exceed the model's {scale}")
        device = model.device
        source = as_noise_source(noise)
        shape = (batch, *latent_shape)
        x = initial.to(device, torch.float32) if initial is not None else source.randn(shape, device)
        cond = conditioning_on(cond, device)
        x0 = x
        for k, t in enumerate(ts):
            step = torch.full((batch,), t, dtype=torch.float32, device=device)
            v = guided_velocity(model, x, step, cond, guidance)
            x0 = x0_from_velocity(x, v, t / scale)
            if k + 1 < len(ts):
                if self.renoise_mode == "ode":
                    x = euler_step(x, v, t / scale, ts[k + 1] / scale)
                else:
                    x = renoise(x0, source.randn(shape, device), ts[k + 1] / scale)
        return x0
