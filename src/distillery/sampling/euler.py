"""Flow-matching samplers over a plain ``diffusers.WanTransformer3DModel`` (no pipeline).

Conventions (DESIGN.md §4): latents ``[B, C, T, H, W]`` in the VAE's *normalised* latent space,
``x_t = (1 − σ) x0 + σ ε``, the transformer predicts ``v = ε − x0`` when fed ``timestep = σ · 1000``,
``x0 = x_t − σ v``; guidance is ``u + w (c − u)`` and is on when ``w > 1`` (as in ``WanPipeline``).

- :class:`EulerSampler` — many-step Euler integration of the flow ODE on exactly the σ grid that
  diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` builds for a given shift, so that
  for the same initial noise and prompt embeddings it reproduces
  ``WanPipeline(..., output_type="latent")`` to float tolerance (fp32 transformer).
- :func:`few_step_x0` — the DMD-style student sampler: at each of K given timesteps predict
  ``x0 = x_t − σ v`` and re-noise it to the next timestep with fresh noise; returns the last x0.

Both are used by training rollouts, validation and exported pipelines. Latents are kept in fp32
between steps whatever the transformer's dtype (the stock pipeline would round them to a bf16
transformer's dtype after each step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("distillery")

LatentShape = tuple[int, int, int, int]  # (C, T, H, W) of one sample


def cfg_enabled(guidance_scale: float) -> bool:
    """Whether classifier-free guidance runs (a second, unconditional forward): ``w > 1``, as WanPipeline."""
    return guidance_scale > 1.0


def nfe_per_video(num_steps: int, guidance_scale: float) -> int:
    """Transformer forward evaluations per video: steps × (2 with CFG, else 1)."""
    return num_steps * (2 if cfg_enabled(guidance_scale) else 1)


def _device_of(transformer: torch.nn.Module) -> torch.device:
    return next(transformer.parameters()).device


def _dtype_of(transformer: torch.nn.Module) -> torch.dtype:
    return next(transformer.parameters()).dtype


def initial_noise(batch_size: int, latent_shape: LatentShape, generator: torch.Generator | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal ``float32 [B, C, T, H, W]`` drawn on the generator's device, then moved to ``device``.

    Draws exactly what diffusers' ``randn_tensor`` (``WanPipeline.prepare_latents``) draws for one generator.
    """
    shape = (batch_size, *latent_shape)
    draw_device = generator.device if generator is not None else torch.device(device)
    return torch.randn(shape, generator=generator, device=draw_device, dtype=torch.float32).to(device)


def _check_inputs(text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None, latent_shape: Sequence[int],
                  noise: torch.Tensor | None) -> None:
    if text_embeds.ndim != 3:
        raise ValueError(f"text_embeds must be [B, L, D], got {tuple(text_embeds.shape)}")
    if negative_embeds is not None and negative_embeds.shape != text_embeds.shape:
        raise ValueError(f"negative_embeds {tuple(negative_embeds.shape)} must match text_embeds {tuple(text_embeds.shape)}")
    if len(latent_shape) != 4:
        raise ValueError(f"latent_shape must be (C, T, H, W), got {tuple(latent_shape)}")
    if noise is not None and tuple(noise.shape) != (text_embeds.shape[0], *latent_shape):
        raise ValueError(f"noise {tuple(noise.shape)} must be [B, C, T, H, W] = {(text_embeds.shape[0], *latent_shape)}")


def guided_velocity(transformer: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                    text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None, guidance_scale: float) -> torch.Tensor:
    """CFG velocity ``u + w (c − u)`` (fp32 ``[B, C, T, H, W]``) at one timestep.

    ``timestep``: scalar tensor in [0, 1000], broadcast to the batch. One forward without CFG, two
    (conditional, then unconditional, separately as WanPipeline does) with it. A missing negative
    embedding is the all-zeros one (what training uses when no empty-prompt embedding is stored).
    Runs under the caller's grad mode.
    """
    dtype = _dtype_of(transformer)
    x = latents.to(dtype)
    t = timestep.to(latents.device, torch.float32).expand(latents.shape[0])
    cond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=text_embeds.to(dtype), return_dict=False)[0]
    if not cfg_enabled(guidance_scale):
        return cond.float()
    negative = negative_embeds if negative_embeds is not None else torch.zeros_like(text_embeds)
    uncond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=negative.to(dtype), return_dict=False)[0]
    cond, uncond = cond.float(), uncond.float()
    return uncond + guidance_scale * (cond - uncond)


