"""Step-time summaries that do not mislead: warm-up steps dropped, GPU time beside host time.

The first steps of every trainer invocation (a fresh run or a resume) pay for compilation,
allocator growth and cuDNN plan building, and their host intervals are skewed by the one-step-late
metric read; a mean over them says little about the steady step. :func:`summarize_step_times`
drops them and reports the median and spread of what remains.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

WARMUP_STEPS = 2  # the first steps of an invocation: compile + the skewed first host intervals


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 6), "min": round(ordered[0], 6), "max": round(ordered[-1], 6)}


def summarize_step_times(rows: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any] | None:
    """``rows``: one invocation's logged metric rows in step order (``step_time_s`` seconds of host
    wall time per step; ``gpu_step_time_s`` the step's GPU span on CUDA). Returns
    ``{"steps_timed", "warmup_steps_dropped", "step_time_s": {median, min, max}[, "gpu_step_time_s": {...}]}``
    over the rows after the first ``warmup``, or None when no row is left."""
    steady = list(rows)[warmup:]
    host = [float(r["step_time_s"]) for r in steady if "step_time_s" in r]
    if not host:
        return None
    summary: dict[str, Any] = {"steps_timed": len(host), "warmup_steps_dropped": min(warmup, len(rows)),
                               "step_time_s": _spread(host)}
    gpu = [float(r["gpu_step_time_s"]) for r in steady if "gpu_step_time_s" in r]
    if gpu:
        summary["gpu_step_time_s"] = _spread(gpu)
    return summary
