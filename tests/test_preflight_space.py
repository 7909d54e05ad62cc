"""Free-space preflight: a training stage's checkpoints are counted where ``runs/`` lives, its model where
``artifacts/`` lives (real-shape checkpoints of a 1.3B model are ~17 GB each: users put runs/ on scratch)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from distillery.common.errors import UserError
from distillery.pipeline.launch.preflight import check_free_space, training_bytes
from distillery.pipeline.params.reader import Params

REPO = Path(__file__).resolve().parents[1]


def _params(tmp_path: Path, **sections: dict) -> Params:
    import yaml

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in sections.items():
        data[section].update(values)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    return Params.load(tmp_path / "params.yaml")


def _base(tmp_path: Path, mib: int) -> Path:
    artifacts = tmp_path / "artifacts"
    (artifacts / "base" / "model" / "transformer").mkdir(parents=True)
    (artifacts / "base" / "model" / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * (mib << 20))
    return artifacts


def test_one_checkpoint_when_the_run_writes_only_its_final_one(tmp_path):
    artifacts = _base(tmp_path, 1)
    fp32 = 2 << 20
    assert training_bytes("teacher", _params(tmp_path, teacher={"steps": 120, "save_every": 40}), artifacts) == (fp32, 2 * 3 * fp32)
    assert training_bytes("teacher", _params(tmp_path, teacher={"steps": 120, "save_every": 0}), artifacts) == (fp32, 3 * fp32)
    assert training_bytes("teacher", _params(tmp_path, teacher={"steps": 2, "save_every": 2}), artifacts) == (fp32, 3 * fp32)


def test_checkpoints_are_counted_on_the_runs_file_system(tmp_path):
    artifacts = _base(tmp_path, 4)  # 8 MiB fp32 masters: 48 MiB of checkpoints, 8 MiB of model
    runs = tmp_path / "runs"
    runs.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(runs)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        params = _params(tmp_path)
        with pytest.raises(UserError, match=f"stage teacher: needs at least .* free in {runs}, only 16.0 MiB"):
            check_free_space("teacher", params, artifacts, runs)
        check_free_space("clips", params, artifacts, runs)  # not a training stage: runs/ is not its business
    finally:
        subprocess.run(["umount", str(runs)], check=True)
    check_free_space("teacher", params, artifacts, runs)  # runs/ back on the large disk beside artifacts/
    shutil.rmtree(runs)


@pytest.mark.slow
def test_export_of_a_student_whose_stage_never_ran_is_one_line(prepared, tmp_path):
    """Outside DVC (``distillery stage export`` alone, a Prefect retry) the student may be missing: one line,
    exit 2 — it was a ``FileNotFoundError`` traceback from ``copytree`` at real shape. (The session's ``prepared``
    workspace, conftest.py: base, clips and latents made, no training stage run.)"""
    from workspace import copy_workspace, stage

    repo = copy_workspace(prepared, tmp_path / "ws")
    assert (repo / "artifacts" / "base").is_dir() and not (repo / "artifacts" / "distill").exists()
    out = stage(repo, "export")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "artifacts/distill/model/transformer not found" in lines[0] and "Traceback" not in out.stderr


def test_an_ode_init_pretrain_counts_its_trajectory_set_less_what_a_killed_run_left(tmp_path):
    """``pretrain.method: ode_init`` writes the teacher's trajectories in runs/ before it trains: per prompt and seed,
    float32 latents of len(t_list) points, shaped by the base's VAE (``base.path``'s, read through the family
    registry: the tiny one's 8 channels, 4x4 pixels a latent)."""
    from distillery.pipeline.launch.preflight import latent_shape, trajectory_bytes

    artifacts = _base(tmp_path, 1)
    (artifacts / "latents" / "data").mkdir(parents=True)
    (artifacts / "latents" / "data" / "preprocess.json").write_text('{"splits": {"train": {"rows": 24}}}')
    dfsft = _params(tmp_path)
    assert trajectory_bytes("pretrain", dfsft, artifacts) == 0  # the default method makes none
    params = _params(tmp_path, pretrain={"method": "ode_init", "seeds_per_prompt": 2})
    c, t, h, w = latent_shape(params)
    points = len(params.get("pretrain.t_list"))
    whole = 24 * 2 * points * c * t * h * w * 4
    assert (c, h) == (8, params.get("clips.size") // 4) and trajectory_bytes("pretrain", params, artifacts) == whole
    assert trajectory_bytes("distill", params, artifacts) == 0
    _, runs_bytes = training_bytes("pretrain", params, artifacts)
    _, dfsft_bytes = training_bytes("pretrain", dfsft, artifacts)
    assert runs_bytes - dfsft_bytes == whole  # on the runs/ file system, beside the checkpoints
    runs = tmp_path / "runs"
    (runs / "pretrain_trajectories").mkdir(parents=True)
    (runs / "pretrain_trajectories" / "shard-00000.parquet").write_bytes(b"\0" * 1000)  # a killed run's first shard
    assert trajectory_bytes("pretrain", params, artifacts, runs) == whole - 1000
