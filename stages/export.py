"""The ``export`` stage: a complete diffusers folder of the chosen student (``export.student``) with its
sampling contract, its own pipeline module and model card, published as ``artifacts/export/`` — or, for a student
that trained a LoRA and ``export.lora: adapter``, its adapter file and a card naming the base it needs."""

from __future__ import annotations

import shutil
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.params.schema import TRAINING_STAGES
from distillery.pipeline.publish.artifacts import ARTIFACTS, finish, fresh_staging, published_off

log = get_logger("stage")


def stage_export(params: StageParams) -> None:
    """A complete diffusers folder: the base's parts + the chosen student's transformer, its sampling
    contract, the modules that sample by it (``pipeline.py`` and the ``distilled_*.py`` it imports,
    :mod:`distillery.export.code`: they need only torch, diffusers, transformers and accelerate) and its own model
    card (``README.md``, :mod:`distillery.export.model_card`: chain, settings, validation scores, code),
    lineage inside.

    What it ships is trusted no further than it can check: the base's ``model_index.json`` may name
    only library classes a WanPipeline takes and no code file of the base is copied
    (:mod:`distillery.pipeline.publish.base_folder`), so the only code in the folder is the modules written here,
    each recorded with its sha256 in the lineage (``config.shipped_code``: ``lineage --verify`` refuses
    any other code, and these with another digest); and every byte of the artifacts it is made from,
    and of theirs upstream, is read against their manifests before it is published
    (``finish(verify_chain=True)``; its cost is logged)."""
    from distillery.export.code import CODE_RECORD_KEY, check_own_pipeline_samples
    from distillery.pipeline.publish.base_folder import check_model_index

    student = params.get("export.student")
    if student not in TRAINING_STAGES:
        raise UserError(f"params.yaml: export.student: {student!r}; valid: {', '.join(TRAINING_STAGES)}")
    if published_off(student):
        raise UserError(f"params.yaml: export.student: {student}: the {student} stage is off ({student}.enabled: false) "
                        f"and made no model; switch it on (-S {student}.enabled=true) or export another stage's student")
    base = ARTIFACTS / "base" / "model"
    check_model_index(base, f"stage export: {base}")
    if not (ARTIFACTS / student / "model" / "transformer").is_dir():
        raise UserError(f"stage export: {ARTIFACTS / student / 'model' / 'transformer'} not found: export.student is {student!r}, "
                        f"and its stage has not produced a model here; run it first (dvc repro runs it)")
    adapter = params.get("export.lora") == "adapter"
    if adapter:  # the student trained a LoRA: its adapter file alone (a one-line error before any work when it did not)
        from distillery.export.lora_card import adapter_folder

        adapter_folder(student, ARTIFACTS / student / "model")
    from distillery.export.i2v_card import is_i2v_folder

    i2v = is_i2v_folder(base)  # an image-to-video base: stock WanImageToVideoPipeline or its own pipeline
    report = ARTIFACTS / "validate" / "report"
    missing = [f.name for f in (report / "metrics.json", report / "report.json") if not f.is_file()]
    if missing:  # the card's scores and snippets come from validate's report: a killed or never-run validate left none
        raise UserError(f"stage export: {report} has no {' or '.join(missing)}: the validate stage has not finished here; "
                        f"run it first (dvc repro runs it)")
    check_own_pipeline_samples(student, ARTIFACTS / student / "model")  # a Wan 2.2 student its pipeline.py would get wrong
    staging = fresh_staging("export")
    if adapter:
        export_adapter(student, staging, params)
        return
    model = staging  # the artifact *is* the diffusers folder, lineage.json inside
    code, stock_nfe = assemble_export(base, ARTIFACTS / student / "model", model)
    metrics = export_metrics(student, model, ARTIFACTS / "validate", stock_nfe)
    # its own model card (the base's described the base): what it is, its chain, settings, scores, the code to load it
    from distillery.data.encoders import read_max_sequence_length
    from distillery.export.model_card import export_model_card

    if i2v:
        from distillery.export.i2v_card import i2v_model_card

        card = i2v_model_card(student, ARTIFACTS / student, ARTIFACTS / "validate", read_max_sequence_length(base))
    else:
        card = export_model_card(student, ARTIFACTS / student, ARTIFACTS / "validate", read_max_sequence_length(base), stock_nfe)
    (model / "README.md").write_text(card, encoding="utf-8")
    finish("export", staging, kind="export", params=params, metrics=metrics, verify_chain=True,
           config={CODE_RECORD_KEY: code},
           inputs=[("student", ARTIFACTS / student), ("base", ARTIFACTS / "base"), ("validation", ARTIFACTS / "validate")])
    say_where_results_are(student, i2v)


