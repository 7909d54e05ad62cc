"""The evaluation and release stages: ``validate`` (teacher and students scored on the validation
prompts) and ``export`` (a complete diffusers folder of the chosen student)."""

from __future__ import annotations

import shutil
from pathlib import Path

from distillery.errors import UserError
from distillery.pipeline.artifacts import ARTIFACTS, finish, fresh_staging
from distillery.pipeline.params import StageParams
from distillery.pipeline.training_table import TRAINING_STAGES


def validation_prompts(n: int) -> list[str]:
    """The first ``n`` distinct captions of the latents' validation split (train split if none)."""
    from distillery.data import LatentDataset

    root = ARTIFACTS / "latents" / "data"
    split = "validation" if (root / "validation").is_dir() and any((root / "validation").glob("*.parquet")) else "train"
    ds = LatentDataset(root, split)
    seen: list[str] = []
    for i in range(len(ds)):
        caption = ds[i]["caption"]
        if caption not in seen:
            seen.append(caption)
        if len(seen) == n:
            break
    return seen


def stage_validate(params: StageParams) -> None:
    """Teacher at many and few steps, the pretrained student at its steps: adherence, NFE, latency, distance."""
    from distillery.validate import Candidate, ValidationConfig, run_validation, teacher_candidates

    v = params.get("validate")
    cfg = ValidationConfig(num_frames=params.get("clips.num_frames"), height=params.get("clips.size"),
                           width=params.get("clips.size"), fps=float(params.get("clips.fps")),
                           teacher_steps=list(v["teacher_steps"]), guidance_scale=float(v["guidance_scale"]),
                           seed=params.get("seed"), progress_bar=False)
    candidates = teacher_candidates(ARTIFACTS / "teacher" / "model", cfg)
    # the student is sampled as its artifact's sampling.json says (the sampler registry, no kinds here)
    candidates.append(Candidate.from_artifact(f"pretrain_{v['student_steps']}", ARTIFACTS / "pretrain" / "model",
                                              int(v["student_steps"]), float(v["guidance_scale"])))
    staging = fresh_staging("validate")
    metrics = run_validation(ARTIFACTS / "base" / "model", candidates, validation_prompts(int(v["num_prompts"])),
                             staging / "report", cfg)
    Path("plots").mkdir(exist_ok=True)
    shutil.copy2(staging / "report" / "plots" / "adherence.csv", Path("plots") / "validate_adherence.csv")
    finish("validate", staging, kind="validation", params=params, metrics=metrics,
           inputs=[("teacher", ARTIFACTS / "teacher"), ("student", ARTIFACTS / "pretrain"), ("base", ARTIFACTS / "base"),
                   ("data", ARTIFACTS / "latents")])


def stage_export(params: StageParams) -> None:
    """A complete diffusers folder: the base's parts + the chosen student's transformer, lineage inside."""
    student = params.get("export.student")
    if student not in TRAINING_STAGES:
        raise UserError(f"params.yaml: export.student: {student!r}; valid: {', '.join(TRAINING_STAGES)}")
    staging = fresh_staging("export")
    model = staging  # the artifact *is* the diffusers folder, lineage.json inside
    base = ARTIFACTS / "base" / "model"
    skip = shutil.ignore_patterns("lineage.json", "fit_report.json")
    shutil.copytree(base, model, dirs_exist_ok=True,  # the base's own transformer is not copied at all
                    ignore=lambda folder, names: set(skip(folder, names)) | ({"transformer"} if Path(folder) == base else set()))
    shutil.copytree(ARTIFACTS / student / "model" / "transformer", model / "transformer")
    shutil.copy2(ARTIFACTS / student / "model" / "sampling.json", model / "sampling.json")
    finish("export", staging, kind="export", params=params, metrics={"student_stage": 0 if student == "teacher" else 1},
           inputs=[("student", ARTIFACTS / student), ("base", ARTIFACTS / "base")])
