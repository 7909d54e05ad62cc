"""The ``prompts`` stage: the prompt embeddings of ``prompts.path`` (no videos) as parquet shards, published as
``artifacts/prompts/`` — the data of a distillation stage with ``<stage>.data: prompts``.

A killed run's finished shards in ``artifacts/prompts.tmp/data`` are kept (:func:`resumable_staging`), and the
previous ``artifacts/prompts/data`` seeds the rest of the new one (its files hard-linked, or copied where a link cannot be
made; every file the encoder rewrites is replaced by rename, never written in place), so a rerun re-encodes only the
shards whose prompts, settings or text encoder changed (:func:`distillery.data.prompts.encode_prompts_file`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distillery.common.log import get_logger
from distillery.lineage.manifest import pin_input
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import ARTIFACTS, finish, resumable_staging

log = get_logger("stage")


def _chosen(params: StageParams, *keys: str):
    """The first of ``keys`` whose value is not null (the last is always set)."""
    for key in keys:
        value = params.get(key)
        if value is not None:
            return value
    return None


def seed_from_previous(previous: Path, staging: Path) -> int:
    """Hard-link (else copy) every regular file of ``previous`` into ``staging`` (same relative paths) that ``staging``
    does not hold yet (a stopped run's newer shard stays); symbolic links and other file types are left out (the encoder
    then redoes what they held). Returns the files seeded."""
    seeded = 0
    if not previous.is_dir() or previous.is_symlink():
        return 0
    for src in sorted(previous.rglob("*")):
        if src.is_symlink() or not src.is_file():
            continue
        dst = staging / src.relative_to(previous)
        if os.path.lexists(dst):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        seeded += 1
    return seeded


def stage_prompts(params: StageParams) -> None:
    from distillery.data.prompts import PromptsConfig, encode_prompts_file
    from distillery.models.registry import latent_shape_for
    from distillery.pipeline.launch.device import stage_device

    p = params.get("prompts")
    cfg = PromptsConfig(
        num_frames=_chosen(params, "prompts.num_frames", "latents.num_frames", "clips.num_frames"),
        height=_chosen(params, "prompts.height", "latents.height", "clips.size"),
        width=_chosen(params, "prompts.width", "latents.width", "clips.size"),
        rows_per_shard=p.rows_per_shard, device=stage_device(p.device, params.get("gpus.nproc_per_node"), "prompts.device"),
        negative_prompt=params.get("latents.negative_prompt") or "", max_file_bytes=p.max_file_bytes,
        max_prompt_chars=p.max_prompt_chars)
    source = Path(p.path)
    staging = resumable_staging("prompts")  # a killed run's finished shards are kept
    seeded = seed_from_previous(ARTIFACTS / "prompts" / "data", staging / "data")
    log.info("prompts: %s for rollouts of %d frames of %dx%d on %s (%d files of the previous set reused where unchanged)",
             source, cfg.num_frames, cfg.height, cfg.width, cfg.device, seeded)
    pinned = {"prompts": pin_input(source)}  # the file as read: a file replaced while it encodes is refused at the end
    base = ARTIFACTS / "base" / "model"
    shape = latent_shape_for(base, cfg.num_frames, cfg.height, cfg.width, "prompts")  # before anything is loaded
    manifest = encode_prompts_file(base, source, staging / "data", cfg, shape)
    metrics = {"train": manifest["splits"]["train"]["rows"]}  # the column the clips' and latents' counts share
    finish("prompts", staging, kind="data", params=params, inputs=[("base", ARTIFACTS / "base"), ("prompts", source)],
           metrics=metrics, volatile={"seconds": manifest["seconds_this_run"]}, pinned=pinned)  # how many it encoded: the log's last line
