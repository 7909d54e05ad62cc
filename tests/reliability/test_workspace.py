"""The workspace itself: a path SQLite cannot open, and a workspace copied or moved (issue 46 G)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SHIPPED = (Path(__file__).resolve().parents[2] / "params.yaml").read_text()


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
