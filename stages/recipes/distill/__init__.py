"""The distill stage's recipes (``distill.method``): a few-step student distilled from the pretrain student against
the teacher. ``self_forcing`` and ``dmd2`` both match the teacher's distribution with a critic (DMD2's losses) and
share :class:`DMDParams`: the critic's knobs and the real score's guidance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from distillery.config.typed import with_default
from distillery.pipeline.params.schema import MAX_GUIDANCE, DistillParams, TrainingStageParams, guidance_at_least_one, rule

if TYPE_CHECKING:
    from distillery.config.schema import Component
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class DMDParams(DistillParams):
    """``distill.*`` with the knobs of a distribution-matching recipe: its critic (the fake score) and the teacher's
    CFG in the real score."""

    critic_learning_rate: float = with_default(TrainingStageParams, "learning_rate", 2.0e-4)  # the critic's peak learning rate
    critic_init: Literal["teacher", "base"] = rule("teacher")  # the critic's init: the teacher artifact, or the base (the published recipes')
    generator_update_interval: int = rule(2, 1, 1000)  # the student steps every k-th step; the critic every step
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)  # the teacher's CFG scale in the real score


def dmd_inputs(p: DMDParams) -> dict[str, str]:
    """The roles of a DMD recipe and where each starts: the pretrain student, the teacher, the critic (``critic_init``)."""
    return {"student": "pretrain", "teacher": "teacher", "critic": p.critic_init}


def dmd_roles(p: DMDParams, run: RunInputs, student: Component) -> dict[str, Component]:
    """``student`` beside the frozen teacher and the critic a DMD recipe matches it with."""
    from stages.recipes.parts import critic, frozen

    return {"student": student, "teacher": frozen(run.init["teacher"]),
            "critic": critic(run.init["critic"], p.critic_learning_rate)}


def dmd_knobs(p: DMDParams) -> dict[str, float | int | str]:
    """The method knobs both DMD recipes take (their config classes' fields)."""
    return {"num_student_steps": p.student_steps, "rollout_renoise": "sde",
            "generator_update_interval": p.generator_update_interval, "real_score_guidance_scale": p.guidance_scale,
            "min_score_timestep_ratio": 0.02, "max_score_timestep_ratio": 0.98}
