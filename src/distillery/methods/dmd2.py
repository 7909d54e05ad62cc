"""DMD2: distribution-matching distillation of a many-step teacher into a few-step student.

Roles: ``student`` (trainable; a few-step x0 predictor over the timestep ladder
``student_timesteps``), ``teacher`` (frozen; the real score) and ``critic`` (trainable; the fake
score, a flow-matching model of the student's outputs, with its own optimizer from
``models.critic.optimizer``, e.g. lr 2e-6, betas [0, 0.999]).

One optimizer step (step numbers start at 1; an *update step* is ``step % generator_update_interval
== 0``):

1. **Rollout** — one student sample ``x̂0 [B, C, T, H, W]`` per step:

   - ``simulate``: from pure noise ``x_{t_0} = ε`` run the student down its ladder
     ``t_0 > t_1 > … > t_{K−1}``: ``x0_j = x_{t_j} − σ_j v(x_{t_j}, t_j)``, then re-noise to the next
     timestep (``sde``: ``x_{t_{j+1}} = (1 − σ_{j+1}) x0_j + σ_{j+1} ε_j`` with fresh ε_j; ``ode``: the
     Euler step ``x_{t_{j+1}} = x_{t_j} + (σ_{j+1} − σ_j) v``), without gradients, and stop at the
     *exit step* ``k`` (one draw in ``[0, K)`` per optimizer step, the same on every rank):
     ``x̂0 = x_{t_k} − σ_k v(x_{t_k}, t_k)``, the only student forward that keeps its graph (and only
     on update steps). Only the batch's shapes and prompt embeddings are read.
   - ``data_latent``: the data latents noised to the exit step's ``t_k`` (the same draw),
     ``x̂0 = x_{t_k} − σ_k v``.

2. **Generator loss** (update steps only). Per sample a score timestep τ (see below);
   ``x_τ = (1 − σ_τ) x̂0 + σ_τ ε`` (no grad); ``f`` = critic x0 at ``(x_τ, τ)``; ``r = u + w (c − u)``
   from the teacher's unconditional (the latent set's empty-prompt embedding: a set without one is
   refused, zeros are not it) and
   conditional x0, ``w = real_score_guidance_scale`` (one teacher forward when w = 1), all without
   gradients; ``g = (f − r) / mean_{C,T,H,W} |x̂0 − r|`` per sample (``g = 0`` for a sample whose
   normaliser is 0; each sample's own normaliser as in the DMD2 paper, on purpose — FastVideo divides
   by one mean over the whole batch, which lets one far-off sample shrink every other's step); ``loss = 0.5 · mean((x̂0 − stopgrad(x̂0 − g))²)``, so
   ``∂loss/∂x̂0 = g / x̂0.numel()`` (a descent step moves x̂0 along ``r − f``).

3. **Critic loss** (every step): the rollout's sample without gradient (on update steps the
   generator's ``x̂0.detach()``, otherwise the step's no-grad rollout) noised to per-sample t drawn
   like τ, ``x_t = (1 − σ_t) x̂0 + σ_t ε``; mean squared error between the critic's velocity and
   ``ε − x̂0``, gradients into the critic only.

Two phases per micro-batch, one graph alive at a time: :meth:`single_train_step` rolls out and
computes the generator loss; :meth:`backward` backpropagates it (freeing the student's graph), then
runs the critic's forward on the detached sample and backpropagates the critic loss (their graphs
touch disjoint trainable parameters; the logged ``total_loss`` is their sum). The teacher has
``requires_grad=False`` and never holds a ``.grad``. On non-update steps the student runs only under
``no_grad``: no graph, no gradient, its weights and optimizer state do not change (grad clipping,
EMA and compute-copy refreshes follow :meth:`roles_to_step`).

**Score timesteps** τ (teacher/critic queries, and the critic's training t): per sample, from the
teacher's shifted distribution truncated to ``[min_score_timestep_ratio, max_score_timestep_ratio]
· n`` (n = 1000): ``u ~ U[shift⁻¹(min), shift⁻¹(max))``, ``τ = n · shift(u)`` with
``shift(σ) = sσ / (1 + (s − 1)σ)``, ``shift⁻¹(y) = y / (s − (s − 1) y)``. This departs from FastVideo
on purpose: FastVideo clamps the shifted draw to the range, which puts an atom at each bound (at
shift 3, 5.7 % of the draws land on 980 exactly and 0.7 % on 20); truncating and renormalising keeps
the shifted density inside the range and puts no mass on the bounds (:func:`truncated_shifted_timesteps`,
drawn by :class:`ScoreTimesteps`, the one copy DMD2, Self-Forcing and DM-PDD share).

**LR schedules.** The student's scheduler steps on update steps only, so its schedule spans its
``max_train_steps // generator_update_interval`` updates (:meth:`DMD2Method.role_updates`; its
``warmup_steps`` count updates too), the critic's every step: a decay ends at the run's last step for both.

**Student ladder** ``student_timesteps`` (descending, in (0, n]); null: ``num_student_steps`` steps
of the shift-warped uniform ladder ``t_j = n · shift(1 − j/K)``, j = 0 … K−1 (``[1000, 900, 750,
500]`` at shift 3, K = 4: the ``[1000, 750, 500, 250]`` ladder mapped through the student's
timestep table, as upstream's ``warp_denoising_step``). The artifact's sampling contract is the
``few_step_x0`` sampler over this ladder (SDE re-noise; see ``rollout_renoise``).

**Randomness.** Everything comes from ``self.rng``. Per-sample draws (noise, τ, t) use the
:class:`~distillery.components.rng.BatchRNG` methods (the global batch is drawn, each rank keeps its
slice); the exit step is one draw from the BatchRNG's generator itself, which is identical on every
rank — all ranks run the same number of student forwards (FSDP2 needs that: each forward
all-gathers). Draw order per step: exit step; the batch noise (``prepare_batch``: the initial noise
in ``simulate``, the data noise in ``data_latent``); the ``sde`` re-noise draws; on update steps τ
then ε_τ; the critic's t then ε. ``check_rank_agreement`` (debug, off by default: two all-reduces
per step, before any forward) raises when ranks drew different exit steps or hold different generator
states (without it, a mismatch under FSDP2 would hang in a collective rather than fail).

``simulate`` reads only the prompt embeddings and the batch's latent shape (``data_kind`` prompts: it trains on a
prompt-only set, and on a latent set without reading its latent columns); ``data_latent`` reads the video latents.

**A discriminator term** (``gan_weight`` > 0; off by default): a head on the critic's hidden states tells noised real
latents from noised student samples, trained in the critic's step (``gan_discriminator_weight``), and the student's
loss gets its non-saturating generator term (:mod:`distillery.methods.gan`: the head, the draws — τ', ε' after the
generator's, ε_r after the critic's — and the losses). The batch's latents are its real samples: it reads a latent set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.methods.base import (
    StepOutput,
    TrainingMethod,
    check_second_scale,
    guided_by_scales,
    require_empty_prompt,
    teacher_scales,
)
from distillery.models.base import ModelBase, TrainingBatch, batch_latent_shape
from distillery.models.schedule import FlowMatchSchedule, euler_step, renoise, x0_from_velocity


def check_score_timestep_range(lo_ratio: float, hi_ratio: float) -> None:
    """The score timesteps' range ``[lo_ratio, hi_ratio] · 1000`` (``min_score_timestep_ratio`` /
    ``max_score_timestep_ratio`` of DMD2's and DM-PDD's configs): ``0 <= lo < hi <= 1``, else ValueError."""
    if not 0.0 <= lo_ratio < hi_ratio <= 1.0:
        raise ValueError("need 0 <= min_score_timestep_ratio < max_score_timestep_ratio <= 1")


@dataclass
class DMD2Config:
    student_timesteps: list[float] | None = None  # the student's descending ladder in (0, 1000]; null: warped uniform (module doc)
    num_student_steps: int = bounded(4, 1, 1000)  # ladder length when student_timesteps is null
    rollout: Literal["simulate", "data_latent"] = "simulate"  # where the student's sample starts (module doc)
    rollout_renoise: Literal["sde", "ode"] = "sde"  # simulate: fresh noise between steps (sde) or the Euler step (ode)
    generator_update_interval: int = 5  # the student steps at every k-th optimizer step; the critic every step
    real_score_guidance_scale: float = 3.5  # teacher CFG w in r = u + w (c − u); 1: conditional only; of two experts the high-noise one's
    real_score_guidance_scale_2: float | None = None  # a two-expert teacher's low-noise expert's w (τ < its boundary); null: the same
    min_score_timestep_ratio: float = 0.02  # lowest score timestep τ, as a fraction of 1000
    max_score_timestep_ratio: float = 0.98  # highest score timestep τ, as a fraction of 1000
    check_rank_agreement: bool = False  # debug: all-reduce the shared draws each step, raise if ranks differ
    gan_weight: float = 0.0  # the student's GAN term's weight (0: no discriminator); methods/gan.py
    gan_discriminator_weight: float = 0.01  # with it: the discriminator's loss's weight in the critic's step
    gan_feature_blocks: list[int] | None = None  # the critic's blocks the discriminator reads; null: 3 (methods/gan.py)

    def __post_init__(self) -> None:
        check_fields(self, "method")  # the declared ranges, for a config built in Python
        if self.rollout not in ("simulate", "data_latent"):
            raise ValueError(f"rollout must be simulate or data_latent, got {self.rollout!r}")
        if self.rollout_renoise not in ("sde", "ode"):
            raise ValueError(f"rollout_renoise must be sde or ode, got {self.rollout_renoise!r}")
        if self.student_timesteps is not None:
            ts = [float(t) for t in self.student_timesteps]
            if not ts or any(not 0.0 < t <= 1000.0 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
                raise ValueError(f"student_timesteps must be non-empty, strictly descending, in (0, 1000]; got {ts}")
            self.student_timesteps = ts
        if self.generator_update_interval < 1:
            raise ValueError("generator_update_interval must be >= 1")
        if not self.real_score_guidance_scale >= 0.0:
            raise ValueError("real_score_guidance_scale must be >= 0")
        if self.real_score_guidance_scale_2 is not None and not self.real_score_guidance_scale_2 >= 1.0:
            raise ValueError(f"real_score_guidance_scale_2 must be >= 1 (1: the conditional teacher), got "
                             f"{self.real_score_guidance_scale_2}")
        check_score_timestep_range(self.min_score_timestep_ratio, self.max_score_timestep_ratio)
        if not (self.gan_weight >= 0.0 and self.gan_discriminator_weight >= 0.0):
            raise ValueError("gan_weight and gan_discriminator_weight must be >= 0")


def warped_ladder(schedule: FlowMatchSchedule, num_steps: int) -> list[float]:
    """The default student ladder ``t_j = n · shift(1 − j/K)``, j = 0 … K−1 (descending, t_0 = n)."""
    n, s = schedule.num_train_timesteps, schedule.shift
    out = []
    for j in range(num_steps):
        u = 1.0 - j / num_steps
        out.append(float(n * s * u / (1.0 + (s - 1.0) * u)))
    return out


def truncated_shifted_timesteps(u01: torch.Tensor, schedule: FlowMatchSchedule, lo_ratio: float, hi_ratio: float) -> torch.Tensor:
    """Timesteps ``[B]`` (float32, in ``[lo_ratio·n, hi_ratio·n]``) from uniforms ``u01 [B]`` in [0, 1):
    the schedule's shifted distribution truncated to that range and renormalised (see the module doc).
    Departs from FastVideo on purpose: FastVideo clamps the shifted draw to the range, an atom of
    5.7 % at the upper bound at shift 3; here the density inside the range is kept and none piles up."""
    s, n = schedule.shift, schedule.num_train_timesteps
    a, b = lo_ratio / (s - (s - 1.0) * lo_ratio), hi_ratio / (s - (s - 1.0) * hi_ratio)
    u = a + (b - a) * u01.double()
    return (n * s * u / (1.0 + (s - 1.0) * u)).float()


def dmd_gradient(x0: torch.Tensor, fake_x0: torch.Tensor, real_x0: torch.Tensor) -> torch.Tensor:
    """``g = (f − r) / mean_{C,T,H,W} |x̂0 − r|`` per sample (float32 ``[B, C, T, H, W]``, no grad);
    a sample whose normaliser is 0 gets ``g = 0``. The normaliser is each sample's own, as the DMD2
    paper writes it — a departure from FastVideo on purpose, which divides the batch by one mean over
    all its samples (so a batch's outlier scales every other sample's step)."""
    with torch.no_grad():
        x0, f, r = x0.detach().float(), fake_x0.float(), real_x0.float()
        norm = (x0 - r).abs().mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
        safe = norm.clamp_min(torch.finfo(torch.float32).tiny)
        return torch.where(norm > 0, (f - r) / safe, torch.zeros_like(f))


@dataclass(frozen=True)
class ScoreModels:
    """What the distribution-matching losses query: the real score (``teacher``, frozen), the fake
    score (``critic``, trainable), the per-sample score-timestep draw ``B → τ [B]`` and the random
    stream of the noise (a method's ``self.rng``); DMD2 and DM-PDD share them."""

    teacher: ModelBase
    critic: ModelBase
    draw_timesteps: Callable[[int], torch.Tensor]
    rng: Any
    training: Any = None  # the run's TrainingConfig, to name its latent set when the empty prompt is missing
    # where the scores are queried (noise ε, σ [B]) → x_σ; None: the sample re-noised, (1 − σ) x̂0 + σ ε (Phased DMD: from its anchor)
    noised: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # the critic's velocity target (ε, σ) → [B, C, T, H, W]; None: ε − x̂0 (Phased DMD: its subinterval's)
    target: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class ScoreTimesteps:
    """The score-timestep draw and the :class:`ScoreModels` of a method with a ``teacher``, a ``critic``,
    a ``student``, ``self.rng`` and ``min_score_timestep_ratio`` / ``max_score_timestep_ratio`` in its
    config: the one copy DMD2 (and Self-Forcing) and DM-PDD share."""

    def draw_score_timesteps(self, batch_size: int) -> torch.Tensor:
        """Per-sample τ ``[B]`` (float32, on the student's device), see the module doc."""
        u = self.rng.rand((batch_size,)).to(self.student.device)
        return truncated_shifted_timesteps(u, self.teacher.schedule, self.config.min_score_timestep_ratio,
                                           self.config.max_score_timestep_ratio)

    def score_models(self) -> ScoreModels:
        """The teacher, the critic and the score-timestep draw the two losses share."""
        return ScoreModels(self.teacher, self.critic, self.draw_score_timesteps, self.rng, self.training)


def distribution_matching_loss(x0: torch.Tensor, cond: Any, scores: ScoreModels, guidance: float, skip_frames: int = 0,
                               guidance_2: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DMD generator loss of a student sample ``x0 [B, C, T, H, W]`` (with graph) and its metrics
    (module doc, step 2: draws τ ``[B]``, then ε_τ; ``guidance`` is the teacher's CFG w — of a two-expert teacher the
    high-noise expert's, ``guidance_2`` the low-noise one's for the samples whose τ is below its boundary,
    :func:`~distillery.methods.base.teacher_scales`). ``skip_frames``: latent frames at the start that are given, not
    generated (a causal image-to-video student's frame 0): the scores see the whole video, the gradient, its
    normaliser and the loss only the frames after them."""
    if guidance != 1.0 or (guidance_2 is not None and guidance_2 != 1.0):
        require_empty_prompt(cond, f"a real-score guidance of {guidance}", scores.training)
    b = x0.shape[0]
    tau = scores.draw_timesteps(b)
    generated = x0[:, :, skip_frames:] if skip_frames else x0  # with graph
    with torch.no_grad():
        noise = scores.rng.randn(x0.shape).to(x0.device)
        sigma = scores.teacher.schedule.sigma(tau)
        x_tau = scores.noised(noise, sigma) if scores.noised is not None else renoise(x0.detach(), noise, sigma)
        fake = scores.critic.predict_x0(x_tau, tau, cond, conditional=True)
        real = guided_by_scales(lambda conditional: scores.teacher.predict_x0(x_tau, tau, cond, conditional=conditional),
                                teacher_scales(scores.teacher, tau, guidance, guidance_2))
        if skip_frames:  # the generated frames only
            fake, real = fake[:, :, skip_frames:], real[:, :, skip_frames:]
        g = dmd_gradient(generated, fake, real)
    loss = 0.5 * F.mse_loss(generated.float(), (generated.detach().float() - g))
    metrics = {"dmd_grad_norm": g.abs().mean(), "score_timestep": tau.mean(),
               "fake_real_x0_gap": (fake - real).abs().mean()}
    return loss, metrics


@dataclass
class CriticPass:
    """The critic's flow-matching forward on a detached student sample: its loss and metrics, the per-sample
    timesteps ``t [B]`` it drew and (when asked) the hidden states of the blocks asked for (a discriminator's input)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    t: torch.Tensor
    features: list[torch.Tensor]


def critic_flow_matching(x0: torch.Tensor, cond: Any, scores: ScoreModels, skip_frames: int = 0,
                         feature_blocks: list[int] | None = None) -> CriticPass:
    """The critic's flow-matching loss on the detached student sample ``x0`` (module doc, step 3: draws t ``[B]``,
    then ε); ``skip_frames``: given leading frames, in the critic's input, not in its loss; ``feature_blocks``: also
    keep those blocks' hidden states of the same forward
    (:meth:`~distillery.models.base.ModelBase.predict_noise_with_features`, a discriminator's input); ``scores``'
    ``noised`` / ``target``, where set, replace the re-noise of ``x0`` and ``ε − x0`` (Phased DMD)."""
    x0 = x0.detach().float()
    t = scores.draw_timesteps(x0.shape[0])
    noise = scores.rng.randn(x0.shape).to(x0.device)
    sigma = scores.critic.schedule.sigma(t)
    x_t = scores.noised(noise, sigma) if scores.noised is not None else renoise(x0, noise, sigma)
    features: list[torch.Tensor] = []
    if feature_blocks:
        v, features = scores.critic.predict_noise_with_features(x_t, t, cond, feature_blocks, conditional=True)
    else:
        v = scores.critic.predict_noise(x_t, t, cond, conditional=True)
    target = scores.target(noise, sigma) if scores.target is not None else noise - x0
    if skip_frames:
        v, target = v[:, :, skip_frames:], target[:, :, skip_frames:]
    return CriticPass(F.mse_loss(v, target), {"critic_timestep": t.mean()}, t, features)


def fake_score_loss(x0: torch.Tensor, cond: Any, scores: ScoreModels,
                    skip_frames: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's flow-matching loss and metrics (:func:`critic_flow_matching`)."""
    critic = critic_flow_matching(x0, cond, scores, skip_frames)
    return critic.loss, critic.metrics


class DMD2Method(ScoreTimesteps, TrainingMethod):
    """Distribution-matching distillation (see the module doc for the losses and draws)."""

    config_class = DMD2Config
    required_roles = ("student", "teacher", "critic")
    trainable_roles = ("student", "critic")
    frozen_roles = ("teacher",)
    data_kind = "latents"

    @classmethod
    def parallel_problem(cls, config: DMD2Config, kind: str) -> str | None:
        """The GAN term takes neither (under SP its head would pool one rank's share of the tokens; under TP it is not
        checked yet)."""
        if config.gan_weight > 0:
            return f"{cls.__name__}'s GAN term (gan_weight {config.gan_weight:g}) does not take {kind} parallelism"
        return super().parallel_problem(config, kind)

    @classmethod
    def reads_latents(cls, config: DMD2Config) -> bool:
        """``data_latent`` starts from the data's latents, a GAN term (``gan_weight`` > 0) reads them as its real
        samples; ``simulate`` alone starts from noise of the batch's shape."""
        return config.rollout == "data_latent" or config.gan_weight > 0

    def __init__(self, config: DMD2Config, role_models: dict[str, ModelBase], training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        self.teacher = role_models["teacher"]
        self.critic = role_models["critic"]
        n = self.student.schedule.num_train_timesteps
        ladder = config.student_timesteps or warped_ladder(self.student.schedule, config.num_student_steps)
        if any(t > n for t in ladder):
            raise UserError(f"config error: method.student_timesteps: {ladder} exceed the student's {n} train timesteps")
        self.ladder: list[float] = [float(t) for t in ladder]
        for role in ("teacher", "critic"):
            if role_models[role].schedule.num_train_timesteps != n:
                raise UserError(f"config error: models.{role}: its timestep scale differs from the student's ({n})")
        check_second_scale(self.teacher, "teacher", "real_score_guidance_scale_2", config.real_score_guidance_scale_2)
        self.gan_blocks: list[int] | None = None  # the critic's blocks the discriminator reads; None: no GAN term
        if config.gan_weight > 0:
            from distillery.methods.gan import attach_discriminator

            self.gan_blocks = attach_discriminator(self.critic, config.gan_feature_blocks)

    @property
    def given_frames(self) -> int:
        """Leading latent frames that are given, not generated (0; a causal image-to-video student's 1: Self-Forcing)."""
        return 0

    # -- schedule ---------------------------------------------------------------------------
    def is_update_step(self, step: int) -> bool:
        """Whether the student (generator) updates at optimizer step ``step`` (1-based)."""
        return step % self.config.generator_update_interval == 0

    def roles_to_step(self, step: int) -> list[str]:
        return ["critic", "student"] if self.is_update_step(step) else ["critic"]

    def role_updates(self, role: str, max_steps: int) -> int:
        """The student updates on every ``generator_update_interval``-th step (its LR schedule spans
        those), the critic on every step."""
        return max_steps // self.config.generator_update_interval if role == "student" else max_steps

    def sampling_contract(self) -> dict[str, Any]:
        schedule = self.student.schedule
        return {"sampler": "few_step_x0", **schedule.contract(),
                "timesteps": list(self.ladder)}

    # -- draws ------------------------------------------------------------------------------
    def draw_exit_step(self, batch: dict[str, Any]) -> Any:
        """One ladder index in ``[0, K)`` shared by the whole batch and every rank (the BatchRNG's
        generator is identical on all ranks; one host sync to branch on it). Subclasses may draw
        more (Self-Forcing: one per chunk); :meth:`exit_code` and :meth:`exit_metrics` read it."""
        del batch
        return self.rng.shared_randint(len(self.ladder))

    def exit_code(self, exit_step: Any) -> int:
        """One integer that differs when the exit draws differ (the rank-agreement check)."""
        return int(exit_step)

    def exit_metrics(self, exit_step: Any) -> dict[str, torch.Tensor]:
        """The exit draw as logged scalars."""
        return {"exit_step": torch.tensor(float(exit_step)), "exit_timestep": torch.tensor(self.ladder[exit_step])}

    # -- rollout ----------------------------------------------------------------------------
    def rollout(self, batch: dict[str, Any], exit_step: int, with_grad: bool) -> tuple[torch.Tensor, TrainingBatch]:
        """The student's sample ``x̂0 [B, C, T, H, W]`` (float32) at ladder index ``exit_step``; it
        keeps its graph only when ``with_grad``. Returns it with the prepared batch (conditioning)."""
        x, tb = self.state_at_exit(batch, exit_step)
        t = torch.full((x.shape[0],), self.ladder[exit_step], dtype=torch.float32, device=self.student.device)
        with torch.set_grad_enabled(with_grad):
            x0 = self.student.predict_x0(x, t, tb, conditional=True)
        return x0, tb

    def state_at_exit(self, batch: dict[str, Any], exit_step: int) -> tuple[torch.Tensor, TrainingBatch]:
        """``(x_{t_k}, the prepared batch)``: the state the exit forward at ladder index ``k = exit_step`` takes
        (module doc, step 1) — ``simulate``: pure noise run down the ladder to ``t_k`` without gradients; ``data_latent``:
        the data noised to ``t_k``."""
        student, ladder = self.student, self.ladder
        n = student.schedule.num_train_timesteps
        device = student.device
        b = batch_latent_shape(batch)[0]

        def full(t: float) -> torch.Tensor:
            return torch.full((b,), t, dtype=torch.float32, device=device)

        if self.config.rollout == "data_latent":
            tb = student.prepare_batch(batch, self.rng, timesteps=full(ladder[exit_step]))
            return tb.noisy_latents, tb
        tb = student.prepare_batch(batch, self.rng, timesteps=full(float(n)))
        x = tb.noise  # x_{t_0}: pure noise
        with torch.no_grad():
            for j in range(exit_step):
                v = student.predict_noise(x, full(ladder[j]), tb, conditional=True)
                sigma, sigma_next = ladder[j] / n, ladder[j + 1] / n
                if self.config.rollout_renoise == "sde":
                    x = renoise(x0_from_velocity(x, v, sigma), self.rng.randn(x.shape).to(device), sigma_next)
                else:
                    x = euler_step(x, v, sigma, sigma_next)
        return x, tb

    # -- losses -----------------------------------------------------------------------------
    def generator_loss(self, x0: torch.Tensor, cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DMD loss of the generator output ``x0`` (with graph) and its metrics (module doc, step 2)."""
        return distribution_matching_loss(x0, cond, self.score_models(), self.config.real_score_guidance_scale,
                                          guidance_2=self.config.real_score_guidance_scale_2)

    def critic_loss(self, x0: torch.Tensor, cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Flow-matching loss of the critic on the student sample ``x0`` (detached), module doc step 3."""
        return fake_score_loss(x0, cond, self.score_models())

    # -- one micro-batch: two phases, one graph alive at a time ----------------------------
    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        """Phase 1: the exit draw, the rollout and (update steps) the generator loss. The critic's
        forward waits for :meth:`backward`, after the student's graph is freed: the student's and the
        critic's activations are never held together (at the Wan-1.3B shape they would not fit one GPU)."""
        update = self.is_update_step(step)
        exit_step = self.draw_exit_step(batch)
        if self.config.check_rank_agreement:  # before any forward: under FSDP2 a mismatch would hang, not fail
            self._check_rank_agreement(self.exit_code(exit_step))
        x0, cond = self.rollout(batch, exit_step, with_grad=update)
        losses: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = self.exit_metrics(exit_step)
        gen_loss = None
        total = torch.zeros((), device=x0.device)
        if update:
            gen_loss, gen_metrics = self.generator_loss(x0, cond)
            losses["generator_loss"] = gen_loss.detach()
            total = gen_loss
            if self.gan_blocks is not None:  # the GAN term: its gradient into the student, its value logged
                from distillery.methods.gan import generator_gan_term

                term, gan_metrics = generator_gan_term(x0, cond, self.score_models(), self.gan_blocks)
                gen_loss = gen_loss + self.config.gan_weight * term
                total = losses["generator_loss"] + self.config.gan_weight * gan_metrics["gan_generator_loss"]
                gen_metrics.update(gan_metrics)
            metrics.update(gen_metrics)
        ctx = {"update": update, "generator_loss": gen_loss, "sample": x0.detach(), "cond": cond}
        return StepOutput(losses={"total_loss": total, **losses}, backward_ctx=ctx, metrics=metrics)

    def backward(self, output: StepOutput, grad_accum_rounds: int = 1) -> None:
        """Phase 2: the generator's backward (update steps; it frees the student's graph), then the
        critic's forward on the detached sample and its backward. Adds ``critic_loss`` and its
        metrics to ``output`` and makes ``total_loss`` the generator + critic loss (detached: both
        backwards are done). Draw order is unchanged (the generator's τ, ε_τ, then the critic's t, ε)."""
        ctx = output.backward_ctx
        gen_loss = ctx.pop("generator_loss")
        if gen_loss is not None and gen_loss.requires_grad:
            self.student.backward(gen_loss, None, grad_accum_rounds)
        sample, cond = ctx.pop("sample"), ctx.pop("cond")
        if self.gan_blocks is None:
            crit_loss, crit_metrics = self.critic_loss(sample, cond)
            self.critic.backward(crit_loss, None, grad_accum_rounds)
        else:  # the fake-score pass keeps the discriminator's features; the real pass follows it (methods/gan.py)
            from distillery.methods.gan import critic_step_with_discriminator

            fake = critic_flow_matching(sample, cond, self.score_models(), self.given_frames, self.gan_blocks)
            crit_loss, crit_metrics = critic_step_with_discriminator(fake, cond.latents, cond, self.score_models(),
                                                                     self.gan_blocks, self.config.gan_discriminator_weight,
                                                                     grad_accum_rounds)
        output.losses["critic_loss"] = crit_loss.detach()
        output.losses["total_loss"] = output.losses["total_loss"].detach() + output.losses["critic_loss"]
        output.metrics.update(crit_metrics)

    def _check_rank_agreement(self, exit_step: int) -> None:
        """Raise when ranks drew different exit steps (``exit_step``: :meth:`exit_code` of the draw) or
        hold different generator states (debug)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        state = self.rng.generator.get_state().to(torch.int64)
        checksum = int((state * torch.arange(1, state.numel() + 1, dtype=torch.int64)).sum())
        values = torch.tensor([exit_step, checksum, -exit_step, -checksum], dtype=torch.int64, device=self.student.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        if values[0] != -values[2] or values[1] != -values[3]:
            raise RuntimeError(f"rank {self.rank}: the ranks drew different DMD2 exit steps or hold different random "
                               f"streams (exit step {exit_step}; max {int(values[0])}, min {-int(values[2])})")
