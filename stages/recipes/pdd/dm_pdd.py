"""``pdd.method: dm_pdd``: PDD's head regression plus DMD2's distribution-matching loss of the student's fused jump to
sigma 0, against a critic (the fake score, from the teacher, trained every step as DMD2 trains it;
:mod:`distillery.methods.dm_pdd`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distillery.config.typed import with_default
from distillery.pipeline.params.schema import MAX_GUIDANCE, PDDParams, TrainingStageParams, non_negative_finite, rule
from stages.recipes.pdd import pdd_inputs, pdd_knobs, pdd_roles

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class Params(PDDParams):
    """``pdd.*`` with DM-PDD's own knobs."""

    dm_weight: float = rule(1.0, 0, MAX_GUIDANCE, non_negative_finite)  # weight of the distribution-matching term
    critic_learning_rate: float = with_default(TrainingStageParams, "learning_rate", 2.0e-4)  # the critic's peak learning rate


STUDENT = "pdd"  # the kind of student it makes (a PDD trunk + head bank; the base family must build one)

def inputs(p: Params) -> dict[str, str]:
    return {**pdd_inputs(p), "critic": "teacher"}  # the fake score starts as the real one


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.dm_pdd import DMPDDMethod
    from stages.recipes.parts import callbacks, critic, method

    return RunConfig(models={**pdd_roles(p, run), "critic": critic(run.init["critic"], p.critic_learning_rate)},
                     method=method(DMPDDMethod, **pdd_knobs(p), dm_weight=p.dm_weight, generator_update_interval=2,
                                   min_score_timestep_ratio=0.02, max_score_timestep_ratio=0.98),
                     training=p.training(run, unconditional="negative"), callbacks=callbacks(p))
