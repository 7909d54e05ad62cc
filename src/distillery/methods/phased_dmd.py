"""Phased DMD: distribution-matching distillation of a two-expert teacher into a two-expert few-step student, each
expert distilled on its own phase of the noise range — a student and a critic per expert (Wan 2.2 A14B).

Phased DMD (Fan et al., 2025, "Phased DMD: few-step distribution matching distillation via score matching within
subintervals") splits the noise range at a boundary and distils each phase with its own generator and fake score;
LightX2V's trainer (``lightx2v_train/trainers/phased_dmd``) runs it on Wan 2.2 A14B with the high-noise and
low-noise experts as the two phases. Here the phases *are* the experts: the student, the teacher and the critic are
each a model of two experts (:class:`~distillery.models.wan.experts.WanExperts`) with one boundary ``B =
boundary_ratio · 1000``, and the experts' own routing (``t >= B``: the high-noise expert) sends every forward of a
phase to that phase's experts — so the high-noise student expert is trained only by the high phase against the
teacher's and the critic's high-noise experts, the low-noise one only by the low phase.

Roles as :mod:`distillery.methods.dmd2` (``student``, ``teacher``, ``critic``), every one two experts of the same
boundary (one line otherwise). The student's ladder ``t_0 > … > t_{K−1}`` (DMD2's ``student_timesteps`` /
``num_student_steps``) splits at ``B``: the high phase's steps ``t_j >= B`` (indices ``[0, m)``), the low phase's
``t_j < B`` (``[m, K)``); each phase needs a step (one line otherwise). ``σ_b = t_m / 1000`` is the first low step:
where the high phase hands the low one its sample.

**Phase of a step**: the optimizer steps run in blocks of ``generator_update_interval`` (the critic every step, the
student at the block's last step, as DMD2's), the blocks alternating high, low, high, … from step 1 (with interval 1:
one phase per step, alternating, as LightX2V's iterations). The exit draw is inside the phase: high ``k ∈ [0, m)``,
low ``k ∈ [m, K)`` (one draw shared by every rank).

**Rollout** (``simulate`` only): from pure noise down the ladder to ``t_k`` without gradients, as DMD2's, then the
exit forward ``v = v_θ(x_{t_k}, t_k)`` (with graph on update steps) and ``x̂0 = x_{t_k} − σ_k v``. The phase's
*anchor* — the sample whose distribution the phase matches — is, high: the state the deployed sampler hands the low
phase, ``x_{σ_b}`` (``ode``: the Euler step ``x_{t_k} + (σ_b − σ_k) v``; ``sde``: ``(1 − σ_b) x̂0 + σ_b ε``), at
``σ_s = σ_b``; low: ``x̂0`` itself, at ``σ_s = 0``.

**Score matching within the subinterval**: scores are queried at ``τ`` drawn (per sample, DMD2's truncated shifted
draw) inside the phase's range — high: ``τ ∈ [B, max_score_timestep_ratio · 1000]``, low:
``τ ∈ [min_score_timestep_ratio · 1000, B)`` (so the teacher's and the critic's expert is the phase's) — from the
anchor: ``x_τ = α x_s + β ε`` with ``α = (1 − σ_τ) / (1 − σ_s)``, ``β = sqrt(σ_τ² − α² σ_s²)``, which has the marginal
of ``(1 − σ_τ) x0 + σ_τ ε'`` when ``x_s`` has that of ``(1 − σ_s) x0 + σ_s ε''`` (at ``σ_s = 0``: DMD2's
re-noise).

- **Generator loss** (update steps): ``f`` = critic x0 and ``r`` = guided teacher x0 at ``(x_τ, τ)`` (the phase's
  expert: CFG ``real_score_guidance_scale`` for the high phase, ``real_score_guidance_scale_2`` — else the same — for
  the low one, as diffusers' ``guidance_scale`` / ``guidance_scale_2``), ``g = (f − r) / mean |x̂0 − r|`` per sample
  (:func:`~distillery.methods.dmd2.dmd_gradient`), ``loss = 0.5 · mean((x̂0 − stopgrad(x̂0 − g))²)`` — on ``x̂0``, as
  LightX2V applies it (the anchor is linear in the same ``v``).
- **Critic loss** (every step, on the detached anchor of the step's rollout, as DMD2 trains its critic on the
  rollout's sample): ``t`` drawn like τ, ``x_t = α x_s + β ε``, and the critic's velocity regressed on the
  subinterval's denoising-score-matching target ``u = −x_s / (1 − σ_s) + c ε`` with ``c = (σ_t + (1 − σ_t) σ_s² /
  (1 − σ_s)²) / β`` — the velocity ``(σ_t ε_{t|s} / β − x_t) / (1 − σ_t)`` the score of ``p(x_t | x_s)`` implies, whose
  regression on ``x_t`` gives the marginal velocity of the phase (at ``σ_s = 0``: ``ε − x̂0``, DMD2's target).

Departures from LightX2V, on purpose: its critic trains on a second, full no-gradient rollout of every step's
batch; here on the step's own rollout (DMD2's economy: one rollout per step). Its low phase also takes, on half its
iterations, the teacher's high-noise expert with an extra fake score (``fake_low_high``); not here (each phase's
scores are its own experts'). Its score timesteps are drawn uniformly over raw timesteps mapped through the warped
schedule; here DMD2's truncated shifted draw, restricted to the phase.

Sampling contract: ``few_step_x0`` over the ladder with ``renoise`` = ``rollout_renoise`` (``ode`` by default, as
LightX2V's Euler rollouts): the student's experts route each step by ``B`` — the high steps, then the low ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from distillery.common.errors import UserError
from distillery.methods.base import StepOutput
from distillery.methods.dmd2 import (
    DMD2Config,
    DMD2Method,
    ScoreModels,
    distribution_matching_loss,
    fake_score_loss,
    truncated_shifted_timesteps,
)
from distillery.models.base import ModelBase, TrainingBatch
from distillery.models.schedule import euler_step, renoise, x0_from_velocity

PHASES = ("high", "low")


@dataclass
class PhasedDMDConfig(DMD2Config):
    rollout_renoise: Literal["sde", "ode"] = "ode"  # Euler steps between the student's ladder steps (LightX2V's); sde: fresh noise

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout != "simulate":
            raise ValueError("Phased DMD rolls its phases out from noise: rollout must be simulate (data_latent is DMD2's)")
        if self.gan_weight > 0:
            raise ValueError("Phased DMD has no discriminator term (its critic trains on each phase's anchor): gan_weight "
                             "must be 0")


@dataclass
class PhaseSample:
    """One step's phase sample: ``anchor`` ``x_s`` (detached, float32 ``[B, C, T, H, W]``) at ``sigma_s``, and its
    ``phase`` (``high`` | ``low``)."""

    anchor: torch.Tensor
    sigma_s: float
    phase: str


def phase_coefficients(sigma_s: float, sigma_t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(α, β)`` of ``x_t = α x_s + β ε`` (module doc) for per-sample ``sigma_t`` ``[B]`` (> ``sigma_s``), shaped to
    broadcast over ``like`` ``[B, C, T, H, W]``; ``β²`` floored at the smallest normal float (never a square root of
    a rounding error's negative)."""
    st = sigma_t.double().view(-1, *[1] * (like.ndim - 1))
    alpha = (1.0 - st) / (1.0 - float(sigma_s))
    beta = (st * st - alpha * alpha * float(sigma_s) ** 2).clamp_min(torch.finfo(torch.float32).tiny).sqrt()
    return alpha.float(), beta.float()


