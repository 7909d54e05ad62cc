"""Sequence parallelism through the pipeline (``params.yaml: gpus.sp_size``, ``<stage>.sp_size``), on gloo CPU ranks:
the pretrain stage (the DFSFT causal student, block-causal attention over chunks) at ``gpus.nproc_per_node: 2,
gpus.sp_size: 2`` — two ranks on each sample — publishes the student of its ``sp_size: 1`` twin on one process (the
same global batch: an SP group is one data rank), within fp32 tolerance, and its lineage records the layout; killed
mid-run at sp 2 and rerun at sp 1 (``dvc repro`` after ``-S``-style edits), it resumes its sp-2 checkpoint (the
resume key leaves the layout out; DCP reshards) and ends where the uninterrupted sp-1 run does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from workspace import copy_workspace, env, kill_all_in, pause_training, read_log_steps, set_params, sh, wait_no_processes

pytestmark = pytest.mark.slow
STAGE = "pretrain"
SP2 = {"gpus.nproc_per_node": 2, "gpus.sp_size": 2}
SP1 = {"gpus.nproc_per_node": 1, "gpus.sp_size": 1}


def _student(repo: Path) -> dict[str, torch.Tensor]:
    folder = repo / "artifacts" / STAGE / "model" / "transformer"
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update({k: v.float() for k, v in load_file(shard).items()})
    assert found, folder
    return found


def _losses(repo: Path) -> list[float]:
    rows = [json.loads(line) for line in (repo / "runs" / STAGE / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return [r["total_loss"] for r in rows]


def _same_student(got: Path, want: Path) -> None:
    """The published students agree as the trainer-level tests hold them (tests/test_model_parallel.py): on average to
    1e-6, every element within 1e-4 (fp32 rounding of near-zero gradients, amplified by Adam's first steps)."""
    a, b = _student(got), _student(want)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    mean = sum((a[k] - b[k]).abs().sum().item() for k in a) / sum(v.numel() for v in a.values())
    assert worst <= 1e-4 and mean <= 1e-6, (worst, mean)


def _layout(repo: Path) -> dict:
    launch = json.loads((repo / "artifacts" / STAGE / "lineage.json").read_text())["launch"]
    return {k: launch[k] for k in ("world_size", "replicate_size", "sp_size", "tp_size")}


def _killed_after_checkpoint_2(repo: Path) -> None:
    """``dvc repro`` of the stage in ``repo``, paused once ``checkpoint-2`` is written and SIGKILLed from dvc down:
    no process left, nothing published."""
    proc = subprocess.Popen(["dvc", "repro", STAGE], cwd=repo, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (repo / "runs" / STAGE / "checkpoint-2" / "metadata.json").is_file():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.01)
        pause_training(repo)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_no_processes(repo, timeout=30) == []
    finally:
        kill_all_in(repo)
    assert not (repo / "artifacts" / STAGE).exists()


def test_an_sp_2_stage_publishes_its_sp_1_twin_and_resumes_at_sp_1(trained, tmp_path):
    one, two, moved = (copy_workspace(trained, tmp_path / name) for name in ("one", "two", "moved"))
    set_params(two, SP2)
    set_params(moved, SP2)
    sh(["dvc", "repro", STAGE], one)
    out = sh(["dvc", "repro", STAGE], two)
    assert "sequence parallel: 2 ranks per sample" in out.stderr + out.stdout
    assert _layout(one) == {"world_size": 1, "replicate_size": 1, "sp_size": 1, "tp_size": 1}
    assert _layout(two) == {"world_size": 2, "replicate_size": 1, "sp_size": 2, "tp_size": 1}
    run = json.loads((two / "artifacts" / STAGE / "lineage.json").read_text())["config"]["training"]["distributed"]
    assert run["sp_size"] == 2
    assert all(abs(x - y) <= 1e-6 + 2e-4 * abs(y) for x, y in zip(_losses(two), _losses(one), strict=True))
    _same_student(two, one)

    _killed_after_checkpoint_2(moved)  # at sp 2 on two processes ...
    set_params(moved, SP1)  # ... then moved to one process
    out = sh(["dvc", "repro", STAGE], moved)
    assert "resumed from runs/pretrain/checkpoint-" in out.stderr, out.stderr[-3000:]
    assert read_log_steps(moved / "runs" / STAGE)[-1] == read_log_steps(one / "runs" / STAGE)[-1]
    assert _layout(moved)["sp_size"] == 1  # the layout it finished at
    _same_student(moved, one)
