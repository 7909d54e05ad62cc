"""The ``validate`` stage: the teacher and every student scored on the validation prompts
(:mod:`distillery.evaluation.validate`), published as ``artifacts/validate/``. Its candidates and
inputs are the training stages :data:`VALIDATED` names, each with how it is scored (:class:`ValidationSpec`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS, finish, fresh_staging, published_off

if TYPE_CHECKING:
    from collections.abc import Mapping

    from distillery.evaluation.validate import Candidate, PromptEmbeddings

log = get_logger("stage")


@dataclass(frozen=True)
class ValidationSpec:
    """How a training stage's model is a candidate of the validate stage (:func:`table_candidates`).

    - ``lineage``: the name of the stage's artifact among validate's lineage inputs;
    - ``steps``: the params.yaml key of its sampling steps — an int, or a list of ints (one candidate
      each) — or None: its sampling contract's own (``sampling.json``);
    - ``guidance``: the params.yaml key of its CFG scale, or None: the contract's (a distilled
      student's guidance is distilled in: none);
    - ``sampler``: None: sampled as the artifact's ``sampling.json`` says; a registered sampler
      name: that sampler at its defaults over the artifact's weights (the teacher's Euler baselines).

    A candidate is named ``<stage>_<steps>``; validate takes the stages in :data:`VALIDATED`'s order, and the first
    candidate is the reference every distance is measured against (put the teacher first).
    """

    lineage: str
    steps: str | None = None
    guidance: str | None = None
    sampler: str | None = None

    def __post_init__(self) -> None:
        if self.sampler is not None and self.steps is None:
            raise ValueError(f"validation {self.lineage}: a sampler of its own ({self.sampler}) needs a steps key")

    def params_read(self) -> list[str]:
        """The params.yaml keys the validate stage reads for this stage."""
        return [k for k in (self.steps, self.guidance) if k is not None]


# training stage -> how validate scores its model (validate's dvc.yaml entry lists each artifact and each key)
VALIDATED: dict[str, ValidationSpec] = {
    # the reference: many- and few-step Euler with CFG (validate.teacher_steps, the first is the reference)
    "teacher": ValidationSpec("teacher", steps="validate.teacher_steps", guidance="validate.guidance_scale", sampler="euler"),
    "pretrain": ValidationSpec("pretrain", steps="validate.pretrain_steps", guidance="validate.guidance_scale"),
    "distill": ValidationSpec("student"),  # its ladder as its contract says, no CFG (the guidance is distilled in)
    "pdd": ValidationSpec("pdd", steps="validate.pdd_nfe"),  # its NFE curve: the fused-block sampler at each NFE
    "posttrain": ValidationSpec("posttrain"),  # as its contract says (the student's it post-trained); left out when off
}

SAMPLE_CACHE = RUNS / "validate" / "cache"  # each candidate's videos and scores, reused while nothing they depend on
# changes (distillery.evaluation.sample_cache); not a DVC out: `dvc repro` leaves it, `rm -rf` it to sample all again
VBENCH_CACHE = RUNS / "validate" / "vbench_cache"  # the headline candidates' VBench scores, reused while their videos,
# the models and the code are the same (distillery.evaluation.vbench.score_cache); not a DVC out either


def latent_settings() -> dict:
    """The latents stage's preprocessing settings (frames, size, fps, ...) from its ``preprocess.json``."""
    from distillery.pipeline.launch.run_config import latent_manifest

    return latent_manifest()["settings"]


def validation_split() -> str:
    """The latents' split validate takes its prompts from: ``validation``, else ``train`` (data without one)."""
    root = ARTIFACTS / "latents" / "data"
    return "validation" if (root / "validation").is_dir() and any((root / "validation").glob("*.parquet")) else "train"


PROMPT_SOURCES = {"validation": "the latent set's validation split (the data's validation/ captions)",
                  "train": "the latent set's TRAIN split: the data has no validation/ folder, so the models are "
                           "validated on captions they were trained on (give the data a validation/ folder to "
                           "validate on held-out captions)"}


def validation_prompts(n: int) -> tuple[list[str], "PromptEmbeddings | None"]:
    """The first ``n`` distinct captions of the latents' validation split (train split if none,
    :func:`validation_split`), and
    their embeddings as the latents stage stored them with the empty prompt's (the base's own text
    encoder made them: validate need not load it) — for an image-to-video set with each caption's first clip's
    first-frame condition and image embeddings: the frames the candidates are given. Latent columns are never read.
    The embeddings are None when the latent set has no stored empty-prompt embedding."""
    from distillery.data import LatentDataset, read_empty_prompt_embedding
    from distillery.evaluation.validate import PromptEmbeddings

    root = ARTIFACTS / "latents" / "data"
    split = validation_split()
    ds = LatentDataset(root, split, with_latents=False)
    seen: dict[str, dict] = {}
    for i in range(len(ds)):
        row = ds[i]
        seen.setdefault(row["caption"], row)
        if len(seen) == n:
            break
    negative = read_empty_prompt_embedding(root)
    rows = list(seen.values())
    frames = [r["first_frame"] for r in rows] if rows and "first_frame" in rows[0] else None  # an image-to-video set
    images = [r["image_embedding"] for r in rows] if rows and "image_embedding" in rows[0] else None
    embeddings = None if negative is None else PromptEmbeddings(texts=[r["text_embedding"] for r in rows], negative=negative,
                                                                first_frames=frames, image_embeds=images)
    return list(seen), embeddings


