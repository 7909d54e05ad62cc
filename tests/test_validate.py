"""The shared samplers reproduce stock WanPipeline; run_validation samples, scores and writes its outputs."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distillery.tinybase.shipped import shipped_tiny_base
from distillery.errors import UserError
from distillery.models.base import Conditioning
from distillery.models.schedule import FlowMatchSchedule
from distillery.models.wan import load_inference_model
from distillery.sampling import GeneratorNoise, build_sampler
from distillery.validate import Candidate, ValidationConfig, run_validation, teacher_candidates

PROMPTS = [
    "a red circle moving left slowly on a black background",
    "a blue square moving up quickly on a black background",
    "a yellow triangle moving right slowly on a black background",
]
LATENT_SHAPE = (8, 5, 8, 8)  # tiny base: z_dim 8, 17 frames → 5, 32 px → 8


@pytest.fixture(scope="module")
def base() -> Path:
    return shipped_tiny_base()


@pytest.fixture(scope="module")
def pipe(base):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(base), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def model(base):
    """The base's transformer as a frozen model plugin (what the samplers call)."""
    return load_inference_model(base, "cpu")


def initial_noise(batch: int, latent_shape, generator: torch.Generator) -> torch.Tensor:
    return GeneratorNoise(generator).randn((batch, *latent_shape), "cpu")


def euler(model, text, negative, steps, guidance, shift, generator, noise=None):
    sampler = build_sampler({"sampler": "euler", "shift": shift, "num_train_timesteps": 1000})
    return sampler.sample(model, Conditioning(text, negative), LATENT_SHAPE, generator, num_steps=steps,
                          guidance_scale=guidance, initial=noise)


def few_step_x0(model, text, negative, ladder, guidance, generator, noise=None):
    sampler = build_sampler({"sampler": "few_step_x0", "shift": 3.0, "timesteps": ladder})
    return sampler.sample(model, Conditioning(text, negative), LATENT_SHAPE, generator, guidance_scale=guidance,
                          initial=noise)


@pytest.fixture(scope="module")
def embeds(base):
    """Padded prompt embeddings ``[2, 32, D]`` and the empty prompt's, from the base's encoders."""
    from distillery.data.encoders import BaseEncoders

    enc = BaseEncoders(base)
    rows = enc.encode_prompts(PROMPTS[:2] + ["", ""])
    padded = torch.stack([torch.cat([r, r.new_zeros(enc.max_sequence_length - r.shape[0], r.shape[1])]) for r in rows])
    return padded[:2], padded[2:]


def test_sigma_grid_is_diffusers_grid():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (1.0, 3.0, 5.0):
        for steps in (1, 2, 4, 10, 40):
            sched = FlowMatchEulerDiscreteScheduler(shift=shift)
            sched.set_timesteps(steps)
            assert torch.equal(FlowMatchSchedule(shift).inference_sigmas(steps), sched.sigmas)
            assert torch.equal(FlowMatchSchedule(shift).inference_timesteps(steps), sched.timesteps)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_euler_sampler_matches_stock_pipeline(pipe, model, embeds, guidance):
    text, negative = embeds
    noise = initial_noise(2, LATENT_SHAPE, torch.Generator().manual_seed(7))
    expected = pipe(PROMPTS[:2], negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=10,
                    guidance_scale=guidance, max_sequence_length=32, latents=noise.clone(), output_type="latent").frames
    ours = euler(model, text, negative, 10, guidance, 3.0, None, noise=noise)
    assert ours.shape == (2, *LATENT_SHAPE)
    assert (ours - expected).abs().max().item() <= 1e-5
    # without explicit noise the generator draws what the pipeline draws from the same generator
    drawn = euler(model, text, negative, 10, guidance, 3.0, torch.Generator().manual_seed(7))
    assert torch.equal(drawn, ours)


def few_step_by_hand(transformer, text, negative, noise, ladder, guidance, generator):
    """DMD-style few-step sampling written out: x0 = x_t − σ v, re-noised with fresh ε to the next σ."""
    x, x0 = noise, None
    for k, t in enumerate(ladder):
        sigma = t / 1000.0
        step = torch.full((noise.shape[0],), t)
        v = transformer(hidden_states=x, timestep=step, encoder_hidden_states=text, return_dict=False)[0]
        if guidance > 1.0:
            u = transformer(hidden_states=x, timestep=step, encoder_hidden_states=negative, return_dict=False)[0]
            v = u + guidance * (v - u)
        x0 = x - sigma * v
        if k + 1 < len(ladder):
            eps = torch.randn(noise.shape, generator=generator)
            x = (1.0 - ladder[k + 1] / 1000.0) * x0 + ladder[k + 1] / 1000.0 * eps
    return x0


