"""Where a run's metrics go: the JSONL log, MLflow, the progress line and ``run_summary.json``.

:class:`RunLogger` is the one object the trainer hands a read step row to. Rank 0 writes; every
rank keeps the invocation's history (what :class:`~distillery.engine.loop.TrainResult` returns).

- ``<output_dir>/train_log.jsonl``: one JSON object (``{"step", **metrics}``) per logged step
  (every ``log_every`` steps and the last), appended at once. A resume first drops the rows past
  the resumed step (left by a run killed after its last checkpoint), so each step is there once.
- MLflow (the tracker, :mod:`distillery.components.tracking`): a logged step reaches it once a
  checkpoint covers it (:meth:`RunLogger.flush`), so a killed run's history never holds steps its
  resume redoes. A resume catches MLflow up from the JSONL with checkpointed steps it lacks (a kill
  right after a checkpoint, before its rows reached MLflow); a fresh run logs its params and
  ``config.yaml``. The run ends ``FINISHED``, or ``KILLED`` on any error.
- The progress line (:class:`~distillery.common.progress.Progress`, rank 0): a bar on a terminal,
  else a log line per 10 % or minute.
- ``<output_dir>/run_summary.json`` (:meth:`RunLogger.write_summary`): what a pipeline stage reads.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distillery.common.fsutil import write_text_atomic
from distillery.common.progress import Progress
from distillery.components.timing import summarize_step_times
from distillery.components.tracking import MLflowTracker, NullTracker, build_tracker
from distillery.config.loader import dump_run_config
from distillery.config.schema import LoopConfig, RunConfig, TrackerConfig

LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "run_summary.json"


def trainer_outputs(output_dir: str | Path) -> tuple[set[str], set[str]]:
    """``(file names, folder names)`` of what runs of the trainer wrote in ``output_dir``: the log, the summary and the
    checkpoint record; the checkpoints that record names and the temporary folders of killed saves
    (:mod:`distillery.components.checkpoint`) — what may be discarded of a run folder, nothing else."""
    from distillery.components.checkpoint import record
    from distillery.components.checkpoint.trust import CHECKPOINT_RE

    temp = {c.name for c in Path(output_dir).glob(".tmp-checkpoint-*") if CHECKPOINT_RE.match(c.name[len(".tmp-"):])}
    return {LOG_FILE, SUMMARY_FILE, record.RECORD_FILE}, record.written(output_dir) | temp


def component_losses(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Each loss a method logs on its own — every ``*_loss`` key but ``total_loss``, in first-logged order
    — as ``{name: [{"step", "loss"}]}`` over the rows that have it (an alternating method logs its
    generator loss only on generator steps: a total over both would saw-tooth)."""
    out: dict[str, list[dict[str, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k.endswith("_loss") and k != "total_loss":
                out.setdefault(k, []).append({"step": r["step"], "loss": v})
    return out


class RunLogger:
    """The metrics of one invocation of a run writing to ``output_dir``.

    ``tracker``: the MLflow settings; ``loop``: ``log_every``, ``max_train_steps`` and
    ``progress_bar``; ``is_main``: rank 0 (the only rank that writes or talks to MLflow).
    """

    def __init__(self, output_dir: str | Path, tracker: TrackerConfig, loop: LoopConfig, is_main: bool) -> None:
        self.output_dir = Path(output_dir)
        self.tracker_config = tracker
        self.loop = loop
        self.is_main = is_main
        self.tracker: MLflowTracker | NullTracker | None = None  # from :meth:`session` on
        self.history: list[dict[str, float]] = []  # this invocation's logged rows: {"step", **metrics}
        self._unflushed: list[tuple[int, dict[str, float]]] = []  # logged, not yet covered by a checkpoint
        self._bar: Progress | None = None

    @property
    def log_path(self) -> Path:
        return self.output_dir / LOG_FILE

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (None before :meth:`session`, or without MLflow)."""
        return self.tracker.run_id if self.tracker is not None else None

    # -- the invocation ------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self, start_step: int, run_id: str | None, config: RunConfig) -> Iterator[MLflowTracker | NullTracker]:
        """Log an invocation that starts after ``start_step`` (0: a fresh run; else the resumed
        step, continuing MLflow run ``run_id`` when it exists). Yields the tracker; on leaving,
        closes the progress line and ends the MLflow run (``FINISHED``, or ``KILLED`` on an error)."""
        self._trim(start_step)
        self.tracker = build_tracker(self.tracker_config, self.is_main, run_id)
        if start_step == 0:
            self.tracker.log_params(config.to_plain())
            self.tracker.log_text(dump_run_config(config), "config.yaml")
        else:
            self._catch_up(start_step)
        total = self.loop.max_train_steps
        self._bar = Progress(total, "train", "step", initial=start_step,
                             enabled=self.is_main and self.loop.progress_bar and start_step < total)
        status = "KILLED"
        try:
            yield self.tracker
            status = "FINISHED"
        finally:
            self._bar.close()
            self.tracker.finish(status)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """A finished step's read metrics: advance the progress line; a logged step (every
        ``log_every``, and the last) goes to the history and the JSONL now, to MLflow at the next
        :meth:`flush`."""
        if step % self.loop.log_every == 0 or step == self.loop.max_train_steps:
            self._unflushed.append((step, metrics))
            self.history.append({"step": step, **metrics})
            self._append({"step": step, **metrics})
        self._bar.update(1, loss=metrics.get("total_loss", float("nan")))

    def flush(self) -> None:
        """Send MLflow the logged steps it lacks (call after a checkpoint covers them, and at the end)."""
        for step, metrics in self._unflushed:
            self.tracker.log_metrics(metrics, step)
        self._unflushed.clear()

    # -- train_log.jsonl ---------------------------------------------------------------------------
    def _rows(self) -> list[dict[str, Any]]:
        if not self.log_path.is_file():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def _append(self, row: dict[str, float]) -> None:
        if self.is_main:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")

    def _trim(self, start_step: int) -> None:
        """Drop the rows past the resumed step, keeping the others byte for byte."""
        if self.is_main and self.log_path.is_file():
            rows = [line for line in self.log_path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line)["step"] <= start_step]
            self.log_path.write_text("".join(line + "\n" for line in kept))

    def _catch_up(self, start_step: int) -> None:
        """Log to MLflow the checkpointed steps (``<= start_step``) it has not got, from the JSONL."""
        rows = [r for r in self._rows() if r["step"] <= start_step]
        if not rows:
            return
        key = next((k for k in rows[-1] if k != "step"), None)
        last = self.tracker.last_logged_step(key) if key else None
        for r in rows:
            if last is None or r["step"] > last:
                self.tracker.log_metrics({k: v for k, v in r.items() if k != "step"}, int(r["step"]))

    # -- run_summary.json ----------------------------------------------------------------------------
    def write_summary(self, final_step: int, checkpoint: Path | None, method: str, sampling: dict[str, Any] | None,
                      selection: dict[str, Any] | None = None) -> None:
        """Rank 0: what a pipeline stage needs from a finished invocation, so it never parses logs or
        checkpoint internals: ``format``, ``final_step``, ``checkpoint`` (folder name in the output
        dir, or null), ``mlflow_run_id``, ``method`` (its ``_target_``), ``last_metrics`` (the last
        logged row), ``loss`` (``[{"step", "loss"}]``: total_loss of every logged step of the run,
        resumed parts included), ``losses`` (:func:`component_losses`: each loss on its own), ``sampling`` (the method's
        sampling contract), ``timing`` (this invocation's step times without its warm-up steps:
        :func:`summarize_step_times`, or null) and, when a callback selected the run's checkpoint (the collapse
        watch), ``selection``: which and why (``checkpoint`` is then that one)."""
        if not self.is_main:
            return
        rows = self._rows()
        summary = {
            "format": 1,
            "final_step": final_step,
            "checkpoint": checkpoint.name if checkpoint is not None else None,
            "mlflow_run_id": self.run_id,
            "method": method,
            "last_metrics": {k: v for k, v in rows[-1].items() if k != "step"} if rows else {},
            "loss": [{"step": r["step"], "loss": r["total_loss"]} for r in rows if "total_loss" in r],
            "losses": component_losses(rows),
            "sampling": sampling,
            "timing": summarize_step_times(self.history),  # this invocation's steady steps, warm-up dropped
        }
        if selection is not None:
            summary["selection"] = selection
        write_text_atomic(self.output_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