def table_candidates(params: StageParams, table: "Mapping[str, ValidationSpec] | None" = None) -> list["Candidate"]:
    """The validate stage's candidates, from ``table`` (default: :data:`VALIDATED`): for each stage, in table order,
    one candidate per step count — named ``<stage>_<steps>``, over ``artifacts/<stage>/model``, sampled as its
    ``sampling.json`` says (or by its own sampler), with the steps and guidance its params keys give (else the
    contract's). The first is the reference. :class:`UserError` when an artifact's sampling contract is missing or
    invalid."""
    from distillery.evaluation.validate import Candidate

    candidates: list[Candidate] = []
    for name, how in (VALIDATED if table is None else table).items():
        if published_off(name):  # switched off (posttrain.enabled: false): no model to score
            log.info("validate: %s is off: not a candidate", name)
            continue
        if not (ARTIFACTS / name).is_dir():  # its stage never ran here: say which, not a missing file inside it
            raise UserError(f"validate: candidate {name}: artifacts/{name} does not exist: the {name} stage has not run "
                            f"here; run it first (`distillery stage {name}`, or `dvc repro` for the whole DAG)")
        model_dir = ARTIFACTS / name / "model"
        guidance = float(params.get(how.guidance)) if how.guidance is not None else None
        if how.steps is None:
            counts: list[int | None] = [None]
        else:
            value = params.get(how.steps)
            counts = [int(n) for n in value] if isinstance(value, list) else [int(value)]
        for n in counts:
            if how.sampler is not None:  # its own sampler at its defaults (no contract read)
                assert n is not None  # ValidationSpec: a sampler of its own comes with a steps key
                cand = Candidate(f"{name}_{n}", model_dir, n, guidance if guidance is not None else 1.0, how.sampler)
            else:
                cand = Candidate.from_artifact(name if n is None else f"{name}_{n}", model_dir, n, guidance)
                if n is None:  # named by the step count its contract gives
                    cand = dataclasses.replace(cand, name=f"{name}_{cand.num_steps}")
            candidates.append(cand)
    return candidates


def headline_candidates(candidates: list["Candidate"], table: "Mapping[str, ValidationSpec] | None" = None) -> list[str]:
    """The candidates whose numbers DVC shows: each validated stage's first (:func:`table_candidates` names
    them ``<stage>_<steps>``, in table order: the reference teacher, the pretrain student, the distilled
    student, the PDD student at its first NFE); the others (the teacher's and PDD's NFE curves) are in
    the report."""
    names = [c.name for c in candidates]
    rows = list(VALIDATED if table is None else table)
    return [next(n for n in names if n.rpartition("_")[0] == row) for row in rows if any(n.rpartition("_")[0] == row for n in names)]


def validation_inputs(table: "Mapping[str, ValidationSpec] | None" = None,
                      clip_model: str | None = None, vbench_models: "Mapping[str, Path] | None" = None) -> list[tuple[str, Path]]:
    """The validate artifact's lineage inputs: each validated stage's artifact under its row's
    ``lineage`` name (table order), then the base and the latents, ``validate.clip_model``'s folder
    when given (an external input: pinned file by file, so the lineage names the CLIP weights the scores
    were read with), and the folder of each model ``validate.vbench`` reads, as ``vbench_<key>`` (pinned too)."""
    rows = (VALIDATED if table is None else table).items()
    return ([(how.lineage, ARTIFACTS / name) for name, how in rows]
            + [("base", ARTIFACTS / "base"), ("data", ARTIFACTS / "latents")]
            + ([("clip_model", Path(clip_model))] if clip_model else [])
            + [(f"vbench_{key}", Path(folder)) for key, folder in (vbench_models or {}).items()])


# code the stage runs only while an option is on, which the default DAG's import trace cannot see: a dep of the stage
# all the same (tests/test_dvc_deps.py), so that an edit to it reruns the stage
OPTION_MODULES = ("distillery.evaluation.vbench.validation",)  # validate.vbench


