"""Reading a training run's public summary: ``<output_dir>/run_summary.json``.

The trainer's logger (:mod:`distillery.engine.run_log`) writes it at the end of a run; a training stage reads
it instead of the trainer's log and checkpoint internals. Format 1::

    {"format": 1, "final_step": 120, "checkpoint": "checkpoint-120" | null,
     "mlflow_run_id": "..." | null, "method": "<method _target_>", "last_metrics": {...},
     "loss": [{"step": 1, "loss": 0.41}, ...],   # total_loss per logged step, resumed parts included
     "sampling": {...}}                           # the method's sampling contract (sampling.json)

``checkpoint`` is a folder name inside ``output_dir``. Anything missing or of the wrong type is a
one-line :class:`UserError` naming the file and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError

SUMMARY_FILE = "run_summary.json"
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

    def checkpoint_dir(self, output_dir: Path) -> Path | None:
        return None if self.checkpoint is None else Path(output_dir) / self.checkpoint

    def loss_rows(self) -> list[dict[str, Any]]:
        """``[{"step": s, "loss": l}, ...]``: the bytes of the artifact's ``loss.json`` and the DVC plot."""
        return [{"step": p.step, "loss": p.loss} for p in self.loss]


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
    loss = []
    for i, row in enumerate(_need(data, "loss", (list,), str(path))):
        where = f"{path}: loss[{i}]"
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected {{\"step\": int, \"loss\": float}}")
        loss.append(LossPoint(step=_need(row, "step", (int,), where), loss=_need(row, "loss", (float, int), where)))
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
    )
