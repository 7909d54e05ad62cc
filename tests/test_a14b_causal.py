"""Causal students of two experts (Wan 2.2 A14B, issue 63 item 2): each expert keeps its own KV cache, each streaming
call goes to the expert of its timestep, a cache write goes into both; Self-Forcing trains such a student (its rollout
the deployed ``causal_streaming`` sampler, both experts trained, its teacher's real score by expert); the export's
shipped samplers sample it as the package does; DFSFT (TFSFT too), causal KD and causal CD, whose one forward spans both
experts, are one line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import nudge_weights, run_config

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.self_forcing import SelfForcingConfig, SelfForcingMethod
from distillery.models.base import Conditioning
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig
from distillery.sampling import build_sampler
from distillery.sampling.noise import RNGNoise
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO

BOUNDARY = A14B_BOUNDARY_RATIO * 1000
LADDER = [1000.0, 900.0, 500.0]  # two steps of the high-noise expert, one of the low-noise one


def causal(folder: Path, chunk_size: int = 1, trainable: bool = False) -> CausalWanModel:
    model = CausalWanModel(CausalWanModelConfig(init_from=str(folder), trainable=trainable, chunk_size=chunk_size), "student")
    model.bind_device(torch.device("cpu"))
    return model


def expert_calls(model) -> list[int]:
    seen: list[int] = []
    for index, expert in enumerate(model.transformer.experts):
        expert.register_forward_hook(lambda m, a, k, o, index=index: seen.append(index), with_kwargs=True)
    return seen


def test_each_expert_streams_through_its_own_cache(a14b):
    """Chunk by chunk with store_kv (the same timestep each call) = the full block-causal forward, on either side of
    the boundary; a storing call runs both experts (each writes its cache), a denoising call only its timestep's."""
    model = causal(a14b)
    g = torch.Generator().manual_seed(0)
    video, text = torch.randn(2, 8, 3, 8, 8, generator=g), torch.randn(2, 6, 32, generator=g)
    cond = Conditioning(text)
    seen = expert_calls(model)
    for t, expert in ((950.0, 0), (BOUNDARY, 0), (300.0, 1)):
        ts = torch.full((2,), t)
        with torch.no_grad():
            full = model.predict_noise(video, ts, cond)
            seen.clear()
            parts = [model.predict_noise_streaming(video[:, :, f:f + 1], ts, cond, cache_tag="c", store_kv=True,
                                                   cur_start_frame=f) for f in range(3)]
            assert seen == [0, 1] * 3 and model.cached_frames("c") == 3
            seen.clear()
            again = model.predict_noise_streaming(video[:, :, 2:3], ts, cond, cache_tag="d", store_kv=False, cur_start_frame=0)
            assert seen == [expert]
        model.clear_caches()
        assert model.cached_frames("c") == 0
        torch.testing.assert_close(torch.cat(parts, dim=2), full, rtol=0, atol=1e-5)
        other = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "x")
        alone = other.transformer.experts[expert](hidden_states=video[:, :, 2:3], timestep=ts, encoder_hidden_states=text,
                                                  return_dict=False)[0]
        torch.testing.assert_close(again, alone.float(), rtol=0, atol=1e-5)  # one chunk: the expert's bidirectional forward
    with pytest.raises(ValueError, match="fall to both experts"):
        model.predict_noise_streaming(video[:, :, :1], torch.tensor([950.0, 300.0]), cond, cache_tag="e", store_kv=False,
                                      cur_start_frame=0)


def test_the_caches_are_the_experts_own(a14b):
    """After a context write, a low-noise step reads the low-noise expert's keys of that context, not the high one's:
    swapping the high-noise expert's weights changes a high step's chunk 1, not a low step's."""
    model = causal(a14b)
    g = torch.Generator().manual_seed(1)
    video, cond = torch.randn(1, 8, 2, 8, 8, generator=g), Conditioning(torch.randn(1, 6, 32, generator=g))

    def step(t: float) -> torch.Tensor:
        model.clear_caches()
        with torch.no_grad():
            model.predict_noise_streaming(video[:, :, :1], torch.zeros(1), cond, cache_tag="c", store_kv=True, cur_start_frame=0)
            return model.predict_noise_streaming(video[:, :, 1:], torch.full((1,), t), cond, cache_tag="c", store_kv=False,
                                                 cur_start_frame=1)

    high, low = step(950.0), step(300.0)
    nudge_weights(model.transformer.transformer)
    assert not torch.equal(step(950.0), high) and torch.equal(step(300.0), low)


