"""The distill stage's recipes (``distill.method``): a few-step student distilled from the pretrain student against
the teacher. ``self_forcing``, ``dmd2`` and ``phased_dmd`` (a base of two experts) all match the teacher's distribution
with a critic (DMD2's losses) and share :class:`DMDParams`: the critic's knobs and the real score's guidance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from distillery.config.typed import with_default
from distillery.pipeline.params.schema import (
    MAX_GUIDANCE,
    DistillParams,
    TrainingStageParams,
    guidance_at_least_one,
    non_negative_finite,
    optional,
    rule,
)

if TYPE_CHECKING:
    from distillery.config.schema import Component
    from distillery.pipeline.launch.run_config import RunInputs

MAX_GAN_WEIGHT = 100.0
COLLAPSE_VAE_FROM = Path("artifacts") / "base" / "model"  # the folder whose VAE decodes the collapse watch's samples


@dataclass
class DMDParams(DistillParams):
    """``distill.*`` with the knobs of a distribution-matching recipe: its critic (the fake score) and the teacher's
    CFG in the real score."""

    critic_learning_rate: float = with_default(TrainingStageParams, "learning_rate", 2.0e-4)  # the critic's peak learning rate
    critic_init: Literal["teacher", "base"] = rule("teacher")  # the critic's init: the teacher artifact, or the base (the published recipes')
    generator_update_interval: int = rule(2, 1, 1000)  # the student steps every k-th step; the critic every step
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)  # the teacher's CFG scale in the real score
    # a two-expert teacher's (Wan 2.2 A14B) low-noise expert's CFG scale (diffusers' guidance_scale_2; Wan's A14B: 3.0
    # low / 4.0 high); null: guidance_scale for both
    guidance_scale_2: float | None = rule(None, 0, MAX_GUIDANCE, optional(guidance_at_least_one))
    # the discriminator term (methods/gan.py): a head on the critic's features tells the data's latents from the
    # student's samples; its generator term's weight in the student's loss (0: off; the published GAN variants: ~0.01)
    gan_weight: float = rule(0.0, 0, MAX_GAN_WEIGHT, non_negative_finite)

    def problem(self, stage: str) -> str | None:
        if self.gan_weight > 0 and self.data == "prompts":
            return (f"{stage}.gan_weight: {self.gan_weight:g}: the discriminator's real samples are the data's video "
                    f"latents, which a prompt-only set has none of; use {stage}.data: latents (a latent set of the "
                    f"teacher's own samples serves), or {stage}.gan_weight: 0")
        return super().problem(stage)


def dmd_inputs(p: DMDParams) -> dict[str, str]:
    """The roles of a DMD recipe and where each starts: the pretrain student, the teacher, the critic (``critic_init``)."""
    return {"student": "pretrain", "teacher": "teacher", "critic": p.critic_init}


def dmd_reads(p: DMDParams) -> dict[str, Path]:
    """What else a DMD run reads, by lineage name: with the collapse watch on (``collapse_every``), the base, whose VAE
    decodes the watch's samples (:func:`collapse_watch`); nothing else."""
    return {"base": COLLAPSE_VAE_FROM.parent} if p.collapse_every else {}


def dmd_roles(p: DMDParams, run: RunInputs, student: Component) -> dict[str, Component]:
    """``student`` beside the frozen teacher and the critic a DMD recipe matches it with."""
    from stages.recipes.parts import critic, frozen

    return {"student": student, "teacher": frozen(run.init["teacher"]),
            "critic": critic(run.init["critic"], p.critic_learning_rate)}


def dmd_knobs(p: DMDParams) -> dict[str, float | int | str | None]:
    """The method knobs every DMD recipe takes (their config classes' fields); ``real_score_guidance_scale_2`` the
    low-noise expert's (None: ``real_score_guidance_scale`` for both; a teacher of one expert refuses a value)."""
    return {"num_student_steps": p.student_steps, "rollout_renoise": "sde",
            "generator_update_interval": p.generator_update_interval, "real_score_guidance_scale": p.guidance_scale,
            "real_score_guidance_scale_2": p.guidance_scale_2, "min_score_timestep_ratio": 0.02,
            "max_score_timestep_ratio": 0.98, "gan_weight": p.gan_weight}


def dmd_callbacks(p: DMDParams, run: RunInputs) -> dict[str, Component]:
    """Every training stage's callbacks (:func:`stages.recipes.parts.callbacks`) and, with ``distill.collapse_every``
    set, the collapse watch over the student (:func:`collapse_watch`)."""
    from stages.recipes.parts import callbacks

    found = callbacks(p)
    if p.collapse_every:
        found.update(collapse_watch(run, every=p.collapse_every, stop=p.stop_on_collapse,
                                    teacher_guidance_scale=p.guidance_scale, teacher_guidance_scale_2=p.guidance_scale_2))
    return found


COLLAPSE_CALLBACK = "collapse"  # the collapse watch's name among the callbacks (its state: callbacks.collapse)


def collapse_watch(run: RunInputs, *, every: int, stop: bool, teacher_guidance_scale: float,
                   teacher_guidance_scale_2: float | None = None) -> dict[str, Component]:
    """The collapse watch (:mod:`distillery.callbacks.collapse`): every ``every`` steps the student samples the first
    prompts of the data it trains on (2 prompts × 2 seeds), decoded with the base's VAE, measured against step 0's and
    against the frozen teacher's many-step samples (CFG ``teacher_guidance_scale``; of two experts
    ``teacher_guidance_scale_2`` the low-noise one's); ``stop``: a collapse ends the run,
    the best pre-collapse checkpoint is the run's (``run_summary.json``'s ``selection``, the artifact's lineage)."""
    from distillery.callbacks.collapse import CollapseWatchCallback
    from distillery.config.loader import component_of

    return {COLLAPSE_CALLBACK: component_of(
        CollapseWatchCallback, f"callbacks.{COLLAPSE_CALLBACK}", data_path=run.data, text_max_length=run.text_max_length,
        every_steps=every, stop=stop, teacher="teacher", teacher_guidance_scale=teacher_guidance_scale,
        teacher_guidance_scale_2=teacher_guidance_scale_2,
        vae_from=str(COLLAPSE_VAE_FROM), seed=run.seed)}
