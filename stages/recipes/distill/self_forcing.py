"""``distill.method: self_forcing``: the causal pretrain student rolled out chunk by chunk on its own KV-cached outputs,
matched to the teacher's distribution (DMD2's losses) with a critic (:mod:`distillery.methods.self_forcing`); it attends
block-causally over the chunks it was pretrained on (``pretrain.chunk_size``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distillery.pipeline.params.schema import MAX_TIMESTEP, rule, timestep
from stages.recipes.distill import DMDParams, dmd_callbacks, dmd_inputs, dmd_knobs, dmd_reads, dmd_roles

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs


@dataclass
class Params(DMDParams):
    """``distill.*`` with Self-Forcing's own knobs."""

    context_noise: float = rule(0.0, 0, MAX_TIMESTEP, timestep)  # timestep of the KV-cached context chunks (0: clean)
    same_step_across_chunks: bool = rule(False)  # one exit-step draw for every chunk of a rollout (false: one per chunk)


PRETRAIN_STUDENT = "causal"  # the kind of pretrain student its recipe starts from (pretrain.method dfsft, ode_init)
STUDENT = "causal"  # the kind of student it trains (its sparse attention is refused where its tiles straddle chunks)
inputs = dmd_inputs
reads = dmd_reads  # the base with the collapse watch on (its VAE)


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.self_forcing import SelfForcingMethod
    from stages.recipes.parts import method, student

    causal = student(p, PRETRAIN_STUDENT, run.init["student"], shift=p.student_shift,
                     chunk_size=run.params.pretrain.chunk_size)  # the chunks it was pretrained on
    return RunConfig(models=dmd_roles(p, run, causal),
                     method=method(SelfForcingMethod, **dmd_knobs(p), context_noise=p.context_noise,
                                   same_step_across_chunks=p.same_step_across_chunks),
                     training=p.training(run, unconditional="negative", betas=(0.0, 0.999)), callbacks=dmd_callbacks(p, run))