def phase_forward(anchor: torch.Tensor, noise: torch.Tensor, sigma_s: float, sigma_t: torch.Tensor) -> torch.Tensor:
    """``x_t = α x_s + β ε`` (float32; module doc)."""
    alpha, beta = phase_coefficients(sigma_s, sigma_t, anchor)
    return alpha * anchor.float() + beta * noise.float()


def phase_velocity_target(anchor: torch.Tensor, noise: torch.Tensor, sigma_s: float, sigma_t: torch.Tensor) -> torch.Tensor:
    """The critic's target ``−x_s / (1 − σ_s) + c ε``, ``c = (σ_t + (1 − σ_t) σ_s² / (1 − σ_s)²) / β`` (float32; module
    doc); at ``σ_s = 0`` it is ``ε − x_s``."""
    _, beta = phase_coefficients(sigma_s, sigma_t, anchor)
    st = sigma_t.float().view(-1, *[1] * (anchor.ndim - 1))
    s = float(sigma_s)
    c = (st + (1.0 - st) * s * s / (1.0 - s) ** 2) / beta
    return -anchor.float() / (1.0 - s) + c * noise.float()


def one_expert(role: str, init_from: Any) -> str:
    """The line that refuses a role of one expert."""
    return (f"config error: models.{role}: Phased DMD distils each expert on its own phase; {init_from} is a model of "
            "one expert (a Wan 2.2 A14B folder has two)")


