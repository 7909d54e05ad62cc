"""The pretrain stage's recipes (``pretrain.method``): the student distillation starts from — Diffusion-Forcing SFT
(``dfsft``), Teacher-Forcing SFT (``tfsft``), causal consistency distillation along the teacher's ODE (``causal_cd``)
or knowledge distillation of the teacher's ODE trajectories (``ode_init``: a causal student;
``ode_init_bidirectional``: a bidirectional one). The two ODE-init recipes share :class:`TrajectoryParams` and
:func:`prepare_trajectories`: the trajectories they train on, made first; the recipes that train on video latents
share :class:`LatentsParams` (a prompt-only set refused in one line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distillery.pipeline.params.schema import (
    MAX_BATCH,
    MAX_GUIDANCE,
    MAX_ROWS_PER_SHARD,
    MAX_SAMPLING_STEPS,
    MAX_SEEDS,
    MAX_TIMESTEP,
    PretrainParams,
    guidance_at_least_one,
    rule,
    trajectory_points,
)

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.config.schema import Component
    from distillery.pipeline.launch.run_config import PreparedData, RunInputs
    from distillery.pipeline.params.reader import StageParams


def teacher_guidance() -> Any:
    """``pretrain.guidance_scale``: the teacher's CFG scale ``w`` (``u + w (c - u)``) wherever a pretrain recipe runs the
    teacher's ODE (``ode_init``'s trajectories, ``causal_cd``'s Euler step); one declaration for both."""
    return rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)


@dataclass
class TrajectoryParams(PretrainParams):
    """``pretrain.*`` with the knobs of the teacher's ODE trajectories (``stages/trajectories.py``)."""

    t_list: list[float] = rule([999.0, 937.0, 833.0, 624.0, 0.0], 0, MAX_TIMESTEP, check=trajectory_points)  # the trajectory points
    teacher_steps: int = rule(8, 1, MAX_SAMPLING_STEPS)  # the teacher's Euler steps (t_list's points added to its grid)
    guidance_scale: float = teacher_guidance()  # the teacher's CFG, u + w (c - u)
    seeds_per_prompt: int = rule(1, 1, MAX_SEEDS)  # trajectories (noise draws) per prompt
    trajectory_batch_size: int = rule(8, 1, MAX_BATCH)  # prompts per teacher batch while generating
    trajectory_rows_per_shard: int = rule(32, 1, MAX_ROWS_PER_SHARD)  # trajectories per shard (the unit of resume)


@dataclass
class LatentsParams(PretrainParams):
    """``pretrain.*`` of a recipe that trains on video latents (``dfsft``, ``tfsft``, ``causal_cd``): a prompt-only
    set (``pretrain.data: prompts``) is refused before anything runs."""

    def problem(self, stage: str) -> str | None:
        if self.data == "prompts":
            return (f"{stage}.data: prompts: {stage}.method {self.method} trains on video latents, which a prompt-only "
                    f"set has none of; use {stage}.method: ode_init (its trajectories start from the prompts), or "
                    f"{stage}.data: latents")
        return super().problem(stage)


def prepare_trajectories(p: TrajectoryParams, params: StageParams) -> PreparedData:
    """The teacher's ODE trajectories over the prompts of ``artifacts/<pretrain.data>``, made (or resumed, or kept) in
    ``runs/pretrain_trajectories`` before training: the set the run trains on, made from the teacher artifact."""
    from distillery.pipeline.launch.run_config import PreparedData
    from distillery.pipeline.publish.artifacts import ARTIFACTS
    from stages.trajectories import ARTIFACT_FOLDER, TEACHER_ARTIFACT, stage_trajectories

    folder = stage_trajectories(params.stage, params, p.data_artifact())
    return PreparedData(folder, ARTIFACT_FOLDER, {TEACHER_ARTIFACT: ARTIFACTS / TEACHER_ARTIFACT})


def pretrain_inputs(p: PretrainParams) -> dict[str, str]:
    """The student, from the teacher artifact or the base (``pretrain.student_init``)."""
    return {"student": p.student_init}


def causal_student(p: PretrainParams, run: RunInputs) -> Component:
    """A block-causal student (its base family's) over chunks of ``pretrain.chunk_size`` latent frames."""
    from stages.recipes.parts import student

    return student(p, "causal", run.init["student"], chunk_size=p.chunk_size)


def chunked_sft(cls: type, p: PretrainParams, run: RunInputs) -> RunConfig:
    """The run config of a chunked SFT of the causal student on the latents (``dfsft``, ``tfsft``: ``cls``, a
    :class:`~distillery.methods.dfsft.DFSFTMethod`): every table index drawn, 10% of captions dropped."""
    from distillery.config import RunConfig
    from stages.recipes.parts import callbacks, method

    return RunConfig(models={"student": causal_student(p, run)},
                     method=method(cls, chunk_size=p.chunk_size, min_timestep_ratio=0.0, max_timestep_ratio=1.0,
                                   caption_dropout=0.1),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))


def causal_contract(p: PretrainParams) -> dict[str, Any]:
    """What a given model standing in for a causal student samples with: its chunks."""
    return {"chunk_size": p.chunk_size}
