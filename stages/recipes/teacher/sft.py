"""``teacher.method: sft``: the teacher is a supervised fine-tune of the base model on the latents
(:mod:`distillery.methods.sft`: flow matching with caption dropout). With ``teacher.source: base`` no recipe runs: the
stage publishes the given model (``teacher.path``, else the base) untrained."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distillery.pipeline.params.schema import TeacherParams

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs

Params = TeacherParams  # teacher.*: no knob of its own


def inputs(p: Params) -> dict[str, str]:
    del p
    return {"student": "base"}


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.sft import SFTMethod
    from stages.recipes.parts import callbacks, method, student

    return RunConfig(models={"student": student(p, "bidirectional", run.init["student"])},
                     method=method(SFTMethod, caption_dropout=0.1),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))
