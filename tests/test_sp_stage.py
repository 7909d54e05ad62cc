"""Sequence parallelism through the pipeline (``params.yaml: gpus.sp_size``, ``<stage>.sp_size``), on gloo CPU ranks:
the pretrain stage (the DFSFT causal student, block-causal attention over chunks) at ``gpus.nproc_per_node: 2,
gpus.sp_size: 2`` — two ranks on each sample — publishes the student of its ``sp_size: 1`` twin on one process (the
same global batch: an SP group is one data rank), within fp32 tolerance, and its lineage records the layout; killed
mid-run at sp 2 and rerun at sp 1, it resumes its sp-2 checkpoint (the resume key leaves the layout out; DCP
reshards) and ends where the uninterrupted sp-1 run does. The stage runs as ``dvc.yaml``'s cmd (``distillery stage
pretrain``): under ``dvc repro`` a changed ``gpus`` section reruns the stages before it as well (their ``params``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from workspace import copy_workspace, kill_after_checkpoint, read_log_steps, set_params, stage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # four stage runs, two of them on two processes
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


def test_an_sp_2_stage_publishes_its_sp_1_twin_and_resumes_at_sp_1(trained, tmp_path, monkeypatch):
    """... and every module the sp-2 run imports (its stage process, launcher and workers: sequence parallelism's
    code, which the default DAG's trace never sees) is one of the stage's dvc.yaml deps."""
    from test_dvc_deps import ROOT, imports_by_stage, recorder_env, uncovered

    from distillery.pipeline.dvcfile import load_dvc_stages

    one, two, moved = (copy_workspace(trained, tmp_path / name) for name in ("one", "two", "moved"))
    set_params(two, SP2)
    set_params(moved, SP2)
    stage(one, STAGE, check=True)
    with monkeypatch.context() as traced:
        for key, value in recorder_env(tmp_path / "recorder", tmp_path / "imports").items():
            traced.setenv(key, value)
        out = stage(two, STAGE, check=True)
    imported = imports_by_stage(tmp_path / "imports")[STAGE]
    assert "src/distillery/models/wan/sequence_parallel.py" in imported
    assert not uncovered(imported, load_dvc_stages(ROOT)[STAGE].deps), uncovered(imported, load_dvc_stages(ROOT)[STAGE].deps)
    assert "sequence parallel: 2 ranks per sample" in out.stderr + out.stdout
    assert _layout(one) == {"world_size": 1, "replicate_size": 1, "sp_size": 1, "tp_size": 1}
    assert _layout(two) == {"world_size": 2, "replicate_size": 1, "sp_size": 2, "tp_size": 1}
    run = json.loads((two / "artifacts" / STAGE / "lineage.json").read_text())["config"]["training"]["distributed"]
    assert run["sp_size"] == 2
    assert all(abs(x - y) <= 1e-6 + 2e-4 * abs(y) for x, y in zip(_losses(two), _losses(one), strict=True))
    _same_student(two, one)

    kill_after_checkpoint(["distillery", "stage", STAGE], moved, STAGE)  # at sp 2 on two processes ...
    set_params(moved, SP1)  # ... then moved to one process
    out = stage(moved, STAGE, check=True)
    assert "resumed from runs/pretrain/checkpoint-" in out.stderr, out.stderr[-3000:]
    assert read_log_steps(moved / "runs" / STAGE)[-1] == read_log_steps(one / "runs" / STAGE)[-1]
    assert _layout(moved)["sp_size"] == 1  # the layout it finished at
    _same_student(moved, one)
