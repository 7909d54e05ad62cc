"""``distill.method: phased_dmd``: Phased DMD on a base of two experts (Wan 2.2 A14B): a bidirectional student of two
experts, each expert distilled on its own phase of the noise range (the high-noise one above the experts' boundary, the
low-noise one below) against the teacher's expert of that phase, with a critic of two experts
(:mod:`distillery.methods.phased_dmd`). Its rollouts are simulated and step by Euler between the ladder's steps
(``renoise: ode``, LightX2V's); the ladder (``distill.student_steps`` at ``distill.student_shift``) needs a step on
each side of the boundary. A student, teacher or critic of one expert is one line before training; so is
``distill.gan_weight`` (its critic trains on each phase's anchor, not on the data's latents beside a discriminator).
The collapse watch (``distill.collapse_every``) as every DMD recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.recipes.distill import DMDParams, dmd_callbacks, dmd_inputs, dmd_knobs, dmd_reads, dmd_roles

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class Params(DMDParams):
    """``distill.*`` with the DMD knobs (``guidance_scale_2``: the low phase's real score), ``gan_weight`` refused."""

    def problem(self, stage: str) -> str | None:
        if self.gan_weight > 0:
            return (f"{stage}.gan_weight: {self.gan_weight:g}: {stage}.method phased_dmd has no discriminator term (its "
                    f"critic trains on each phase's own samples); use {stage}.gan_weight: 0, or {stage}.method dmd2")
        return super().problem(stage)


inputs = dmd_inputs
reads = dmd_reads  # the base with the collapse watch on (its VAE)
PRETRAIN_STUDENT = "bidirectional"  # its student is bidirectional (pretrain.source: given with an A14B folder, or ODE init)
STUDENT = "bidirectional"  # the kind of student it trains (two experts of it)
EXPERTS = 2  # the experts its base (teacher, student, critic) must have: Wan 2.2 A14B's


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.phased_dmd import PhasedDMDMethod
    from stages.recipes.parts import method, student

    knobs = {**dmd_knobs(p), "rollout_renoise": "ode"}  # Euler between its ladder's steps, as its sampler deploys
    return RunConfig(models=dmd_roles(p, run, student(p, STUDENT, run.init["student"], shift=p.student_shift)),
                     method=method(PhasedDMDMethod, **knobs, rollout="simulate"),
                     training=p.training(run, unconditional="negative", betas=(0.0, 0.999)), callbacks=dmd_callbacks(p, run))
