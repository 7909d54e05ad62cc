"""``distill.method: dmd2``: a bidirectional few-step student (from the pretrain weights: ``pretrain.method:
ode_init_bidirectional`` is its ODE init) matched to the teacher's distribution with a critic, its rollouts simulated
(:mod:`distillery.methods.dmd2`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.recipes.distill import DMDParams, dmd_callbacks, dmd_inputs, dmd_knobs, dmd_reads, dmd_roles

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs

Params = DMDParams  # distill.* with the DMD knobs: none of its own

inputs = dmd_inputs
reads = dmd_reads  # the base with the collapse watch on (its VAE)
PRETRAIN_STUDENT = "bidirectional"  # the kind of pretrain student its recipe starts from (ode_init_bidirectional)
STUDENT = "bidirectional"  # the kind of student it trains


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.dmd2 import DMD2Method
    from stages.recipes.parts import method, student

    return RunConfig(models=dmd_roles(p, run, student(p, PRETRAIN_STUDENT, run.init["student"], shift=p.student_shift)),
                     method=method(DMD2Method, **dmd_knobs(p), rollout="simulate"),
                     training=p.training(run, unconditional="negative", betas=(0.0, 0.999)), callbacks=dmd_callbacks(p, run))
