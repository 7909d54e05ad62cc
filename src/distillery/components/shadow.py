"""Shadow weights: fp32 copies of the parameters a role trains, in the role's own sharding, that follow it on request.

Two users, one component:

- an **EMA copy** (:class:`~distillery.callbacks.ema.EMACallback`): tensors only, :meth:`ShadowWeights.detached`
  clones the role's parameters (a DTensor clone keeps its placement: each rank holds the shard of its own
  parameter's rows);
- a **target network** a method reads (a consistency model's EMA target, an RL method's old or reference policy):
  the shadow's tensors are the parameters of a frozen twin of the role
  (:meth:`~distillery.models.base.ModelBase.twin`, placed like the role by the builder), so the twin's forward
  computes with them; :meth:`ShadowWeights.of_twin` pairs the two after placement.

Either way the shadow holds exactly the parameters the role trains (``trainable_modules()``, those with
``requires_grad``: a LoRA role's adapter only), keyed ``{module: {parameter: tensor}}``, fp32, with the role's
sharding (FSDP2 shards are local views of the same shape on every rank as the role's). Updates work on the local
shards, no collective: :meth:`ShadowWeights.copy_` (shadow ← weights) and :meth:`ShadowWeights.lerp_`
(shadow ← shadow + w · (weights − shadow), i.e. an EMA step of decay 1 − w). After an update a twin's
low-precision compute copy (one rank, bf16) is rewritten from its fp32 masters (``refresh``).

A shadow is a DCP ``Stateful``: its :meth:`state_dict` is the ``{module: {parameter: tensor}}`` tree of its own
tensors (DCP loads into them in place, resharded when the world size changed), so a checkpoint holds it bitwise and
a resume continues it bitwise. Who saves it names the key: an EMA callback under ``callbacks.<name>.<role>``, a
method's twin under ``shadows.<name>`` (:meth:`~distillery.methods.base.TrainingMethod.checkpoint_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from distillery.components.distributed import local_shard


def trained_parameters(modules: dict[str, torch.nn.Module]) -> dict[str, dict[str, torch.nn.Parameter]]:
    """``{module: {name: parameter}}`` of the parameters that train (``requires_grad``) in ``modules``."""
    return {name: {n: p for n, p in module.named_parameters() if p.requires_grad} for name, module in modules.items()}


class ShadowWeights(Stateful):
    """fp32 shadows of the trained parameters of one role (module doc).

    ``sources``: the role's ``{module: {name: parameter}}`` (what the shadow follows); ``tensors``: the shadow's
    own, the same keys and local shapes; ``refresh``: called after every change of the tensors (a twin's
    compute-copy refresh), or None."""

    def __init__(self, sources: dict[str, dict[str, torch.nn.Parameter]], tensors: dict[str, dict[str, torch.Tensor]],
                 refresh: Callable[[], None] | None = None) -> None:
        if {m: sorted(p) for m, p in sources.items()} != {m: sorted(t) for m, t in tensors.items()}:
            raise ValueError("a shadow needs one tensor per trained parameter of the role, by module and name")
        for module, params in sources.items():
            for name, param in params.items():
                shadow = tensors[module][name]
                if shadow.dtype != torch.float32 or local_shard(shadow).shape != local_shard(param).shape:
                    raise ValueError(f"shadow of {module}.{name}: {shadow.dtype} {tuple(local_shard(shadow).shape)}, "
                                     f"need float32 {tuple(local_shard(param).shape)} (the role's sharding)")
        self.sources = sources
        self.tensors = tensors
        self.refresh = refresh

    @classmethod
    @torch.no_grad()
    def detached(cls, modules: dict[str, torch.nn.Module]) -> "ShadowWeights":
        """A shadow of ``modules`` (a role's ``trainable_modules()``) in tensors of its own: fp32 clones of the
        trained parameters as they are now, sharded as they are."""
        sources = trained_parameters(modules)
        tensors = {m: {n: p.detach().float().clone() for n, p in params.items()} for m, params in sources.items()}
        return cls(sources, tensors)

    @classmethod
    def of_twin(cls, modules: dict[str, torch.nn.Module], twin: dict[str, torch.nn.Module],
                refresh: Callable[[], None] | None = None) -> "ShadowWeights":
        """A shadow whose tensors are the parameters of ``twin`` (the frozen twin's ``trainable_modules()``, placed
        like the role): the parameters named as the role's trained ones in ``modules``."""
        sources = trained_parameters(modules)
        tensors = {}
        for module, params in sources.items():
            own = dict(twin[module].named_parameters())
            tensors[module] = {n: own[n] for n in params}
        return cls(sources, tensors, refresh)

    # -- updates (local shards, no collective) ----------------------------------------------------
    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shadows, current = [], []
        for module, params in self.sources.items():
            for name, param in params.items():
                shadows.append(local_shard(self.tensors[module][name]))
                current.append(local_shard(param).float())
        return shadows, current

    @torch.no_grad()
    def copy_(self) -> None:
        """shadow ← the role's weights."""
        shadows, current = self._pairs()
        if shadows:
            torch._foreach_copy_(shadows, current)
        self._changed()

    @torch.no_grad()
    def lerp_(self, weight: float) -> None:
        """shadow ← shadow + ``weight`` · (weights − shadow) (``torch.lerp``; an EMA step of decay ``1 − weight``)."""
        shadows, current = self._pairs()
        if shadows:
            torch._foreach_lerp_(shadows, current, weight)
        self._changed()

    def _changed(self) -> None:
        if self.refresh is not None:
            self.refresh()

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {module: dict(tensors) for module, tensors in self.tensors.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for module, tensors in state.items():
            for name, saved in tensors.items():
                target = self.tensors[module][name]
                if saved is not target:
                    local_shard(target).copy_(local_shard(saved))
        self._changed()