def stage_validate(params: StageParams) -> None:
    """Every candidate of the training table (:func:`table_candidates`: by default the teacher at many
    and few steps — the reference: its first step count —, the pretrain student at its steps with
    the teacher's guidance, the distilled student as its sampling contract says (its ladder, no CFG:
    the guidance is distilled in) and the PDD student at each NFE of ``validate.pdd_nfe``) scored on
    the validation prompts — adherence, distribution and paired distance, sharpness, NFE, latency,
    each with its spread over seeds, and with ``validate.clip_model`` (a CLIP folder) CLIP text–video
    similarity, CLIP frame consistency and motion, each with its 95% bootstrap interval. A candidate whose weights, sampling contract, prompts, seeds,
    sizes, device and code did not change since it was last sampled is reused from
    :data:`SAMPLE_CACHE` (the log says which). ``metrics.json`` (and DVC's ``metrics/validate.json``) holds the
    headline numbers (:func:`distillery.evaluation.validate.headline_metrics` of :func:`headline_candidates`:
    adherence and Fréchet distance of each validated stage's first candidate); ``report/metrics.json``
    all of them, ``report/summary.md`` the table a user reads. The grid and the adherence plot go to the stage's MLflow run.
    With ``validate.vbench.dimensions``, the headline candidates' videos are scored on those VBench dimensions too
    (:mod:`distillery.evaluation.vbench.validation`: checked and loaded before any sampling; ``report/vbench/``,
    their numbers in both metrics files, each model's folder pinned in the lineage; a candidate whose videos, models and
    code are those it was scored with is not scored again: :data:`VBENCH_CACHE`)."""
    from distillery.evaluation.sample_cache import SampleCache
    from distillery.evaluation.validate import ValidationConfig, headline_metrics, run_validation
    from distillery.pipeline.launch.device import stage_device

    v = params.get("validate")
    made = latent_settings()  # the videos validate samples have the size the models were trained on
    cfg = ValidationConfig(num_prompts=v.num_prompts, num_frames=int(made["num_frames"]), height=int(made["height"]),
                           width=int(made["width"]), fps=float(made["fps"]),
                           seed=params.get("seed"), num_seeds=v.num_seeds,  # progress: a line per 10 % or minute
                           vae_precision=v.vae_precision, vae_chunk_frames=v.vae_chunk_frames, compile=v.compile,
                           clip_model=v.clip_model,  # checked here (one line) before anything loads or samples
                           device=stage_device(v.device, params.get("gpus.nproc_per_node"), "validate.device"))
    log.info("validate: on %s", cfg.device)
    # students are sampled as their artifacts' sampling.json says (the sampler registry, no kinds here)
    candidates = table_candidates(params)
    scorer, vbench_models, pinned, model_files = None, {}, {}, {}
    if v.vbench.dimensions:  # refused before any sampling: a model not given or of another class, videos too small
        from distillery.evaluation.vbench import validation as vbench
        from distillery.evaluation.vbench.score_cache import ScoreCache
        from distillery.lineage.manifest import pin_input

        vbench_models = vbench.check(v.vbench.dimensions, v.vbench.models.given(), cfg.num_frames, cfg.height, cfg.width)
        model_files = {key: pin_input(folder) for key, folder in vbench_models.items()}
        pinned = {f"vbench_{key}": files for key, files in model_files.items()}  # as read: changed meanwhile, refused
        scorer = vbench.load(v.vbench.dimensions, {key: str(folder) for key, folder in vbench_models.items()})
    staging = fresh_staging("validate")
    report = staging / "report"
    prompts, embeddings = validation_prompts(cfg.num_prompts)
    metrics = run_validation(ARTIFACTS / "base" / "model", candidates, prompts, report, cfg, prompt_embeddings=embeddings,
                             cache=SampleCache(SAMPLE_CACHE), prompt_source=PROMPT_SOURCES[validation_split()])
    headline = headline_candidates(candidates)
    shown_metrics = headline_metrics(metrics, headline, candidates[0].name)
    if scorer is not None:  # the headline candidates' videos, as sampled above (or reused from the sample cache)
        shown_metrics.update(vbench.score_candidates(scorer, report, headline, cfg.device,
                                                     cache=ScoreCache(VBENCH_CACHE), models=model_files))
    # DVC gets the numbers a user compares; every metric stays in report/metrics.json, the details in report.json
    shown = [(report / name, "grid") for name in ("grid.gif", "grid.mp4")] + [(report / "plots" / "adherence_vs_nfe.png", "plots")]
    shown += [(report / "vbench" / "vbench.md", "vbench")]
    finish("validate", staging, kind="validation", params=params,
           metrics=shown_metrics, pinned=pinned or None,
           mlflow_files=[(path, folder) for path, folder in shown if path.is_file()],
           plots={"validate_adherence.csv": Path("report/plots/adherence.csv")},
           inputs=validation_inputs(clip_model=cfg.clip_model, vbench_models=vbench_models))
