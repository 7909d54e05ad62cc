"""Experiment tracking: MLflow on a local store by default, nothing sent to the network.

The tracking URI is ``training.tracker.tracking_uri`` if set, else ``$MLFLOW_TRACKING_URI``,
else ``sqlite:///<workspace>/mlflow.db`` (artifacts in ``<workspace>/mlruns``; the workspace: :func:`workspace_root`,
the current folder unless DVC runs the stage). Only rank 0 talks to MLflow;
other ranks get a :class:`NullTracker`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind
from distillery.common.log import get_logger
from distillery.common.treeutil import flatten
from distillery.config.schema import TrackerConfig

log = get_logger("tracking")

MLFLOW_PARAM_MAX = 6000


class NullTracker:
    run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None: ...

    def last_logged_step(self, key: str) -> int | None:
        return None

    def finish(self, status: str = "FINISHED") -> None: ...


def log_param_texts(client: Any, run_id: str, texts: dict[str, str]) -> None:
    """Log ``{key: text}`` as MLflow params of run ``run_id`` in batches of 100 (keys cut to 250
    characters, values to ``MLFLOW_PARAM_MAX``)."""
    from mlflow.entities import Param

    batch = [Param(k[:250], v[:MLFLOW_PARAM_MAX]) for k, v in texts.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])


def workspace_root() -> Path:
    """The folder whose ``mlflow.db`` a run logs into: the workspace DVC names in ``DVC_ROOT`` when it runs the stage —
    under ``dvc exp run --queue`` (or ``--temp``) the user's workspace, not the temporary copy under ``.dvc/tmp/exps``
    the experiment runs in, so queued experiments reach the store ``mlflow ui`` shows — else the current folder."""
    root = os.environ.get("DVC_ROOT")
    return Path(root) if root and Path(root).is_dir() else Path.cwd()


def default_tracking_uri(cfg: TrackerConfig) -> str:
    if cfg.tracking_uri:
        return cfg.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{workspace_root() / 'mlflow.db'}"


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Exclusive inter-process lock on a local ``sqlite:///`` store (``<db>.lock`` beside it).

    Independent pipeline stages run concurrently (Prefect submits them together); the first use of
    a fresh MLflow database creates its tables by migration, and two processes doing that at once,
    or creating the same experiment, fail. Hold this lock around store creation and find-or-create
    steps. Other URIs: no lock.
    """
    if not tracking_uri.startswith("sqlite:///"):
        with store_errors(tracking_uri):
            yield
        return
    db = Path(tracking_uri[len("sqlite:///"):])
    try:
        mode = os.stat(db).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):  # SQLite would block on a FIFO, fail on a folder
        raise UserError(f"MLflow store {db} is {file_kind(mode)}, not a database file: move it away (or set "
                        "MLFLOW_TRACKING_URI to another store) and rerun")
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            with store_errors(tracking_uri):
                yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def store_errors(tracking_uri: str) -> Iterator[None]:
    """Opening the MLflow store, finding or making an experiment or a run: a store that cannot be used — a
    file that is not an SQLite database, a truncated one, one locked by another writer past SQLite's wait, a
    server that does not answer — is one :class:`UserError` line naming the store, not MLflow's traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - MLflow, SQLAlchemy, sqlite3 and requests all raise their own
        why = " ".join(str(exc).split())
        why = why if len(why) <= 160 else why[:159] + "…"
        raise UserError(f"MLflow store {tracking_uri} cannot be used ({type(exc).__name__}: {why}); fix or move it "
                        "away (a new one is made), or set MLFLOW_TRACKING_URI to another store, and rerun") from None


def ensure_experiment(client: Any, name: str, tracking_uri: str) -> str:
    """Id of experiment ``name``, created if missing (artifacts in ``mlruns/`` beside a sqlite store).
    Call under :func:`store_lock`."""
    exp = client.get_experiment_by_name(name)
    artifact_location = None
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        artifact_location = (db.parent / "mlruns").resolve().as_uri()
        if exp is not None and exp.artifact_location != artifact_location and exp.artifact_location.endswith("/mlruns"):
            relocate_artifacts(db, exp.artifact_location, artifact_location)
    if exp is not None:
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location)


def relocate_artifacts(db: Path, old: str, new: str) -> None:
    """A workspace copied or moved with its ``mlflow.db`` and ``mlruns/``: the store still names the old
    ``mlruns/`` (absolute), so new runs would write their artifacts into the old workspace. Point every
    experiment and run of the store that names ``old`` at ``new`` instead (MLflow's own tables, one
    transaction), said in one warning line. Call under :func:`store_lock`."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as con, con:
        experiments = con.execute("UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?",
                                  (new, old)).rowcount
        runs = con.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE artifact_uri LIKE ? ESCAPE '\\'",
                           (new, len(old) + 1, old.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "/%")).rowcount
    log.warning("MLflow store %s named artifacts in %s (a copied or moved workspace): %d experiment(s) and %d run(s) "
                "now keep them in %s", db, old, experiments, runs, new)


