"""``pretrain.method: ode_init_bidirectional``: knowledge distillation of the teacher's ODE trajectories into a
bidirectional student, the init of ``distill.method: dmd2`` (FastVideo's KDMethod; ``ode_init`` is the causal one,
for Self-Forcing): one trajectory point per sample, no chunks (:mod:`distillery.methods.kd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.recipes.pretrain import TrajectoryParams, prepare_trajectories, pretrain_inputs

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


Params = TrajectoryParams  # pretrain.* with the trajectories' knobs
prepare = prepare_trajectories
inputs = pretrain_inputs
STUDENT = "bidirectional"  # the kind of student it makes (distill.method: dmd2 starts from one)


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.kd import KDMethod
    from stages.recipes.parts import callbacks, method, student

    return RunConfig(models={"student": student(p, STUDENT, run.init["student"])},
                     method=method(KDMethod, t_list=p.t_list),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))
