"""DMD2 under the GPU's precision set-up (issue 29: 2-GPU FSDP2 DMD2 stopped at step 1 with inf grad norms).

Cause: torch ≥ 2.10 Inductor's *mix-order reduction* (on by default for Triton, i.e. CUDA) drops the writes of the
fused reduction into the gradient of a Wan block's ``scale_shift_table`` (the table is ``chunk``-ed into the
modulation vectors of chained modulated norms; pytorch/pytorch#193061, fix PR #193103, not in torch 2.13): compiled
blocks return uninitialised / stale memory as that gradient — inf on 2 GPUs, silently wrong but finite on one.
Self-Forcing was spared only because its causal student turned the feature off process-wide. The CPU (C++)
Inductor backend has no mix-order reduction, so no CPU run shows the corruption itself; these tests pin what can be
checked here:

- compiling the blocks of *any* role (a bidirectional Wan included) turns the feature off before anything compiles;
- 2 gloo ranks under the GPU's FSDP2 mixed-precision policy (bf16 gathers and compute, fp32 masters and fp32
  reduce-scatter, random init) give finite gradient norms equal to one rank's bf16 run (compute copies) for DMD2.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_log, run_config, torchrun_command, train_in_process, write_config

from distillery.components.distributed import DistEnv
from distillery.config.schema import DistributedConfig, ModelRuntimeConfig
from distillery.engine.builder import place_model
from distillery.models.wan import WanModel, WanModelConfig


def _cpu_env() -> DistEnv:
    """A world of one on the CPU, fp32 compute (no FSDP, so no mesh is needed)."""
    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", mesh=None,
                   compute_dtype=torch.float32)


@pytest.mark.process
@pytest.mark.parametrize("trainable", [True, False])
def test_compiling_a_bidirectional_wan_turns_off_mix_order_reduction(tiny_base, trainable):
    """Placing a compiled bidirectional Wan role (student/critic or frozen teacher) switches Inductor's mix-order
    reduction off; placing it uncompiled leaves the setting alone. (Before the fix only causal models did.)"""
    from torch._inductor import config as inductor_config

    model = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=trainable), "critic" if trainable else "teacher")
    with inductor_config.patch({"triton.mix_order_reduction": True}):  # CUDA's default; restored on exit
        place_model(model, _cpu_env(), DistributedConfig(), ModelRuntimeConfig(compile=False))
        assert inductor_config.triton.mix_order_reduction is True
        place_model(model, _cpu_env(), DistributedConfig(), ModelRuntimeConfig(compile=True))
        assert inductor_config.triton.mix_order_reduction is False


STEPS = 2
KEYS = ("critic_loss", "generator_loss", "dmd_grad_norm", "grad_norm/critic", "grad_norm/student")


def _dmd2_bf16_config(base: Path, data: Path, out: Path, batch_size: int) -> dict:
    """The failing benchmark's DMD2 set-up, tiny: random init, data_latent, every step a generator update, teacher
    CFG 4, critic betas [0, 0.999], grad clip 1.0; bf16 compute (``mixed_precision: bf16``, the GPU's default)."""
    cfg = run_config(base, data, out, method="distillery.methods.dmd2.DMD2Method", steps=STEPS, batch_size=batch_size,
                     lr=1e-5, method_knobs={"rollout": "data_latent", "generator_update_interval": 1,
                                            "real_score_guidance_scale": 4.0, "check_rank_agreement": True},
                     callbacks={"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback",
                                              "max_grad_norm": 1.0}})
    wan = "distillery.models.wan.WanModel"
    cfg["models"] = {
        "student": {"_target_": wan, "init_from": str(base), "random_init": True},
        "teacher": {"_target_": wan, "init_from": str(base), "random_init": True, "trainable": False},
        "critic": {"_target_": wan, "init_from": str(base), "random_init": True,
                   "optimizer": {"learning_rate": 1e-5, "betas": [0.0, 0.999]}},
    }
    cfg["training"]["distributed"] = {"mixed_precision": "bf16"}
    return cfg


@pytest.mark.slow
def test_two_gloo_ranks_under_the_gpu_precision_policy_match_one_rank(tmp_path, tiny_base, latent_set):
    """2 ranks × 1 sample (FSDP2: bf16 param_dtype, fp32 reduce_dtype) and 1 rank × 2 samples (bf16 compute copies
    beside fp32 masters): every loss and gradient norm finite and equal to bf16 rounding."""
    two = _dmd2_bf16_config(tiny_base, latent_set, tmp_path / "two", batch_size=1)
    path = write_config(tmp_path / "two.yaml", two)
    cmd = torchrun_command(2, tmp_path, "-m", "distillery.cli.train", "--config", str(path))
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    train_in_process(_dmd2_bf16_config(tiny_base, latent_set, tmp_path / "one", batch_size=2))
    got, ref = read_log(tmp_path / "two"), read_log(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(got, ref):
        for key in KEYS:
            assert math.isfinite(a[key]) and b[key] > 0, (a["step"], key, a[key])
            assert a[key] == pytest.approx(b[key], rel=2e-3), (a["step"], key, a[key], b[key])
