"""A copy of a role's trainable weights that a method runs forwards with: DiffusionNFT's old policy and reference.

:class:`WeightCopy` holds fp32 copies of the trainable parameters of a role's ``trainable_modules()`` (the
transformer, a PDD head bank), each shaped and sharded as its parameter (under FSDP2 a DTensor whose local shard
is this rank's: the copy costs one fp32 shard of the role per rank, never a gathered model). It can be

- refreshed from the role (:meth:`WeightCopy.copy_from_role`), or moved toward it (:meth:`WeightCopy.lerp_toward`:
  ``copy ← decay · copy + (1 − decay) · weights``, one fused kernel per module);
- run: :meth:`WeightCopy.swapped_in` puts the copy into the role for the forwards inside it and gives the role its
  own weights back, bit for bit, on leaving. With a bf16 compute copy (one rank without FSDP) the copy is cast into
  the compute parameters and the masters are never touched (the compute copy is refreshed from them after); else
  the role's own (local) parameters are saved, overwritten and restored. Never while a graph through the role's
  weights is alive (its saved tensors would change under it): forwards inside are ``no_grad``;
- checkpointed: :meth:`WeightCopy.state_dict` is its tensors by module and parameter name (DCP, resharded on load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from distillery.components.distributed import local_shard
from distillery.models.base import ModelBase


class WeightCopy:
    """fp32 copies of ``model``'s trainable parameters (module doc), made from its current weights."""

    def __init__(self, model: ModelBase) -> None:
        self.model = model
        self.params: dict[str, dict[str, torch.nn.Parameter]] = {
            name: {n: p for n, p in module.named_parameters() if p.requires_grad}
            for name, module in model.trainable_modules().items()}
        with torch.no_grad():
            self.tensors = {name: {n: p.detach().float().clone() for n, p in params.items()}
                            for name, params in self.params.items()}

    def _pairs(self, module: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(copy's local shards, the role's local shards) of one trainable module, in parameter order."""
        names = list(self.params[module])
        return ([local_shard(self.tensors[module][n]) for n in names],
                [local_shard(self.params[module][n]) for n in names])

    @torch.no_grad()
    def copy_from_role(self) -> None:
        """The copy ← the role's current weights."""
        for module in self.params:
            mine, live = self._pairs(module)
            torch._foreach_copy_(mine, [t.float() for t in live])

    @torch.no_grad()
    def lerp_toward(self, decay: float) -> None:
        """``copy ← decay · copy + (1 − decay) · weights`` (decay 0: a plain copy)."""
        for module in self.params:
            mine, live = self._pairs(module)
            torch._foreach_lerp_(mine, [t.float() for t in live], 1.0 - float(decay))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The role computes with the copy inside the block (no gradients); its own weights return on leaving."""
        model = self.model
        compute = model.compute_copy
        saved: dict[str, list[torch.Tensor]] = {}
        _reshard(model)  # FSDP2 gathers the (swapped) shards again at the next forward
        with torch.no_grad():
            for module_name, module in model.trainable_modules().items():
                mine, live = self._pairs(module_name)
                if compute is not None and module is model.transformer:  # cast into the compute copy, masters untouched
                    torch._foreach_copy_(compute._compute_params, mine)
                    continue
                saved[module_name] = [t.clone() for t in live]
                torch._foreach_copy_(live, mine)
        try:
            with torch.no_grad():
                yield
        finally:
            _reshard(model)
            with torch.no_grad():
                for module_name, tensors in saved.items():
                    torch._foreach_copy_(self._pairs(module_name)[1], tensors)
                if compute is not None:
                    compute.refresh()

    def state_dict(self) -> dict[str, Any]:
        return {module: dict(tensors) for module, tensors in self.tensors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for module, tensors in state.items():
                for n, t in tensors.items():
                    target = self.tensors[module][n]
                    if t is not target:
                        local_shard(target).copy_(local_shard(t))


def _reshard(model: ModelBase) -> None:
    """Free every FSDP2 unit's gathered weights of ``model``'s trainable modules, so the next forward gathers the
    shards as they are now (a unit that keeps its weights after a forward, ``reshard_after_forward`` off on a shard
    group of one rank, would otherwise compute with the weights it gathered before the swap)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.trainable_modules().values():
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
