"""A training stage under a real Slurm: a one-host cluster (munged, slurmctld, two slurmd: nodes n1, n2 on
127.0.0.1; ``.ci/slurm-up``) runs ``distillery stage teacher`` with ``gpus: {nnodes: 2, launcher: slurm}``
inside ``salloc -N2``: the stage's ``srun`` step starts one torchrun agent per node. Its losses are the
1-process run's, its lineage names the Slurm job; killing the stage mid-run leaves no agent or worker
and no running job step. Skipped (with the reason) where Slurm's daemons are not installed or we are
not root (``.ci/install-slurm`` installs them; ``.ci/run`` does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers import read_log, train_in_process
from workspace import ROOT, env, kill_all_in, processes_in, set_params, wait_no_processes

MISSING = [b for b in ("slurmctld", "slurmd", "munged", "srun", "salloc") if shutil.which(b) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed ({', '.join(MISSING)} missing): "
                                                       "run .ci/install-slurm (as root)"),
              pytest.mark.skipif(os.geteuid() != 0, reason="Slurm's daemons need root for a one-host test cluster")]


def _free_base_port() -> int:
    """A port p with p, p+1, p+2 free on 127.0.0.1 (slurmctld and the two slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 > 65535:
            continue
        try:
            for p in (base, base + 1, base + 2):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    up = subprocess.run([str(ROOT / ".ci" / "slurm-up"), str(folder), str(_free_base_port())], capture_output=True,
                        text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run([str(ROOT / ".ci" / "slurm-up"), "--down", str(folder)], timeout=60)


def _stage_pid(salloc: int) -> int | None:
    """The ``distillery stage teacher`` process salloc started (its child)."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == salloc and b"stage" in argv:
            return int(entry.name)
    return None


def _workers(folder: Path) -> list[int]:
    found = []
    for pid in processes_in(folder):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"distillery.cli.train" in argv and b"distillery.cli.launch" not in argv:
            found.append(pid)
    return found


@pytest.mark.reliability(case="8.6", title="a training stage on 2 Slurm nodes, and killing it",
                         injected="`salloc -N2 distillery stage teacher` with gpus.launcher: slurm, nnodes: 2; then "
                                  "SIGKILL to the stage mid-run",
                         expect="the 1-process losses, the job id in the lineage; after the kill no agent, worker or "
                                "job step survives")
def test_teacher_stage_on_two_slurm_nodes(ws, cluster, monkeypatch, data_lost):
    for k, v in cluster.items():
        monkeypatch.setenv(k, v)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    batch = params["teacher"]["batch_size"]
    set_params(ws, {"gpus.nnodes": 2, "gpus.launcher": "slurm", "teacher.batch_size": batch // 2})  # the same global batch
    proc = subprocess.run(["salloc", "-N2", "--ntasks-per-node=1", "distillery", "stage", "teacher"], cwd=ws, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    job = re.search(r"Granted job allocation (\d+)", proc.stderr).group(1)
    lineage = json.loads((ws / "artifacts" / "teacher" / "lineage.json").read_text())
    assert lineage["launch"] == {"launcher": "slurm", "nnodes": 2, "nproc_per_node": 1, "world_size": 2,
                                 "slurm_job_id": job, "slurm_nodes": "2", "slurm_nodelist": "n[1-2]",
                                 "replicate_size": 1, "sp_size": 1, "tp_size": 1}
    assert f"launch: slurm, 2 node(s) x 1 process(es), rendezvous {socket.gethostname()}:" in proc.stderr

    run = yaml.safe_load((ws / "runs" / "teacher" / "run.yaml").read_text())  # the same run on one process
    run["training"]["data"].update(batch_size=batch, path=str(ws / run["training"]["data"]["path"]))
    run["models"]["student"]["init_from"] = str(ws / run["models"]["student"]["init_from"])
    run["training"]["checkpoint"]["output_dir"] = str(ws.parent / "one")  # outside ws: this process never works there
    run["training"]["tracker"] = {"backend": "none"}
    train_in_process(run)
    one = read_log(ws.parent / "one")
    two = json.loads((ws / "artifacts" / "teacher" / "loss.json").read_text())
    assert [r["step"] for r in two] == [r["step"] for r in one] and one
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["total_loss"], rel=1e-5, abs=1e-6), a["step"]

    set_params(ws, {"teacher.steps": 400})  # a long run, killed once both nodes' workers run
    salloc = subprocess.Popen(["salloc", "-N2", "--ntasks-per-node=1", "distillery", "stage", "teacher"], cwd=ws, env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while len(_workers(ws)) < 2:
            assert salloc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        os.kill(_stage_pid(salloc.pid), signal.SIGKILL)
        left = wait_no_processes(ws, timeout=60)
        data_lost.record(len(left), "processes left in the workspace after the stage was killed")
        salloc.wait(timeout=60)
        steps = subprocess.run(["squeue", "-h", "-s", "-o", "%i"], env=env(), capture_output=True, text=True, timeout=30)
        assert steps.stdout.strip() == "", steps.stdout
    finally:
        kill_all_in(ws)
        if salloc.poll() is None:
            salloc.kill()
    assert data_lost.total == 0
