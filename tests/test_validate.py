"""The shared samplers reproduce stock WanPipeline; run_validation samples, scores and writes its outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distillery.base.shipped import shipped_tiny_base
from distillery.errors import UserError
from distillery.sampling import EulerSampler, few_step_x0, initial_noise, nfe_per_video
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
            assert torch.equal(EulerSampler().sigmas(steps, shift), sched.sigmas)
            assert torch.equal(EulerSampler().timesteps(steps, shift), sched.timesteps)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_euler_sampler_matches_stock_pipeline(pipe, embeds, guidance):
    text, negative = embeds
    noise = initial_noise(2, LATENT_SHAPE, torch.Generator().manual_seed(7))
    expected = pipe(PROMPTS[:2], negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=10,
                    guidance_scale=guidance, max_sequence_length=32, latents=noise.clone(), output_type="latent").frames
    ours = EulerSampler().sample(pipe.transformer, text, negative, LATENT_SHAPE, 10, guidance, 3.0, None, noise=noise)
    assert ours.shape == (2, *LATENT_SHAPE)
    assert (ours - expected).abs().max().item() <= 1e-5
    # without explicit noise the generator draws what the pipeline draws from the same generator
    drawn = EulerSampler().sample(pipe.transformer, text, negative, LATENT_SHAPE, 10, guidance, 3.0,
                                  torch.Generator().manual_seed(7))
    assert torch.equal(drawn, ours)


def test_few_step_x0(pipe, embeds):
    text, negative = embeds
    noise = initial_noise(2, LATENT_SHAPE, torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = few_step_x0(pipe.transformer, text, None, LATENT_SHAPE, [1000.0, 750.0, 500.0, 250.0], 1.0,
                          torch.Generator().manual_seed(1), noise=noise)
        assert out.shape == (2, *LATENT_SHAPE) and torch.isfinite(out).all()
        one = few_step_x0(pipe.transformer, text, negative, LATENT_SHAPE, [1000.0], 1.0, None, noise=noise)
        v = pipe.transformer(hidden_states=noise, timestep=torch.full((2,), 1000.0), encoder_hidden_states=text,
                             return_dict=False)[0]
    torch.testing.assert_close(one, noise - v, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="descending"):
        few_step_x0(pipe.transformer, text, None, LATENT_SHAPE, [500.0, 750.0], 1.0, None)


@pytest.fixture(scope="module")
def validation(base, tmp_path_factory):
    cfg = ValidationConfig(teacher_steps=[10, 2], progress_bar=False)
    candidates = teacher_candidates(base, cfg) + [Candidate("student", base, 2, 1.0, "few_step_x0")]
    out = tmp_path_factory.mktemp("validate") / "validate"
    metrics = run_validation(base, candidates, PROMPTS, out, cfg)
    return out, metrics, candidates


def test_run_validation_writes_samples_grid_and_plots(validation):
    import imageio.v3 as iio

    from distillery.clips.video_io import read_video

    out, _, candidates = validation
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


def test_run_validation_metrics(validation):
    out, metrics, candidates = validation
    assert json.loads((out / "metrics.json").read_text()) == metrics
    keys = ("colour", "shape", "direction", "all", "latency_s", "nfe", "distance_to_teacher")
    assert set(metrics) == {f"{c.name}/{k}" for c in candidates for k in keys}
    assert (metrics["teacher_10/nfe"], metrics["teacher_2/nfe"], metrics["student/nfe"]) == (20, 4, 2)
    assert metrics["teacher_10/nfe"] == nfe_per_video(10, 4.0)
    assert metrics["teacher_10/distance_to_teacher"] == 0.0
    assert metrics["teacher_2/distance_to_teacher"] > 0.0
    assert metrics["teacher_10/colour"] >= 2 / 3
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
