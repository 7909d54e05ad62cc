"""``pretrain.method: tfsft``: Teacher-Forcing SFT of the teacher's weights into a causal student — DFSFT's draws and
loss, each chunk denoised beside the *clean* earlier chunks (the context it would hold had it generated the data
exactly; Causal Forcing's first stage, :mod:`distillery.methods.tfsft`). Its artifact feeds ``distill`` as a DFSFT
student does: block-causal over the chunks of ``pretrain.chunk_size`` latent frames."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.recipes.pretrain import LatentsParams, causal_contract, chunked_sft, pretrain_inputs

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


Params = LatentsParams  # pretrain.*: no knob of its own; it trains on video latents
STUDENT = "causal"  # the kind of student it makes (distill recipes start from one kind: chain_notes)
inputs = pretrain_inputs
given_contract = causal_contract  # a given model standing in for it: the block-causal student's chunks


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.methods.tfsft import TFSFTMethod

    return chunked_sft(TFSFTMethod, p, run)
