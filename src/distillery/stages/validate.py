"""The ``validate`` stage: the teacher and every student scored on the validation prompts
(:mod:`distillery.evaluation.validate`), published as ``artifacts/validate/``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from distillery.common.log import get_logger
from distillery.stages.artifacts import ARTIFACTS, finish, fresh_staging
from distillery.stages.params import StageParams

if TYPE_CHECKING:
    from distillery.evaluation.validate import PromptEmbeddings

log = get_logger("stage")


def latent_settings() -> dict:
    """The latents stage's preprocessing settings (frames, size, fps, ...) from its ``preprocess.json``."""
    from distillery.stages.run_config import latent_manifest

    return latent_manifest()["settings"]


def validation_prompts(n: int) -> tuple[list[str], "PromptEmbeddings | None"]:
    """The first ``n`` distinct captions of the latents' validation split (train split if none), and
    their embeddings as the latents stage stored them with the empty prompt's (the base's own text
    encoder made them: validate need not load it). Latent columns are never read. The embeddings are
    None when the latent set has no stored empty-prompt embedding."""
    from distillery.data import LatentDataset, read_empty_prompt_embedding
    from distillery.evaluation.validate import PromptEmbeddings

    root = ARTIFACTS / "latents" / "data"
    split = "validation" if (root / "validation").is_dir() and any((root / "validation").glob("*.parquet")) else "train"
    ds = LatentDataset(root, split, with_latents=False)
    seen: dict[str, object] = {}
    for i in range(len(ds)):
        row = ds[i]
        seen.setdefault(row["caption"], row["text_embedding"])
        if len(seen) == n:
            break
    negative = read_empty_prompt_embedding(root)
    embeddings = None if negative is None else PromptEmbeddings(texts=list(seen.values()), negative=negative)
    return list(seen), embeddings


def stage_validate(params: StageParams) -> None:
    """The teacher at many and few steps (the reference: its first step count), the pretrain student
    at its steps with the teacher's guidance, the distilled student as its sampling contract
    says (its ladder, no CFG: the guidance is distilled in) and the PDD student at each NFE of
    ``validate.pdd_nfe`` — adherence, distribution and paired
    distance, sharpness, NFE, latency, each with its spread over seeds. ``metrics.json`` (and DVC's
    ``metrics/validate.json``) holds the headline numbers (:func:`distillery.evaluation.validate.headline_metrics`);
    ``report/metrics.json`` all of them. The grid and the adherence plot go to the stage's MLflow run."""
    from distillery.evaluation.validate import Candidate, ValidationConfig, headline_metrics, run_validation, teacher_candidates
    from distillery.stages.device import stage_device

    v = params.get("validate")
    made = latent_settings()  # the videos validate samples have the size the models were trained on
    cfg = ValidationConfig(num_prompts=v.num_prompts, num_frames=int(made["num_frames"]), height=int(made["height"]),
                           width=int(made["width"]), fps=float(made["fps"]),
                           teacher_steps=list(v.teacher_steps), guidance_scale=v.guidance_scale,
                           seed=params.get("seed"), num_seeds=v.num_seeds,  # progress: a line per 10 % or minute
                           device=stage_device(v.device, params.get("gpus.nproc_per_node"), "validate.device"))
    log.info("validate: on %s", cfg.device)
    candidates = teacher_candidates(ARTIFACTS / "teacher" / "model", cfg)
    # students are sampled as their artifacts' sampling.json says (the sampler registry, no kinds here)
    candidates.append(Candidate.from_artifact(f"pretrain_{v.pretrain_steps}", ARTIFACTS / "pretrain" / "model",
                                              v.pretrain_steps, v.guidance_scale))
    distilled = Candidate.from_artifact("distill", ARTIFACTS / "distill" / "model")
    candidates.append(dataclasses.replace(distilled, name=f"distill_{distilled.num_steps}"))  # named by its step count
    # the PDD student's NFE curve: its fused-block sampler at each NFE (no CFG: the teacher's guidance is distilled in)
    candidates += [Candidate.from_artifact(f"pdd_{n}", ARTIFACTS / "pdd" / "model", n) for n in v.pdd_nfe]
    staging = fresh_staging("validate")
    report = staging / "report"
    prompts, embeddings = validation_prompts(cfg.num_prompts)
    metrics = run_validation(ARTIFACTS / "base" / "model", candidates, prompts, report, cfg, prompt_embeddings=embeddings)
    # DVC gets the numbers a user compares; every metric stays in report/metrics.json, the details in report.json
    shown = [(report / name, "grid") for name in ("grid.gif", "grid.mp4")] + [(report / "plots" / "adherence_vs_nfe.png", "plots")]
    finish("validate", staging, kind="validation", params=params, metrics=headline_metrics(metrics),
           mlflow_files=[(path, folder) for path, folder in shown if path.is_file()],
           plots={"validate_adherence.csv": Path("report/plots/adherence.csv")},
           inputs=[("teacher", ARTIFACTS / "teacher"), ("pretrain", ARTIFACTS / "pretrain"),
                   ("student", ARTIFACTS / "distill"), ("pdd", ARTIFACTS / "pdd"), ("base", ARTIFACTS / "base"),
                   ("data", ARTIFACTS / "latents")])
