"""Self-Forcing: DMD2 whose student is a causal model that rolls the video out chunk by chunk on its own outputs.

Roles as :mod:`distillery.methods.dmd2`: ``student`` (trainable, a
:class:`~distillery.models.base.CausalModelBase`), ``teacher`` (frozen, bidirectional: the real
score) and ``critic`` (trainable, bidirectional: the fake score). Generator loss, critic loss,
score timesteps, ``generator_update_interval`` and teacher guidance are DMD2's, applied to the whole
rolled-out video ``x̂0 [B, C, T, H, W]``. Only the rollout differs — it is the deployed sampler
(``causal_streaming``), so the student is trained on the context it will see at inference (its own
chunks, not the data's: no exposure bias):

The ``T`` latent frames are split into chunks of the student's ``chunk_size`` frames from frame 0
(the last chunk may be shorter), ``K`` = the ladder length. Starting from pure noise ``ε [B, C, T, H, W]``
(one draw for the whole video), chunk ``c`` starting at frame ``s``:

1. run the chunk down the ladder ``t_0 > … > t_{K−1}`` against the student's KV cache (tag
   ``"rollout"``, ``store_kv=False``) without gradients, re-noising between steps (``sde``: fresh
   noise ``(1 − σ_{j+1}) x0_j + σ_{j+1} ε_j``; ``ode``: the Euler step), and stop at the chunk's
   *exit step* ``k_c``: ``x̂0_c = x_{t_k} − σ_k v(x_{t_k}, t_k)``. That forward keeps its graph when
   the step is an update step, ``enable_gradient_in_rollout`` is true and ``s ≥ start_gradient_frame``
   (earlier chunks then act as fixed context; the gradient never flows through the cache);
2. unless it is the last chunk, write ``x̂0_c`` (detached) to the cache (``store_kv=True``), clean
   at t = 0 or re-noised to ``t = context_noise`` with fresh noise.

**Given first frame** (a causal image-to-video student, ``given_first_frame``): latent frame 0 of ``x̂0`` is the
condition's clean latent of the given frame (:func:`~distillery.models.base.given_first_latent`), written to the cache
at t = 0 (clean, whatever ``context_noise``) before the first chunk, never denoised; the chunks (and their exit draws)
start at frame 1 (a length other than ``1 + k · chunk_size``: one line). The teacher and critic score the whole video;
the DMD gradient, its normaliser, the generator loss and the critic's loss leave frame 0 out.

``x̂0`` is the chunks concatenated along T. With ``last_step_only`` every exit step is ``K − 1`` and
the rollout is exactly the ``causal_streaming`` sampler of the artifact's sampling contract run on
the method's random stream (a test checks it).

**Exit steps**: one draw per chunk from the BatchRNG's generator (identical on every rank, so every
rank runs the same forwards — FSDP2 all-gathers in each); ``same_step_across_chunks``: one draw for
all chunks. Draw order per optimizer step: exit steps; the initial noise (``prepare_batch``); per
chunk the ``sde`` re-noise draws, then the context-noise draw; then DMD2's τ, ε_τ, t, ε.

Only the prompt embeddings and the batch's latent shape are read (``simulate`` only: ``rollout: data_latent``
is refused), so it trains on a prompt-only set (``data_kind`` prompts) as on a latent set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.methods.base import causal_contract
from distillery.methods.dmd2 import DMD2Config, DMD2Method, distribution_matching_loss, fake_score_loss
from distillery.models.base import CausalModelBase, ModelBase, TrainingBatch, batch_latent_shape, chunk_bounds, given_first_latent
from distillery.models.schedule import renoise, x0_from_velocity

ROLLOUT_CACHE = "rollout"  # the student's KV cache tag during a rollout


@dataclass
class SelfForcingConfig(DMD2Config):
    context_noise: float = 0.0  # timestep at which finished chunks are written to the cache (0: clean)
    enable_gradient_in_rollout: bool = True  # false: no student gradient at all (the critic still trains)
    start_gradient_frame: int = 0  # chunks starting before this latent frame are context only (no graph)
    same_step_across_chunks: bool = False  # one exit-step draw for every chunk of a video
    last_step_only: bool = False  # every chunk exits at the last ladder step (the deployed sampler exactly)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout != "simulate":
            raise ValueError("Self-Forcing rolls out from noise: rollout must be simulate (data_latent is DMD2's)")
        if not 0.0 <= float(self.context_noise) < 1000.0:
            raise ValueError(f"context_noise must be in [0, 1000), got {self.context_noise}")
        if int(self.start_gradient_frame) < 0:
            raise ValueError(f"start_gradient_frame must be >= 0, got {self.start_gradient_frame}")
        self.context_noise = float(self.context_noise)
        self.start_gradient_frame = int(self.start_gradient_frame)


class SelfForcingMethod(DMD2Method):
    """Self-Forcing distillation of a causal student (module doc)."""

    config_class = SelfForcingConfig
    role_kinds = {"student": CausalModelBase}

    def __init__(self, config: SelfForcingConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        n = self.student.schedule.num_train_timesteps
        if config.context_noise >= n:
            raise UserError(f"config error: method.context_noise: {config.context_noise} is not below the student's {n} "
                            "train timesteps")

    @property
    def causal(self) -> CausalModelBase:
        """The student, typed as the causal model ``role_kinds`` made sure it is."""
        return self.student  # type: ignore[return-value]

    def sampling_contract(self) -> dict[str, Any]:
        schedule = self.student.schedule
        return {"sampler": "causal_streaming", **schedule.contract(),
                "timesteps": list(self.ladder), **causal_contract(self.causal),
                "context_noise": self.config.context_noise, "renoise": self.config.rollout_renoise}

    @property
    def given_frames(self) -> int:
        """Leading latent frames that are given, not generated: 1 for a causal image-to-video student, else 0."""
        return 1 if self.causal.given_first_frame else 0

    def generator_loss(self, x0: torch.Tensor, cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DMD2's, on the generated frames (module doc)."""
        return distribution_matching_loss(x0, cond, self.score_models(), self.config.real_score_guidance_scale,
                                          skip_frames=self.given_frames, guidance_2=self.config.real_score_guidance_scale_2)

    def critic_loss(self, x0: torch.Tensor, cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DMD2's, on the generated frames (module doc)."""
        return fake_score_loss(x0, cond, self.score_models(), skip_frames=self.given_frames)

    # -- draws ------------------------------------------------------------------------------
    def draw_exit_step(self, batch: dict[str, Any]) -> list[int]:
        """One ladder index per chunk of the batch's video (shared by the batch and every rank)."""
        chunks = len(chunk_bounds(int(batch_latent_shape(batch)[2]), int(self.causal.chunk_size), self.causal.given_first_frame))
        k = len(self.ladder)
        if self.config.last_step_only:
            return [k - 1] * chunks
        g = self.rng.generator
        draws = torch.randint(0, k, (1 if self.config.same_step_across_chunks else chunks,), generator=g, device=g.device)
        values = [int(v) for v in draws.tolist()]
        return values * chunks if self.config.same_step_across_chunks else values

    def exit_code(self, exit_step: list[int]) -> int:
        code = 0
        for e in exit_step:  # base-K digits, one per chunk
            code = code * len(self.ladder) + int(e)
        return code

    def exit_metrics(self, exit_step: list[int]) -> dict[str, torch.Tensor]:
        out = {f"exit_step/chunk{c}": torch.tensor(float(e)) for c, e in enumerate(exit_step)}
        out["exit_step"] = torch.tensor(sum(exit_step) / len(exit_step))
        out["exit_timestep"] = torch.tensor(sum(self.ladder[e] for e in exit_step) / len(exit_step))
        return out

    # -- rollout ----------------------------------------------------------------------------
    def rollout(self, batch: dict[str, Any], exit_step: list[int], with_grad: bool) -> tuple[torch.Tensor, TrainingBatch]:
        """The causal student's chunk-by-chunk sample ``x̂0 [B, C, T, H, W]`` (float32), module doc;
        chunks whose exit forward keeps its graph are the only ones with a gradient path."""
        student, ladder, cfg = self.causal, self.ladder, self.config
        n = student.schedule.num_train_timesteps
        device = student.device
        shape = batch_latent_shape(batch)
        b, frames = int(shape[0]), int(shape[2])
        bounds = chunk_bounds(frames, int(student.chunk_size), student.given_first_frame)
        if len(exit_step) != len(bounds):
            raise ValueError(f"{len(exit_step)} exit steps for {len(bounds)} chunks")

        def full(t: float) -> torch.Tensor:
            return torch.full((b,), t, dtype=torch.float32, device=device)

        def velocity(x: torch.Tensor, t: float, start: int, store: bool) -> torch.Tensor:
            return student.predict_noise_streaming(x, full(t), tb, cache_tag=ROLLOUT_CACHE, store_kv=store,
                                                   cur_start_frame=start, conditional=True)

        tb = student.prepare_batch(batch, self.rng, timesteps=full(float(n)))
        noise = tb.noise  # the whole video's initial noise
        chunks: list[torch.Tensor] = []
        student.clear_caches(ROLLOUT_CACHE)
        try:
            if student.given_first_frame:  # frame 0: the given frame's clean latent, cached at t = 0, never denoised
                first = given_first_latent(tb, int(shape[1])).expand(b, -1, -1, -1, -1)
                chunks.append(first)
                with torch.no_grad():
                    velocity(first, 0.0, 0, store=True)
            for (start, f), k in zip(bounds, exit_step):
                x = noise[:, :, start:start + f]
                with torch.no_grad():
                    for j in range(k):
                        v = velocity(x, ladder[j], start, store=False)
                        sigma, sigma_next = ladder[j] / n, ladder[j + 1] / n
                        x0 = x0_from_velocity(x, v, sigma)
                        if cfg.rollout_renoise == "sde":
                            x = renoise(x0, self.rng.randn(x.shape).to(device), sigma_next)
                        else:  # the Euler step: x0 + σ_next v
                            x = renoise(x0, x0 + v, sigma_next)
                grad = with_grad and cfg.enable_gradient_in_rollout and start >= cfg.start_gradient_frame
                with torch.set_grad_enabled(grad):
                    x0 = x0_from_velocity(x, velocity(x, ladder[k], start, store=False), ladder[k] / n)
                chunks.append(x0)
                if start + f < frames:
                    context = x0.detach()
                    if cfg.context_noise > 0:
                        context = renoise(context, self.rng.randn(context.shape).to(device), cfg.context_noise / n)
                    with torch.no_grad():
                        velocity(context, cfg.context_noise, start, store=True)
        finally:
            student.clear_caches(ROLLOUT_CACHE)
        return torch.cat(chunks, dim=2), tb