@dataclass(frozen=True)
class EulerSampler:
    """Many-step Euler flow-matching sampler with CFG, on diffusers' shifted σ grid."""

    num_train_timesteps: int = 1000  # timesteps fed to the transformer are σ × this

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """σ grid ``float32 [num_steps + 1]``, descending from 1, ending with an appended 0.

        Bit-for-bit ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps).sigmas``
        (static shift, no Karras/exponential/beta/terminal options): the scheduler's training table
        gives σ_max = shift(1) = 1 and σ_min = shift(1/N) (fp32); the inference grid is
        ``linspace(σ_max, σ_min, num_steps)`` in float64 and is shifted *again*, then cast to fp32.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        n = self.num_train_timesteps
        ends = torch.tensor([float(n), 1.0], dtype=torch.float32) / n  # table ends, as the scheduler's __init__
        ends = shift * ends / (1 + (shift - 1) * ends)
        sigma_max, sigma_min = ends[0].item(), ends[1].item()
        grid = np.linspace(sigma_max * n, sigma_min * n, num_steps) / n
        grid = shift * grid / (1 + (shift - 1) * grid)
        sig = torch.from_numpy(grid).to(torch.float32)
        return torch.cat([sig, torch.zeros(1)])

    def timesteps(self, num_steps: int, shift: float) -> torch.Tensor:
        """Timesteps ``float32 [num_steps]`` fed to the transformer: σ × num_train_timesteps (last σ = 0 dropped)."""
        return self.sigmas(num_steps, shift)[:-1] * self.num_train_timesteps

    @torch.no_grad()
    def sample(
        self,
        transformer: torch.nn.Module,
        text_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        latent_shape: LatentShape,
        num_steps: int,
        guidance_scale: float,
        shift: float,
        generator: torch.Generator | None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Integrate from noise to data; returns normalised latents ``float32 [B, C, T, H, W]``.

        ``text_embeds``/``negative_embeds``: ``[B, L, D]`` (zero-padded to the model's sequence
        length, as WanPipeline pads them). ``noise``: optional initial ``x_1`` ``[B, C, T, H, W]``;
        otherwise drawn from ``generator`` (what WanPipeline draws with the same generator).
        NFE = ``nfe_per_video(num_steps, guidance_scale)`` per sample. Always runs without gradients.
        """
        _check_inputs(text_embeds, negative_embeds, latent_shape, noise)
        device = _device_of(transformer)
        sigmas = self.sigmas(num_steps, shift).to(device)
        timesteps = sigmas[:-1] * self.num_train_timesteps
        x = noise.to(device, torch.float32) if noise is not None else initial_noise(
            text_embeds.shape[0], latent_shape, generator, device)
        text = text_embeds.to(device)
        negative = negative_embeds.to(device) if negative_embeds is not None else None
        for i in range(num_steps):
            v = guided_velocity(transformer, x, timesteps[i], text, negative, guidance_scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        return x


def few_step_timesteps(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> list[float]:
    """A default K-step student ladder: the first K timesteps of the Euler grid (starts at 1000)."""
    return [float(t) for t in EulerSampler(num_train_timesteps).timesteps(num_steps, shift)]


def few_step_x0(
    transformer: torch.nn.Module,
    text_embeds: torch.Tensor,
    negative_embeds: torch.Tensor | None,
    latent_shape: LatentShape,
    timesteps: Sequence[float],
    guidance_scale: float,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """DMD-style few-step sampling; returns the final x0 prediction ``float32 [B, C, T, H, W]``.

    ``timesteps``: K values in [0, num_train_timesteps], descending, already shifted
    (σ_k = t_k / num_train_timesteps); the first is normally 1000 (pure noise). Step k predicts
    ``x0 = x_t − σ_k v(x_t, t_k)`` and, except after the last, re-noises
    ``x_{t_{k+1}} = (1 − σ_{k+1}) x0 + σ_{k+1} ε`` with fresh ε from ``generator``. The initial
    ``x_{t_0} = noise`` (drawn from ``generator`` when not given) is used as is, whatever t_0 is.
    NFE = ``nfe_per_video(K, guidance_scale)`` per sample. Runs under the caller's grad mode (training
    rollouts backpropagate through it; wrap inference in ``torch.no_grad()``).
    """
    _check_inputs(text_embeds, negative_embeds, latent_shape, noise)
    ts = [float(t) for t in timesteps]
    if not ts:
        raise ValueError("few_step_x0 needs at least one timestep")
    if any(not 0.0 <= t <= num_train_timesteps for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
        raise ValueError(f"timesteps must be strictly descending in [0, {num_train_timesteps}], got {ts}")
    device = _device_of(transformer)
    batch = text_embeds.shape[0]
    x = noise.to(device, torch.float32) if noise is not None else initial_noise(batch, latent_shape, generator, device)
    text = text_embeds.to(device)
    negative = negative_embeds.to(device) if negative_embeds is not None else None
    x0 = x
    for k, t in enumerate(ts):
        sigma = t / num_train_timesteps
        v = guided_velocity(transformer, x, torch.tensor(t, dtype=torch.float32), text, negative, guidance_scale)
        x0 = x - sigma * v
        if k + 1 < len(ts):
            next_sigma = ts[k + 1] / num_train_timesteps
            eps = initial_noise(batch, latent_shape, generator, device)
            x = (1.0 - next_sigma) * x0 + next_sigma * eps
    return x0
