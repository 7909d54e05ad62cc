"""LoRA under FSDP2 (``torchrun --nproc_per_node 2``, gloo, CPU): the adapter trains as in one process, a run stopped
and resumed by a new CLI launch ends bitwise where the uninterrupted one does (adapter, its AdamW moments, EMA
shadow, losses) — for SFT (LoRA on the student, adapter dropout on) and DMD2 (LoRA on the student and the critic
beside the frozen teacher) — and a resume under another LoRA is one line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from helpers import dcp_tensors, read_log, run_config, train_in_process, write_config
from test_distributed import torchrun
from torchrun_each import torchrun_each

pytestmark = pytest.mark.slow
STEPS = 6
LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]}
CALLBACKS = {
    "grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
    "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9},
}
STATE = ("roles.", "optimizers.", "callbacks.")  # what a checkpoint holds of the training: adapters, moments, shadows


def _sft(base, data, out, batch_size):
    cfg = run_config(base, data, out, steps=STEPS, batch_size=batch_size, lr=1e-2, callbacks=CALLBACKS)
    cfg["models"]["student"]["lora"] = {**LORA, "dropout": 0.1}
    cfg["method"]["caption_dropout"] = 0.25
    return cfg


def _dmd2(base, data, out, batch_size):
    wan = "distillery.models.wan.WanModel"
    cfg = run_config(base, data, out, method="distillery.methods.dmd2.DMD2Method", steps=STEPS, batch_size=batch_size, lr=1e-3,
                     method_knobs={"generator_update_interval": 2, "real_score_guidance_scale": 2.0},
                     callbacks={"grad_clip": CALLBACKS["grad_clip"]})
    cfg["models"]["student"]["lora"] = dict(LORA)
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base), "lora": {**LORA, "rank": 8},
                               "optimizer": {"learning_rate": 2e-3, "betas": [0.0, 0.999]}}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False}
    return cfg


def _stopped(cfg):
    return {**cfg, "training": {**cfg["training"], "loop": {**cfg["training"]["loop"], "stop_at_step": STEPS // 2}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """Per method: an uninterrupted 2-rank run, a 2-rank run stopped at STEPS/2 (one launch for all four), then the
    stopped ones resumed by new launches of the CLI, and a 1-rank reference of DMD2."""
    root = tmp_path_factory.mktemp("lora-dist")
    make = {"sft": _sft, "dmd2": _dmd2}
    launch = []
    for name, build in make.items():
        launch += [(build(tiny_base, latent_set, root / name / "full", 2), root / f"{name}-full.yaml"),
                   (_stopped(build(tiny_base, latent_set, root / name / "split", 2)), root / f"{name}-stopped.yaml")]
    torchrun_each(launch)
    for name, build in make.items():
        torchrun(build(tiny_base, latent_set, root / name / "split", 2), root / f"{name}-split.yaml")
    train_in_process(_dmd2(tiny_base, latent_set, root / "dmd2" / "single", 4))
    return root


@pytest.mark.parametrize("method", ["sft", "dmd2"])
def test_lora_stop_and_resume_under_fsdp2_is_bitwise(runs, method):
    full, split = runs / method / "full" / f"checkpoint-{STEPS}", runs / method / "split" / f"checkpoint-{STEPS}"
    a, b = dcp_tensors(full, STATE), dcp_tensors(split, STATE)
    assert a.keys() == b.keys()
    roles = {k.split(".")[1] for k in a if k.startswith("roles.")}
    assert roles == ({"student"} if method == "sft" else {"student", "critic"})
    assert all(".lora_A." in k or ".lora_B." in k for k in a if k.startswith(("roles.", "optimizers.", "callbacks.")) and
               not k.endswith((".step",)) or ".state." in k), "only adapter tensors in the checkpoint"
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["total_loss"] for r in read_log(runs / method / "split")] == [r["total_loss"] for r in read_log(runs / method / "full")]


@pytest.mark.parametrize("method", ["dmd2"])  # (SFT's adapter dropout draws from each rank's own generator, as any
def test_lora_under_fsdp2_follows_one_process(runs, method):  # nn.Dropout: its masks depend on the rank split)
    two, one = read_log(runs / method / "full"), read_log(runs / method / "single")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one):
        assert abs(a["total_loss"] - b["total_loss"]) <= 1e-4 * max(1.0, abs(b["total_loss"])), (a, b)
    sa = dcp_tensors(runs / method / "full" / f"checkpoint-{STEPS}", ("roles.",))
    sb = dcp_tensors(runs / method / "single" / f"checkpoint-{STEPS}", ("roles.",))
    assert sa.keys() == sb.keys() and any("lora_B" in k and sa[k].abs().sum() > 0 for k in sa)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-4)


def test_resume_under_another_lora_is_one_line(runs, tmp_path, tiny_base, latent_set):
    out = tmp_path / "run"
    shutil.copytree(runs / "sft" / "split", out)
    cfg = _sft(tiny_base, latent_set, out, 4)
    cfg["models"]["student"]["lora"]["rank"] = 8
    path = write_config(tmp_path / "run.yaml", cfg)
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.main", "train", "--config", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # (after the models' INFO lines: a checkpoint is read once they are built)
    assert "the student's LoRA rank was 4, this run's is 8" in last and "Traceback" not in proc.stderr
    assert (out / f"checkpoint-{STEPS}").is_dir()  # nothing lost
