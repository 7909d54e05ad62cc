"""Causal consistency distillation: a causal student learns self-consistency along the teacher's ODE, with no cached
trajectories.

Roles: ``student`` (trainable, a :class:`~distillery.models.base.CausalModelBase`, text-to-video), ``teacher`` (frozen:
a causal model — a Teacher-Forcing SFT student, as in Causal Forcing — is run under teacher forcing with the clean
context; a bidirectional one on the whole noisy video), and the **target network**: a frozen twin of the student whose
weights are the student's shadow (:mod:`distillery.components.shadow`, ``shadow_networks``), an exponential moving
average that starts as the student's initial weights and follows it from ``target_start_step`` on.

**The discrete grid** (``num_discrete_steps`` N, FastVideo's ``discrete_cd_N``): ``σ_i = shift(1 − i/N)``,
``t_i = n σ_i`` for i = 0 … N − 1 (``shift(σ) = sσ / (1 + (s − 1)σ)``, s the teacher's flow shift, n its timestep
scale, 1000): the shifted N-step Euler grid without its last point (σ = 0).

**One micro-batch** (clean latents ``x0 [B, C, T, H, W]`` of the data, ``cond`` the prompts):

1. one grid index ``i ∈ [0, N − 1)`` for the whole batch (and every rank), ``t = t_i``, ``t' = t_{i+1}``;
2. noise ε; ``x_t = (1 − σ_t) x0 + σ_t ε`` (every frame at t);
3. the teacher's Euler step with CFG w = ``guidance_scale``: ``v = u + w (c − u)`` from its unconditional (the latent
   set's empty-prompt embedding; refused without it, zeros are not it) and conditional velocity at ``(x_t, t)``
   (one forward when w = 1), ``x_{t'} = x_t − (σ_t − σ_{t'}) v``, without gradient;
4. the target's x0 at ``(x_{t'}, t')``: ``x̂0⁻ = x_{t'} − σ_{t'} v_target``, without gradient;
5. the student's x0 at ``(x_t, t)``: ``x̂0 = x_t − σ_t v_student``, with gradient;
6. loss ``mean (x̂0 − x̂0⁻)²`` over every element (float32).

The student, the target and a causal teacher see the batch's clean latents as context (teacher forcing,
:meth:`~distillery.models.base.CausalModelBase.predict_noise_teacher_forcing`): chunk c attends to its own noisy frames
and to the clean frames of the chunks before it. After each optimizer step s ≥ ``target_start_step``:
``target ← target + (1 − target_decay) (student − target)`` (until then the target stays the initial weights). This is
FastVideo 0.2.1's ``CausalConsistencyDistillationMethod`` (``consistency_model/causal_cd.py``), on our roles: a
differential test runs FastVideo's own code on the same tensors (tests/test_causal_cd.py).

**Randomness** (``self.rng``): the grid index from the BatchRNG's generator (the same on every rank: every rank runs
the same forwards), then the per-sample noise. Only the index and the noise are drawn.

The artifact's sampling contract is DFSFT's and ODE-init's (many-step Euler under the block-causal mask,
``chunk_size`` in it): a causal-CD student feeds ``distill`` as an ODE-init student does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.methods.base import StepOutput, TrainingMethod, causal_contract, require_empty_prompt
from distillery.models.base import CausalModelBase, ModelBase, TrainingBatch
from distillery.models.schedule import FlowMatchSchedule, euler_step, x0_from_velocity


@dataclass
class CausalCDConfig:
    num_discrete_steps: int = bounded(48, 2, 1000)  # N: the teacher's Euler grid the consistency is learned along
    guidance_scale: float = 3.0  # the teacher's CFG w in its ODE step, u + w (c − u); 1: conditional only
    target_decay: float = 0.99  # the target network's EMA decay per optimizer step
    target_start_step: int = bounded(200, 0, 10**9)  # the target follows the student from this optimizer step on

    def __post_init__(self) -> None:
        check_fields(self, "method")  # the declared ranges, for a config built in Python
        if not self.guidance_scale >= 0.0:
            raise ValueError("guidance_scale must be >= 0")
        if not 0.0 <= self.target_decay <= 1.0:
            raise ValueError("target_decay must be in [0, 1]")


def discrete_grid(schedule: FlowMatchSchedule, num_steps: int) -> torch.Tensor:
    """Timesteps ``[N]`` (float32, descending): ``t_i = n · shift(1 − i/N)``, i = 0 … N − 1 (module doc)."""
    unshifted = 1.0 - torch.arange(num_steps, dtype=torch.float64) / num_steps
    return (schedule.shift_sigma(unshifted) * schedule.num_train_timesteps).float()


def consistency_loss(student_x0: torch.Tensor, target_x0: torch.Tensor) -> torch.Tensor:
    """``mean (x̂0 − x̂0⁻)²`` over every element, float32 (module doc, step 6)."""
    return F.mse_loss(student_x0.float(), target_x0.float())


class CausalCDMethod(TrainingMethod):
    """Causal consistency distillation (module doc)."""

    config_class = CausalCDConfig
    required_roles = ("student", "teacher")
    trainable_roles = ("student",)
    frozen_roles = ("teacher",)
    role_kinds = {"student": CausalModelBase}
    data_kind = "latents"
    sequence_parallel = False  # its teacher-forcing forward is not checked under sequence parallelism yet
    tensor_parallel = False  # nor under tensor parallelism

    @classmethod
    def shadow_networks(cls, config: CausalCDConfig) -> dict[str, str]:
        """The target network: the student's shadow."""
        return {"target": "student"}

    def __init__(self, config: CausalCDConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        self.teacher = role_models["teacher"]
        if self.causal.given_first_frame:
            raise UserError("config error: method: causal consistency distillation of an image-to-video student is not "
                            "supported")
        if self.student.boundary_timestep is not None:  # teacher forcing: the clean context (t = 0) beside the noisy frames
            raise UserError("config error: models.student: a model of two experts (Wan 2.2 A14B); causal consistency "
                            "distillation's teacher-forcing forward holds the clean context at t = 0 beside the noisy "
                            "frames and would span both experts in one forward: not supported (train its causal student "
                            "by Self-Forcing, whose every call is one expert's)")
        n = self.student.schedule.num_train_timesteps
        if self.teacher.schedule.num_train_timesteps != n:
            raise UserError(f"config error: models.teacher: its timestep scale differs from the student's ({n})")
        self.grid = discrete_grid(self.teacher.schedule, config.num_discrete_steps)

    @property
    def causal(self) -> CausalModelBase:
        """The student, typed as the causal model ``role_kinds`` made sure it is."""
        return self.student  # type: ignore[return-value]

    @property
    def target(self) -> ModelBase:
        """The target network (the student's frozen twin; its weights are ``self.shadows["target"]``)."""
        return self.twins["target"]

    def sampling_contract(self) -> dict[str, Any]:
        """Many-step Euler under the block-causal mask (``chunk_size`` in it): DFSFT's and ODE-init's (module doc)."""
        return {**super().sampling_contract(), **causal_contract(self.student)}

    # -- one micro-batch ---------------------------------------------------------------------------
    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        index = self.rng.shared_randint(self.config.num_discrete_steps - 1)
        t = float(self.grid[index])
        b = int(batch["latents"].shape[0])
        tb = self.student.prepare_batch(batch, self.rng, timesteps=torch.full((b,), t, dtype=torch.float32))
        return self.loss(tb, index)

    def loss(self, tb: TrainingBatch, index: int) -> StepOutput:
        """The consistency loss of a prepared batch ``tb`` (its ``noisy_latents`` at grid point ``index``; module doc,
        steps 3–6)."""
        n = self.student.schedule.num_train_timesteps
        t, t_next = float(self.grid[index]), float(self.grid[index + 1])
        device, b = tb.noisy_latents.device, tb.noisy_latents.shape[0]
        x_t, clean = tb.noisy_latents, tb.latents
        w = self.config.guidance_scale
        if w != 1.0:
            require_empty_prompt(tb, f"a teacher guidance of {w}", self.training)
        with torch.no_grad():
            full_t, full_next = (torch.full((b,), v, dtype=torch.float32, device=device) for v in (t, t_next))
            velocity = self._velocity(self.teacher, x_t, full_t, tb, clean, conditional=True)
            if w != 1.0:
                uncond = self._velocity(self.teacher, x_t, full_t, tb, clean, conditional=False)
                velocity = uncond + w * (velocity - uncond)
            x_next = euler_step(x_t.float(), velocity, t / n, t_next / n)
            target_x0 = x0_from_velocity(x_next, self._velocity(self.target, x_next, full_next, tb, clean, True), t_next / n)
        student_x0 = x0_from_velocity(x_t, self._velocity(self.student, x_t, full_t, tb, clean, True), t / n)
        loss = consistency_loss(student_x0, target_x0)
        return StepOutput(losses={"total_loss": loss, "consistency_loss": loss.detach()},
                          metrics={"cd_timestep": torch.tensor(t), "cd_step": torch.tensor(float(index))})

    @staticmethod
    def _velocity(model: ModelBase, x: torch.Tensor, t: torch.Tensor, tb: TrainingBatch, clean: torch.Tensor,
                  conditional: bool) -> torch.Tensor:
        """``model``'s velocity at ``(x, t)``: under teacher forcing with the clean context for a causal model, over the
        whole noisy video for a bidirectional one."""
        if isinstance(model, CausalModelBase):
            return model.predict_noise_teacher_forcing(x, t, tb, clean, conditional=conditional)
        return model.predict_noise(x, t, tb, conditional=conditional)

    def optimizers_step(self, step: int) -> None:
        """The student's update, then (from ``target_start_step`` on) the target's EMA step."""
        super().optimizers_step(step)
        if step >= self.config.target_start_step:
            self.shadows["target"].lerp_(1.0 - self.config.target_decay)