def say_where_results_are(student: str, i2v: bool = False) -> None:
    """The last lines of a run (the export is the DAG's last stage; DVC's own hints follow): where the report and the
    export are, how to load the export, and the exported student against the teacher in one fair line
    (:func:`distillery.evaluation.summary.versus_line`)."""
    import json

    from distillery.evaluation.summary import versus_line
    from distillery.export.model_card import validated_candidate

    folder = ARTIFACTS / "export"
    report_dir = ARTIFACTS / "validate" / "report"
    report = json.loads((report_dir / "report.json").read_text())
    metrics = json.loads((report_dir / "metrics.json").read_text())
    contract = json.loads((folder / "sampling.json").read_text())
    candidate = validated_candidate(student, contract, report)
    if student == "teacher":
        load = f'WanPipeline.from_pretrained("{folder}")'
    else:
        load = f'DiffusionPipeline.from_pretrained("{folder}", custom_pipeline="{folder}", trust_remote_code=True)'
    lines = ["results:",
             f"  report: {report_dir / 'summary.md'} (every candidate's scores; the videos: {report_dir / 'grid.gif'})",
             f"  export: {folder}/ ({student}; its card {folder / 'README.md'} has the code to sample and save a video)",
             f"  load it: {load}" + (" (an image-to-video model: the card says how to pass the first frame)" if i2v else "")]
    plots = offline_plots(ARTIFACTS)
    if plots:
        lines.append(f"  plots (PNG, open offline; `dvc plots show` needs the network): {plots}")
    if candidate is not None and candidate["name"] != report.get("reference"):
        lines.append("  " + versus_line(metrics, report, candidate["name"]))
    for line in lines:
        log.info("%s", line)


def offline_plots(artifacts: Path) -> str:
    """The run's plots as PNG images, which open without the network (``dvc plots show``'s HTML loads Vega-Lite
    from a CDN), in one short phrase: validate's adherence against NFE, then the training stages' loss curves in
    DAG order as one shell brace pattern (``artifacts/{teacher,pretrain}/loss.png``); only the files that exist (a
    stage off, or adherence n/a on one's own prompts, has none); empty when there are none."""
    adherence = artifacts / "validate" / "report" / "plots" / "adherence_vs_nfe.png"
    losses = [stage for stage in TRAINING_STAGES if (artifacts / stage / "loss.png").is_file()]
    said = [str(adherence)] if adherence.is_file() else []
    if losses:
        said.append(str(artifacts / (losses[0] if len(losses) == 1 else "{" + ",".join(losses) + "}") / "loss.png"))
    return ", ".join(said)


def export_adapter(student: str, staging: Path, params: StageParams) -> None:
    """``export.lora: adapter``: the folder is the student's LoRA adapter, its ``base.json``, ``sampling.json`` and a
    card naming the base it needs (:mod:`distillery.export.lora_card`), lineage inside."""
    import json

    from distillery.export.lora_card import adapter_model_card, assemble_adapter_export

    info = assemble_adapter_export(ARTIFACTS / student / "model", staging)
    contract = json.loads((staging / "sampling.json").read_text())
    (staging / "README.md").write_text(adapter_model_card(student, info, contract, model_folder=str(ARTIFACTS / "base" / "model")),
                                       encoding="utf-8")
    metrics = {"is_teacher": 1 if student == "teacher" else 0, "lora_rank": int(info["rank"])}
    finish("export", staging, kind="export", params=params, metrics=metrics, verify_chain=True,
           inputs=[("student", ARTIFACTS / student), ("base", ARTIFACTS / "base"), ("validation", ARTIFACTS / "validate")])


