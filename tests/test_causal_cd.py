"""Causal consistency distillation (src/distillery/methods/causal_cd.py) on the tiny Wan.

- one step: the student alone gets gradients (the teacher and the target network none), the target is the student's
  frozen twin computing with its shadow weights; it stays the initial weights until ``target_start_step`` and takes
  an EMA step after each update from then on;
- a causal teacher is run under teacher forcing, a bidirectional one on the whole video;
- refusals, one line each: a bidirectional student (from the config, before any weights load), a prompt-only set,
  guidance without the empty prompt's embedding, an image-to-video student.

Its loss and gradients against FastVideo's own code: tests/test_fastvideo_differential.py. Through the trainer (1 rank
≡ 2 ranks, a stopped run resumed bit for bit): tests/test_consistency_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import nudge_weights, prompt_twin, run_config, tiny_raw_batch

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.causal_cd import CausalCDConfig, CausalCDMethod, discrete_grid
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig

TARGET = "distillery.methods.causal_cd.CausalCDMethod"


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, causal_teacher: bool = True, **knobs) -> CausalCDMethod:
    student = CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), trainable=True, chunk_size=1), "student")
    if causal_teacher:
        teacher = CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), trainable=False, chunk_size=1), "teacher")
    else:
        teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
    nudge_weights(teacher.transformer)
    method = CausalCDMethod(CausalCDConfig(**{"num_discrete_steps": 8, **knobs}), {"student": student, "teacher": teacher},
                            training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def test_the_grid_is_the_shifted_euler_grid_without_its_end(tiny_base, training):
    method = make(tiny_base, training)
    s, n = method.teacher.schedule.shift, 8
    expected = [1000 * s * (1 - i / n) / (1 + (s - 1) * (1 - i / n)) for i in range(n)]
    torch.testing.assert_close(method.grid, torch.tensor(expected), rtol=0, atol=1e-3)
    assert method.grid[0] == 1000.0 and method.grid[-1] > 0
    assert torch.equal(discrete_grid(method.teacher.schedule, n), method.grid)


def test_only_the_student_learns_and_the_target_follows_from_its_start_step(tiny_base, training):
    method = make(tiny_base, training, target_start_step=2, target_decay=0.5)
    target = method.shadows["target"].tensors["transformer"]
    twin = dict(method.target.transformer.named_parameters())
    assert target["proj_out.weight"] is twin["proj_out.weight"]  # the target network computes with the shadow
    initial = {n: t.clone() for n, t in target.items()}
    for step in (1, 2):
        out = method.single_train_step(tiny_raw_batch(), step)
        assert torch.isfinite(out.losses["total_loss"]) and out.losses["total_loss"] > 0
        method.backward(out)
        assert all(p.grad is not None for p in method.student.transformer.parameters())
        assert all(p.grad is None for p in method.teacher.transformer.parameters())
        assert all(p.grad is None for p in method.target.transformer.parameters())
        method.optimizers_step(step)
        method.zero_grad(step)
        weights = dict(method.student.transformer.named_parameters())
        if step == 1:  # before target_start_step: the target is the initial student
            assert all(torch.equal(t, initial[n]) for n, t in target.items())
        else:
            assert all(torch.equal(t, torch.lerp(initial[n], weights[n].detach(), 0.5)) for n, t in target.items())
    assert method.sampling_contract() == {"sampler": "euler", "shift": method.student.schedule.shift,
                                          "num_train_timesteps": 1000, "chunk_size": 1}


@pytest.mark.parametrize("causal_teacher", [True, False])
def test_the_teacher_is_teacher_forced_when_causal(tiny_base, training, causal_teacher):
    """A causal teacher's forwards take the clean context (the teacher-forcing call), a bidirectional one's the
    noisy video alone; both one conditional and one unconditional forward (guidance 3)."""
    method = make(tiny_base, training, causal_teacher=causal_teacher)
    calls: list[int] = []
    method.teacher.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[2]),
                                                     with_kwargs=True)
    method.single_train_step(tiny_raw_batch(), 1)
    assert calls == ([6, 6] if causal_teacher else [3, 3])  # [clean | noisy] frames, or the 3 noisy ones


def test_refusals_are_one_line(tiny_base, latent_set, training, tmp_path):
    from distillery.engine.batches import check_data_kind
    from distillery.engine.builder import check_roles_early

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method=TARGET)
    cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(tiny_base), "trainable": False}
    with pytest.raises(UserError, match="CausalCDMethod needs a CausalModelBase as its student"):
        check_roles_early(load_run_config(raw=cfg, prefixes=allowed_prefixes()))
    cfg["models"]["student"] = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(tiny_base), "chunk_size": 1}
    cfg["training"]["data"]["path"] = str(prompt_twin(latent_set, tmp_path / "prompts"))
    with pytest.raises(UserError, match="holds prompt embeddings only .* CausalCDMethod trains on video latents"):
        check_data_kind(load_run_config(raw=cfg, prefixes=allowed_prefixes()))
    method = make(tiny_base, training)
    batch = {k: v for k, v in tiny_raw_batch().items() if k != "empty_text_embeds"}
    with pytest.raises(UserError, match="no empty_prompt.safetensors, the empty prompt's embedding that a teacher guidance"):
        method.single_train_step(batch, 1)
    make(tiny_base, training, guidance_scale=1.0).single_train_step(batch, 1)  # conditional only: no empty prompt needed


def test_an_image_to_video_student_is_refused(tmp_path, training):
    from distillery.tinybase.tiny_i2v import make_tiny_i2v_base

    base = make_tiny_i2v_base(tmp_path / "i2v", seed=0, captions=["a red circle"])
    student = CausalWanModel(CausalWanModelConfig(init_from=str(base), trainable=True, chunk_size=1), "student")
    teacher = WanModel(WanModelConfig(init_from=str(base), trainable=False), "teacher")
    with pytest.raises(UserError, match="causal consistency distillation of an image-to-video student is not supported"):
        CausalCDMethod(CausalCDConfig(), {"student": student, "teacher": teacher}, training)
