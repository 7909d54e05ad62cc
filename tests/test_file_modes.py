"""Files written by a writer that creates through a private temporary file (safetensors' ``save_file``:
mode 0600) follow the umask like every other file: weights, checkpoint host state, published artifacts."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from distillery.common.fsutil import follow_umask, umask_mode


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_follow_umask_gives_safetensors_files_the_umask_s_mode(tmp_path):
    old = os.umask(0o022)
    try:
        (tmp_path / "sub").mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp_path / "sub" / "w.safetensors"))
        assert _mode(tmp_path / "sub" / "w.safetensors") == 0o600  # what safetensors does on its own
        follow_umask(tmp_path)
        assert _mode(tmp_path / "sub" / "w.safetensors") == 0o644 == umask_mode()
        os.umask(0o077)  # a private umask is followed too
        follow_umask(tmp_path / "sub" / "w.safetensors")
        assert _mode(tmp_path / "sub" / "w.safetensors") == 0o600
    finally:
        os.umask(old)


def test_checkpoint_host_state_and_published_artifacts_follow_the_umask(tmp_path, monkeypatch):
    from distillery.components.checkpoint.host_state import write_state
    from distillery.pipeline.publish import artifacts

    old = os.umask(0o022)
    try:
        written = write_state(tmp_path, "rank-0", {"noise": torch.ones(3)})
        assert {p.suffix: _mode(p) for p in written} == {".safetensors": 0o644, ".json": 0o644}
        monkeypatch.setattr(artifacts, "ARTIFACTS", tmp_path / "artifacts")
        staging = tmp_path / "artifacts" / "stage.tmp"
        staging.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(staging / "latents.safetensors"))
        published = artifacts.publish("stage", staging)
        assert _mode(published / "latents.safetensors") == 0o644
    finally:
        os.umask(old)
