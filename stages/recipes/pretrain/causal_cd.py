"""``pretrain.method: causal_cd``: causal consistency distillation — the causal student learns self-consistency along
the teacher's ODE on the latents, with no cached trajectories (Causal Forcing's cheaper alternative to ``ode_init``,
whose trajectories cost a teacher generation per prompt; :mod:`distillery.methods.causal_cd`). Roles: the student
(block-causal over the chunks of ``pretrain.chunk_size`` latent frames), the frozen teacher artifact whose Euler step
with CFG ``pretrain.guidance_scale`` is the ODE, and the target network (the student's shadow, an EMA from
``pretrain.target_start_step``). Its artifact feeds ``distill`` exactly as an ODE-init student does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distillery.pipeline.params.schema import MAX_STEPS, fraction, rule
from stages.recipes.pretrain import LatentsParams, causal_contract, causal_student, teacher_guidance

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class Params(LatentsParams):
    """``pretrain.*`` with causal CD's knobs."""

    guidance_scale: float = teacher_guidance()  # the teacher's CFG in its ODE step, u + w (c - u)
    cd_steps: int = rule(48, 2, 1000)  # N: the teacher's shifted Euler grid the consistency is learned along
    target_decay: float = rule(0.99, 0, 1, fraction)  # the target network's EMA decay per optimizer step
    target_start_step: int = rule(0, 0, MAX_STEPS)  # the target stays the init's weights until this step, then follows


STUDENT = "causal"  # the kind of student it makes (distill recipes start from one kind: chain_notes)
given_contract = causal_contract  # a given model standing in for it: the block-causal student's chunks


def inputs(p: Params) -> dict[str, str]:
    """The student (from ``pretrain.student_init``) and the teacher artifact, whose ODE it follows."""
    return {"student": p.student_init, "teacher": "teacher"}


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.causal_cd import CausalCDMethod
    from stages.recipes.parts import callbacks, frozen, method

    return RunConfig(models={"student": causal_student(p, run), "teacher": frozen(run.init["teacher"])},
                     method=method(CausalCDMethod, num_discrete_steps=p.cd_steps, guidance_scale=p.guidance_scale,
                                   target_decay=p.target_decay, target_start_step=p.target_start_step),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))