def store_error_words(error: object) -> str:
    """An MLflow/SQLAlchemy error's own words, on one line: the driver's error (``(sqlite3.OperationalError) database or
    disk is full``) without SQLAlchemy's preamble and the SQL it ran."""
    flat = " ".join(str(error).split())
    flat = flat.split(" [SQL:")[0]
    driver = flat.rfind("(sqlite3.")
    flat = flat[driver:] if driver >= 0 else flat
    return flat if len(flat) <= 200 else flat[:199] + "…"


class _OneWarning(logging.Filter):
    """On MLflow's log handler: its own error records — SQLAlchemy's traceback, logged by every call into a store that
    cannot be written (a full disk) — become one warning line, the first one only: the caller's error, or its own
    one-line warning, says the rest (the stage's outcome is not MLflow's to tell)."""

    def __init__(self) -> None:
        super().__init__("distillery-one-warning")
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if self.said:
            return False
        self.said = True
        cause = record.args[0] if isinstance(record.args, tuple) and record.args else None
        words = store_error_words(cause if isinstance(cause, BaseException) else record.getMessage())
        record.msg, record.args = "MLflow: %s (further MLflow errors of this process not shown)", (words or "error",)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def mlflow_client(tracking_uri: str) -> Any:
    """An ``MlflowClient`` of ``tracking_uri`` (telemetry off; MLflow's and alembic's INFO lines — a fresh store's
    ``Creating initial MLflow database tables...`` — not shown unless ``MLFLOW_LOGGING_LEVEL`` asks for them; MLflow's
    error logs quieted to one warning line, :class:`_OneWarning`): the one way distillery opens an MLflow store."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    if not os.environ.get("MLFLOW_LOGGING_LEVEL"):  # a user who sets it sees what they asked for
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger("mlflow").handlers:  # MLflow's own, set up when it is imported
        if not any(isinstance(f, _OneWarning) for f in handler.filters):
            handler.addFilter(_OneWarning())
    return MlflowClient(tracking_uri=tracking_uri)


class MLflowTracker:
    """One MLflow run; resumes ``run_id`` when given (a resumed training continues its run)."""

    def __init__(self, cfg: TrackerConfig, run_id: str | None = None) -> None:
        self.tracking_uri = default_tracking_uri(cfg)
        self.experiment = cfg.experiment
        with store_lock(self.tracking_uri):
            self.client = mlflow_client(self.tracking_uri)
            exp_id = ensure_experiment(self.client, cfg.experiment, self.tracking_uri)
        import mlflow

        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            except mlflow.exceptions.MlflowException:
                log.warning("MLflow run %s not found in %s; starting a new run", run_id, self.tracking_uri)
                run_id = None
        if run_id is None:
            tags = dict(cfg.tags)
            if cfg.parent_run_id:
                tags["mlflow.parentRunId"] = cfg.parent_run_id
            run = self.client.create_run(exp_id, run_name=cfg.run_name, tags=tags)
            self.run_id = run.info.run_id
        log.info("MLflow run %s at %s", self.run_id, self.tracking_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        existing = self.client.get_run(self.run_id).data.params
        # an empty section (e.g. no tracker tags) is not a parameter; params are immutable: a resumed run keeps the first values
        log_param_texts(self.client, self.run_id, {k: str(v) for k, v in flatten(params).items() if v != {} and k not in existing})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Copy the file ``local_path`` into the run's artifacts (under the folder ``artifact_path``)."""
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def last_logged_step(self, key: str) -> int | None:
        """The largest step at which metric ``key`` was logged in this run (None: never)."""
        history = self.client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=None)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status``. When the store cannot record it (its disk is full, its database
        locked or broken: the error that ended the run may be that very disk), one warning line says so
        and the original outcome stands — the trainer's own error, not the store's, is what the user sees."""
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:  # noqa: BLE001 - MLflow raises MlflowException, sqlite3 and SQLAlchemy errors
            if status == "FINISHED":
                raise
            log.warning("MLflow run %s could not be marked %s (%s); the run's outcome is the error above",
                        self.run_id, status, store_error_words(exc))


def build_tracker(cfg: TrackerConfig, is_main: bool, run_id: str | None = None) -> MLflowTracker | NullTracker:
    if not is_main or cfg.backend == "none":
        return NullTracker()
    return MLflowTracker(cfg, run_id=run_id)
