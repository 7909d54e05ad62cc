"""Before a training stage works: can its student attend block-sparsely as ``params.yaml`` asks
(``<stage>.attention: sparse``, ``sparsity``, ``sparse_tile``; docs/training.md)?

Known from the params and the base folder alone, each refused in one line (:class:`UserError`) before any stage
works — the stage about to run and every training stage after it (one switched off, ``posttrain.enabled: false``,
trains nothing and is not asked):

- a stage that publishes a given model untrained (``teacher.source: base``, ``pretrain.source: given``);
- the base's family has no sparse attention (:attr:`~distillery.models.registry.ModelFamily.sparse_attention`:
  Cosmos; Wan 2.2 A14B's two experts);
- a tile of more tokens than one attention tile may hold;
- a causal student (its recipe's ``STUDENT``) whose chunks (``pretrain.chunk_size``, after an image-to-video base's
  given first frame) a tile's frames would straddle;
- a sparsity that, on the video the stage trains on, drops no key tile: the student would train dense under a
  sparse name. The token grid is the latent's (the base's VAE over ``<stage>.data``'s frames and size) divided by the
  transformer's patch; a tile that does not divide it is ragged at the grid's end (the attention pads it), not
  refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from distillery.common.errors import UserError
from distillery.pipeline.launch.preflight import clip_size
from distillery.pipeline.params.reader import Params
from distillery.pipeline.params.schema import TRAINING_STAGES


def rollout_size(params: Params, data: str) -> tuple[int, int, int]:
    """``(frames, height, width)`` of the videos a training stage reading ``data`` (``latents`` or ``prompts``) trains
    on: the latents' clips, or the prompts stage's rollouts (``prompts.*``, else the latents')."""
    frames, height, width = clip_size(params)
    if data != "prompts":
        return frames, height, width
    return (params.get("prompts.num_frames") or frames, params.get("prompts.height") or height,
            params.get("prompts.width") or width)


def token_grid(base: Path, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The ``(frames, rows, columns)`` of tokens the base's transformer attends over for a ``frames × height × width``
    video: its VAE's latent (:func:`~distillery.models.registry.latent_shape_for`) divided by the transformer's
    ``patch_size``."""
    from distillery.models.registry import latent_shape_for

    _, t, h, w = latent_shape_for(base, frames, height, width, "params.yaml")
    config = json.loads((base / "transformer" / "config.json").read_text())
    pt, ph, pw = (int(v) for v in config.get("patch_size") or (1, 2, 2))
    return t // pt, h // ph, w // pw


def check_stage_attention(stage: str, params: Params) -> None:
    """Refuse training stage ``stage``'s ``attention: sparse`` where its student cannot attend so (module doc)."""
    section = params.get(stage)
    if section.attention != "sparse" or section.off():  # a stage switched off trains nothing
        return
    from distillery.models.registry import family_of, image_conditioning
    from distillery.models.wan.sparse_attention import causal_problem, keep_count, spec_problem
    from distillery.pipeline.params.base_path import resolve_base

    where = f"params.yaml: {stage}"
    if section.given():
        raise UserError(f"{where}.attention: sparse: {stage} publishes a given model as is (nothing trains it sparse); "
                        f"use {stage}.attention: auto, or train the stage")
    base = resolve_base(params.get("base.path"))
    family = family_of(base)
    if not family.sparse_attention:
        raise UserError(f"{where}.attention: sparse: the base's family {family.name} has no sparse attention (only the "
                        "one-transformer Wan families do, models/wan/sparse.py); use attention: dense or auto")
    tile = [int(v) for v in section.sparse_tile]
    problem = spec_problem(float(section.sparsity), tile)
    if problem:
        raise UserError(f"{where}.sparse_tile: {tile}: {problem}")
    recipe = params.recipes[stage][section.method]
    if getattr(recipe, "STUDENT", "bidirectional") == "causal":
        chunk = int(params.get("pretrain.chunk_size"))
        problem = causal_problem(tuple(tile), chunk, 1 if image_conditioning(base) is not None else 0)
        if problem:
            raise UserError(f"{where}.sparse_tile: {tile}: {problem} (pretrain.chunk_size {chunk}, the causal student's)")
    grid = token_grid(base, *rollout_size(params, section.data_artifact()))
    tiles = math.prod(-(-g // t) for g, t in zip(grid, tile))
    if keep_count(float(section.sparsity), tiles) >= tiles:
        least = f"a sparsity of at least {math.ceil(1000 / tiles) / 1000:g} or " if tiles > 1 else ""  # drops 1 of n from 1/n
        raise UserError(f"{where}.sparsity: {section.sparsity}: drops none of the {tiles} key tiles of the "
                        f"{'×'.join(map(str, grid))} token grid it trains on (tiles of {'×'.join(map(str, tile))} tokens): "
                        f"it would train dense; set {least}a smaller {stage}.sparse_tile")


def check_attention(params: Params, stage: str | None = None, order: tuple[str, ...] = ()) -> None:
    """:func:`check_stage_attention` for ``stage`` and every training stage after it in ``order`` (the DAG order,
    :data:`distillery.pipeline.launch.runner.STAGES`); ``stage`` None: every training stage."""
    at = order.index(stage) if stage in order else 0
    for name in TRAINING_STAGES:
        if stage is None or name not in order or order.index(name) >= at:
            check_stage_attention(name, params)
