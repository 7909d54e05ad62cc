"""What a run does with a NaN or Inf loss or gradient norm.

Two checks, both on values averaged over ranks (every rank decides the same):

- before the optimizer step, with ``training.loop.skip_nonfinite_steps > 0`` (one extra host sync
  per step): a non-finite step is skipped without an update, up to that many per invocation
  (:meth:`NonFiniteGuard.skip`); one more stops the run;
- after a step's metrics reach the host (:meth:`NonFiniteGuard.check`), before any checkpoint of
  that step or a later one: a non-finite value stops the run.

Stopping is a :class:`NonFiniteError` (a one-line user error) naming the values, the last good
checkpoint and what to change; nothing after that checkpoint is saved, so a rerun resumes from it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.checkpoint.manager import list_checkpoints
from distillery.components.distributed import all_reduce_mean

log = get_logger("trainer")


class NonFiniteError(UserError):
    """A loss or gradient norm became NaN/Inf: training stops at that step, nothing after the last
    good checkpoint is saved (a rerun resumes from it)."""


class NonFiniteGuard:
    """``budget``: ``training.loop.skip_nonfinite_steps`` (0: never skip); ``output_dir``: where the
    run's checkpoints are (named in the error); ``device``: where a step's tensors are reduced."""

    def __init__(self, budget: int, output_dir: str | Path, device: torch.device) -> None:
        self.budget = budget
        self.output_dir = Path(output_dir)
        self.device = device
        self.skipped = 0  # steps skipped by this invocation

    def skip(self, step: int, tensors: dict[str, torch.Tensor]) -> bool:
        """True: step ``step``'s losses/grad norms (``tensors``, before the update) are not all
        finite on every rank and the budget allows skipping it (the caller drops its gradients).
        Raises :class:`NonFiniteError` past the budget. Without a budget: False, no host sync."""
        if not self.budget or self._all_finite(tensors):
            return False
        self.skipped += 1
        if self.skipped > self.budget:
            raise NonFiniteError(self.message(step, tensors, f"more than training.loop.skip_nonfinite_steps={self.budget} such steps"))
        log.warning("step %d: non-finite loss or gradient; skipped without an update (%d of %d allowed)", step,
                    self.skipped, self.budget)
        return True

    def check(self, step: int, values: dict[str, float]) -> None:
        """Raise :class:`NonFiniteError` when any of step ``step``'s read ``values`` is NaN/Inf."""
        if not all(math.isfinite(v) for v in values.values()):
            raise NonFiniteError(self.message(step, values))

    def _all_finite(self, tensors: dict[str, torch.Tensor]) -> bool:
        """One host sync: are these tensors finite on every rank?"""
        if not tensors:
            return True
        stacked = torch.stack([t.to(self.device, torch.float32).reshape(()) for t in tensors.values()])
        return bool(torch.isfinite(all_reduce_mean(stacked)).all().item())

    def message(self, step: int, metrics: dict[str, Any], why: str = "") -> str:
        bad = [f"{k}={float(v):g}" for k, v in sorted(metrics.items()) if not math.isfinite(float(v))]
        found = next(reversed(list_checkpoints(self.output_dir)), (None, None))[1]
        keep = f"the last good checkpoint is {found}" if found else "no checkpoint was written yet"
        return (f"training diverged at step {step}: {', '.join(bad) or 'a non-finite value'}{' (' + why + ')' if why else ''}; "
                f"stopped without saving; {keep}; lower training.optimizer.learning_rate (or allow "
                f"training.loop.skip_nonfinite_steps) and rerun")
