"""Every method that trains a Wan student trains it with block-sparse attention (``models.student.attention: sparse``,
issue 64): SFT, DFSFT, KD, DMD2, Self-Forcing, PDD and DM-PDD, each through the trainer for two steps with a sparse
student (frame tiles of 2 × 2 tokens; a query tile keeps half the key tiles it may attend: the tiny set's 3 latent
frames of 4 × 4 tokens are 12 tiles). Its self-attention went through the sparse attention (the real one, counted:
block-causally for a causal student), its checkpoint records the attention it trained with, and the exported
transformer samples with it (``attention: auto``). The attention itself is checked against its dense masked
reference, and sparsity 0 against dense attention, in ``test_sparse_attention.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import read_log, run_config, train_in_process

from distillery.data.demo import make_demo_latents

WAN, CAUSAL, PDD = "distillery.models.wan.WanModel", "distillery.models.wan.CausalWanModel", "distillery.models.wan.PDDWanModel"
T_LIST = [999.0, 833.0, 0.0]
SPARSE = {"attention": "sparse", "sparsity": 0.5, "sparse_tile": [1, 2, 2]}
CRITIC = {"_target_": WAN, "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
TEACHER = {"_target_": WAN, "trainable": False}

METHODS = {  # name: (method target, knobs, student, other roles, data: latents | trajectories)
    "sft": ("distillery.methods.sft.SFTMethod", {}, {"_target_": WAN}, {}, "latents"),
    "dfsft": ("distillery.methods.dfsft.DFSFTMethod", {"chunk_size": 1}, {"_target_": CAUSAL, "chunk_size": 1}, {}, "latents"),
    "kd": ("distillery.methods.kd.KDMethod", {"t_list": T_LIST}, {"_target_": WAN}, {}, "trajectories"),
    "dmd2": ("distillery.methods.dmd2.DMD2Method", {"generator_update_interval": 1, "real_score_guidance_scale": 2.0},
             {"_target_": WAN}, {"critic": CRITIC, "teacher": TEACHER}, "latents"),
    "self_forcing": ("distillery.methods.self_forcing.SelfForcingMethod",
                     {"generator_update_interval": 1, "real_score_guidance_scale": 2.0, "context_noise": 50.0},
                     {"_target_": CAUSAL, "chunk_size": 1}, {"critic": CRITIC, "teacher": TEACHER}, "latents"),
    "pdd": ("distillery.methods.pdd.PDDMethod", {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4,
                                                  "teacher_guidance_scale": 2.0, "sampling_steps": 2},
            {"_target_": PDD, "pdd_steps": 4}, {"teacher": TEACHER}, "latents"),
    "dm_pdd": ("distillery.methods.dm_pdd.DMPDDMethod", {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4,
                                                          "teacher_guidance_scale": 2.0, "sampling_steps": 2, "dm_weight": 0.5,
                                                          "generator_update_interval": 1},
               {"_target_": PDD, "pdd_steps": 4}, {"teacher": TEACHER, "critic": CRITIC}, "latents"),
}


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory) -> Path:
    """A set shaped like KD's trajectory set: each row's channels hold len(T_LIST) points of 8 latent channels."""
    return make_demo_latents(tmp_path_factory.mktemp("trajectories") / "data", num_samples=4, rows_per_shard=4,
                             channels=8 * len(T_LIST))


def _run(out: Path, name: str, base: Path, data: Path) -> Path:
    target, knobs, student, others, _ = METHODS[name]
    cfg = run_config(base, data, out, method=target, method_knobs=dict(knobs), steps=2, batch_size=2, save_every=2)
    cfg["models"] = {"student": {**student, "init_from": str(base), **SPARSE},
                     **{role: {**spec, "init_from": str(base)} for role, spec in others.items()}}
    train_in_process(cfg)
    return out


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_trains_a_sparse_student(tmp_path, tiny_base, latent_set, trajectories, name, monkeypatch):
    from distillery.export.weights import export_weights
    from distillery.models.registry import load_inference_model
    from distillery.models.wan import causal, sparse

    calls = {"bidirectional": 0, "causal": 0}

    def counted(kind, attend):  # the real attention, counted: which path every sparse student forward took
        def run(*args, **kwargs):
            calls[kind] += 1
            assert kwargs.get("causal") is not None or kind == "bidirectional"
            return attend(*args, **kwargs)
        return run

    monkeypatch.setattr(sparse, "_SAFE", counted("bidirectional", sparse.compile_safe_attention()))
    monkeypatch.setattr(causal, "video_sparse_attention", counted("causal", causal.video_sparse_attention))
    data = trajectories if METHODS[name][4] == "trajectories" else latent_set
    out = _run(tmp_path / "sparse", name, tiny_base, data)
    log = read_log(out)
    assert len(log) == 2 and all(abs(v) < 1e6 for row in log for k, v in row.items() if k.endswith("loss"))
    is_causal = "chunk_size" in METHODS[name][2]
    assert calls["causal" if is_causal else "bidirectional"] > 0 and calls["bidirectional" if is_causal else "causal"] == 0
    checkpoint = out / "checkpoint-2"
    record = json.loads((checkpoint / "roles" / "student" / "config.json").read_text())["_sparse_attention"]
    assert record == {"sparsity": 0.5, "tile": [1, 2, 2]}
    folder = export_weights(checkpoint, "student", tmp_path / "export")
    assert json.loads((folder / "config.json").read_text())["_sparse_attention"] == record
    (tmp_path / "export" / "scheduler").symlink_to(tiny_base / "scheduler", target_is_directory=True)
    options = {"chunk_size": 1} if is_causal else {"pdd_steps": 4} if name.endswith("pdd") else {}
    assert load_inference_model(tmp_path / "export", **options).sparse is not None  # validate samples it sparse
