"""``pretrain.method: dfsft``: Diffusion-Forcing SFT of the teacher's weights into a causal student (the init of
Self-Forcing): block-causal attention over the chunks of ``pretrain.chunk_size`` latent frames that DFSFT noises
independently (:mod:`distillery.methods.dfsft`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distillery.pipeline.params.schema import PretrainParams
from stages.recipes.pretrain import causal_contract, causal_student, pretrain_inputs

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class Params(PretrainParams):
    """``pretrain.*``: no knob of its own; it trains on video latents."""

    def problem(self, stage: str) -> str | None:
        if self.data == "prompts":
            return (f"{stage}.data: prompts: {stage}.method {self.method} trains on video latents, which a prompt-only "
                    f"set has none of; use {stage}.method: ode_init (its trajectories start from the prompts), or "
                    f"{stage}.data: latents")
        return super().problem(stage)


STUDENT = "causal"  # the kind of student it makes (distill recipes start from one kind: chain_notes)
inputs = pretrain_inputs

given_contract = causal_contract  # a given model standing in for it: the block-causal student's chunks


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.dfsft import DFSFTMethod
    from stages.recipes.parts import callbacks, method

    return RunConfig(models={"student": causal_student(p, run)},
                     method=method(DFSFTMethod, chunk_size=p.chunk_size, min_timestep_ratio=0.0, max_timestep_ratio=1.0,
                                   caption_dropout=0.1),
                     training=p.training(run, min_lr_ratio=0.1), callbacks=callbacks(p))
