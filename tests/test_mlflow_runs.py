"""The pipeline's MLflow parent run says which DVC experiment and which commit made it, and lasts as long as
its stages: named after ``$DVC_EXP_NAME`` (what ``dvc exp run`` sets) or a readable ``repro <commit> · params
<hash>``, tagged with the experiment and the git commit, its end time moved by each stage that reports."""

from __future__ import annotations

import subprocess
import time

from distillery.pipeline.publish.mlflow_runs import parent_run_id


def test_parent_runs_are_named_and_tagged_after_the_experiment_and_commit(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.delenv("DISTILLERY_PIPELINE_RUN", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("DVC_EXP_NAME", "plush-reel")
    exp = parent_run_id("seed: 0\n")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(exp)
    assert run.data.tags["mlflow.runName"] == "plush-reel"
    assert run.data.tags["distillery.experiment"] == "plush-reel"
    assert run.data.tags["distillery.git_commit"] == commit == run.data.tags["mlflow.source.git.commit"]
    first_end = run.info.end_time
    time.sleep(0.05)
    assert parent_run_id("seed: 0\n") == exp  # a later stage of the same experiment finds it ...
    assert client.get_run(exp).info.end_time > first_end  # ... and the parent lasts to that stage
    monkeypatch.delenv("DVC_EXP_NAME")
    plain = client.get_run(parent_run_id("seed: 1\n"))  # a plain `dvc repro` of other params
    assert plain.data.tags["mlflow.runName"].startswith(f"repro {commit[:7]} · params ")
    assert plain.data.tags["distillery.experiment"] == "workspace"
