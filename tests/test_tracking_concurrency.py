"""Concurrent pipeline stages share one fresh local MLflow store: no migration race, one parent run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = (
    "import sys\n"
    "from distillery.pipeline.tracking import log_stage_run, parent_run_id\n"
    "parent = parent_run_id('seed: 0\\n')\n"
    "child = log_stage_run(sys.argv[1], parent, {'stage': sys.argv[1]}, {'seconds': 1.0})\n"
    "print('PARENT', parent, child['run_id'])\n"
)


def test_stages_starting_together_on_a_fresh_store_share_one_parent_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "DISTILLERY_PIPELINE_RUN": "concurrent-test", "MLFLOW_TRACKING_URI": ""}
    env.pop("MLFLOW_TRACKING_URI")
    procs = [subprocess.Popen([sys.executable, "-c", CODE, f"stage{i}"], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    parents = {line.split()[1] for out, _ in outs for line in out.splitlines() if line.startswith("PARENT")}
    assert len(parents) == 1
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("distillery").experiment_id])
    assert sum(r.data.tags.get("distillery.kind") == "pipeline" for r in runs) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents]
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == ["stage0", "stage1", "stage2", "stage3"]
