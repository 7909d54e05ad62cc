"""DM-PDD: PDD's head regression plus DMD2's distribution-matching generator loss against a critic.

PDD (:mod:`distillery.methods.pdd`) regresses one head per step onto the teacher's velocity over its
interval; each head is fitted to a conditional mean, so fused blocks average over what the teacher
would do and few-NFE samples come out blurry. DM-PDD adds the term DMD2 (:mod:`distillery.methods.dmd2`)
trains a few-step student with: the student's sample is pushed along ``r − f``, the teacher's (real)
minus a critic's (fake) score at a re-noised copy of it, which moves the sample *distribution* to the
teacher's rather than each head to a mean.

Roles: ``student`` (trainable :class:`~distillery.models.base.PDDModelBase`), ``teacher`` (frozen: the
PDD target and the real score), ``critic`` (trainable: the fake score, a flow-matching model of the
student's samples, initialised from the teacher, its own optimizer from ``models.critic.optimizer``).

One micro-batch (step numbers start at 1; a *DM step* is ``step % generator_update_interval == 0``):

1. **PDD** — steps 1–4 of :mod:`distillery.methods.pdd` as they are (each row's block start ``n_i``
   and head ``k_i``, ``x_n`` noised data or the rows' staggered carried trajectories, the teacher
   target), with the same draws in the same order: ``pdd_loss = mean((head_k − target)²)``.
2. **The student's sample** from the same trunk forward at ``x_n``, per row: the fused block
   ``[n_i, P)`` (every head from ``n_i`` to the grid's end, weighted ``Δ_j / Σ Δ`` as the sampler fuses
   a block), i.e. the student's one-forward jump to σ = 0: ``x̂0_i = x_{n,i} − σ_{n_i} ·
   v̄_{[n_i, P)}(x_{n,i})`` ``[B, C, T, H, W]`` (float32). The forward projects the heads ``[min_g n_g,
   P)`` (the global batch's lowest start: the same heads on every rank) and each row sums its own
   block's; they keep their graph on DM steps (gradients reach those heads and the trunk), and are
   projected from the detached trunk states otherwise. In ``simulate`` ``x_n`` is on the student's
   own trajectory, so ``x̂0`` is what the student samples from there.
3. **Distribution matching** (DM steps): DMD2's generator loss of ``x̂0``
   (:func:`~distillery.methods.dmd2.distribution_matching_loss`: per-sample τ from the teacher's
   shifted distribution truncated to ``[min_score_timestep_ratio, max_score_timestep_ratio] · 1000``,
   then ε_τ; the real score guided with ``teacher_guidance_scale``, the guidance PDD's target uses:
   1 is the conditional teacher in both, > 1 is CFG in both, < 1 is refused by the config).
   The student's objective is ``pdd_loss + dm_weight · generator_loss`` (``total_loss`` before the
   backward); other steps it is ``pdd_loss``. The student's optimizer steps every step.
4. **Critic** (every step, in :meth:`backward` after the student's backward has freed its graph, one
   graph alive at a time as in DMD2): DMD2's fake-score loss on ``x̂0.detach()``
   (:func:`~distillery.methods.dmd2.fake_score_loss`: its t, then ε); ``total_loss`` becomes the
   student's objective + ``critic_loss`` (detached, for the log).

Randomness: everything from ``self.rng`` (PDD's draws, then τ, ε_τ, then t, ε), so 2 ranks draw what 1
rank draws for the same global batch, and a resume continues the streams (the carried trajectories
are PDD's host state). The sampling contract is PDD's (``pdd_fused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded
from distillery.methods.base import StepOutput
from distillery.methods.dmd2 import ScoreTimesteps, check_score_timestep_range, distribution_matching_loss, fake_score_loss
from distillery.methods.pdd import PDDConfig, PDDMethod, Plan
from distillery.models.base import HeadGroup, ModelBase, PDDModelBase
from distillery.models.schedule import block_weights


@dataclass
class DMPDDConfig(PDDConfig):
    dm_weight: float = 1.0  # weight of the distribution-matching term beside the head regression
    generator_update_interval: int = bounded(1, 1, 1000)  # the DM term joins every k-th step; the critic trains every step
    min_score_timestep_ratio: float = 0.02  # lowest score timestep τ, as a fraction of 1000
    max_score_timestep_ratio: float = 0.98  # highest score timestep τ, as a fraction of 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.dm_weight >= 0.0:
            raise ValueError("dm_weight must be >= 0")
        check_score_timestep_range(self.min_score_timestep_ratio, self.max_score_timestep_ratio)


class DMPDDMethod(ScoreTimesteps, PDDMethod):
    """PDD + DMD2's distribution matching (see the module doc)."""

    config_class = DMPDDConfig
    required_roles = ("student", "teacher", "critic")
    trainable_roles = ("student", "critic")
    frozen_roles = ("teacher",)
    role_kinds = {"student": PDDModelBase}

    def __init__(self, config: DMPDDConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        self.critic = role_models["critic"]
        n = self.student.schedule.num_train_timesteps
        if self.critic.schedule.num_train_timesteps != n:
            raise UserError(f"config error: models.critic: its timestep scale differs from the student's ({n})")

    def is_dm_step(self, step: int) -> bool:
        """Whether the distribution-matching term joins the student's loss at optimizer step ``step`` (1-based)."""
        return step % self.config.generator_update_interval == 0

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        """Module doc steps 1–3: one trunk forward gives the supervised head and the sample ``x̂0``."""
        dm = self.is_dm_step(step)
        sigmas = self.student.fine_sigmas()  # CPU: the fusion weights, as the sampler's
        p = self.pdd_steps
        lowest: list[int] = []

        def sample_group(plan: Plan) -> list[HeadGroup]:
            lowest.append(min(plan.nodes))
            return [HeadGroup(list(range(lowest[0], p)), detached=not dm)]

        out = self.pdd_step(batch, sample_group)
        heads = out.extra[0]  # [B, P − lowest, C, T, H, W]
        weights = torch.zeros(len(out.nodes), p - lowest[0], dtype=torch.float64)
        for i, n in enumerate(out.nodes):  # row i fuses its own block [n_i, P)
            weights[i, n - lowest[0]:] = block_weights(sigmas, n, p)
        weights = weights.to(heads.device, torch.float32)
        v_bar = (weights.view(*weights.shape, *[1] * (heads.ndim - 2)) * heads).sum(1)
        sigma_n = self.student.fine_sigmas(out.x_n.device)[torch.tensor(out.nodes, device=out.x_n.device)]
        x0 = out.x_n.float() - sigma_n.view(-1, *[1] * (v_bar.ndim - 1)) * v_bar  # each row's fused jump [n_i, P) to σ_P = 0
        losses: dict[str, torch.Tensor] = {"pdd_loss": out.loss.detach()}
        metrics = dict(out.metrics)
        total = out.loss
        if dm:
            gen_loss, gen_metrics = distribution_matching_loss(x0, out.cond, self.score_models(),
                                                               self.config.teacher_guidance_scale,
                                                               guidance_2=self.config.teacher_guidance_scale_2)
            losses["generator_loss"] = gen_loss.detach()
            metrics.update(gen_metrics)
            total = total + self.config.dm_weight * gen_loss
        ctx = {"sample": x0.detach(), "cond": out.cond}
        return StepOutput(losses={"total_loss": total, **losses}, backward_ctx=ctx, metrics=metrics)

    def backward(self, output: StepOutput, grad_accum_rounds: int = 1) -> None:
        """Module doc step 4: the student's backward (freeing its graph), then the critic's forward on
        the detached sample and its backward; adds ``critic_loss`` and makes ``total_loss`` the sum (detached)."""
        ctx = output.backward_ctx
        self.student.backward(output.losses["total_loss"], None, grad_accum_rounds)
        crit_loss, crit_metrics = fake_score_loss(ctx.pop("sample"), ctx.pop("cond"), self.score_models())
        self.critic.backward(crit_loss, None, grad_accum_rounds)
        output.losses["critic_loss"] = crit_loss.detach()
        output.losses["total_loss"] = output.losses["total_loss"].detach() + output.losses["critic_loss"]
        output.metrics.update(crit_metrics)
