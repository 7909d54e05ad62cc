"""Trust rules of the training stages (docs/reliability.md) on a real git + DVC workspace: resume only
what the same inputs made, same inputs give the same bytes, and kill-anywhere: SIGKILL a training
stage at random moments (one inside a checkpoint write), rerun each time, and compare the end with
an uninterrupted run — the shipped weights bitwise, the training log, the MLflow history, the DVC
metrics and plots — with no process left behind after any kill.

The session-scoped workspaces ``prepared`` (clips → base → latents) and ``trained`` (+ teacher, 6
steps of the tiny base, checkpoints every 2) are in conftest.py; each test works on a copy.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workspace import TRAINED, copy_workspace, env, read_log_steps, set_params, sh, stage, tree_sha, wait_no_processes

from distillery.lineage.hashing import hash_file

pytestmark = pytest.mark.slow
WEIGHTS = Path("artifacts/teacher/model/transformer/diffusion_pytorch_model.safetensors")




@pytest.mark.reliability(case="8.1", title="changed param: no stale resume",
                         injected="complete `dvc repro teacher`, then change teacher.learning_rate and `dvc repro teacher`",
                         expect="one line names the changed config; training restarts at step 1; the shipped weights "
                                "equal a fresh run's with the new value, bitwise; lineage names the new value")
def test_changed_learning_rate_restarts_and_ships_the_new_weights(trained, tmp_path, data_lost):
    import shutil

    repo = copy_workspace(trained, tmp_path / "changed")
    old = hash_file(repo / WEIGHTS)
    set_params(repo, {"teacher.learning_rate": 5.0e-4})
    fresh = copy_workspace(trained, tmp_path / "fresh")  # the reference: a fresh run with the new value
    set_params(fresh, {"teacher.learning_rate": 5.0e-4})
    shutil.rmtree(fresh / "runs")
    # the two workspaces share nothing (own DVC cache, MLflow store, runs/): both stages at once
    changed, reference = (subprocess.Popen(["dvc", "repro", "teacher"], cwd=ws, env=env(), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True) for ws in (repo, fresh))
    out_err, ref_err = (p.communicate(timeout=900)[1] for p in (changed, reference))
    assert changed.returncode == 0 and reference.returncode == 0, out_err[-3000:] + ref_err[-3000:]
    assert "not resuming runs/teacher (changed: the run config): starting from step 0" in out_err
    assert "resumed from" not in out_err
    assert read_log_steps(repo / "runs" / "teacher") == [1, 2, 3, 4, 5, 6]
    new = hash_file(repo / WEIGHTS)
    assert new != old and new == hash_file(fresh / WEIGHTS)
    lineage = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())
    assert lineage["config"]["training"]["optimizer"]["learning_rate"] == 5.0e-4
    assert next(o for o in lineage["outputs"] if o["path"] == "model/transformer/diffusion_pytorch_model.safetensors")["sha256"] == new
    data_lost.record(0 if (repo / "artifacts" / "teacher").is_dir() else 1, "artifacts lost")


@pytest.mark.reliability(case="8.2", title="changed input data: no stale resume, no manual cleanup",
                         injected="complete teacher, then clips.num_train 16 → 12 (new clips, new latents), `dvc repro teacher`",
                         expect="one line names the changed input (data); the teacher retrains from step 1 (no 'cannot "
                                "resume the data order'), exit 0")
def test_changed_input_data_retrains_without_manual_cleanup(trained, tmp_path):
    repo = copy_workspace(trained, tmp_path / "ws")
    set_params(repo, {"clips.num_train": 12})
    out = sh(["dvc", "repro", "teacher"], repo)
    assert "not resuming runs/teacher (changed: input data): starting from step 0" in out.stderr
    assert "cannot resume" not in out.stderr and "resumed from" not in out.stderr
    assert read_log_steps(repo / "runs" / "teacher") == [1, 2, 3, 4, 5, 6]
    assert json.loads((repo / "metrics" / "latents.json").read_text())["train"] == 12


@pytest.mark.reliability(case="8.3", title="same inputs, same artifact bytes",
                         injected="`dvc repro -f -s latents` and `dvc repro -f -s teacher` on a complete workspace",
                         expect="byte-identical artifacts; `dvc status` clean (downstream stays cached); lineage still "
                                "names an MLflow run that exists")
def test_forced_rerun_gives_identical_bytes(trained, tmp_path):
    repo = copy_workspace(trained, tmp_path / "ws")
    before = {s: tree_sha(repo / "artifacts" / s) for s in ("latents", "teacher")}
    sh(["dvc", "repro", "-f", "-s", "latents"], repo)
    sh(["dvc", "repro", "-f", "-s", "teacher"], repo)
    assert {s: tree_sha(repo / "artifacts" / s) for s in ("latents", "teacher")} == before
    status = sh(["dvc", "status", "teacher"], repo).stdout  # the stages up to teacher (pretrain never ran here)
    assert "Data and pipelines are up to date" in status, status
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    for s in ("latents", "teacher"):
        run_id = json.loads((repo / "artifacts" / s / "lineage.json").read_text())["mlflow"]["run_id"]
        assert client.get_run(run_id).info.run_id == run_id



STEPS = 6  # the `trained` reference: SMALL params of workspace.py (save_every 2)
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
        time.sleep(0.001)  # a write takes 200+ ms: a look every millisecond sees it, without spinning a core
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
def test_kill_anywhere_resumes_to_the_uninterrupted_result(prepared, trained, tmp_path, data_lost):
    reference = trained  # the same workspace and params, trained without interruption
    duration = TRAINED["seconds"]
    victim = copy_workspace(prepared, tmp_path / "victim")
    rng = random.Random(SEED)
    moments = sorted(rng.uniform(0.5, duration) for _ in range(KILLS - 1))
    inside_write = False
    for i in range(KILLS):
        proc = _start(victim)
        if i == 0:  # the first kill aims at a checkpoint write while all of them are ahead (again if it missed one)
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
    assert not list((victim / "artifacts").glob("*.tmp")) and not list((victim / "artifacts").glob(".*.old-*"))
