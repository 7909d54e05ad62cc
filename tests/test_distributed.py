"""FSDP2 under ``torchrun --nproc_per_node 2`` (gloo, CPU): same trajectory as one process,
exact stop/resume, and a 2-rank checkpoint resumed on 1 rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_log, role_state, run_config, torchrun_command, train_in_process, write_config
from torchrun_each import torchrun_each

pytestmark = pytest.mark.slow
STEPS = 8
CALLBACKS = {
    "grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
    "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9},
}


def torchrun(config: dict, path: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 -m distillery.cli.train --config PATH``, as a user starts it."""
    write_config(path, config)
    return _launch(["-m", "distillery.cli.train", "--config", str(path)], path.parent, nproc)


def _launch(args: list[str], cwd: Path, nproc: int) -> subprocess.CompletedProcess:
    cmd = torchrun_command(nproc, cwd, *args)
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """One uninterrupted 2-rank run, one stopped at STEPS/2 and resumed, and a 1-rank reference."""
    root = tmp_path_factory.mktemp("dist")

    def cfg(name: str, batch_size: int) -> dict:
        c = run_config(tiny_base, latent_set, root / name, steps=STEPS, batch_size=batch_size, callbacks=CALLBACKS)
        c["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=2)
        c["method"]["caption_dropout"] = 0.25
        return c

    split = cfg("split", 2)
    stopped = {**split, "training": {**split["training"], "loop": {**split["training"]["loop"], "stop_at_step": STEPS // 2}}}
    torchrun_each([(cfg("fsdp2", 2), root / "fsdp2.yaml"), (stopped, root / "split-stopped.yaml")])  # 2 ranks, one launch
    shutil.copytree(root / "split", root / "reshard")  # keeps checkpoint-4 (saved by 2 ranks)
    torchrun(split, root / "split.yaml")  # the resume: a new launch of the CLI, as a user restarts a stopped run
    single = train_in_process(cfg("single", 4))
    reshard = cfg("reshard", 4)
    resumed_on_one = train_in_process(reshard)
    return {"root": root, "single": single, "resumed_on_one": resumed_on_one}


def test_fsdp2_follows_the_single_process_trajectory(runs):
    root = runs["root"]
    two, one = read_log(root / "fsdp2"), read_log(root / "single")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one):
        assert abs(a["total_loss"] - b["total_loss"]) <= 1e-5 * max(1.0, abs(b["total_loss"])), (a, b)
        assert abs(a["grad_norm/student"] - b["grad_norm/student"]) <= 1e-4 * b["grad_norm/student"], (a, b)
    assert one[-1]["total_loss"] < one[0]["total_loss"]
    sa, sb = role_state(root / "fsdp2" / f"checkpoint-{STEPS}"), role_state(root / "single" / f"checkpoint-{STEPS}")
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-5)


def test_torchrun_stop_and_resume_matches_uninterrupted(runs):
    root = runs["root"]
    full, split = root / "fsdp2" / f"checkpoint-{STEPS}", root / "split" / f"checkpoint-{STEPS}"
    assert json.loads((full / "metadata.json").read_text())["world_size"] == 2
    for ema in (None, "ema"):  # exact resume on 2 ranks: bitwise, weights and EMA shadow alike
        sa, sb = role_state(full, ema=ema), role_state(split, ema=ema)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (ema, k)
    losses = [r["total_loss"] for r in read_log(root / "split")]
    assert losses == [r["total_loss"] for r in read_log(root / "fsdp2")]


def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    from distillery.components.checkpoint.checksums import verify_checkpoint
    from distillery.components.checkpoint.dcp_io import read_dcp_metadata

    root = runs["root"]
    saved = root / "split" / f"checkpoint-{STEPS // 2}"  # both ranks' files are in its checksums
    listed = json.loads((saved / "checksums.json").read_text())["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng/rank-0.json", "rng/rank-1.json"} <= set(listed)
    assert verify_checkpoint(saved) is None and read_dcp_metadata(saved / "dcp").storage_data
    result = runs["resumed_on_one"]
    assert result.history[0]["step"] == STEPS // 2 + 1 and result.final_step == STEPS
    two = role_state(root / "fsdp2" / f"checkpoint-{STEPS}")
    one = role_state(root / "reshard" / f"checkpoint-{STEPS}")
    for k in two:
        torch.testing.assert_close(one[k], two[k], rtol=0, atol=1e-5)
