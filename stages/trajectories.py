"""The teacher's ODE trajectories a knowledge-distillation stage trains on (``pretrain.method: ode_init``).

:func:`stage_trajectories` runs inside the training stage, before its run config is filled: the teacher
artifact's model (``artifacts/teacher/model``), loaded frozen on the stage's device (the first GPU when
``gpus.nproc_per_node`` ≥ 1 and CUDA is there, bf16; else the CPU, fp32), integrates its ODE with CFG for
every prompt of the stage's data set (its text embeddings: the latent set's, or with ``<stage>.data: prompts``
the prompt-only set's) and ``<stage>.seeds_per_prompt`` seeds
(:func:`distillery.sampling.trajectories.generate_trajectories`), into ``runs/<stage>_trajectories/`` — a
crash-resume folder like the stage's checkpoints: a killed stage resumes at the first unfinished shard,
and a rerun whose settings and prompts are unchanged makes nothing again. The finished set is the run's
``training.data.path``; the stage puts it in its artifact (``artifacts/<stage>/trajectories/``, hard links where the
file system allows: :func:`distillery.pipeline.publish.artifacts.link_tree`), so DVC tracks it and the artifact says
what its model was trained on. The ODE-init recipes make it (``stages/recipes/pretrain``: their ``prepare``).
"""

from __future__ import annotations

from pathlib import Path

from distillery.common.log import get_logger
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.params.schema import DATA_ARTIFACT
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS

log = get_logger("stage")

TEACHER_ARTIFACT = "teacher"
ARTIFACT_FOLDER = "trajectories"  # in artifacts/<stage>/


def trajectories_dir(stage: str) -> Path:
    """Where the stage's trajectory set is made and resumed: ``runs/<stage>_trajectories``."""
    return RUNS / f"{stage}_trajectories"


def stage_trajectories(stage: str, params: StageParams, data: str = DATA_ARTIFACT) -> Path:
    """Make (or resume, or keep) the stage's trajectory set from ``params.yaml <stage>.*`` (module doc) over the
    prompts of ``artifacts/<data>/data`` (the latent set, or — ``<stage>.data: prompts`` — the prompt-only set);
    returns its folder. Settings out of range never get here (params check: one line)."""
    import torch

    from distillery.models.registry import load_inference_model
    from distillery.pipeline.launch.device import stage_device
    from distillery.pipeline.launch.resume_key import folder_digest
    from distillery.sampling.trajectories import TrajectorySettings, generate_trajectories, source_layout

    p = params.get(stage)
    source = ARTIFACTS / data / "data"
    teacher_folder = ARTIFACTS / TEACHER_ARTIFACT / "model"
    device = stage_device("auto", params.get("gpus.nproc_per_node"), "gpus.nproc_per_node")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    teacher = load_inference_model(teacher_folder, device, dtype, role="teacher")
    shape, length = source_layout(source)
    settings = TrajectorySettings(
        teacher_sha256=folder_digest(teacher_folder), t_list=tuple(float(t) for t in p.t_list),
        teacher_steps=p.teacher_steps, guidance_scale=float(p.guidance_scale), seed=int(params.get("seed")),
        seeds_per_prompt=p.seeds_per_prompt, rows_per_shard=p.trajectory_rows_per_shard, batch_size=p.trajectory_batch_size,
        teacher_shift=float(teacher.schedule.shift), latent_shape=tuple(shape), text_max_length=length)
    out = trajectories_dir(stage)
    log.info("stage %s: the teacher's ODE trajectories at t %s (%d Euler steps, CFG %g, %d seed(s) a prompt) on %s into %s",
             stage, list(settings.t_list), settings.teacher_steps, settings.guidance_scale, settings.seeds_per_prompt,
             device, out)
    report = generate_trajectories(teacher, source, out, settings)
    per_row = report.seconds / report.rows_made if report.rows_made else 0.0
    log.info("stage %s: %d trajectories in %d shard(s): %d made this run (%d shard(s), %.2f s, %.3f s a trajectory), "
             "the rest kept", stage, report.rows, report.shards, report.rows_made, report.shards_made, report.seconds, per_row)
    del teacher
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out
