"""Faults inside the training library itself (no pipeline): a corrupt sample that makes the loss
NaN, with and without a skip budget, and a finished run resumed again."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from helpers import read_log, role_state, run_config, train_in_process, write_config

PY = sys.executable
pytestmark = pytest.mark.process  # each test runs `python -m distillery.cli.train` in a subprocess


def _nan_latent_set(src: Path, dst: Path) -> Path:
    """The demo latent set with the latents of one sample replaced by NaN."""
    from distillery.data import LatentDataset
    from distillery.data.dataset import read_empty_prompt_embedding, write_empty_prompt_embedding
    from distillery.data.writer import LatentRecord, write_latent_shards

    ds = LatentDataset(src, "train")
    records = []
    for i in range(len(ds)):
        row = ds[i]
        latent = row["latents"].clone().float()
        if i == 5:
            latent[:] = float("nan")
        records.append(LatentRecord(id=row["id"], caption=row["caption"], latent=latent,
                                    text_embedding=row["text_embedding"].clone().float(), num_frames=9, height=32,
                                    width=32, fps=8.0, source="nan-injection"))
    write_latent_shards(records, dst, rows_per_shard=8)
    write_empty_prompt_embedding(dst, read_empty_prompt_embedding(src))
    return dst


def _train(cfg_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "distillery.cli.train", "--config", str(cfg_path), *extra], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.reliability(case="8.10", title="NaN sample, no skip budget",
                         injected="one latent sample set to NaN; 8 steps of batch 4 over 16 samples",
                         expect="exit 2, one line naming the step of the first NaN loss; no checkpoint at or after it")
def test_nan_sample_stops_at_its_step(tmp_path, tiny_base, latent_set, data_lost):
    data = _nan_latent_set(latent_set, tmp_path / "nan-latents")
    cfg = run_config(tiny_base, data, tmp_path / "run", steps=8, batch_size=4, save_every=1)
    out = _train(write_config(tmp_path / "c.yaml", cfg))
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    assert errors[0].startswith("error: training diverged at step ") and "total_loss=nan" in errors[0]
    bad = int(errors[0].split("step ")[1].split(":")[0])
    from distillery.components.checkpoint.manager import list_checkpoints

    saved = [s for s, _ in list_checkpoints(tmp_path / "run")]
    assert saved == list(range(1, bad)), (saved, bad)
    assert all(r["step"] < bad for r in read_log(tmp_path / "run"))
    data_lost.record(0 if saved == list(range(1, bad)) else 1, "good checkpoints lost")


@pytest.mark.reliability(case="8.10", title="NaN sample within the skip budget",
                         injected="the same NaN sample with training.loop.skip_nonfinite_steps 2 (it is drawn twice in 8 steps)",
                         expect="the NaN steps are skipped without an update; the run finishes with finite weights; "
                                "a budget of 1 stops at the second NaN step with one line")
def test_nan_sample_is_skipped_within_budget(tmp_path, tiny_base, latent_set):
    data = _nan_latent_set(latent_set, tmp_path / "nan-latents")
    cfg = run_config(tiny_base, data, tmp_path / "run", steps=8, batch_size=4)
    cfg["training"]["loop"]["skip_nonfinite_steps"] = 2
    assert train_in_process(cfg).final_step == 8  # the trainer `distillery train` runs, here: it finishes (no UserError)
    rows = read_log(tmp_path / "run")
    skipped = [r["step"] for r in rows if r.get("skipped_nonfinite")]
    assert len(skipped) == 2
    assert all(math.isfinite(r["total_loss"]) for r in rows if not r.get("skipped_nonfinite"))
    state = role_state(tmp_path / "run" / "checkpoint-8")
    assert all(torch.isfinite(t).all() for t in state.values())
    cfg["training"]["loop"]["skip_nonfinite_steps"] = 1
    cfg["training"]["checkpoint"]["output_dir"] = str(tmp_path / "run1")
    out = _train(write_config(tmp_path / "c1.yaml", cfg))
    assert out.returncode == 2
    assert f"training diverged at step {skipped[1]}" in out.stderr and "skip_nonfinite_steps=1" in out.stderr


@pytest.mark.reliability(case="8.10", title="a finished run resumed again",
                         injected="rerun `distillery train` on a run that already reached max_train_steps",
                         expect="'already complete at step N; checkpoint … (saved <when, ISO UTC>)', the time the first "
                                "run's line gave (a stale run shows), exit 0, no 'loss nan'")
def test_finished_run_says_complete(tmp_path, tiny_base, latent_set):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=2, batch_size=4)
    path = write_config(tmp_path / "c.yaml", cfg)
    before = datetime.now(timezone.utc).replace(microsecond=0)
    first = _train(path)  # the finished run ...
    after = datetime.now(timezone.utc)
    assert first.returncode == 0, first.stderr[-2000:]
    trained = re.search(r"^trained to step 2; checkpoint (\S+) \(saved (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\); loss ",
                        first.stdout, re.M)
    assert trained, first.stdout
    saved = datetime.strptime(trained[2], "%Y-%m-%dT%H:%M:%S%z")
    assert before <= saved <= after, (before, saved, after)  # when the checkpoint was written, in UTC
    again = _train(path)  # ... that `distillery train` is asked to run again
    assert again.returncode == 0 and "nan" not in again.stdout
    assert f"already complete at step 2; checkpoint {trained[1]} (saved {trained[2]})" in again.stdout, again.stdout
