"""``pretrain.method: ode_init``: knowledge distillation of the teacher's ODE trajectories into a causal student — the
init the Self-Forcing paper distills from. The stage first makes the trajectories (:func:`prepare`: the teacher artifact
with CFG, resumable) and trains on them: the student at a trajectory point ``x_t, t`` regresses the trajectory's clean
end point, the frames of a chunk sharing one point (:mod:`distillery.methods.kd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.recipes.pretrain import (
    TrajectoryParams,
    causal_contract,
    causal_student,
    prepare_trajectories,
    pretrain_inputs,
)

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


Params = TrajectoryParams  # pretrain.* with the trajectories' knobs
prepare = prepare_trajectories
inputs = pretrain_inputs
STUDENT = "causal"  # the kind of student it makes (distill recipes start from one kind: chain_notes)
given_contract = causal_contract  # a given model standing in for it: the block-causal student's chunks


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.kd import KDMethod
    from stages.recipes.parts import callbacks, method

    return RunConfig(models={"student": causal_student(p, run)},
                     method=method(KDMethod, t_list=p.t_list, chunk_size=p.chunk_size),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))
