"""The ``base`` stage: the base model folder (``base.path``: ``tiny`` or a Wan2.1 diffusers folder), checked
(only library classes a WanPipeline takes, no code) and published as ``artifacts/base/``."""

from __future__ import annotations

import json

from distillery.common.log import get_logger
from distillery.lineage.manifest import pin_input
from distillery.pipeline.params.base_path import resolve_base
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import finish, fresh_staging

log = get_logger("stage")


def stage_base(params: StageParams) -> None:
    """The base model folder as ``artifacts/base/model``: its ``model_index.json`` may name only
    diffusers/transformers classes a WanPipeline takes (one-line error otherwise), and no code file
    of it (``.py``, bytecode, native modules) is copied (:mod:`distillery.pipeline.publish.base_folder`); a folder of
    no registered model family (:func:`distillery.models.registry.family_of`: e.g. a Wan 2.2 A14B folder with one
    expert missing) is refused in one line before anything is copied."""
    from distillery.models.registry import family_of
    from distillery.pipeline.publish.base_folder import check_model_index, copy_model_folder

    source = resolve_base(params.get("base.path"))
    check_model_index(source, f"params.yaml: base.path: {source}")
    family = family_of(source)  # one line, nothing copied: a class or layout no family loads, a Wan 2.2 expert missing
    log.info("base: %s is a %s model", source, family.name)
    staging = fresh_staging("base")
    pinned = {"source": pin_input(source)}  # the folder as copied: a file changed meanwhile is refused at the end
    left_out = copy_model_folder(source, staging / "model", exclude=("lineage.json",))
    if left_out:
        log.info("base: left out %d code file(s) of %s (%s): no code of a base is copied or run", len(left_out), source,
                 ", ".join(left_out[:5]) + (", ..." if len(left_out) > 5 else ""))
    cfg = json.loads((staging / "model" / "transformer" / "config.json").read_text())
    finish("base", staging, kind="model", params=params, inputs=[("source", source)], pinned=pinned,
           metrics={"layers": cfg.get("num_layers")})  # a few short keys: `dvc metrics show` stays narrow
