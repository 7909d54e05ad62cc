"""The workspace itself: a path SQLite cannot open, and a workspace copied or moved (issue 46 G)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from workspace import copy_pipeline, copy_stages, shipped_params_text

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = shipped_params_text()  # the defaults as shipped, not the workspace's
DISTILLERY = str(Path(sys.executable).parent / "distillery")


@pytest.mark.reliability(case="10.G", title="a workspace path SQLite cannot open",
                         injected="the workspace nested 560 bytes deep; `distillery stage clips` (MLflow's store "
                                  "would be mlflow.db there)",
                         expect="exit 2, one line naming the store's path length and the bound, before any work "
                                "(it failed every stage after its work, ~106 s in)")
def test_a_workspace_too_deep_for_sqlite_is_one_line_first(tmp_path, monkeypatch, capsys, data_lost):
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    ws = tmp_path
    while len(os.fsencode(str(ws))) < 560:
        ws = ws / ("w" * 120)
    ws.mkdir(parents=True)
    (ws / "params.yaml").write_text(SHIPPED)
    monkeypatch.chdir(ws)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ns = build_parser().parse_args(["stage", "clips", "--params", "params.yaml"])
    capsys.readouterr()
    rc = run_guarded(lambda: ns.func(ns))
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "bytes long; SQLite opens at most 500" in lines[0], lines
    data_lost.record(0, "files lost")
    assert sorted(p.name for p in ws.iterdir()) == ["params.yaml"]


@pytest.mark.process
@pytest.mark.reliability(case="10.G", title="a stage run outside a workspace (no stages/ package)",
                         injected="`distillery stage clips` in a folder holding params.yaml and dvc.yaml but no stages/ "
                                  "(the stage adapters a workspace holds beside them)",
                         expect="exit 2, one line naming the missing module and the folder, nothing written")
def test_a_stage_outside_a_workspace_is_one_line(tmp_path, data_lost):
    copy_pipeline(tmp_path, ("params.yaml", "dvc.yaml"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run([DISTILLERY, "stage", "clips"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    # the first stage module it needs is missing: the recipes' registry (read to check params.yaml) or the stage's own
    assert re.search(rf"no module stages\.(recipes|clips) in {re.escape(str(tmp_path.resolve()))}", lines[0]), lines
    assert "Traceback" not in proc.stderr
    data_lost.record(0, "files lost")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dvc.yaml", "params.yaml"]


@pytest.mark.reliability(case="10.G", title="a workspace moved with its mlflow.db",
                         injected="a run tracked in workspace A (an artifact logged), A moved to B, a new run tracked in B",
                         expect="one warning line; the new run's and the old run's artifacts are in B/mlruns, nothing "
                                "is written under A's path")
def test_a_moved_workspace_keeps_its_mlflow_artifacts(tmp_path, monkeypatch, warnings_logged, data_lost):
    from distillery.components.tracking import MLflowTracker
    from distillery.config.schema import TrackerConfig

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a, b = tmp_path / "ws-a", tmp_path / "ws-b"
    a.mkdir()
    monkeypatch.chdir(a)
    note = a / "note.txt"
    note.write_text("hello\n")
    first = MLflowTracker(TrackerConfig(experiment="moved"))
    first.log_artifact(note, "notes")
    first.finish()
    monkeypatch.chdir(tmp_path)
    shutil.move(a, b)
    monkeypatch.chdir(b)
    second = MLflowTracker(TrackerConfig(experiment="moved"))
    second.log_artifact(b / "note.txt", "notes")
    second.finish()
    uris = [second.client.get_run(r).info.artifact_uri for r in (first.run_id, second.run_id)]
    assert all(u.startswith((b / "mlruns").as_uri()) for u in uris), uris
    assert (b / "mlruns").is_dir() and not a.exists()
    assert len([w for w in warnings_logged if "copied or moved workspace" in w]) == 1, warnings_logged
    data_lost.record(0 if (Path(uris[0][len("file://"):]) / "notes" / "note.txt").is_file() else 1, "old run's artifacts unreachable")
    assert data_lost.total == 0


def _small_workspace(root: Path) -> Path:
    import yaml

    root.mkdir(parents=True)
    params = yaml.safe_load(SHIPPED)
    params["clips"]["num_train"], params["clips"]["num_validation"] = 4, 2
    for stage in ("teacher", "pretrain", "distill", "pdd"):  # batches 4 clips fill (the first stage checks them all)
        params[stage]["batch_size"] = 2
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy(Path(__file__).resolve().parents[2] / "dvc.yaml", root / "dvc.yaml")
    copy_stages(root)
    return root


def _truncated_store(ws: Path) -> None:
    """A real MLflow store cut to its first 8 KiB (the header is SQLite's, the tables are gone)."""
    import subprocess

    subprocess.run([DISTILLERY, "stage", "clips"], cwd=ws, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    raw = (ws / "mlflow.db").read_bytes()
    shutil.rmtree(ws / "artifacts")
    (ws / "mlflow.db").write_bytes(raw[:8192])


@pytest.mark.process
@pytest.mark.reliability(case="10.6b", title="an MLflow store that cannot be used, a quote in the pipeline run",
                         injected="mlflow.db of random bytes; a FIFO; a real store truncated to 8 KiB; "
                                  "MLFLOW_TRACKING_URI at a port nothing listens on; DISTILLERY_PIPELINE_RUN with a quote; "
                                  "`distillery stage clips`",
                         expect="exit 2, one line naming the store (garbage and FIFO before any work), no traceback; "
                                "the quote: the stage runs (exit 0)")
@pytest.mark.parametrize("kind", ["garbage", "fifo", "truncated", "unreachable", "quote"])
def test_a_store_that_cannot_be_used_is_one_line(tmp_path, data_lost, kind):
    import subprocess

    ws = _small_workspace(tmp_path / "ws")
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "DISTILLERY_PIPELINE_RUN")}
    if kind == "garbage":
        (ws / "mlflow.db").write_bytes(os.urandom(4096))
    elif kind == "fifo":
        os.mkfifo(ws / "mlflow.db")
    elif kind == "truncated":
        _truncated_store(ws)
    elif kind == "unreachable":
        env.update(MLFLOW_TRACKING_URI="http://127.0.0.1:9", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                   MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    else:
        env["DISTILLERY_PIPELINE_RUN"] = "it's a 'run' \" with quotes"
    out = subprocess.run([DISTILLERY, "stage", "clips"], cwd=ws, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    if kind == "quote":
        assert out.returncode == 0 and (ws / "artifacts" / "clips" / "lineage.json").is_file(), out.stderr[-2000:]
    else:
        assert out.returncode == 2 and len(errors) == 1 and "MLflow store" in errors[0], out.stderr[-3000:]
    if kind in ("garbage", "fifo"):
        assert not (ws / "artifacts").exists()  # refused before the stage worked
    data_lost.record(0, "files lost")
