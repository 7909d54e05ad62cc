"""Case 11.7: MLflow says what happened, in one place, in few words (issue 58, item 7).

- A store that cannot be written (its disk full) costs one warning line of MLflow's, not SQLAlchemy's traceback per
  call; the caller's own line says the rest.
- ``dvc exp run --queue`` experiments log into the workspace's ``mlflow.db`` (DVC's ``DVC_ROOT``), not into the
  temporary copy the queue runs them in (deleted afterwards).
- A training stage stopped by SIGTERM ends its trainer's MLflow run ``KILLED``, never leaves it ``RUNNING`` under a
  parent marked ``FINISHED``; its rerun resumes and finishes the same run.
- A fresh store is made without a word: MLflow's table creation and migration (``Creating initial MLflow database
  tables...``, ``Updating database tables``) are not the user's business.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workspace import copy_workspace, env, set_params, sh, stage, wait_no_processes


def _runs(repo: Path, **tags: str) -> list:
    """The runs of the workspace's store with ``tags`` (keys with dots written with ``__``)."""
    from distillery.components.tracking import mlflow_client
    from distillery.pipeline.publish.mlflow_runs import EXPERIMENT

    client = mlflow_client(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    where = " and ".join(f"tags.`{k.replace('__', '.')}` = '{v}'" for k, v in tags.items())
    return client.search_runs([exp.experiment_id], where)


@pytest.mark.reliability(case="11.7", title="an MLflow store on a full disk: one warning, not a traceback a call",
                         injected="the store (sqlite) on a 4 MiB tmpfs; after a run is made the file system is filled; "
                                  "metrics logged, then the run ended KILLED (what a trainer does after its own error)",
                         expect="the logging call raises (its caller's one line); MLflow's own log says one warning line, "
                                "no SQLAlchemy traceback; the end of the run is one warning of ours")
def test_a_full_store_costs_one_warning_line(tmp_path, capfd, data_lost):
    from distillery.components.tracking import MLflowTracker
    from distillery.config.schema import TrackerConfig

    store = tmp_path / "store"
    store.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(store)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        tracker = MLflowTracker(TrackerConfig(tracking_uri=f"sqlite:///{store / 'mlflow.db'}", experiment="full",
                                              run_name="run"))
        tracker.log_metrics({"loss": 1.0}, step=1)
        stats = os.statvfs(store)
        with open(store / "another-job.bin", "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, max(stats.f_bavail * stats.f_frsize - 4096, 1))
        capfd.readouterr()
        with pytest.raises(Exception):  # noqa: B017 - MLflow's own exception class: what the caller reports in its line
            for step in range(2, 200):  # rows until a page of the database must grow
                tracker.log_metrics({f"metric_{i}": float(i) for i in range(50)}, step=step)
        tracker.finish("KILLED")
        err = capfd.readouterr().err
        mlflow_lines = [ln for ln in err.splitlines() if "mlflow" in ln.lower() or "sqlalchemy" in ln.lower()]
        assert "Traceback" not in err and "SQLAlchemy database error" not in err, err[-3000:]
        assert len(mlflow_lines) <= 2, mlflow_lines  # MLflow's one warning, our one warning
        assert any("database or disk is full" in ln for ln in mlflow_lines), mlflow_lines
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
    data_lost.record(0, "files lost (the store only)")


@pytest.mark.reliability(case="11.7", title="a fresh MLflow store is made without a word",
                         injected="no mlflow.db yet: a client opened on it and an experiment found or made (what every "
                                  "stage's tracker does first), MLFLOW_LOGGING_LEVEL unset",
                         expect="nothing on stdout or stderr: no INFO line of MLflow's or alembic's store creation")
def test_a_fresh_store_is_made_without_a_word(tmp_path, capfd, monkeypatch, data_lost):
    from distillery.components.tracking import ensure_experiment, mlflow_client, store_lock

    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    capfd.readouterr()
    with store_lock(uri):
        ensure_experiment(mlflow_client(uri), "fresh", uri)
    out, err = capfd.readouterr()
    assert (tmp_path / "mlflow.db").is_file()
    assert out + err == "", out + err
    data_lost.record(0, "files lost (none written but the store)")


@pytest.mark.slow
@pytest.mark.reliability(case="11.7", title="queued experiments log into the workspace's MLflow store",
                         injected="`dvc exp run --queue -S clips.num_train=12 clips`, then `dvc queue start` (DVC runs it "
                                  "in a temporary copy under .dvc/tmp/exps, deleted afterwards)",
                         expect="the workspace's mlflow.db holds the experiment's clips run, tagged with its name")
def test_queued_experiments_log_into_the_workspace_store(prepared, tmp_path, data_lost):
    repo = copy_workspace(prepared, tmp_path / "ws")
    sh(["dvc", "exp", "run", "--queue", "-n", "queued-one", "-S", "clips.num_train=12", "clips"], repo)
    try:
        sh(["dvc", "queue", "start"], repo)
        deadline = time.time() + 600
        while time.time() < deadline:
            status = sh(["dvc", "queue", "status"], repo).stdout
            if "queued-one" in status and any(w in status for w in ("Success", "Failed")):
                break
            time.sleep(2)
        assert "Success" in status, status + sh(["dvc", "queue", "logs", "queued-one"], repo, check=False).stdout[-3000:]
    finally:
        sh(["dvc", "queue", "stop", "--kill"], repo, check=False)
    parents = _runs(repo, distillery__experiment="queued-one")
    assert parents, "the queued experiment's pipeline run is not in the workspace's store"
    children = _runs(repo, mlflow__parentRunId=parents[0].info.run_id, distillery__stage="clips")
    assert children and children[0].info.status == "FINISHED", children
    data_lost.record(0 if children else 1, "queued experiments missing from the workspace's store")
    assert data_lost.total == 0


@pytest.mark.slow
@pytest.mark.reliability(case="11.7", title="a stage stopped by SIGTERM ends its MLflow run KILLED",
                         injected="SIGTERM to `distillery stage teacher` once its trainer has saved checkpoint-10; "
                                  "then the stage run again",
                         expect="exit 143, no process left; the trainer's MLflow run KILLED (never RUNNING under a "
                                "FINISHED parent); the rerun resumes and ends the same run FINISHED")
def test_a_stage_stopped_by_sigterm_ends_its_mlflow_run_killed(prepared, tmp_path, data_lost):
    repo = copy_workspace(prepared, tmp_path / "ws")
    set_params(repo, {"teacher.steps": 60, "teacher.save_every": 10})
    proc = subprocess.Popen(["distillery", "stage", "teacher"], cwd=repo, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    saved = repo / "runs" / "teacher" / "checkpoint-10" / "metadata.json"  # a checkpoint: the rerun resumes from it
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not saved.is_file():
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert not wait_no_processes(repo)
    runs = _runs(repo, distillery__stage="teacher")
    assert runs and all(r.info.status == "KILLED" for r in runs), [(r.info.run_id, r.info.status) for r in runs]
    parent = _runs(repo, distillery__kind="pipeline")[0]
    assert runs[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
    again = stage(repo, "teacher", check=True)
    assert "resumed from runs/teacher/checkpoint-" in again.stderr, again.stderr[-3000:]
    after = _runs(repo, distillery__stage="teacher")
    assert [(r.info.run_id, r.info.status) for r in after] == [(runs[0].info.run_id, "FINISHED")]
    lineage = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())
    assert lineage["mlflow"]["run_id"] == runs[0].info.run_id
    data_lost.record(sum(r.info.status == "RUNNING" for r in after), "MLflow runs left RUNNING")
    assert data_lost.total == 0
