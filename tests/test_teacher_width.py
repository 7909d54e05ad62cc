"""A teacher of another width and depth than the student (issue 42 item 1: Wan2.1-14B beside a 1.3B student),
through the real trainer, in every method that reads a teacher: DMD2 and Self-Forcing (critic at the student's
width, as ``distill.critic_init: base`` starts it), PDD and DM-PDD. Only latents and prompt embeddings pass
between the roles, so the teacher's width is its own: each run trains (finite losses), the teacher's transformer
is the wide one and the checkpointed student keeps its own width."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import read_log, run_config, train_in_process

from distillery.tinybase.tiny import TinyBaseConfig, TinyTransformerConfig, make_tiny_base

WAN = "distillery.models.wan.WanModel"


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory) -> Path:
    """A second tiny base: the same VAE and text encoder (latent channels, text width), a transformer of 6 heads of
    48 (288 wide, the default's 128) and 5 blocks (the default's 4)."""
    config = TinyBaseConfig(transformer=TinyTransformerConfig(num_attention_heads=6, attention_head_dim=48, ffn_dim=640,
                                                              num_layers=5))
    return make_tiny_base(tmp_path_factory.mktemp("wide") / "tiny-wan-wide", config, seed=0)


def _config(method: str, student: Path, teacher: Path, data: Path, out: Path) -> dict:
    critic = {"_target_": WAN, "init_from": str(student), "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
    if method in ("dmd2", "self_forcing"):
        target = {"dmd2": "distillery.methods.dmd2.DMD2Method", "self_forcing": "distillery.methods.self_forcing.SelfForcingMethod"}
        cfg = run_config(student, data, out, method=target[method], steps=3, batch_size=2,
                         method_knobs={"generator_update_interval": 2, "real_score_guidance_scale": 2.0})
        if method == "self_forcing":
            cfg["models"]["student"] = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(student), "chunk_size": 1}
        cfg["models"]["critic"] = critic
    else:
        knobs = {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4, "teacher_guidance_scale": 2.0, "sampling_steps": 2}
        if method == "dm_pdd":
            knobs.update(dm_weight=0.5, generator_update_interval=2)
        target = "distillery.methods.dm_pdd.DMPDDMethod" if method == "dm_pdd" else "distillery.methods.pdd.PDDMethod"
        cfg = run_config(student, data, out, method=target, steps=3, batch_size=2, method_knobs=knobs)
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(student), "pdd_steps": 4}
        if method == "dm_pdd":
            cfg["models"]["critic"] = critic
    cfg["models"]["teacher"] = {"_target_": WAN, "init_from": str(teacher), "trainable": False}
    return cfg


def _width(folder: Path) -> tuple[int, int]:
    config = json.loads((folder / "transformer" / "config.json").read_text())
    return config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]


@pytest.mark.parametrize("method", ["dmd2", "self_forcing", "pdd", "dm_pdd"])
def test_a_wider_deeper_teacher_works_in_every_method_that_reads_one(tmp_path, tiny_base, wide_base, latent_set, method):
    assert _width(wide_base) == (288, 5) and _width(tiny_base) == (128, 4)
    result = train_in_process(_config(method, tiny_base, wide_base, latent_set, tmp_path / "run"))
    assert result.final_step == 3
    losses = [r["total_loss"] for r in read_log(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    saved = json.loads((result.checkpoint / "roles" / "student" / "config.json").read_text())
    assert saved["num_attention_heads"] * saved["attention_head_dim"] == 128 and saved["num_layers"] == 4
    meta = json.loads((result.checkpoint / "metadata.json").read_text())
    assert Path(meta["frozen_roles"]["teacher"]["path"]) == wide_base / "transformer"  # the wide teacher was the real score
