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

from distillery.common.errors import UserError
from distillery.models.base import chunk_bounds, given_first_latent
from distillery.models.schedule import euler_step
from distillery.sampling.base import (
    ExpertGuidance,
    LatentShape,
    Sampler,
    causal_model_options,
    cfg_enabled,
    check_inputs,
    conditioning_on,
    guide,
    guided_velocity,
    nfe_per_video,
    parse_chunk_size,
    parse_given_first_frame,
    require_causal,
)
from distillery.sampling.noise import NoiseLike, as_noise_source
from distillery.sampling.registry import register_sampler

if TYPE_CHECKING:
    from distillery.models.base import CausalModelBase, Conditioning, ModelBase

CACHE_TAGS = ("cond", "uncond")  # the given-first-frame path's caches of the conditional / unconditional passes


@register_sampler("euler")
class EulerSampler(Sampler):
    """Contract: ``{"sampler": "euler", "shift", "num_train_timesteps"[, "num_steps", "guidance_scale", "chunk_size"]}``.

    ``chunk_size``: the model is causal (block-causal attention over chunks of that many latent
    frames, e.g. a Diffusion-Forcing student): every frame is denoised in step, each full-sequence
    forward under the block-causal mask — the synchronous way to sample a DF model, one forward
    per step instead of one per chunk (``causal_streaming`` is the chunk-by-chunk way).
    NFE per video: steps × (2 with CFG, else 1). Always runs without gradients.

    ``given_first_frame`` (with ``chunk_size``: a causal image-to-video student): latent frame 0 is the given frame's
    clean latent (:func:`~distillery.models.base.given_first_latent`), written once to a KV cache at t = 0 (one more
    forward per branch) and returned as it is; every step then denoises frames ``1 … T − 1`` in one streaming call
    against that cache (block-causal among their chunks) — what DFSFT trains: frame 0 clean at t = 0 under the same
    mask. A video of other than ``1 + k · chunk_size`` latent frames is refused in one line. The initial noise is drawn
    for the whole video (its frame 0 unused).
    """

    option_keys = ("chunk_size", "given_first_frame")
    default_num_steps = 40

    def configure(self, options: dict[str, Any]) -> None:
        self.chunk_size = parse_chunk_size(options.get("chunk_size"), self.name)
        self.given_first_frame = parse_given_first_frame(options.get("given_first_frame"), self.name)
        if self.given_first_frame and self.chunk_size is None:
            raise UserError("sampler euler: given_first_frame is a causal student's layout; the contract names no chunk_size")

    def nfe(self, num_steps: int | None = None, guidance_scale: float | None = None, num_frames: int | None = None) -> int:
        """steps × branches, + branches for a given first frame's cache write (a ``num_frames`` its layout does not fit:
        the one-line :class:`UserError` sampling would raise)."""
        if self.given_first_frame and num_frames is not None and self.chunk_size is not None:
            chunk_bounds(int(num_frames), self.chunk_size, True)
        per = nfe_per_video(self.resolve_steps(num_steps), self.resolve_guidance(guidance_scale))
        return per + (2 if cfg_enabled(self.resolve_guidance(guidance_scale)) else 1) * int(self.given_first_frame)

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
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        batch = check_inputs(cond, latent_shape, initial)
        if self.chunk_size is not None:
            require_causal(model, self.chunk_size, self.name, self.given_first_frame)
        guidance = self.expert_guidance(model, guidance_scale, guidance_scale_2)
        if self.given_first_frame:
            return self._sample_given_first_frame(model, cond, latent_shape, noise, num_steps, guidance, initial)
        steps = self.resolve_steps(num_steps)
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

    def _sample_given_first_frame(self, model: "ModelBase", cond: "Conditioning", latent_shape: LatentShape,
                                  noise: NoiseLike, num_steps: int | None, guidance: ExpertGuidance,
                                  initial: torch.Tensor | None) -> torch.Tensor:
        """The class doc's ``given_first_frame`` path (runs under :meth:`sample`'s no_grad)."""
        causal: CausalModelBase = model  # type: ignore[assignment]
        batch = check_inputs(cond, latent_shape, initial)
        c, frames = int(latent_shape[0]), int(latent_shape[1])
        chunk_bounds(frames, int(causal.chunk_size), True)  # a length that does not fit: one line, before any forward
        steps = self.resolve_steps(num_steps)
        device = model.device
        schedule = self.schedule_for(model)
        sigmas = schedule.inference_sigmas(steps).to(device)
        timesteps = sigmas[:-1] * schedule.num_train_timesteps
        source = as_noise_source(noise)
        whole = initial.to(device, torch.float32) if initial is not None else source.randn((batch, *latent_shape), device)
        cond = conditioning_on(cond, device)
        tags = CACHE_TAGS if guidance.enabled else CACHE_TAGS[:1]
        first = given_first_latent(cond, c).expand(batch, -1, -1, -1, -1)

        def streamed(x: torch.Tensor, t: torch.Tensor, start: int, store: bool) -> torch.Tensor:
            return guide(lambda conditional: causal.predict_noise_streaming(
                x, t, cond, cache_tag=tags[0 if conditional else 1], store_kv=store, cur_start_frame=start,
                conditional=conditional), guidance.scale, guidance.scale_at(float(t[0])))

        for tag in tags:
            causal.clear_caches(tag)
        try:
            streamed(first, torch.zeros(batch, dtype=torch.float32, device=device), 0, True)
            x = whole[:, :, 1:]
            for i in range(steps):
                v = streamed(x, timesteps[i].expand(batch), 1, False)
                x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        finally:
            for tag in tags:
                causal.clear_caches(tag)
        return torch.cat([first, x], dim=2)
