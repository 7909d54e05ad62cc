"""The ``clips`` stage: a synthetic captioned clip set, published as ``artifacts/clips/``."""

from __future__ import annotations

import time

from distillery.common.log import get_logger
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import finish, fresh_staging

log = get_logger("stage")


def stage_clips(params: StageParams) -> None:
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set

    c = params.get("clips")
    staging = fresh_staging("clips")
    started = time.perf_counter()
    fps = int(c.fps) if c.fps.is_integer() else c.fps  # the MP4's rate; a whole one as an int (the set's README records it)
    cfg = ClipSetConfig(num_train=c.num_train, num_validation=c.num_validation, num_frames=c.num_frames,
                        height=c.size, width=c.size, fps=fps, seed=params.get("seed"))
    make_clip_set(staging / "data", cfg)
    finish("clips", staging, kind="data", params=params, inputs=[],
           metrics={"train": c.num_train, "validation": c.num_validation},  # counts: the columns latents shares
           volatile={"seconds": round(time.perf_counter() - started, 2)})
