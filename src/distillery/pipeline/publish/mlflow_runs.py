"""One MLflow parent run per pipeline run; each stage logs a child run under it.

A pipeline run is identified by ``$DISTILLERY_PIPELINE_RUN`` when set (the Prefect flow sets it),
else by the hash of params.yaml's content, the code commit and the DVC experiment's name: every stage of one ``dvc repro``
finds the same parent run. The parent records the ``params.yaml`` it ran with: every key as a
dotted MLflow param (``pretrain.learning_rate``) and the file itself as the artifact ``params.yaml``.

It is named after what made it (:func:`pipeline_run_name`): the DVC experiment (``$DVC_EXP_NAME``, which
``dvc exp run`` sets for its stages), else the Prefect flow run, else ``repro <commit> · params <hash>``; and tagged
``distillery.experiment`` (the experiment's name, ``workspace`` for a plain ``dvc repro``), ``distillery.git_commit``
and MLflow's own ``mlflow.source.git.commit``. Its end time moves with each stage that reports to it, so its
duration spans the pipeline run (first stage to last), not the instant it was created.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from distillery.common.treeutil import flatten
from distillery.components.tracking import (
    MLflowTracker,
    default_tracking_uri,
    ensure_experiment,
    log_param_texts,
    mlflow_client,
    store_lock,
)
from distillery.config.schema import TrackerConfig
from distillery.lineage.manifest import code_info

EXPERIMENT = "distillery"


_PLAIN_KEY = re.compile(r"[A-Za-z0-9._:@+-]{1,200}")  # a key MLflow's search filter takes between quotes as is


def pipeline_key(params_text: str) -> str:
    """The tag that finds this pipeline run's parent: ``$DISTILLERY_PIPELINE_RUN`` when it is plain text
    (letters, digits, ``._:@+-``), else its digest (a quote in it would break MLflow's search filter), else a
    digest of the params, the commit and the DVC experiment."""
    env = os.environ.get("DISTILLERY_PIPELINE_RUN")
    if env:
        return env if _PLAIN_KEY.fullmatch(env) else "run-" + hashlib.sha256(env.encode()).hexdigest()[:16]
    commit = code_info().get("git_commit") or "no-git"
    return hashlib.sha256((params_text + commit + (experiment_name() or "")).encode()).hexdigest()[:16]  # one per experiment


def experiment_name() -> str | None:
    """The DVC experiment this stage runs for (``$DVC_EXP_NAME``: ``dvc exp run`` sets it), or None."""
    return os.environ.get("DVC_EXP_NAME") or None


def pipeline_run_name(key: str, commit: str | None) -> str:
    """A parent run's name: the DVC experiment's, else the Prefect flow run's (``$DISTILLERY_PIPELINE_RUN``), else
    ``repro <commit[:7]> · params <key[:6]>`` (a ``dvc repro`` of the workspace)."""
    exp = experiment_name()
    if exp:
        return exp
    if os.environ.get("DISTILLERY_PIPELINE_RUN"):
        return os.environ["DISTILLERY_PIPELINE_RUN"][:250]
    return f"repro {commit[:7] if commit else 'no-git'} · params {key[:6]}"


def parent_run_id(params_text: str, experiment: str = EXPERIMENT) -> str:
    """Find or create the parent run of this pipeline run; returns its id (its end time moved to now)."""
    import time

    key = pipeline_key(params_text)
    commit = code_info().get("git_commit")
    tags = {"distillery.pipeline_key": key, "distillery.kind": "pipeline",
            "distillery.experiment": experiment_name() or "workspace", "distillery.git_commit": commit or "none"}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    cfg = TrackerConfig(experiment=experiment, run_name=pipeline_run_name(key, commit), tags=tags)
    uri = default_tracking_uri(cfg)
    with store_lock(uri):  # concurrent stages of one pipeline run find (or make) the same parent
        client = mlflow_client(uri)
        exp_id = ensure_experiment(client, experiment, uri)
        found = client.search_runs([exp_id], f"tags.`distillery.pipeline_key` = '{key}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
            client.set_terminated(run_id, status="FINISHED", end_time=int(time.time() * 1000))  # it lasts to this stage
            return run_id
        run = client.create_run(exp_id, run_name=cfg.run_name, tags=cfg.tags)
        log_params_file(client, run.info.run_id, params_text)
        client.set_terminated(run.info.run_id, status="FINISHED")
        return run.info.run_id


def log_params_file(client: Any, run_id: str, params_text: str) -> None:
    """``params.yaml``'s text into run ``run_id``: every leaf as a dotted param (lists as their text, ``[40, 8]``) and the
    file itself as the artifact ``params.yaml``. The file was validated before any stage ran."""
    data = yaml.safe_load(params_text)
    leaves = flatten(data) if isinstance(data, dict) else {}
    log_param_texts(client, run_id, {k: "null" if v is None else str(v) for k, v in leaves.items()})
    client.log_text(run_id, params_text, "params.yaml")


def log_files(tracking_uri: str, run_id: str, files: Sequence[tuple[Path, str]]) -> None:
    """Copy ``(local file, artifact folder)`` pairs into the existing run ``run_id`` (a training stage's
    loss plot into the run its trainer made)."""
    client = mlflow_client(tracking_uri)
    for path, folder in files:
        client.log_artifact(run_id, str(path), folder)


def log_stage_run(stage: str, parent: str, params: dict[str, Any], metrics: dict[str, float],
                  files: Sequence[tuple[Path, str]] = ()) -> dict[str, str]:
    """A child run for a stage that does not train (clips, latents, validate, export); ``files``:
    ``(local file, artifact folder)`` pairs copied into its artifacts (validate's grid and plots)."""
    cfg = TrackerConfig(experiment=EXPERIMENT, run_name=stage, parent_run_id=parent, tags={"distillery.stage": stage})
    tracker = MLflowTracker(cfg)
    tracker.log_params(params)
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if numeric:
        tracker.log_metrics(numeric, step=0)
    for path, folder in files:
        tracker.log_artifact(path, folder)
    tracker.finish()
    return {"tracking_uri": tracker.tracking_uri, "experiment": EXPERIMENT, "run_id": tracker.run_id, "parent_run_id": parent}


def end_running_stage_runs(stage: str, params_text: str, experiment: str = EXPERIMENT) -> list[str]:
    """End ``KILLED`` every run of ``stage`` still ``RUNNING`` under this pipeline run's parent (``params_text``'s): what a
    stage stopped by a signal leaves when its trainer was killed before it could end its own run. Returns their ids."""
    parent = parent_run_id(params_text, experiment)
    uri = default_tracking_uri(TrackerConfig(experiment=experiment))
    with store_lock(uri):
        client = mlflow_client(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        running = client.search_runs([exp.experiment_id], f"tags.`distillery.stage` = '{stage}' and "
                                     f"tags.`mlflow.parentRunId` = '{parent}' and attributes.status = 'RUNNING'")
        for run in running:
            client.set_terminated(run.info.run_id, status="KILLED")
    return [run.info.run_id for run in running]
