"""What the recipes build their run configs from: the roles (the trained student, a frozen teacher, a DMD critic), the
method and the callbacks every training stage runs — each a typed :class:`~distillery.config.Component` of its plugin
class (:func:`distillery.config.loader.component_of`: checked against its declarations as a file's would be).

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


def student(p: TrainingStageParams, cls: type, init_from: str, **knobs: Any) -> Component:
    """The role the artifact ships: a ``cls`` model (a Wan plugin) from ``init_from`` with ``knobs``, the stage's LoRA
    (``<stage>.lora_rank`` > 0: an adapter trains instead of its weights) and its attention (``<stage>.attention``:
    sparse, dense, or auto — as its init trained)."""
    return component_of(cls, "models.student", init_from=init_from, lora=p.student_lora(), **p.student_attention(),
                        **knobs)


def frozen(cls: type, init_from: str, role: str = "teacher") -> Component:
    """A frozen role (the teacher): a ``cls`` model from ``init_from`` that never trains."""
    return component_of(cls, f"models.{role}", init_from=init_from, trainable=False)


def critic(init_from: str, learning_rate: float) -> Component:
    """A DMD critic (the fake score): a bidirectional Wan from ``init_from`` with its own learning rate and betas."""
    from distillery.models.wan import WanModel

    return component_of(WanModel, "models.critic", init_from=init_from,
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
