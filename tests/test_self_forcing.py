"""Self-Forcing (src/distillery/methods/self_forcing.py) on the tiny Wan: a causal student, bidirectional teacher and critic.

- with every chunk exiting at the last ladder step the rollout *is* the artifact's
  ``causal_streaming`` sampler run on the method's random stream (bitwise);
- only the exit forward of each chunk at or after ``start_gradient_frame`` keeps a graph, the
  student gets gradients only through those, the teacher never;
- the exit draws: one per chunk, shared when asked, the forwards they imply;
- configuration errors (a bidirectional student, ``data_latent``) are one clear message.

Through the trainer (2 ranks vs 1, a stopped 2-rank run resumed): ``tests/test_dmd2.py`` runs both
methods in one torchrun launch.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import nudge_weights, run_config

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.self_forcing import SelfForcingConfig, SelfForcingMethod
from distillery.models.base import Conditioning, chunk_bounds
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig
from distillery.sampling import build_sampler
from distillery.sampling.noise import RNGNoise

CHUNK = 1  # latent frames per chunk: the batch's 3 frames are 3 chunks


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, chunk_size: int = CHUNK, **knobs) -> SelfForcingMethod:
    models = {"student": CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), trainable=True, chunk_size=chunk_size),
                                        "student")}
    for role in ("teacher", "critic"):
        models[role] = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=role == "critic"), role)
    for model in models.values():
        model.bind_device(torch.device("cpu"))
    nudge_weights(models["critic"].transformer)  # a critic that differs from the teacher
    method = SelfForcingMethod(SelfForcingConfig(**knobs), models, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def raw_batch(b: int = 2, frames: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(b, 8, frames, 8, 8, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g),
            "empty_text_embeds": torch.randn(8, 32, generator=g)}


def student_calls(method: SelfForcingMethod) -> list[dict]:
    calls: list[dict] = []

    def hook(module, args, kwargs, output):
        calls.append({"t": float(kwargs["timestep"].flatten()[0]), "frames": int(kwargs["hidden_states"].shape[2]),
                      "graph": output[0].requires_grad})

    method.student.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("renoise,context_noise", [("sde", 0.0), ("ode", 0.0), ("sde", 120.0)])
def test_last_step_rollout_is_the_deployed_sampler(tiny_base, training, renoise, context_noise):
    method = make(tiny_base, training, chunk_size=2, last_step_only=True, rollout_renoise=renoise,
                  context_noise=context_noise, student_timesteps=[1000, 700, 300])
    batch = raw_batch(frames=5)  # chunks of 2, 2, 1 frames
    rng_copy = copy.deepcopy(method.rng)
    with torch.no_grad():
        got, _ = method.rollout(batch, method.draw_exit_step(batch), with_grad=False)
    contract = method.sampling_contract()
    assert contract == {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                        "timesteps": [1000.0, 700.0, 300.0], "chunk_size": 2, "context_noise": context_noise, "renoise": renoise}
    cond = Conditioning(batch["text_embeds"], batch["empty_text_embeds"].expand_as(batch["text_embeds"]))
    with torch.no_grad():
        want = build_sampler(contract).sample(method.student, cond, (8, 5, 8, 8), RNGNoise(rng_copy), guidance_scale=1.0)
    assert torch.equal(got, want)


def test_only_exit_forwards_after_start_gradient_frame_keep_a_graph(tiny_base, training):
    method = make(tiny_base, training, start_gradient_frame=1, generator_update_interval=1, real_score_guidance_scale=2.0)
    calls = student_calls(method)
    exits = [2, 0, 3]
    method.draw_exit_step = lambda batch: list(exits)
    out = method.single_train_step(raw_batch(), step=1)
    # chunk c: k_c + 1 ladder forwards, then (not after the last chunk) one context write at t = 0
    expected = []
    for c, k in enumerate(exits):
        expected += [(method.ladder[j], c >= 1 and j == k) for j in range(k + 1)]
        if c < len(exits) - 1:
            expected.append((0.0, False))
    assert [(c["t"], c["graph"]) for c in calls] == [(pytest.approx(t), g) for t, g in expected]
    assert all(c["frames"] == CHUNK for c in calls)
    assert out.metrics["exit_step/chunk2"] == 3.0 and float(out.metrics["exit_step"]) == pytest.approx(5 / 3)
    method.backward(out)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.student.transformer.parameters())
    assert all(p.grad is None for p in method.teacher.transformer.parameters())
    assert method.causal.cached_frames("rollout") == 0  # the rollout leaves no cache behind


def test_no_chunk_with_a_graph_trains_only_the_critic(tiny_base, training):
    method = make(tiny_base, training, start_gradient_frame=99, generator_update_interval=1)
    out = method.single_train_step(raw_batch(), step=1)
    assert "generator_loss" in out.losses and not out.losses["total_loss"].isnan()
    method.backward(out)
    assert all(p.grad is None for p in method.student.transformer.parameters())
    assert any(p.grad is not None for p in method.critic.transformer.parameters())


def test_exit_draws(tiny_base, training):
    assert chunk_bounds(5, 2) == [(0, 2), (2, 2), (4, 1)] and chunk_bounds(3, 4) == [(0, 3)]
    method = make(tiny_base, training)
    draws = [method.draw_exit_step(raw_batch()) for _ in range(30)]
    assert all(len(d) == 3 and all(0 <= e < 4 for e in d) for d in draws)
    assert any(len(set(d)) > 1 for d in draws) and len({tuple(d) for d in draws}) > 5
    assert len({method.exit_code(d) for d in draws}) == len({tuple(d) for d in draws})  # the code tells draws apart
    shared = make(tiny_base, training, same_step_across_chunks=True)
    assert all(len(set(shared.draw_exit_step(raw_batch()))) == 1 for _ in range(10))
    last = make(tiny_base, training, last_step_only=True, num_student_steps=3)
    assert last.draw_exit_step(raw_batch()) == [2, 2, 2]


def test_config_errors(tiny_base, training):
    with pytest.raises(ValueError, match="simulate"):
        SelfForcingConfig(rollout="data_latent")
    for bad in ({"context_noise": -1.0}, {"context_noise": 1000.0}, {"start_gradient_frame": -1}):
        with pytest.raises(ValueError):
            SelfForcingConfig(**bad)
    models = {role: WanModel(WanModelConfig(init_from=str(tiny_base), trainable=role != "teacher"), role)
              for role in ("student", "teacher", "critic")}
    with pytest.raises(UserError, match="CausalModelBase as its student"):
        SelfForcingMethod(SelfForcingConfig(), models, training)
