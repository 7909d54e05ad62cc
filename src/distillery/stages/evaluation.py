"""The evaluation and release stages: ``validate`` (teacher and students scored on the validation
prompts) and ``export`` (a complete diffusers folder of the chosen student)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.stages.artifacts import ARTIFACTS, finish, fresh_staging
from distillery.stages.params import StageParams
from distillery.stages.training_table import TRAINING_STAGES

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
    from distillery.stages.device import stage_device
    from distillery.evaluation.validate import Candidate, ValidationConfig, headline_metrics, run_validation, teacher_candidates

    v = params.get("validate")
    made = latent_settings()  # the videos validate samples have the size the models were trained on
    cfg = ValidationConfig(num_frames=int(made["num_frames"]), height=int(made["height"]), width=int(made["width"]),
                           fps=float(made["fps"]),
                           teacher_steps=list(v["teacher_steps"]), guidance_scale=float(v["guidance_scale"]),
                           seed=params.get("seed"), num_seeds=int(v["num_seeds"]),  # progress: a line per 10 % or minute
                           device=stage_device(str(v.get("device", "auto")), int(params.get("gpus.nproc_per_node")), "validate.device"))
    log.info("validate: on %s", cfg.device)
    candidates = teacher_candidates(ARTIFACTS / "teacher" / "model", cfg)
    # students are sampled as their artifacts' sampling.json says (the sampler registry, no kinds here)
    candidates.append(Candidate.from_artifact(f"pretrain_{v['pretrain_steps']}", ARTIFACTS / "pretrain" / "model",
                                              int(v["pretrain_steps"]), float(v["guidance_scale"])))
    distilled = Candidate.from_artifact("distill", ARTIFACTS / "distill" / "model")
    candidates.append(dataclasses.replace(distilled, name=f"distill_{distilled.num_steps}"))  # named by its step count
    # the PDD student's NFE curve: its fused-block sampler at each NFE (no CFG: the teacher's guidance is distilled in)
    candidates += [Candidate.from_artifact(f"pdd_{n}", ARTIFACTS / "pdd" / "model", int(n)) for n in v["pdd_nfe"]]
    staging = fresh_staging("validate")
    report = staging / "report"
    prompts, embeddings = validation_prompts(int(v["num_prompts"]))
    metrics = run_validation(ARTIFACTS / "base" / "model", candidates, prompts, report, cfg, prompt_embeddings=embeddings)
    # DVC gets the numbers a user compares; every metric stays in report/metrics.json, the details in report.json
    shown = [(report / name, "grid") for name in ("grid.gif", "grid.mp4")] + [(report / "plots" / "adherence_vs_nfe.png", "plots")]
    finish("validate", staging, kind="validation", params=params, metrics=headline_metrics(metrics),
           mlflow_files=[(path, folder) for path, folder in shown if path.is_file()],
           plots={"validate_adherence.csv": Path("report/plots/adherence.csv")},
           inputs=[("teacher", ARTIFACTS / "teacher"), ("pretrain", ARTIFACTS / "pretrain"),
                   ("student", ARTIFACTS / "distill"), ("pdd", ARTIFACTS / "pdd"), ("base", ARTIFACTS / "base"),
                   ("data", ARTIFACTS / "latents")])


def stage_export(params: StageParams) -> None:
    """A complete diffusers folder: the base's parts + the chosen student's transformer, its sampling
    contract, the pipeline module that samples by it (``pipeline.py``) and its own model card
    (``README.md``, :mod:`distillery.export.model_card`: chain, settings, validation scores, code),
    lineage inside.

    What it ships is trusted no further than it can check: the base's ``model_index.json`` may name
    only library classes a WanPipeline takes and no code file of the base is copied
    (:mod:`distillery.stages.base_folder`), so the only code in the folder is the ``pipeline.py``
    written here; and every byte of the artifacts it is made from, and of theirs upstream, is read
    against their manifests before it is published (``finish(verify_chain=True)``; its cost is logged)."""
    import importlib.util

    from distillery.stages.base_folder import check_model_index, copy_model_folder

    student = params.get("export.student")
    if student not in TRAINING_STAGES:
        raise UserError(f"params.yaml: export.student: {student!r}; valid: {', '.join(TRAINING_STAGES)}")
    base = ARTIFACTS / "base" / "model"
    check_model_index(base, f"stage export: {base}")
    staging = fresh_staging("export")
    model = staging  # the artifact *is* the diffusers folder, lineage.json inside
    # the base's parts; its own transformer is not copied at all (the student's replaces it)
    left_out = copy_model_folder(base, model, exclude=("lineage.json", "fit_report.json"), exclude_top=("transformer",))
    left_out += copy_model_folder(ARTIFACTS / student / "model" / "transformer", model / "transformer")
    if left_out:  # an artifact made before the base stage left code out
        log.info("export: left out %d code file(s) (%s): an export ships only its own pipeline.py",
                 len(left_out), ", ".join(left_out[:5]))
    shutil.copy2(ARTIFACTS / student / "model" / "sampling.json", model / "sampling.json")
    metrics: dict[str, float] = {"student_stage": 0 if student == "teacher" else 1}
    stock_nfe = fuse_for_stock_pipeline(ARTIFACTS / student / "model", model / "transformer")
    if stock_nfe is not None:
        metrics["stock_nfe"] = stock_nfe
    # its own model card (the base's described the base): what it is, its chain, settings, scores, the code to load it
    from distillery.data.encoders import read_max_sequence_length
    from distillery.export.model_card import export_model_card

    (model / "README.md").write_text(export_model_card(student, ARTIFACTS / student, ARTIFACTS / "validate",
                                                       read_max_sequence_length(base), stock_nfe), encoding="utf-8")
    # the folder's own pipeline: DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder) samples as
    # sampling.json says (few-step ladder, causal streaming) with the code validate used
    shutil.copy2(importlib.util.find_spec("distillery.export.diffusers_pipeline").origin, model / "pipeline.py")  # copied, not imported
    finish("export", staging, kind="export", params=params, metrics=metrics, verify_chain=True,
           inputs=[("student", ARTIFACTS / student), ("base", ARTIFACTS / "base"), ("validation", ARTIFACTS / "validate")])


def fuse_for_stock_pipeline(student_model: Path, transformer_dir: Path) -> int | None:
    """A PDD student (``pdd_fused`` contract) also becomes a plain transformer stock ``WanPipeline``
    samples: its whole fine grid fused into one block, written into ``transformer_dir``'s
    ``proj_out`` — with ``FlowMatchEulerDiscreteScheduler`` (its shift) at 1 step and guidance 1 it
    is the student at 1 NFE. 1 is the only NFE a plain transformer can hold: each block needs its own
    fused projection and a transformer has one (the custom ``pipeline.py`` samples every NFE from the
    heads, ``pdd_heads.safetensors``, kept beside the weights). Returns the stock NFE (1), or None
    for a student that is not PDD or was not trained on blocks as wide as its grid (1 NFE untrained:
    ``proj_out`` is left as trained)."""
    import json

    contract = json.loads((student_model / "sampling.json").read_text())
    if contract.get("sampler") != "pdd_fused":
        return None
    steps = int(contract["pdd_steps"])
    if int(contract.get("block_size_max", steps)) < steps:
        log.info("export: the PDD student was trained on blocks of at most %s of %s intervals: no 1-NFE stock transformer",
                 contract.get("block_size_max"), steps)
        return None
    from distillery.models.wan import load_inference_model
    from distillery.models.wan.pdd import HEADS_FILE

    plugin = load_inference_model(student_model, pdd_steps=steps, shift=contract.get("shift"))
    plugin.fuse_into_projection(plugin.transformer, 0, steps)
    tmp = transformer_dir.parent / ".tmp-fused-transformer"
    if tmp.exists():
        shutil.rmtree(tmp)
    plugin.transformer.save_pretrained(tmp, safe_serialization=True)
    shutil.copy2(transformer_dir / HEADS_FILE, tmp / HEADS_FILE)
    shutil.rmtree(transformer_dir)
    tmp.rename(transformer_dir)
    return 1