def assemble_export(base: Path, student_model: Path, out: Path) -> tuple[dict[str, str], int | None]:
    """Fill ``out`` with the export's diffusers folder: ``base``'s parts (no code file, not its
    transformer), ``student_model``'s ``transformer/`` and ``sampling.json``, the shipped modules
    (:func:`distillery.export.code.write_export_code`) and, for a PDD student, the 1-NFE fused
    transformer (:func:`fuse_for_stock_pipeline`); every file follows the umask. Returns
    ``({module file: sha256}, stock NFE or None)``."""
    from distillery.common.fsutil import follow_umask
    from distillery.export.code import write_export_code
    from distillery.pipeline.publish.base_folder import copy_model_folder

    # the base's parts; its own transformer(s) not copied at all (the student's replace them)
    left_out = copy_model_folder(base, out, exclude=("lineage.json", "fit_report.json"),
                                 exclude_top=("transformer", "transformer_2"))
    left_out += copy_model_folder(student_model / "transformer", out / "transformer", exclude=("transformer_2",))
    second = student_model / "transformer" / "transformer_2"
    if second.is_dir():  # a Wan 2.2 A14B student's low-noise expert: beside the other, as diffusers lays them out
        left_out += copy_model_folder(second, out / "transformer_2")
    if left_out:  # an artifact made before the base stage left code out
        log.info("export: left out %d code file(s) (%s): an export ships only its own modules",
                 len(left_out), ", ".join(left_out[:5]))
    shutil.copy2(student_model / "sampling.json", out / "sampling.json")
    stock_nfe = fuse_for_stock_pipeline(student_model, out / "transformer")
    # the folder's own pipeline and what it imports: DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder)
    # samples as sampling.json says (few-step ladder, causal streaming, PDD blocks) without distillery installed
    code = write_export_code(out)
    follow_umask(out)
    return code, stock_nfe


def export_metrics(student: str, model: Path, validate_dir: Path, stock_nfe: int | None) -> dict[str, float]:
    """The export's DVC metrics: ``is_teacher`` (1 when the exported model is the teacher itself, 0 for a
    student); ``nfe_per_video``, the transformer forwards per video of the call its model card shows (validate's
    candidate for it, :func:`~distillery.export.model_card.validated_candidate`: its steps and guidance, at
    validate's size), and for a streaming student ``nfe_per_chunk`` (its denoising steps + the forward that writes
    the chunk to the KV cache); ``stock_nfe`` when stock ``WanPipeline`` samples it (a fused PDD student)."""
    import json

    from distillery.export.model_card import validated_candidate
    from distillery.export.standalone.distilled_samplers import build_sampler  # counted as the shipped code counts

    metrics: dict[str, float] = {"is_teacher": 1 if student == "teacher" else 0}
    contract = json.loads((model / "sampling.json").read_text())
    try:
        report = json.loads((validate_dir / "report" / "report.json").read_text())
    except (OSError, ValueError):
        report = {}
    candidate = validated_candidate(student, contract, report) if isinstance(report, dict) else None
    if candidate is not None and isinstance(candidate.get("nfe"), (int, float)):
        metrics["nfe_per_video"] = candidate["nfe"]
    if contract.get("sampler") == "causal_streaming":
        steps = candidate.get("num_steps") if candidate else None
        metrics["nfe_per_chunk"] = build_sampler(contract).nfe(steps) + 1  # its steps, then the cache write
    if stock_nfe is not None:
        metrics["stock_nfe"] = stock_nfe
    return metrics


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
    from distillery.models.base import PDDModelBase
    from distillery.models.registry import family_of

    loaders = family_of(student_model).loaders()
    plugin = loaders.load_inference_model(student_model, pdd_steps=steps, shift=contract.get("shift"))
    assert isinstance(plugin, PDDModelBase)  # what load_inference_model(pdd_steps=...) returns
    plugin.fuse_into_projection(plugin.transformer, 0, steps)
    tmp = transformer_dir.parent / ".tmp-fused-transformer"
    if tmp.exists():
        shutil.rmtree(tmp)
    plugin.transformer.save_pretrained(tmp, safe_serialization=True)  # the caller makes it follow the umask
    shutil.copy2(transformer_dir / loaders.HEAD_BANK_FILE, tmp / loaders.HEAD_BANK_FILE)
    shutil.rmtree(transformer_dir)
    tmp.rename(transformer_dir)
    return 1