@pytest.fixture(scope="module")
def training(a14b, latent_set):
    return load_run_config(raw=run_config(a14b, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(a14b: Path, training, **knobs) -> SelfForcingMethod:
    models = {"student": causal(a14b, trainable=True)}
    for role in ("teacher", "critic"):
        models[role] = WanModel(WanModelConfig(init_from=str(a14b), trainable=role == "critic"), role)
        models[role].bind_device(torch.device("cpu"))
    nudge_weights(models["critic"].transformer)
    method = SelfForcingMethod(SelfForcingConfig(student_timesteps=LADDER, **knobs), models, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def raw_batch(b: int = 2, frames: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"latents": torch.randn(b, 8, frames, 8, 8, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g),
            "empty_text_embeds": torch.randn(8, 32, generator=g)}


@pytest.mark.parametrize("renoise,context_noise", [("sde", 0.0), ("ode", 50.0)])
def test_self_forcing_rollout_on_two_experts_is_the_deployed_sampler(a14b, training, renoise, context_noise):
    method = make(a14b, training, last_step_only=True, rollout_renoise=renoise, context_noise=context_noise)
    batch = raw_batch()
    rng = copy.deepcopy(method.rng)
    with torch.no_grad():
        got, _ = method.rollout(batch, method.draw_exit_step(batch), with_grad=False)
    contract = method.sampling_contract()
    cond = Conditioning(batch["text_embeds"], batch["empty_text_embeds"].expand_as(batch["text_embeds"]))
    with torch.no_grad():
        want = build_sampler(contract).sample(method.student, cond, (8, 3, 8, 8), RNGNoise(rng), guidance_scale=1.0)
    assert torch.equal(got, want)


def test_self_forcing_trains_each_expert_on_its_own_steps(a14b, training):
    """Chunk 0 exits at t = 1000 (the high-noise expert), chunk 2 at t = 500 (the low-noise one): the student's
    gradient reaches both experts; a step whose exits are all high reaches only the high-noise one. The teacher's real
    score guides its experts with their own scales (``real_score_guidance_scale_2``)."""
    method = make(a14b, training, generator_update_interval=1, real_score_guidance_scale=4.0, real_score_guidance_scale_2=2.0)
    high, low = method.student.transformer.experts
    for exits, reached in (([0, 1, 2], (True, True)), ([0, 1, 0], (True, False))):
        method.draw_exit_step = lambda batch, exits=exits: list(exits)
        for p in method.student.transformer.parameters():
            p.grad = None
        out = method.single_train_step(raw_batch(), step=1)
        method.backward(out)
        got = tuple(any(p.grad is not None and p.grad.abs().sum() > 0 for p in e.parameters()) for e in (high, low))
        assert got == reached, exits
    assert method.causal.cached_frames("rollout") == 0


def test_the_shipped_samplers_stream_a_two_expert_student_as_the_package_does(a14b, tmp_path):
    """The export's causal denoiser over both experts (its own cache each) and its samplers give the package's latents
    bit for bit: streaming with CFG and a context noise, and the block-causal Euler."""
    import json
    import shutil

    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.models import registry

    model_dir = tmp_path / "model"
    student = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "s")
    nudge_weights(student.transformer)
    student.transformer.save_pretrained(model_dir / "transformer", safe_serialization=True)
    shutil.copytree(a14b / "scheduler", model_dir / "scheduler")
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    for contract, steps, guidance in (
            ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": LADDER,
              "chunk_size": 2, "context_noise": 50.0, "renoise": "sde", "guidance_scale_2": 2.0}, None, 3.0),
            ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 2}, 4, 2.5)):
        (model_dir / "sampling.json").write_text(json.dumps(contract))
        package = build_sampler(contract)
        plugin = registry.load_inference_model(model_dir, shift=3.0, **package.model_options())
        assert plugin.boundary_timestep == BOUNDARY
        expected = package.sample(plugin, Conditioning(text, negative), (8, 5, 4, 4), torch.Generator().manual_seed(5),
                                  num_steps=steps, guidance_scale=guidance)
        shipped = distilled_samplers.build_sampler(contract)
        got = shipped.sample(shipped_denoiser(model_dir, shipped.model_kind()), distilled_wan.Conditioning(text, negative),
                             (8, 5, 4, 4), torch.Generator().manual_seed(5), num_steps=steps, guidance_scale=guidance)
        assert torch.equal(got, expected), contract["sampler"]


@pytest.mark.parametrize("method,student", [
    ("distillery.methods.dfsft.DFSFTMethod", "distillery.models.wan.CausalWanModel"),
    ("distillery.methods.dfsft.DFSFTMethod", "distillery.models.wan.WanModel"),
    ("distillery.methods.tfsft.TFSFTMethod", "distillery.models.wan.CausalWanModel"),
    ("distillery.methods.kd.KDMethod", "distillery.models.wan.CausalWanModel"),
    ("distillery.methods.causal_cd.CausalCDMethod", "distillery.models.wan.CausalWanModel")])
def test_methods_whose_one_forward_spans_both_experts_are_one_line(a14b, latent_set, tmp_path, method, student):
    from helpers import train_in_process

    knobs = {"methods.kd.": {"chunk_size": 1, "t_list": [999.0, 500.0, 0.0]}, "methods.causal_cd.": {}}
    cfg = run_config(a14b, latent_set, tmp_path / "run", method=method,
                     method_knobs=next((v for k, v in knobs.items() if k in method), {"chunk_size": 1}), steps=1)
    cfg["models"]["student"] = {"_target_": student, "init_from": str(a14b),
                                **({"chunk_size": 1} if student.endswith("CausalWanModel") else {})}
    if "causal_cd" in method:  # its frozen teacher: the same two experts, bidirectional
        cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(a14b), "trainable": False}
    with pytest.raises(UserError, match="two experts .*span both experts in one forward"):
        train_in_process(cfg)
