"""What the recipes build their run configs from: the roles (the trained student, a frozen teacher, a DMD critic), the
method and the callbacks every training stage runs — each a typed :class:`~distillery.config.Component` of its plugin
class (:func:`distillery.config.loader.component_of`: checked against its declarations as a file's would be). A role's
plugin class is its kind's (``bidirectional``, ``causal``, ``pdd``: :data:`distillery.models.registry.STUDENT_KINDS`)
in the model family of the folder it starts from, read from that folder (its transformer's class and layout:
:func:`~distillery.models.registry.family_of`), never named here: one recipe trains a Wan, Cosmos or HunyuanVideo 1.5
base alike.

Imported by a recipe when it runs (never at a recipe module's top: those are imported by every stage, to check
``params.yaml`` whole), so a change here reruns the training stages and nothing else.
"""

from __future__ import annotations

from typing import Any

from distillery.config.loader import component_of
from distillery.config.schema import Component, OptimizerOverride
from distillery.pipeline.launch.run_config import EMA_CALLBACK
from distillery.pipeline.params.schema import TrainingStageParams

CRITIC_BETAS = (0.0, 0.999)  # a DMD critic's AdamW betas (the published recipes')


def model_class(kind: str, init_from: str) -> type:
    """The ``kind`` plugin class of the model family of the folder ``init_from`` (one :class:`UserError` line when the
    family builds no such model, e.g. a causal HunyuanVideo 1.5; the stage's preflight refuses that before any work)."""
    from distillery.models.registry import family_of

    return family_of(init_from).model_class(kind)


def student(p: TrainingStageParams, kind: str, init_from: str, **knobs: Any) -> Component:
    """The role the artifact ships: a ``kind`` model (:func:`model_class`) from ``init_from`` with ``knobs``, the stage's
    LoRA (``<stage>.lora_rank`` > 0: an adapter trains instead of its weights) and its attention (``<stage>.attention``:
    sparse, dense, or auto — as its init trained)."""
    return component_of(model_class(kind, init_from), "models.student", init_from=init_from, lora=p.student_lora(),
                        **p.student_attention(), **knobs)


def frozen(init_from: str, role: str = "teacher") -> Component:
    """A frozen role (the teacher): a bidirectional model from ``init_from`` that never trains."""
    return component_of(model_class("bidirectional", init_from), f"models.{role}", init_from=init_from, trainable=False)


def critic(init_from: str, learning_rate: float) -> Component:
    """A DMD critic (the fake score): a bidirectional model from ``init_from`` with its own learning rate and betas."""
    return component_of(model_class("bidirectional", init_from), "models.critic", init_from=init_from,
                        optimizer=OptimizerOverride(learning_rate=learning_rate, betas=CRITIC_BETAS))


def method(cls: type, **knobs: Any) -> Component:
    """The run's training method: ``cls`` with ``knobs`` (its config class's fields)."""
    return component_of(cls, "method", **knobs)


def callbacks(p: TrainingStageParams) -> dict[str, Component]:
    """Every training stage's callbacks: gradient clipping at norm 1 and, with ``<stage>.ema_decay`` set, the EMA of the
    student whose shadow the artifact ships (``callbacks.ema``: :func:`stages.training.shipped_weights`)."""
    from distillery.callbacks.grad_clip import GradClipCallback

    found = {"grad_clip": component_of(GradClipCallback, "callbacks.grad_clip", max_grad_norm=1.0)}
    ema = p.ema()
    if ema is not None:
        from distillery.callbacks.ema import EMACallback

        decay, start = ema
        found[EMA_CALLBACK] = component_of(EMACallback, f"callbacks.{EMA_CALLBACK}", decay=decay, start_step=start,
                                           roles=["student"])
    return found
