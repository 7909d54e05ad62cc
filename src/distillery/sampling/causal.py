"""``causal_streaming`` — chunk-by-chunk generation with a causal model's KV cache (Self-Forcing students).

The video's ``T`` latent frames are split into chunks of ``chunk_size`` frames (the last may be
shorter). Chunk by chunk, starting at latent frame ``s``:

1. denoise the chunk through the step list ``t_0 > t_1 > … > t_{K−1}`` (in ``[0, num_train_timesteps]``,
   already shifted: σ_k = t_k / num_train_timesteps), attending to the cached earlier chunks
   (``store_kv=False``): ``x0 = x_t − σ_k v(x_t, t_k)`` with the guided velocity ``u + w (c − u)``;
   except after the last step, re-noise to ``t_{k+1}``: ``renoise: "sde"`` (default) with fresh
   noise ``(1 − σ_{k+1}) x0 + σ_{k+1} ε``, ``renoise: "ode"`` with the noise the prediction implies
   ``ε̂ = x_t + (1 − σ_k) v`` (the deterministic DDIM / Euler step);
2. write the chunk's final x0 to the cache (``store_kv=True``), clean (t = 0) or re-noised to
   ``t = context_noise`` with fresh noise — skipped after the last chunk (nothing follows it).

**Given first frame** (contract ``given_first_frame: true``: a causal image-to-video student,
:attr:`~distillery.models.base.CausalModelBase.given_first_frame`): latent frame 0 is the condition's clean latent
of the given frame (:func:`~distillery.models.base.given_first_latent`), written to the cache(s) first by one forward
at t = 0 (clean, whatever ``context_noise``) and returned as it is; the chunks of ``chunk_size`` start at frame 1, and
a video of other than ``1 + k · chunk_size`` latent frames is refused in one line. The initial noise is still drawn
for the whole video (its frame 0 unused), so the draws are the same as without.

With CFG (``w > 1``) the conditional and unconditional passes keep separate caches (tags
``cond`` / ``uncond``). Noise draws, in order: the initial noise of the whole video
``[B, C, T, H, W]`` (unless given), then per chunk the SDE re-noise draws ``[B, C, f, H, W]`` and the
context-noise draw. Forward evaluations per video (:meth:`CausalStreamingSampler.nfe`):
branches × (chunks × K + chunks − 1), + branches for the given frame's write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distillery.common.errors import UserError
from distillery.models.base import chunk_bounds, given_first_latent
from distillery.models.schedule import renoise, x0_from_velocity
from distillery.sampling.base import (
    LatentShape,
    causal_model_options,
    cfg_enabled,
    check_inputs,
    conditioning_on,
    parse_chunk_size,
    parse_given_first_frame,
    require_causal,
)
from distillery.sampling.few_step import LadderSampler
from distillery.sampling.noise import NoiseLike, as_noise_source
from distillery.sampling.registry import register_sampler

if TYPE_CHECKING:
    from distillery.models.base import CausalModelBase, Conditioning, ModelBase

CACHE_TAGS = ("cond", "uncond")  # cache tags of the conditional / unconditional passes


@register_sampler("causal_streaming")
class CausalStreamingSampler(LadderSampler):
    """Contract: ``{"sampler": "causal_streaming", "shift", "num_train_timesteps"[, "timesteps": [t_0, …],
    "num_steps", "guidance_scale", "chunk_size", "context_noise", "renoise", "given_first_frame"]}``.

    ``timesteps``: the per-chunk step list (default :func:`~distillery.sampling.few_step.default_ladder`
    of ``num_steps``); ``chunk_size``: latent frames per chunk (default: the model's; must equal it);
    ``context_noise``: timestep in ``[0, num_train_timesteps)`` at which finished chunks are written
    to the cache (default 0: clean); ``renoise``: ``sde`` (fresh noise, default) or ``ode``;
    ``given_first_frame``: the model's frame 0 is the given frame (module doc; must be the model's).
    Needs a :class:`~distillery.models.base.CausalModelBase`. Runs under the caller's grad mode.
    """

    option_keys = ("timesteps", "chunk_size", "context_noise", "renoise", "given_first_frame")
    default_num_steps = 4

    def configure(self, options: dict[str, Any]) -> None:
        scale = self.num_train_timesteps or 1000
        self.configure_ladder(options)
        self.chunk_size = parse_chunk_size(options.get("chunk_size"), self.name)
        context = options.get("context_noise", 0.0)
        try:
            self.context_noise = float(context if context is not None else 0.0)
        except (TypeError, ValueError):
            raise UserError(f"sampler causal_streaming: context_noise must be a number, got {context!r}") from None
        if not 0.0 <= self.context_noise < scale:
            raise UserError(f"sampler causal_streaming: context_noise must be in [0, {scale}), got {self.context_noise}")
        mode = options.get("renoise", "sde")
        if mode not in ("sde", "ode"):
            raise UserError(f"sampler causal_streaming: renoise must be 'sde' or 'ode', got {mode!r}")
        self.renoise_mode = mode
        self.given_first_frame = parse_given_first_frame(options.get("given_first_frame"), self.name)

    def model_options(self) -> dict[str, Any]:
        """A causal model with the contract's ``chunk_size`` (a plain folder does not say it is causal)."""
        return causal_model_options(self.chunk_size, self.name)

    def nfe(self, num_steps: int | None = None, guidance_scale: float | None = None,
            num_frames: int | None = None) -> int:
        """Transformer forward evaluations per video of ``num_frames`` latent frames:
        branches × (chunks × steps + chunks − 1 context writes), + branches for a given first frame's write (its
        chunks: those after it). Without ``num_frames`` (or without a contract ``chunk_size``): one chunk's,
        branches × steps — the video total needs the length."""
        steps = self.resolve_steps(num_steps)
        branches = 2 if cfg_enabled(self.resolve_guidance(guidance_scale)) else 1
        if num_frames is None or self.chunk_size is None:
            return branches * steps
        chunks = len(chunk_bounds(int(num_frames), self.chunk_size, self.given_first_frame))
        return branches * (chunks * steps + chunks - 1 + (1 if self.given_first_frame else 0))

    def chunk_size_for(self, model: "ModelBase") -> int:
        """The chunk size of a call: the model's; a contract's ``chunk_size`` (and ``given_first_frame``) must agree
        with it."""
        return require_causal(model, self.chunk_size, self.name, self.given_first_frame)

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
        chunk_size = self.chunk_size_for(model)
        causal: CausalModelBase = model  # type: ignore[assignment]
        batch = check_inputs(cond, latent_shape, initial)
        guidance = self.expert_guidance(model, guidance_scale, guidance_scale_2)
        guided = guidance.enabled
        schedule = self.schedule_for(model)
        ts = self.ladder(schedule, num_steps)
        scale = schedule.num_train_timesteps
        if any(t > scale for t in ts):
            raise UserError(f"sampler causal_streaming: timesteps {ts} exceed the model's {scale}")
        device = model.device
        source = as_noise_source(noise)
        c, frames, h, wd = latent_shape
        whole = initial.to(device, torch.float32) if initial is not None else source.randn((batch, *latent_shape), device)
        cond = conditioning_on(cond, device)
        tags = CACHE_TAGS if guided else CACHE_TAGS[:1]
        for tag in tags:
            causal.clear_caches(tag)

        def velocity(x: torch.Tensor, t: float, start: int, store: bool) -> torch.Tensor:
            step = torch.full((batch,), t, dtype=torch.float32, device=device)
            v = causal.predict_noise_streaming(x, step, cond, cache_tag=tags[0], store_kv=store,
                                               cur_start_frame=start, conditional=True)
            if not guided:
                return v
            u = causal.predict_noise_streaming(x, step, cond, cache_tag=tags[1], store_kv=store,
                                               cur_start_frame=start, conditional=False)
            return u + guidance.scale_at(t) * (v - u)

        bounds = chunk_bounds(frames, chunk_size, self.given_first_frame)  # a length that does not fit: one line
        chunks = []
        try:
            if self.given_first_frame:  # frame 0: the given frame's clean latent, cached at t = 0, never denoised
                first = given_first_latent(cond, c).expand(batch, -1, -1, -1, -1)
                chunks.append(first)
                with torch.no_grad():
                    velocity(first, 0.0, 0, store=True)
            for start, f in bounds:
                shape = (batch, c, f, h, wd)
                x = whole[:, :, start:start + f]
                x0 = x
                for k, t in enumerate(ts):
                    v = velocity(x, t, start, store=False)
                    x0 = x0_from_velocity(x, v, t / scale)
                    if k + 1 < len(ts):
                        if self.renoise_mode == "sde":
                            eps = source.randn(shape, device)
                        else:  # the noise the prediction implies: ε̂ = x0 + v = x_t + (1 − σ) v
                            eps = x0 + v
                        x = renoise(x0, eps, ts[k + 1] / scale)
                chunks.append(x0)
                if start + f < frames:  # write the finished chunk as context for the next ones
                    context = x0
                    if self.context_noise > 0:
                        context = renoise(x0, source.randn(shape, device), self.context_noise / scale)
                    with torch.no_grad():  # the cache is detached: no graph to keep
                        velocity(context, self.context_noise, start, store=True)
        finally:
            for tag in tags:
                causal.clear_caches(tag)
        return torch.cat(chunks, dim=2)
