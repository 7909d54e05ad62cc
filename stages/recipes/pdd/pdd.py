"""``pdd.method: pdd``: the student's head bank regresses the teacher's fine-grid jumps, on carried on-policy
trajectories or noised data (:mod:`distillery.methods.pdd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distillery.pipeline.params.schema import PDDParams
from stages.recipes.pdd import pdd_inputs, pdd_knobs, pdd_roles

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs

Params = PDDParams  # pdd.*: no knob of its own

inputs = pdd_inputs
STUDENT = "pdd"  # the kind of student it makes (a PDD trunk + head bank; the base family must build one)


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.pdd import PDDMethod
    from stages.recipes.parts import callbacks, method

    return RunConfig(models=pdd_roles(p, run), method=method(PDDMethod, **pdd_knobs(p)),
                     training=p.training(run, unconditional="negative"), callbacks=callbacks(p))
