"""Callback interface: hooks the trainer calls around each optimizer step.

Hook order per optimizer step: ``on_before_optimizer_step`` (after all micro-batch backwards,
before ``optimizer.step``) → ``on_training_step_end`` (after the step). Hooks return metric
tensors; the trainer reads them with one host sync per step. ``state_dict`` holds tensors that go
into the DCP checkpoint (DTensors are resharded on load); ``load_state_dict`` restores them.

The trainer holds its callbacks as one :class:`CallbackList`: each hook is called on every callback
in config order, and the metric dicts they return are merged (a later callback's key wins).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from distillery.common.errors import UserError

if TYPE_CHECKING:
    from distillery.models.base import ModelBase


@dataclass
class RunControl:
    """What callbacks may ask of the training loop; the trainer reads it after each step's callbacks.

    - ``save``: write a checkpoint at this step (besides ``save_every``); the trainer clears it after saving;
    - ``stop``: a reason (one line): the trainer writes a checkpoint at this step, logs the reason and ends the run
      (set at loop start — a resumed run that had stopped — it ends before any step);
    - ``keep``: steps whose checkpoints ``keep_last`` never prunes;
    - ``selection``: the checkpoint the run recommends publishing and why (``{"step", "checkpoint", "reason", ...}``;
      ``checkpoint`` null: none is fit to publish): ``run_summary.json`` names it as the run's checkpoint and records
      it under ``selection``."""

    save: bool = False
    stop: str | None = None
    keep: set[int] = field(default_factory=set)
    selection: dict[str, Any] | None = None


@dataclass
class CallbackContext:
    """What callbacks may see — a narrow view, never the method object:

    - ``roles``: role name → model plugin (``trainable_modules()`` says what trains);
    - ``roles_to_step(step)``: the trainable roles whose optimizers step at ``step``;
    - ``sampling``: the method's sampling contract (``sampling.json`` content: the sampler to
      build from :mod:`distillery.sampling` for the student), or None;
    - ``tracker``: the run's tracker (``log_metrics``, ``log_artifact``; rank 0 does the writing);
    - ``rank``, ``world_size``, ``max_train_steps``;
    - ``control``: what a callback may ask of the loop (:class:`RunControl`: a checkpoint now, a stop, a checkpoint
      kept from pruning, the checkpoint to publish).
    """

    roles: dict[str, "ModelBase"]
    rank: int
    world_size: int
    max_train_steps: int
    roles_to_step: Callable[[int], list[str]] = field(default=lambda step: [])
    sampling: dict[str, Any] | None = None
    tracker: Any = None
    control: RunControl = field(default_factory=RunControl)


class Callback:
    component_kind: ClassVar[str] = "callback"
    config_class: ClassVar[type]
    role_fields: ClassVar[tuple[str, ...]] = ()  # config fields naming roles (a name or a list), checked by check_roles

    def __init__(self, config: Any, name: str) -> None:
        self.config = config
        self.name = name

    @classmethod
    def check_roles(cls, config: Any, roles: Iterable[str], where: str) -> None:
        """Raise a one-line UserError unless every role ``config`` names is one of the run's ``roles``;
        called with the method's own role check, before any model loads
        (:func:`distillery.engine.builder.check_roles_early`; ``where``: ``callbacks.<name>``). A
        callback naming roles lists its config's fields of role names in ``role_fields``."""
        valid = sorted(roles)
        for field_name in getattr(cls, "role_fields", ()):
            value = getattr(config, field_name)
            for role in [value] if isinstance(value, str) else (value or []):  # None: no role named
                if role not in valid:
                    raise UserError(f"config error: {where}.{field_name}: {role!r} is not a role of this run; "
                                    f"valid: {', '.join(valid)}")

    def on_train_start(self, ctx: CallbackContext) -> None:
        """Before the resume: create state (the resume then loads saved state into it)."""

    def on_loop_start(self, ctx: CallbackContext, step: int) -> None:
        """After the resume, with ``ctx.tracker`` ready, before optimizer step ``step + 1`` (``step``
        is 0 for a fresh run, the resumed step otherwise)."""

    def on_before_optimizer_step(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        return {}

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        return {}

    def on_validation_begin(self, ctx: CallbackContext, step: int) -> None: ...

    def on_validation_end(self, ctx: CallbackContext, step: int) -> None: ...

    def on_train_end(self, ctx: CallbackContext, step: int) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class CallbackList:
    """The run's callbacks as one: each hook calls it on every callback, in order.

    Metric hooks return the callbacks' metrics merged into one dict (a key two callbacks return
    is the later one's). :meth:`stateful` names the callbacks whose tensors a checkpoint holds.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def append(self, callback: Callback) -> None:
        self.callbacks.append(callback)

    def stateful(self) -> dict[str, Callback]:
        """Checkpoint key (``callbacks.<name>``) → the callback, for those with a non-empty ``state_dict``."""
        return {f"callbacks.{cb.name}": cb for cb in self.callbacks if cb.state_dict()}

    def on_train_start(self, ctx: CallbackContext) -> None:
        for cb in self.callbacks:
            cb.on_train_start(ctx)

    def on_loop_start(self, ctx: CallbackContext, step: int) -> None:
        for cb in self.callbacks:
            cb.on_loop_start(ctx, step)

    def on_before_optimizer_step(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for cb in self.callbacks:
            merged.update(cb.on_before_optimizer_step(ctx, step))
        return merged

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for cb in self.callbacks:
            merged.update(cb.on_training_step_end(ctx, step))
        return merged

    def on_validation_begin(self, ctx: CallbackContext, step: int) -> None:
        for cb in self.callbacks:
            cb.on_validation_begin(ctx, step)

    def on_validation_end(self, ctx: CallbackContext, step: int) -> None:
        for cb in self.callbacks:
            cb.on_validation_end(ctx, step)

    def on_train_end(self, ctx: CallbackContext, step: int) -> None:
        for cb in self.callbacks:
            cb.on_train_end(ctx, step)
