"""The data stages: ``clips`` (a synthetic captioned clip set), ``base`` (the base model folder) and
``latents`` (VAE latents + prompt embeddings as parquet). Each reads only its dvc.yaml params and
publishes ``artifacts/<stage>/`` through :func:`distillery.stages.artifacts.finish`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.stages.artifacts import ARTIFACTS, finish, fresh_staging
from distillery.stages.params import StageParams

log = get_logger("stage")


def stage_clips(params: StageParams) -> None:
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set

    c = params.get("clips")
    staging = fresh_staging("clips")
    started = time.perf_counter()
    cfg = ClipSetConfig(num_train=c["num_train"], num_validation=c["num_validation"], num_frames=c["num_frames"],
                        height=c["size"], width=c["size"], fps=c["fps"], seed=params.get("seed"))
    make_clip_set(staging / "data", cfg)
    finish("clips", staging, kind="data", params=params, inputs=[],
           metrics={"clips_train": c["num_train"], "clips_validation": c["num_validation"]},
           volatile={"seconds": round(time.perf_counter() - started, 2)})


def resolve_base(path: str) -> Path:
    """``base.path`` → a diffusers model folder (``tiny``: the shipped fitted tiny Wan)."""
    if path == "tiny":
        from distillery.tinybase.shipped import shipped_tiny_base

        return shipped_tiny_base()
    p = Path(path).expanduser()
    if not (p / "model_index.json").is_file():
        raise UserError(f"params.yaml: base.path: {p} is not a diffusers model folder (no model_index.json); use 'tiny' or a Wan2.1 folder")
    return p


def stage_base(params: StageParams) -> None:
    """The base model folder as ``artifacts/base/model``: its ``model_index.json`` may name only
    diffusers/transformers classes a WanPipeline takes (one-line error otherwise), and no code file
    of it (``.py``, bytecode, native modules) is copied (:mod:`distillery.stages.base_folder`)."""
    from distillery.stages.base_folder import check_model_index, copy_model_folder

    source = resolve_base(params.get("base.path"))
    check_model_index(source, f"params.yaml: base.path: {source}")
    staging = fresh_staging("base")
    left_out = copy_model_folder(source, staging / "model", exclude=("lineage.json",))
    if left_out:
        log.info("base: left out %d code file(s) of %s (%s): no code of a base is copied or run", len(left_out), source,
                 ", ".join(left_out[:5]) + (", ..." if len(left_out) > 5 else ""))
    cfg = json.loads((staging / "model" / "transformer" / "config.json").read_text())
    finish("base", staging, kind="model", params=params, inputs=[("source", source)],
           metrics={"transformer_layers": cfg.get("num_layers"), "latent_channels": cfg.get("in_channels")})


def stage_latents(params: StageParams) -> None:
    from distillery.data.preprocess import PreprocessConfig, preprocess

    data = params.get("latents.data") or str(ARTIFACTS / "clips" / "data")
    staging = fresh_staging("latents")
    from distillery.stages.device import stage_device

    l = params.get("latents")

    def chosen(key: str, fallback: str):  # latents.<key>, or the clips stage's value when null
        return l.get(key) if l.get(key) is not None else params.get(fallback)

    cfg = PreprocessConfig(num_frames=int(chosen("num_frames", "clips.num_frames")), height=int(chosen("height", "clips.size")),
                           width=int(chosen("width", "clips.size")), fps=float(chosen("fps", "clips.fps")),
                           rows_per_shard=l["rows_per_shard"], max_bad_fraction=l["max_bad_fraction"],
                           device=stage_device(str(l.get("device", "auto")), int(params.get("gpus.nproc_per_node")), "latents.device"))
    log.info("latents: %d frames of %dx%d at %g fps on %s", cfg.num_frames, cfg.height, cfg.width, cfg.fps, cfg.device)
    manifest = preprocess(ARTIFACTS / "base" / "model", Path(data), staging / "data", cfg)
    metrics = {f"{s}_clips": c["rows"] for s, c in manifest["splits"].items()}
    metrics.update({f"{s}_skipped": c["skipped"] for s, c in manifest["splits"].items()})
    inputs = [("base", ARTIFACTS / "base"), ("videos", ARTIFACTS / "clips" if not params.get("latents.data") else Path(data))]
    finish("latents", staging, kind="data", params=params, inputs=inputs, metrics=metrics,
           volatile={"seconds": manifest["seconds_this_run"]})
