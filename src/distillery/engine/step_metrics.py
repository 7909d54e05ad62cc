"""A step's metrics on their way to the host: one device→host copy per step, read one step late.

The trainer queues step N's metric tensors right after the step (:meth:`StepMetrics.stage`: stack,
average over ranks, copy without waiting) and reads them (:meth:`StepMetrics.read`, the step's one
host sync) once step N+1 is launched, so the device never idles while the host waits; a checkpoint
or the end of the run reads them at once.

Timing: ``step_time_s`` is a step's share of host wall time (from its start to the start of the
next step, or to the read when nothing follows); on CUDA ``gpu_step_time_s`` is its span on the GPU
timeline (CUDA events around its queued work), which does not shift with where the host happened
to wait, so a step's own cost reads right even on the first steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distillery.components.distributed import all_reduce_mean


@dataclass
class StepClock:
    """When a step began: ``started`` (``perf_counter()`` seconds) and, on CUDA, a timing event
    recorded in the current stream (None on CPU)."""

    started: float
    gpu_started: Any = None


@dataclass
class PendingMetrics:
    """One step's metrics queued for the host."""

    step: int
    names: list[str]  # sorted metric names
    values: torch.Tensor | None  # [len(names)] fp32 on the host once ``event`` has completed
    event: Any  # torch.cuda.Event, or None on CPU (values are ready)
    clock: StepClock
    learning_rates: dict[str, float]  # per role, after the step's schedule update


@dataclass
class StepRow:
    """A step's metrics, read: ``values`` are its own tensors (losses, grad norms; the mean over
    ranks), ``metrics`` those plus ``step_time_s``, ``samples_per_s``, ``gpu_step_time_s`` (CUDA)
    and ``lr/<role>`` — the row the logger writes."""

    step: int
    values: dict[str, float]
    metrics: dict[str, float]


class StepMetrics:
    """The one-step-late metric pipe of a run on ``device``: at most one step is pending.

    ``samples_per_step``: global samples per optimizer step (batch × accumulation × ranks), for
    ``samples_per_s``; ``learning_rates()``: the per-role learning rates after a step's update.
    """

    def __init__(self, device: torch.device, samples_per_step: int, learning_rates: Callable[[], dict[str, float]]) -> None:
        self.device = device
        self.samples_per_step = samples_per_step
        self.learning_rates = learning_rates
        self.pending: PendingMetrics | None = None

    def clock(self) -> StepClock:
        """Mark a step's start, on the host and (CUDA) on the GPU timeline."""
        started = time.perf_counter()
        gpu_started = None
        if self.device.type == "cuda":
            gpu_started = torch.cuda.Event(enable_timing=True)
            gpu_started.record()
        return StepClock(started, gpu_started)

    def stage(self, step: int, tensors: dict[str, torch.Tensor], clock: StepClock) -> None:
        """Queue step ``step``'s copy (``tensors``: 0-dim metric tensors; collective: every rank
        calls it with the same names). The step read before must have been read."""
        assert self.pending is None, "read the pending step first"
        names = sorted(tensors)
        values = None
        if names:
            stacked = torch.stack([tensors[n].to(self.device, torch.float32).reshape(()) for n in names])
            values = all_reduce_mean(stacked).to("cpu", non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=clock.gpu_started is not None)
            event.record()
        self.pending = PendingMetrics(step, names, values, event, clock, self.learning_rates())

    def read(self, finished: float | None = None) -> StepRow | None:
        """The pending step's row (None when none is pending): waits for its copy. ``finished``:
        when the next step started (default: now, before the wait, for a step nothing follows)."""
        finished = time.perf_counter() if finished is None else finished
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.event is not None:
            pending.event.synchronize()
        values = dict(zip(pending.names, pending.values.tolist())) if pending.values is not None else {}
        elapsed = max(finished - pending.clock.started, 1e-9)
        metrics = {**values, "step_time_s": elapsed, "samples_per_s": self.samples_per_step / elapsed}
        if pending.clock.gpu_started is not None:
            metrics["gpu_step_time_s"] = pending.clock.gpu_started.elapsed_time(pending.event) / 1000.0
        metrics.update({f"lr/{role}": lr for role, lr in pending.learning_rates.items()})
        return StepRow(pending.step, values, metrics)