class PhasedDMDMethod(DMD2Method):
    """Phased DMD over two experts (module doc)."""

    config_class = PhasedDMDConfig

    @classmethod
    def check_roles(cls, role_models: dict[str, Any]) -> None:
        """DMD2's roles, and each of them two experts: a role whose ``init_from`` folder is of one expert is refused
        here, from the run config before any weights load (a stage refuses it before launching)."""
        super().check_roles(role_models)
        from distillery.models.registry import family_of

        for role in ("student", "teacher", "critic"):
            spec = role_models.get(role)
            init = getattr(getattr(spec, "config", spec), "init_from", None)
            if init and Path(init).is_dir() and family_of(init).experts != 2:
                raise UserError(one_expert(role, init))

    def __init__(self, config: PhasedDMDConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        boundary = self.student.boundary_timestep
        for role, model in (("student", self.student), ("teacher", self.teacher), ("critic", self.critic)):
            if model.boundary_timestep is None:
                raise UserError(one_expert(role, model.config.init_from))
            if model.boundary_timestep != boundary:
                raise UserError(f"config error: models.{role}: its experts' boundary t = {model.boundary_timestep:g} "
                                f"differs from the student's {boundary:g}; the phases are one split for every role")
        assert boundary is not None
        self.boundary = float(boundary)
        self.split = sum(1 for t in self.ladder if t >= self.boundary)  # m: the high phase's steps
        if not 0 < self.split < len(self.ladder):
            raise UserError(f"config error: method.student_timesteps: the ladder {self.ladder} gives the "
                            f"{'low' if self.split == len(self.ladder) else 'high'}-noise expert no step (its boundary "
                            f"t = {self.boundary:g}); each phase needs at least one")
        n = self.student.schedule.num_train_timesteps
        self.sigma_b = self.ladder[self.split] / n  # the first low step: where the high phase hands over
        lo, hi = self.config.min_score_timestep_ratio * n, self.config.max_score_timestep_ratio * n
        if not lo < self.boundary <= hi:
            raise UserError(f"config error: method.min_score_timestep_ratio / max_score_timestep_ratio: the score range "
                            f"[{lo:g}, {hi:g}] must hold the experts' boundary t = {self.boundary:g} (each phase "
                            "scores on its side of it)")

    # -- phases -----------------------------------------------------------------------------
    def phase_of(self, step: int) -> str:
        """The phase of optimizer step ``step`` (1-based): blocks of ``generator_update_interval`` steps, alternating
        high, low, … (module doc)."""
        return PHASES[((step - 1) // self.config.generator_update_interval) % 2]

    def draw_phase_exit(self, phase: str) -> int:
        """A ladder index inside ``phase`` (one draw shared by every rank)."""
        m, k = self.split, len(self.ladder)
        return self.rng.shared_randint(m) if phase == "high" else m + self.rng.shared_randint(k - m)

    def draw_phase_timesteps(self, batch_size: int, phase: str) -> torch.Tensor:
        """Per-sample score timesteps ``[B]`` (float32) inside ``phase``'s range (module doc): DMD2's truncated shifted
        draw; the low phase's strictly below the boundary (its experts)."""
        n = self.student.schedule.num_train_timesteps
        ratio = self.boundary / n
        lo, hi = (ratio, self.config.max_score_timestep_ratio) if phase == "high" else (self.config.min_score_timestep_ratio, ratio)
        u = self.rng.rand((batch_size,)).to(self.student.device)
        tau = truncated_shifted_timesteps(u, self.teacher.schedule, lo, hi)
        if phase == "low":
            below = torch.nextafter(torch.tensor(self.boundary, dtype=torch.float32), torch.tensor(0.0))
            tau = torch.minimum(tau, below.to(tau.device))
        return tau.clamp_min(self.boundary) if phase == "high" else tau

    def sampling_contract(self) -> dict[str, Any]:
        return {**super().sampling_contract(), "renoise": self.config.rollout_renoise}

    # -- rollout ----------------------------------------------------------------------------
    def phase_rollout(self, batch: dict[str, Any], exit_step: int, phase: str,
                      with_grad: bool) -> tuple[torch.Tensor, PhaseSample, TrainingBatch]:
        """``(x̂0 with graph when with_grad, the phase sample, the prepared batch)`` of a rollout exiting at ladder index
        ``exit_step`` (module doc)."""
        x, tb = self.state_at_exit(batch, exit_step)
        n = self.student.schedule.num_train_timesteps
        t = torch.full((x.shape[0],), self.ladder[exit_step], dtype=torch.float32, device=x.device)
        sigma = self.ladder[exit_step] / n
        with torch.set_grad_enabled(with_grad):
            v = self.student.predict_noise(x, t, tb, conditional=True)
            x0 = x0_from_velocity(x, v, sigma)  # as the few_step_x0 sampler computes it
        with torch.no_grad():
            if phase == "low":
                return x0, PhaseSample(x0.detach().float(), 0.0, phase), tb
            if self.config.rollout_renoise == "ode":
                anchor = euler_step(x, v.detach(), sigma, self.sigma_b)
            else:
                anchor = renoise(x0.detach(), self.rng.randn(x.shape).to(x.device), self.sigma_b)
        return x0, PhaseSample(anchor.float(), self.sigma_b, phase), tb

    # -- losses: DMD2's, queried from the phase's anchor inside the phase's range ---------------------
    def phase_scores(self, sample: PhaseSample) -> ScoreModels:
        """DMD2's :class:`~distillery.methods.dmd2.ScoreModels` for ``sample``'s phase: τ (and the critic's t) inside its
        range, the scores queried at ``α x_s + β ε`` from its anchor, the critic's target the subinterval's (module doc)."""
        anchor, s = sample.anchor, sample.sigma_s
        return ScoreModels(self.teacher, self.critic, lambda b: self.draw_phase_timesteps(b, sample.phase), self.rng,
                           self.training, noised=lambda noise, sigma: phase_forward(anchor, noise, s, sigma),
                           target=lambda noise, sigma: phase_velocity_target(anchor, noise, s, sigma))

    def phase_generator_loss(self, x0: torch.Tensor, sample: PhaseSample,
                             cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The phase's DMD loss on ``x̂0`` (with graph) and its metrics (module doc; draws τ, then ε)."""
        return distribution_matching_loss(x0, cond, self.phase_scores(sample), self.config.real_score_guidance_scale,
                                          guidance_2=self.config.real_score_guidance_scale_2)

    def critic_loss(self, x0: Any, cond: TrainingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's loss on the step's :class:`PhaseSample` (``x0``: what the rollout handed DMD2's backward; module
        doc: draws t, then ε)."""
        return fake_score_loss(x0.anchor, cond, self.phase_scores(x0))

    # -- one micro-batch --------------------------------------------------------------------
    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        """DMD2's two phases (the critic's forward waits for :meth:`~distillery.methods.dmd2.DMD2Method.backward`), the
        rollout and scores inside the step's phase (module doc)."""
        update, phase = self.is_update_step(step), self.phase_of(step)
        exit_step = self.draw_phase_exit(phase)
        if self.config.check_rank_agreement:
            self._check_rank_agreement(self.exit_code(exit_step))
        x0, sample, cond = self.phase_rollout(batch, exit_step, phase, with_grad=update)
        metrics: dict[str, torch.Tensor] = {**self.exit_metrics(exit_step), "phase": torch.tensor(float(PHASES.index(phase)))}
        losses: dict[str, torch.Tensor] = {}
        gen_loss = None
        if update:
            gen_loss, gen_metrics = self.phase_generator_loss(x0, sample, cond)
            losses["generator_loss"] = gen_loss.detach()
            metrics.update(gen_metrics)
        total = gen_loss if gen_loss is not None else torch.zeros((), device=x0.device)
        ctx = {"update": update, "generator_loss": gen_loss, "sample": sample, "cond": cond}
        return StepOutput(losses={"total_loss": total, **losses}, backward_ctx=ctx, metrics=metrics)
