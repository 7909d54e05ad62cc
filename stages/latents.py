"""The ``latents`` stage: VAE latents and prompt embeddings of the clips (or ``latents.data``) as parquet
shards, published as ``artifacts/latents/``."""

from __future__ import annotations

from pathlib import Path

from distillery.common.log import get_logger
from distillery.lineage.manifest import pin_input
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.params.schema import CLIPS_VIDEOS, given_path
from distillery.pipeline.publish.artifacts import ARTIFACTS, finish, resumable_staging

log = get_logger("stage")


def stage_latents(params: StageParams) -> None:
    from distillery.data.preprocess import PreprocessConfig, preprocess

    own = given_path(params.get("latents.data"), CLIPS_VIDEOS)  # None: the clips stage's videos
    data = own or str(ARTIFACTS / "clips" / "data")
    staging = resumable_staging("latents")  # a killed run's finished shards are kept
    from distillery.pipeline.launch.device import stage_device

    lat = params.get("latents")

    def chosen(value, fallback: str):  # latents.<key>, or the clips stage's value when null
        return value if value is not None else params.get(fallback)

    cfg = PreprocessConfig(num_frames=chosen(lat.num_frames, "clips.num_frames"), height=chosen(lat.height, "clips.size"),
                           width=chosen(lat.width, "clips.size"), fps=float(chosen(lat.fps, "clips.fps")),
                           rows_per_shard=lat.rows_per_shard, max_bad_fraction=lat.max_bad_fraction,
                           device=stage_device(lat.device, params.get("gpus.nproc_per_node"), "latents.device"),
                           negative_prompt=lat.negative_prompt or "")
    log.info("latents: %d frames of %dx%d at %g fps on %s", cfg.num_frames, cfg.height, cfg.width, cfg.fps, cfg.device)
    pinned = {"videos": pin_input(own)} if own else None  # one's own videos as read: changed meanwhile, refused at the end
    manifest = preprocess(ARTIFACTS / "base" / "model", Path(data), staging / "data", cfg)
    # clips per split (the columns the clips stage's counts share) and those skipped: `dvc metrics show` stays narrow
    metrics = {s: c["rows"] for s, c in manifest["splits"].items()}
    metrics["skipped"] = sum(c["skipped"] for c in manifest["splits"].values())
    inputs = [("base", ARTIFACTS / "base"), ("videos", ARTIFACTS / "clips" if not own else Path(data))]
    finish("latents", staging, kind="data", params=params, inputs=inputs, metrics=metrics,
           volatile={"seconds": manifest["seconds_this_run"]}, pinned=pinned)
