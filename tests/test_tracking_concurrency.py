"""Concurrent pipeline stages share one fresh local MLflow store: no migration race, one parent run.

The stage processes meet at a barrier (a Unix socket the test holds) after their imports, so all of
them reach the fresh store in the same instant instead of one after another as their imports finish.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WRITERS = 4
CODE = (
    "import socket, sys\n"
    "from mlflow.tracking import MlflowClient  # the slow imports happen before the barrier\n"
    "from distillery.pipeline.publish.mlflow_runs import log_stage_run, parent_run_id\n"
    "barrier = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "barrier.connect(sys.argv[2])\n"
    "assert barrier.recv(1) == b'g'  # released together with the other stages\n"
    "parent = parent_run_id('seed: 0\\n')\n"
    "child = log_stage_run(sys.argv[1], parent, {'stage': sys.argv[1]}, {'seconds': 1.0})\n"
    "print('PARENT', parent, child['run_id'])\n"
)


@pytest.mark.slow  # several stage processes at once (~45 s)
def test_stages_starting_together_on_a_fresh_store_share_one_parent_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "DISTILLERY_PIPELINE_RUN": "concurrent-test"}
    env.pop("MLFLOW_TRACKING_URI", None)
    address = Path(tempfile.mkdtemp(prefix="barrier-")) / "s"  # short: AF_UNIX paths are limited to ~107 bytes
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(address))
    server.listen(WRITERS)
    server.settimeout(300)  # a hang guard, not a timing assertion
    procs = [subprocess.Popen([sys.executable, "-c", CODE, f"stage{i}", str(address)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(WRITERS)]
    waiting = []
    try:
        for _ in range(WRITERS):  # every stage process is blocked at the barrier ...
            waiting.append(server.accept()[0])
        for conn in waiting:  # ... before any of them may touch the store
            conn.sendall(b"g")
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for conn in waiting:
            conn.close()
        server.close()
        address.unlink(missing_ok=True)
        address.parent.rmdir()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    parents = {line.split()[1] for out, _ in outs for line in out.splitlines() if line.startswith("PARENT")}
    assert len(parents) == 1
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("distillery").experiment_id])
    assert sum(r.data.tags.get("distillery.kind") == "pipeline" for r in runs) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents]
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == [f"stage{i}" for i in range(WRITERS)]
