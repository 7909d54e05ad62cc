"""Reading a training run's public summary: ``<output_dir>/run_summary.json``.

The trainer's logger (:mod:`distillery.engine.run_log`) writes it at the end of a run; a training stage reads
it instead of the trainer's log and checkpoint internals. Format 1::

    {"format": 1, "final_step": 120, "checkpoint": "checkpoint-120" | null,
     "mlflow_run_id": "..." | null, "method": "<method _target_>", "last_metrics": {...},
     "loss": [{"step": 1, "loss": 0.41}, ...],   # total_loss per logged step, resumed parts included
     "losses": {"critic_loss": [{"step": 1, "loss": 0.47}, ...], ...},  # each loss on its own (optional)
     "sampling": {...},                           # the method's sampling contract (sampling.json)
     "selection": {"step": 40 | null, "checkpoint": "checkpoint-40" | null, "reason": "...", "by": "collapse",
                   "collapse_step": 60 | null, "metrics": {...}}}  # optional: a callback chose the run's checkpoint

``checkpoint`` is a folder name inside ``output_dir`` (with a ``selection``: the selected one, or null when the run
collapsed before any healthy check). Anything missing or of the wrong type is a
one-line :class:`UserError` naming the file and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.engine.run_log import SUMMARY_FILE

FORMAT = 1


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float


@dataclass(frozen=True)
class RunSummary:
    """What a finished run says about itself (the module doc's format, typed)."""

    final_step: int
    checkpoint: str | None
    mlflow_run_id: str | None
    method: str
    last_metrics: dict[str, Any]
    loss: list[LossPoint]
    sampling: dict[str, Any]
    losses: dict[str, list[LossPoint]] = field(default_factory=dict)  # each *_loss on its own; {} in older summaries
    selection: dict[str, Any] | None = None  # a callback's choice of the run's checkpoint and why (the collapse watch)

    @property
    def stopped_early(self) -> str | None:
        """Why a callback ended the run before its last step (its collapse, one line), or None."""
        if self.selection is None or self.selection.get("collapse_step") is None:
            return None
        return str(self.selection.get("reason", "a collapse"))

    def checkpoint_dir(self, output_dir: Path) -> Path | None:
        return None if self.checkpoint is None else Path(output_dir) / self.checkpoint

    def loss_rows(self) -> list[dict[str, Any]]:
        """``[{"step": s, "loss": l}, ...]``: the bytes of the artifact's ``loss.json`` and the DVC plot."""
        return [{"step": p.step, "loss": p.loss} for p in self.loss]

    def component_rows(self) -> dict[str, list[dict[str, Any]]]:
        """``{name: [{"step": s, "loss": l}, ...]}``: each loss on its own (the loss plot's lines)."""
        return {name: [{"step": p.step, "loss": p.loss} for p in points] for name, points in self.losses.items()}


def _need(data: dict[str, Any], key: str, types: tuple[type, ...], where: str) -> Any:
    value = data.get(key)
    if key not in data or not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise UserError(f"{where}: {key}: expected {names}, got {json.dumps(value)[:80] if key in data else 'nothing'}; "
                        "rerun the stage (the trainer writes this file at the end of a run)")
    return value


def read_run_summary(output_dir: Path) -> RunSummary:
    """Read and check ``<output_dir>/run_summary.json``."""
    path = Path(output_dir) / SUMMARY_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found: the training run ended without its summary; rerun the stage") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); rerun the stage") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object; rerun the stage")
    if data.get("format") != FORMAT:
        raise UserError(f"{path}: format {data.get('format')!r}; this distillery reads format {FORMAT}")
    loss = _points(_need(data, "loss", (list,), str(path)), f"{path}: loss")
    losses = data.get("losses", {})
    if not isinstance(losses, dict):
        raise UserError(f"{path}: losses: expected dict, got {json.dumps(losses)[:80]}; rerun the stage")
    losses = {str(name): _points(rows if isinstance(rows, list) else [rows], f"{path}: losses.{name}")
              for name, rows in losses.items()}
    selection = data.get("selection")
    if selection is not None and not isinstance(selection, dict):
        raise UserError(f"{path}: selection: expected dict, got {json.dumps(selection)[:80]}; rerun the stage")
    checkpoint = _need(data, "checkpoint", (str, type(None)), str(path))
    if checkpoint is not None and (Path(checkpoint).name != checkpoint or checkpoint in (".", "..")):
        raise UserError(f"{path}: checkpoint: {checkpoint!r} is not a folder name inside {output_dir}")
    return RunSummary(
        final_step=_need(data, "final_step", (int,), str(path)),
        checkpoint=checkpoint,
        mlflow_run_id=_need(data, "mlflow_run_id", (str, type(None)), str(path)),
        method=_need(data, "method", (str,), str(path)),
        last_metrics=_need(data, "last_metrics", (dict,), str(path)),
        loss=loss,
        sampling=_need(data, "sampling", (dict,), str(path)),
        losses=losses,
        selection=selection,
    )


def _points(rows: list[Any], where: str) -> list[LossPoint]:
    points = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{where}[{i}]: expected {{\"step\": int, \"loss\": float}}")
        points.append(LossPoint(step=_need(row, "step", (int,), f"{where}[{i}]"),
                                loss=_need(row, "loss", (float, int), f"{where}[{i}]")))
    return points
