"""``euler`` — many-step Euler integration of the flow ODE with CFG (teachers, base models).

Integrates on exactly the σ grid that diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps``
builds for the shift (:meth:`FlowMatchSchedule.inference_sigmas`), so that for the same initial
noise and prompt embeddings it reproduces ``WanPipeline(..., output_type="latent")`` to float
tolerance (fp32 model). Latents stay fp32 between steps whatever the model's compute dtype (the
stock pipeline would round them to a bf16 transformer's dtype after each step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distillery.models.schedule import euler_step
from distillery.sampling.base import (
    LatentShape,
    Sampler,
    causal_model_options,
    check_inputs,
    conditioning_on,
    guided_velocity,
    parse_chunk_size,
    require_causal,
)
from distillery.sampling.noise import NoiseLike, as_noise_source
from distillery.sampling.registry import register_sampler

if TYPE_CHECKING:
    from distillery.models.base import Conditioning, ModelBase


@register_sampler("euler")
class EulerSampler(Sampler):
    """Contract: ``{"sampler": "euler", "shift", "num_train_timesteps"[, "num_steps", "guidance_scale", "chunk_size"]}``.

    ``chunk_size``: the model is causal (block-causal attention over chunks of that many latent
    frames, e.g. a Diffusion-Forcing student): every frame is denoised in step, each full-sequence
    forward under the block-causal mask — the synchronous way to sample a DF model, one forward
    per step instead of one per chunk (``causal_streaming`` is the chunk-by-chunk way).
    NFE per video: steps × (2 with CFG, else 1). Always runs without gradients.
    """

    option_keys = ("chunk_size",)
    default_num_steps = 40

    def configure(self, options: dict[str, Any]) -> None:
        self.chunk_size = parse_chunk_size(options.get("chunk_size"), self.name)

    def model_options(self) -> dict[str, Any]:
        return {} if self.chunk_size is None else causal_model_options(self.chunk_size, self.name)

    @torch.no_grad()
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
    ) -> torch.Tensor:
        batch = check_inputs(cond, latent_shape, initial)
        if self.chunk_size is not None:
            require_causal(model, self.chunk_size, self.name)
        steps, guidance = self.resolve_steps(num_steps), self.resolve_guidance(guidance_scale)
        device = model.device
        schedule = self.schedule_for(model)
        sigmas = schedule.inference_sigmas(steps).to(device)  # [steps + 1], ends with 0
        timesteps = sigmas[:-1] * schedule.num_train_timesteps
        source = as_noise_source(noise)
        x = initial.to(device, torch.float32) if initial is not None else source.randn((batch, *latent_shape), device)
        cond = conditioning_on(cond, device)
        for i in range(steps):
            v = guided_velocity(model, x, timesteps[i].expand(batch), cond, guidance)
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        return x
