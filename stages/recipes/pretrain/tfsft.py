"""``pretrain.method: tfsft``: Teacher-Forcing SFT of the teacher's weights into a causal student — DFSFT's recipe (its
params, inputs, student and draws) with each chunk denoised beside the *clean* earlier chunks (the context it would hold
had it generated the data exactly; Causal Forcing's first stage, :mod:`distillery.methods.tfsft`). Its artifact feeds
``distill`` as a DFSFT student does: block-causal over the chunks of ``pretrain.chunk_size`` latent frames."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.recipes.pretrain import chunked_sft
from stages.recipes.pretrain.dfsft import STUDENT, Params, given_contract, inputs  # noqa: F401 - DFSFT's, the method aside

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.methods.tfsft import TFSFTMethod

    return chunked_sft(TFSFTMethod, p, run)
