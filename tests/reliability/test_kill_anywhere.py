"""Kill-anywhere: SIGKILL a training stage at random moments (one inside a checkpoint write), rerun
each time, and compare the end with an uninterrupted run: the shipped weights bitwise, the training
log, the MLflow history, the DVC metrics and plots — and no process left behind after any kill."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workspace import copy_workspace, env, read_log_steps, set_params, stage, wait_no_processes

pytestmark = pytest.mark.slow
STEPS = 12
KILLS = 5
SEED = int(os.environ.get("DISTILLERY_KILL_SEED", "20261130"))


def _start(repo: Path) -> subprocess.Popen:
    return subprocess.Popen(["distillery", "stage", "teacher"], cwd=repo, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_inside_checkpoint_write(repo: Path, proc: subprocess.Popen) -> bool:
    """SIGKILL the stage while a checkpoint is being written; True when the kill landed inside one."""
    runs = repo / "runs" / "teacher"
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        try:
            writing = [e.name for e in os.scandir(runs) if e.name.startswith(".tmp-checkpoint-")]
        except FileNotFoundError:
            writing = []
        if writing:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return (runs / writing[0]).exists()  # the half-written checkpoint is still there: killed inside it
    return False


def _mlflow_steps(repo: Path) -> list[int]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(run_id, "total_loss"))


@pytest.mark.reliability(case="8.6-kill", title="kill anywhere, resume to the same result",
                         injected=f"{KILLS} SIGKILLs of `distillery stage teacher` at random moments (seeded), one inside "
                                  "a checkpoint write, each followed by a rerun",
                         expect="no process survives a kill; the final weights equal an uninterrupted run's bitwise; "
                                "train_log, MLflow history and DVC plots hold each step once")
def test_kill_anywhere_resumes_to_the_uninterrupted_result(prepared, tmp_path, data_lost):
    reference = copy_workspace(prepared, tmp_path / "reference")
    set_params(reference, {"teacher.steps": STEPS, "teacher.save_every": 2})
    started = time.perf_counter()
    assert stage(reference, "teacher").returncode == 0
    duration = time.perf_counter() - started

    victim = copy_workspace(prepared, tmp_path / "victim")
    set_params(victim, {"teacher.steps": STEPS, "teacher.save_every": 2})
    rng = random.Random(SEED)
    moments = sorted(rng.uniform(0.5, duration) for _ in range(KILLS - 1))
    inside_write = False
    for i in range(KILLS):
        proc = _start(victim)
        if i == KILLS // 2:  # one kill aimed at a checkpoint write (tried again if it landed just after one)
            inside_write = _kill_inside_checkpoint_write(victim, proc)
            for _ in range(5):
                if inside_write:
                    break
                assert wait_no_processes(victim, timeout=30) == []
                inside_write = _kill_inside_checkpoint_write(victim, _start(victim))
        else:
            try:
                proc.wait(timeout=moments.pop(0))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        left = wait_no_processes(victim, timeout=30)
        assert left == [], f"kill {i}: processes left behind: {left}"
    assert inside_write, "no kill landed inside a checkpoint write"
    final = stage(victim, "teacher")
    assert final.returncode == 0, final.stderr[-3000:]

    import torch
    from safetensors.torch import load_file

    weights = "artifacts/teacher/model/transformer/diffusion_pytorch_model.safetensors"
    got, want = load_file(victim / weights), load_file(reference / weights)
    differing = [k for k in want if not torch.equal(got[k], want[k])]
    data_lost.record(len(differing), "tensors differing from the uninterrupted run")
    assert differing == []
    steps = read_log_steps(victim / "runs" / "teacher")
    assert steps == list(range(1, STEPS + 1))
    assert _mlflow_steps(victim) == list(range(1, STEPS + 1))
    plot = json.loads((victim / "plots" / "teacher_loss.json").read_text())
    assert [r["step"] for r in plot] == list(range(1, STEPS + 1))
    assert plot == json.loads((reference / "plots" / "teacher_loss.json").read_text())
    assert json.loads((victim / "artifacts" / "teacher" / "metrics.json").read_text()) == \
        json.loads((reference / "artifacts" / "teacher" / "metrics.json").read_text())
    assert not list((victim / "runs" / "teacher").glob(".tmp-checkpoint-*"))