@pytest.mark.parametrize("ladder, guidance", [([1000.0, 750.0, 500.0, 250.0], 1.0), ([1000.0, 600.0, 200.0], 4.0),
                                              ([1000.0], 1.0)])
def test_few_step_x0_matches_the_loop_written_out(pipe, model, embeds, ladder, guidance):
    text, negative = embeds
    noise = initial_noise(2, LATENT_SHAPE, torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = few_step_x0(model, text, negative, ladder, guidance, torch.Generator().manual_seed(1), noise=noise)
        expected = few_step_by_hand(pipe.transformer, text, negative, noise, ladder, guidance, torch.Generator().manual_seed(1))
        drawn = few_step_x0(model, text, negative, ladder, guidance, torch.Generator().manual_seed(3))
    assert out.shape == (2, *LATENT_SHAPE)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    if len(ladder) == 1:  # the generator only draws the initial noise, as initial_noise does
        assert torch.equal(drawn, out)
    with pytest.raises(UserError, match="descending"):  # a bad ladder in a sampling contract is the user's to fix
        few_step_x0(model, text, None, [500.0, 750.0], 1.0, None)


@pytest.fixture(scope="module")
def validation(base, tmp_path_factory):
    cfg = ValidationConfig(teacher_steps=[10, 2], progress_bar=False)
    candidates = teacher_candidates(base, cfg) + [Candidate("student", base, 2, 1.0, "few_step_x0")]
    out = tmp_path_factory.mktemp("validate") / "validate"
    started = time.perf_counter()
    metrics = run_validation(base, candidates, PROMPTS, out, cfg)
    return out, metrics, candidates, time.perf_counter() - started


def _diffusers_timesteps(steps: int, shift: float) -> list[float]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    return [float(t) for t in sched.timesteps]


def decode_by_hand(vae, latents: torch.Tensor) -> np.ndarray:
    """Normalised latents ``[C, T, H, W]`` → ``uint8 [T, H, W, 3]``: un-normalise as WanPipeline, decode, round."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents[None] * std + mean).sample[0]  # [3, T, H, W] in [-1, 1]
    return ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()


def test_run_validation_writes_samples_grid_and_plots(validation):
    import imageio.v3 as iio

    from distillery.clips.video_io import read_video

    out, _, candidates, _ = validation
    for cand in candidates:
        for i in range(len(PROMPTS)):
            frames, fps = read_video(out / "samples" / cand.name / f"{i}.mp4")
            assert frames.shape == (17, 32, 32, 3) and fps == pytest.approx(8.0)
        from safetensors.torch import load_file

        latents = load_file(out / "samples" / cand.name / "latents.safetensors")
        assert sorted(latents) == [str(i) for i in range(len(PROMPTS))]
        assert all(t.shape == LATENT_SHAPE and t.dtype == torch.float32 for t in latents.values())
    rows, cols = len(candidates), len(PROMPTS)
    size = (rows * 33 - 1, cols * 33 - 1)
    grid_mp4, _ = read_video(out / "grid.mp4")
    assert grid_mp4.shape == (17, *size, 3)
    grid_gif = iio.imread(out / "grid.gif", index=None)
    assert grid_gif.shape[1:3] == size
    tile = read_video(out / "samples" / "teacher_2" / "1.mp4")[0]
    assert np.abs(grid_mp4[:, 33:65, 33:65].astype(int) - tile.astype(int)).max() <= 2  # row 1, column 1
    with (out / "plots" / "adherence.csv").open() as fh:
        plot = list(csv.DictReader(fh))
    assert [r["candidate"] for r in plot] == ["teacher_10", "teacher_2", "student"]
    assert [int(r["nfe"]) for r in plot] == [20, 4, 2]
    assert not list(out.parent.glob(".validate.*"))  # no temp folders left behind


def test_run_validation_metrics(validation, pipe, embeds):
    """Every metric recomputed from the saved latents: decode them by hand, score and compare them."""
    from safetensors.torch import load_file

    from distillery.clips.analyzer import AnalyzerConfig, score

    out, metrics, candidates, wall_s = validation
    assert json.loads((out / "metrics.json").read_text()) == metrics
    keys = ("colour", "shape", "direction", "all", "latency_s", "nfe", "distance_to_teacher")
    assert set(metrics) == {f"{c.name}/{k}" for c in candidates for k in keys}
    assert (metrics["teacher_10/nfe"], metrics["teacher_2/nfe"], metrics["student/nfe"]) == (20, 4, 2)  # steps × (2 with CFG)
    latents = {c.name: load_file(out / "samples" / c.name / "latents.safetensors") for c in candidates}
    # the reference's latents are what stock WanPipeline returns for the prompt and seed (seed + i)
    expected = pipe(PROMPTS[0], negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=10,
                    guidance_scale=4.0, max_sequence_length=32, generator=torch.Generator().manual_seed(0),
                    output_type="latent").frames[0]
    torch.testing.assert_close(latents["teacher_10"]["0"], expected, rtol=0, atol=1e-5)
    # the student's are the 2-step x0 loop on the first two Euler timesteps, written out
    generator = torch.Generator().manual_seed(1)  # prompt 1: seed 0 + 1 draws the noise, then each re-noising ε
    with torch.no_grad():
        noise = torch.randn((1, *LATENT_SHAPE), generator=generator)
        ladder = _diffusers_timesteps(2, 3.0)  # the default ladder: the first 2 timesteps of the Euler grid
        student = few_step_by_hand(pipe.transformer, embeds[0][1:2], None, noise, ladder, 1.0, generator)
    torch.testing.assert_close(latents["student"]["1"], student[0], rtol=0, atol=1e-5)
    frames = {c.name: [decode_by_hand(pipe.vae, latents[c.name][str(i)]) for i in range(len(PROMPTS))] for c in candidates}
    analyzer = AnalyzerConfig(**json.loads((Path(shipped_tiny_base()) / "analyzer.json").read_text()))
    report = json.loads((out / "report.json").read_text())
    for c in candidates:
        ref = [f.astype(np.float64) / 255.0 for f in frames["teacher_10"]]
        distance = np.mean([np.mean((f.astype(np.float64) / 255.0 - r) ** 2) for f, r in zip(frames[c.name], ref)])
        assert metrics[f"{c.name}/distance_to_teacher"] == pytest.approx(distance, abs=1e-6), c.name
        scores = [score(f, p, analyzer) for f, p in zip(frames[c.name], PROMPTS)]
        for key in ("colour", "shape", "direction", "all"):
            assert metrics[f"{c.name}/{key}"] == pytest.approx(sum(s[key] for s in scores) / len(PROMPTS), abs=1e-6), (c.name, key)
        per_prompt = [r["latency_s"] for r in report["per_prompt"][c.name]]
        assert metrics[f"{c.name}/latency_s"] == pytest.approx(np.mean(per_prompt), abs=2e-6), c.name
    assert metrics["teacher_2/distance_to_teacher"] > 1e-4  # 2 steps do not land on the 10-step videos
    # per-video latency is measured inside the call: all the videos together took less than the whole run
    assert sum(metrics[f"{c.name}/latency_s"] for c in candidates) * len(PROMPTS) < wall_s
    assert all(metrics[f"{c.name}/latency_s"] > 0 for c in candidates)


def test_candidate_errors(base, tmp_path):
    with pytest.raises(UserError, match="letters"):
        Candidate("bad/name", base, 2, 1.0)
    with pytest.raises(UserError, match="unknown sampler"):
        Candidate("x", base, 2, 1.0, "heun")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="unique"):
        run_validation(base, [Candidate("a", base, 1, 1.0)] * 2, PROMPTS, tmp_path / "v", ValidationConfig())
    with pytest.raises(UserError, match="grid_formats"):
        ValidationConfig(grid_formats=["avi"])


def test_candidate_from_an_artifacts_sampling_contract(base, tmp_path):
    artifact = tmp_path / "model"
    artifact.mkdir()
    (artifact / "sampling.json").write_text(json.dumps(
        {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000, 500]}))
    cand = Candidate.from_artifact("student", artifact)
    assert cand == Candidate("student", artifact, 2, 1.0, "few_step_x0", timesteps=(1000.0, 500.0), shift=3.0)
    assert cand.nfe == 2 and Candidate.from_artifact("s", artifact, guidance_scale=4.0).nfe == 4
    assert cand.sampling_contract(3.0) == {"num_train_timesteps": 1000, "sampler": "few_step_x0", "shift": 3.0,
                                           "timesteps": [1000.0, 500.0]}
    euler = tmp_path / "teacher"
    euler.mkdir()
    (euler / "sampling.json").write_text(json.dumps({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}))
    assert Candidate.from_artifact("t", euler, 10, 4.0) == Candidate("t", euler, 10, 4.0, "euler", shift=3.0)
    with pytest.raises(UserError, match="ladder"):
        Candidate.from_artifact("s", artifact, num_steps=3)
    with pytest.raises(UserError, match="sampling.json not found"):
        Candidate.from_artifact("s", base)
    (euler / "sampling.json").write_text(json.dumps({"sampler": "pdd_fused_v9"}))
    from distillery.sampling import sampler_names

    assert {"euler", "few_step_x0"} <= set(sampler_names())
    with pytest.raises(UserError, match=f"unknown sampler 'pdd_fused_v9'; valid: {', '.join(sampler_names())}$"):
        Candidate.from_artifact("s", euler)
