"""DCP views (``Stateful``) of everything a checkpoint holds, as tensors only.

Each class turns one piece of training state into a dict of tensors for
``torch.distributed.checkpoint`` and back. No Python object is stored for pickling: scalars
(steps, learning rates, positions) become 0-d / 1-d tensors (float64 for floats, so a resumed run
continues bit for bit), and sharded parameters and optimizer moments stay DTensors (DCP reshards
them when the world size changes).

- :class:`ModuleState` — one module's parameters and persistent buffers (or its LoRA adapter's only).
- :class:`OptimizerState` — AdamW moments and step per parameter (by FQN within the role's modules);
  hyper-parameters are not stored: they come from the run config and the LR schedule. A parameter
  that never received a gradient has no state and gets none back (:meth:`OptimizerState.expect`).
- :class:`SchedulerState` — an LR schedule's position (and the learning rates it set).
- :class:`RNGState` — a :class:`~distillery.components.rng.BatchRNG`'s generator.
- :class:`CallbackState` — a callback's tensors (e.g. EMA shadow weights).
- :class:`ScalarState` — named integers (the trainer's step and data position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


def is_adapter_key(fqn: str) -> bool:
    """A LoRA adapter parameter's FQN (``...lora_A.<adapter>.weight`` / ``...lora_B.<adapter>.weight``, PEFT's names)."""
    return ".lora_A." in fqn or ".lora_B." in fqn


class ModuleState(Stateful):
    """A module's (possibly FSDP2-sharded) parameters and persistent buffers, by FQN.

    ``adapters_only``: only its LoRA adapter parameters (:func:`is_adapter_key`; a role with ``models.<role>.lora``,
    whose base weights are frozen and come from its ``init_from``): saved alone, and loaded strictly as that set."""

    def __init__(self, module: torch.nn.Module, adapters_only: bool = False) -> None:
        self.module = module
        self.adapters_only = adapters_only

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.module)
        if self.adapters_only:
            state = {k: v for k, v in state.items() if is_adapter_key(k)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.adapters_only:
            set_model_state_dict(self.module, state, options=StateDictOptions(strict=True))
            return
        wanted = {k for k in get_model_state_dict(self.module) if is_adapter_key(k)}
        if set(state) != wanted:
            odd = sorted(set(state) ^ wanted)
            raise ValueError(f"the saved adapter does not fit this one ({len(odd)} parameters differ, e.g. {odd[0]})")
        set_model_state_dict(self.module, state, options=StateDictOptions(strict=False))


def _container(modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """One module over a role's trainable modules, so parameter FQNs are ``<module>.<param>``."""
    return torch.nn.ModuleDict(dict(sorted(modules.items())))


class OptimizerState(Stateful):
    """A role's optimizer state: ``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}}``.

    Saved: the per-parameter tensors only. Loaded: the entries the checkpoint has (the checkpoint
    manager calls :meth:`expect` with them first); a parameter without saved state (it had not
    received a gradient yet) is left without state, exactly as in the run that saved it. The
    hyper-parameters (betas, eps, weight decay, the current lr) are this run's; the LR schedule
    (:class:`SchedulerState`) sets the lr it had reached.
    """

    def __init__(self, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self.container = _container(modules)
        self.optimizer = optimizer
        self._expected: dict[str, set[str]] | None = None  # fqn → saved state names, when loading

    def _full(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.container, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        if self._expected is None:  # a save
            # no state yet (the role has not stepped): nothing to save, and asking torch for the
            # state dict would create placeholder state (a zero-lr step) that changes the run
            return {"state": self._full()["state"] if self.optimizer.state else {}}
        if not self._expected:
            return {"state": {}}
        # a load target: exactly the saved entries (a fresh optimizer's placeholder state for the
        # others is dropped in load_state_dict)
        full = self._full()
        return {"state": {fqn: {k: full["state"][fqn][k] for k in names}
                          for fqn, names in self._expected.items() if fqn in full["state"]}}

    def expect(self, keys: Iterable[str], prefix: str) -> None:
        """Before a load: the flattened DCP keys of the checkpoint (``<prefix>.state.<fqn>.<name>``)."""
        expected: dict[str, set[str]] = {}
        head = f"{prefix}.state."
        for key in keys:
            if key.startswith(head):
                fqn, _, name = key[len(head):].rpartition(".")
                expected.setdefault(fqn, set()).add(name)
        self._expected = expected

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._expected = None
        saved = {fqn: dict(values) for fqn, values in state.get("state", {}).items()}
        if not saved:
            self.optimizer.state.clear()  # the saving run had not stepped this role yet
            return
        full = self._full()  # (creates placeholder state for every parameter)
        full["state"] = saved
        # not strict: a parameter without saved state never had a gradient in the saving run (e.g. a
        # PDD head not supervised yet); it must end up without state, as it was there
        set_optimizer_state_dict(self.container, self.optimizer, full, options=StateDictOptions(strict=False))
        for fqn, param in self.container.named_parameters():
            if fqn not in saved:
                self.optimizer.state.pop(param, None)


class SchedulerState(Stateful):
    """An LR schedule's position: ``last_epoch``, ``step_count``, ``base_lrs``, ``last_lr``.

    Loading also writes ``last_lr`` into the optimizer's parameter groups (what the schedule set
    before the save), since the optimizer's hyper-parameters are not stored.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = self.scheduler.state_dict()
        return {
            "last_epoch": torch.tensor(int(sd["last_epoch"]), dtype=torch.int64),
            "step_count": torch.tensor(int(sd.get("_step_count", 0)), dtype=torch.int64),
            "base_lrs": torch.tensor([float(v) for v in sd["base_lrs"]], dtype=torch.float64),
            "last_lr": torch.tensor([float(v) for v in sd["_last_lr"]], dtype=torch.float64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sd = self.scheduler.state_dict()
        last_lr = [float(v) for v in state["last_lr"].tolist()]
        sd.update(last_epoch=int(state["last_epoch"]), _step_count=int(state["step_count"]),
                  base_lrs=[float(v) for v in state["base_lrs"].tolist()], _last_lr=last_lr)
        self.scheduler.load_state_dict(sd)
        for group, lr in zip(self.optimizer.param_groups, last_lr):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


class RNGState(Stateful):
    """The generator of a BatchRNG (the same on every rank): its state bytes as a uint8 tensor."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.rng.generator.get_state().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.generator.set_state(state["generator"].to(torch.uint8).cpu())


class CallbackState(Stateful):
    """A callback's tensor state (e.g. EMA shadow weights); DTensors are resharded on load."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def state_dict(self) -> dict[str, Any]:
        return self.callback.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.callback.load_state_dict(state)


class ScalarState(Stateful):
    """Named integers read from ``get()`` at save and handed to ``put()`` at load (int64 tensors)."""

    def __init__(self, get: Callable[[], dict[str, int]], put: Callable[[dict[str, int]], None]) -> None:
        self.get = get
        self.put = put

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.tensor(int(v), dtype=torch.int64) for k, v in self.get().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.put({k: int(v) for k, v in state.items()})
