"""The shared samplers reproduce stock WanPipeline; run_validation samples, scores and writes its outputs."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distillery.common.errors import UserError
from distillery.evaluation.candidates import Candidate, teacher_candidates
from distillery.evaluation.validate import HEADLINE_METRICS, headline_metrics, run_validation
from distillery.evaluation.validation_config import ValidationConfig, generator_seed
from distillery.evaluation.video_scores import METRIC_NAMES, SEEDED_METRICS, WARMUP_VIDEOS, latency_summary, sample_key
from distillery.models.base import Conditioning
from distillery.models.schedule import FlowMatchSchedule
from distillery.models.wan import load_inference_model
from distillery.sampling import GeneratorNoise, build_sampler
from distillery.tinybase.shipped import shipped_tiny_base

PROMPTS = [
    "a red circle moving left slowly on a black background",
    "a blue square moving up quickly on a black background",
    "a yellow triangle moving right slowly on a black background",
]
LATENT_SHAPE = (8, 5, 8, 8)  # tiny base: z_dim 8, 17 frames → 5, 32 px → 8
NUM_SEEDS = 2
VIDEO_KEYS = [(i, j) for j in range(NUM_SEEDS) for i in range(len(PROMPTS))]  # (prompt, seed index), seed-major


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
    cfg = ValidationConfig(num_seeds=NUM_SEEDS, progress_bar=False)
    candidates = teacher_candidates(base, [10, 2], 4.0) + [Candidate("student", base, 2, 1.0, "few_step_x0")]
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
    from safetensors.torch import load_file

    for cand in candidates:
        for i, j in VIDEO_KEYS:
            frames, fps = read_video(out / "samples" / cand.name / f"{sample_key(i, j)}.mp4")
            assert frames.shape == (17, 32, 32, 3) and fps == pytest.approx(8.0)
        assert len(list((out / "samples" / cand.name).glob("*.mp4"))) == len(PROMPTS) * NUM_SEEDS
        latents = load_file(out / "samples" / cand.name / "latents.safetensors")
        assert sorted(latents) == sorted(["0", "1", "2", "0_s1", "1_s1", "2_s1"])  # seed index 0 keeps the plain "<i>"
        assert all(t.shape == LATENT_SHAPE and t.dtype == torch.float32 for t in latents.values())
    rows, cols = len(candidates), len(PROMPTS)  # seed index 0 only: the grid does not grow with num_seeds
    top, left = json.loads((out / "report.json").read_text())["grid"]["origin_px"]
    grid_mp4, _ = read_video(out / "grid.mp4")
    assert grid_mp4.shape[0] == 17 and grid_mp4.shape[1] >= top + rows * 33 - 1 and grid_mp4.shape[2] >= left + cols * 33 - 1
    grid_gif = iio.imread(out / "grid.gif", index=None)
    assert grid_gif.shape[1:3] == grid_mp4.shape[1:3]
    tile = read_video(out / "samples" / "teacher_2" / "1.mp4")[0]
    y, x = top + 33, left + 33  # row 1, column 1
    assert np.abs(grid_mp4[:, y:y + 32, x:x + 32].astype(int) - tile.astype(int)).max() <= 2
    # the labels are in the video: bright text pixels left of every row, above the columns and under the grid
    frame = grid_gif[0].astype(int)
    for r in range(rows):
        assert (frame[top + r * 33: top + r * 33 + 32, :left - 4] > 200).any(), f"row {r} has no label"
    assert (frame[:top, left:] > 200).any() and (frame[top + rows * 33:, :] > 200).any()
    with (out / "plots" / "adherence.csv").open() as fh:
        plot = list(csv.DictReader(fh))
    assert [r["candidate"] for r in plot] == ["teacher_10", "teacher_2", "student"]
    assert [int(r["nfe"]) for r in plot] == [20, 4, 2]
    assert list(plot[0]) == ["candidate", "sampler", "nfe", "adherence", "adherence_std", "colour", "shape", "direction",
                             "latency_s", "distance_to_teacher", "sharpness", "frechet_distance", "frechet_distance_std"]
    assert float(plot[0]["frechet_distance"]) == 0.0 and float(plot[2]["frechet_distance"]) > 0
    image = out / "plots" / "adherence_vs_nfe.png"  # the same curve as an image, drawn offline
    assert iio.imread(image).shape[:2] == (400, 640)
    assert not list(out.parent.glob(".validate.*"))  # no temp folders left behind


def test_run_validation_metrics(validation, pipe, embeds):
    """Every metric recomputed from the saved latents: decode them by hand, score and compare them."""
    from safetensors.torch import load_file

    from distillery.clips.analyzer import AnalyzerConfig, score
    from distillery.evaluation.kid import kid
    from distillery.evaluation.video_metrics import Standardiser, frechet_distance, sharpness, video_features

    out, metrics, candidates, wall_s = validation
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert set(METRIC_NAMES) >= {f"{k}_std" for k in SEEDED_METRICS}  # every metric but nfe has a spread
    extra = {"teacher_10": ["frechet_floor", "kid_floor"]}  # the reference's noise floors, num_seeds >= 2; the others: resolved?
    expected_keys = [f"{c.name}/{k}" for c in candidates
                     for k in [*METRIC_NAMES, *extra.get(c.name, ["kid_resolved", "frechet_resolved"])]]
    assert list(metrics) == expected_keys  # candidates in input order
    assert (metrics["teacher_10/nfe"], metrics["teacher_2/nfe"], metrics["student/nfe"]) == (20, 4, 2)  # steps × (2 with CFG)
    report = json.loads((out / "report.json").read_text())
    assert report["seeds"] == [0, 1, 2] and report["num_seeds"] == NUM_SEEDS
    assert report["seed_grid"] == [[i, i + 1000] for i in range(len(PROMPTS))]
    assert report["seed_grid"] == [[generator_seed(ValidationConfig(), i, j) for j in range(NUM_SEEDS)] for i in range(3)]
    assert report["sample_keys"] == [[str(i), f"{i}_s1"] for i in range(len(PROMPTS))]
    latents = {c.name: load_file(out / "samples" / c.name / "latents.safetensors") for c in candidates}
    # the reference's latents are what stock WanPipeline returns for the prompt and generator seed (seed + i + 1000·j)
    kw = dict(negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=10, guidance_scale=4.0,
              max_sequence_length=32, output_type="latent")
    expected = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), **kw).frames[0]
    torch.testing.assert_close(latents["teacher_10"]["0"], expected, rtol=0, atol=1e-5)
    expected = pipe(PROMPTS[2], generator=torch.Generator().manual_seed(1002), **kw).frames[0]
    torch.testing.assert_close(latents["teacher_10"]["2_s1"], expected, rtol=0, atol=1e-5)
    # the student's are the 2-step x0 loop on the first two Euler timesteps, written out
    generator = torch.Generator().manual_seed(1)  # prompt 1: seed 0 + 1 draws the noise, then each re-noising ε
    with torch.no_grad():
        noise = torch.randn((1, *LATENT_SHAPE), generator=generator)
        ladder = _diffusers_timesteps(2, 3.0)  # the default ladder: the first 2 timesteps of the Euler grid
        student = few_step_by_hand(pipe.transformer, embeds[0][1:2], None, noise, ladder, 1.0, generator)
    torch.testing.assert_close(latents["student"]["1"], student[0], rtol=0, atol=1e-5)
    frames = {c.name: {(i, j): decode_by_hand(pipe.vae, latents[c.name][sample_key(i, j)]) for i, j in VIDEO_KEYS}
              for c in candidates}
    analyzer = AnalyzerConfig(**json.loads((Path(shipped_tiny_base()) / "analyzer.json").read_text()))
    ref = {k: f.astype(np.float64) / 255.0 for k, f in frames["teacher_10"].items()}
    scaler = Standardiser.fit(np.stack([video_features(ref[k], analyzer=analyzer) for k in VIDEO_KEYS]))
    ref_z = scaler(np.stack([video_features(ref[k], analyzer=analyzer) for k in VIDEO_KEYS]))
    reported_ref = np.asarray([r["features"] for r in report["per_video"]["teacher_10"]])
    reported_scaler = Standardiser.fit(reported_ref)
    np.testing.assert_allclose(report["frechet"]["reference_mean"], reported_scaler.mean, atol=1e-12)
    reported_ref = reported_scaler(reported_ref)
    for c in candidates:
        vids = frames[c.name]
        per_video = {  # metric → [S, P]
            "distance_to_teacher": [[np.mean((vids[i, j] / 255.0 - ref[i, j]) ** 2) for i in range(3)] for j in range(2)],
            "sharpness": [[sharpness(vids[i, j]) for i in range(3)] for j in range(2)],
        }
        scores = [[score(vids[i, j], PROMPTS[i], analyzer) for i in range(3)] for j in range(2)]
        for key in ("colour", "shape", "direction", "all"):
            per_video[key] = [[float(s[key]) for s in row] for row in scores]
        times = [row["latency_s"] for row in report["per_video"][c.name]]  # in sampling order (seed-major)
        assert [row["warmup"] for row in report["per_video"][c.name]] == [True] * WARMUP_VIDEOS + [False] * (6 - WARMUP_VIDEOS)
        timed = times[WARMUP_VIDEOS:]
        assert metrics[f"{c.name}/latency_s"] == pytest.approx(float(np.median(timed)), abs=2e-6)
        assert metrics[f"{c.name}/latency_s_iqr"] == pytest.approx(float(np.subtract(*np.percentile(timed, [75, 25]))), abs=2e-6)
        assert report["latency"][c.name]["warmup_s"] == times[:WARMUP_VIDEOS] and report["latency"][c.name]["timed_videos"] == 5
        span = report["timeline"][c.name]  # the sampling window holds every timed video
        start, end = span["sampling_unix"]
        assert span["load_s"] >= 0 and span["scoring_wait_s"] >= 0 and end - start == pytest.approx(span["sampling_s"], abs=2e-3)
        assert span["sampling_s"] >= sum(times) - 1e-3
        for key, table in per_video.items():
            seed_means = np.asarray(table).mean(axis=1)  # [S]
            assert metrics[f"{c.name}/{key}"] == pytest.approx(seed_means.mean(), abs=2e-6), (c.name, key)
            assert metrics[f"{c.name}/{key}_std"] == pytest.approx(seed_means.std(ddof=1), abs=2e-6), (c.name, key)
            assert [r[key] for r in report["per_seed"][c.name]] == pytest.approx(seed_means, abs=1e-6), (c.name, key)
            per_prompt = [r[key] for r in report["per_prompt"][c.name]]  # means over seeds, whose mean is the headline
            assert np.mean(per_prompt) == pytest.approx(metrics[f"{c.name}/{key}"], abs=2e-6), (c.name, key)
        hand = np.stack([video_features(vids[k], analyzer=analyzer) for k in VIDEO_KEYS])
        reported = np.asarray([r["features"] for r in report["per_video"][c.name]])  # seed-major, as VIDEO_KEYS
        np.testing.assert_allclose(reported, hand, rtol=0, atol=1e-5)  # the two decodes differ by <= 1/255 on a few pixels
        assert metrics[f"{c.name}/frechet_distance"] == pytest.approx(frechet_distance(scaler(hand), ref_z), rel=1e-3)
        assert metrics[f"{c.name}/frechet_distance"] == pytest.approx(frechet_distance(reported_scaler(reported),
                                                                                        reported_ref), abs=1e-6)
        assert metrics[f"{c.name}/frechet_distance_std"] >= 0
        assert metrics[f"{c.name}/kid"] == pytest.approx(kid(reported_scaler(reported), reported_ref), abs=1e-6)
        assert metrics[f"{c.name}/kid_lo"] <= metrics[f"{c.name}/kid"] <= metrics[f"{c.name}/kid_hi"]
        if c.name != "teacher_10":
            lower, floor = metrics[f"{c.name}/kid_lo"], metrics["teacher_10/kid_floor"]
            assert metrics[f"{c.name}/kid_resolved"] == float(lower > max(floor, 0.0))
    assert metrics["teacher_10/frechet_distance"] == 0.0 and metrics["teacher_10/distance_to_teacher"] == 0.0
    assert metrics["teacher_10/frechet_floor"] == pytest.approx(frechet_distance(reported_ref[:3], reported_ref[3:]), abs=1e-6)
    assert metrics["teacher_10/frechet_floor"] == pytest.approx(frechet_distance(ref_z[:3], ref_z[3:]), rel=1e-3)
    assert metrics["teacher_10/frechet_floor"] > 0  # two noise draws of the same model differ
    assert metrics["teacher_10/kid"] == 0.0
    assert metrics["teacher_10/kid_floor"] == pytest.approx(kid(reported_ref[:3], reported_ref[3:]), abs=1e-6)
    assert metrics["teacher_2/distance_to_teacher"] > 1e-4  # 2 steps do not land on the 10-step videos
    assert metrics["teacher_2/frechet_distance"] > 0 and metrics["student/frechet_distance"] > 0
    assert metrics["student/frechet_distance_std"] > 0 and metrics["teacher_2/distance_to_teacher_std"] > 0
    # per-video latency is measured inside the call: all the videos together took less than the whole run
    assert sum(r["latency_s"] for c in candidates for r in report["per_video"][c.name]) < wall_s
    assert all(metrics[f"{c.name}/latency_s"] > 0 for c in candidates)
    shown = headline_metrics(metrics)  # every candidate's headline numbers
    assert set(shown) == {f"{c.name}/{k}" for c in candidates for k in HEADLINE_METRICS.values()}
    assert all(shown[f"{c.name}/{short}"] == metrics[f"{c.name}/{k}"] for c in candidates for k, short in HEADLINE_METRICS.items())
    assert len(shown) < len(metrics) / 2
    # what the validate stage gives DVC: a few columns — the chosen candidates' adherence and Fréchet distance (short
    # names: a narrow `dvc metrics show`), without the reference's distances (0 by construction)
    assert headline_metrics(metrics, ["teacher_10", "student"], "teacher_10") == {
        "teacher_10/all": metrics["teacher_10/all"], "student/all": metrics["student/all"],
        "student/frechet": metrics["student/frechet_distance"]}


def test_latency_leaves_out_the_warm_up_and_reports_median_and_spread():
    summary = latency_summary([33.97, 2.01, 0.89, 0.91, 0.95, 0.90])  # the first videos of one candidate
    assert summary["warmup_s"] == [33.97] and summary["timed_videos"] == 5
    assert summary["median_s"] == 0.91 and summary["iqr_s"] == pytest.approx(0.95 - 0.90)
    assert (summary["min_s"], summary["max_s"]) == (0.89, 2.01)
    assert latency_summary([1.5]) == {"median_s": 1.5, "iqr_s": 0.0, "min_s": 1.5, "max_s": 1.5, "timed_videos": 1,
                                      "warmup_s": []}  # nothing but the warm-up: it is all there is


def test_one_seed_gives_the_seed_0_samples_and_no_spread(validation, base, tmp_path, monkeypatch):
    """num_seeds=1 samples exactly the seed-0 videos of a num_seeds=2 run (same prompts), with spreads 0; each
    video is scored and encoded on the scoring thread (off the sampler's critical path), in sampling order."""
    import threading

    from safetensors.torch import load_file

    from distillery.clips import analyzer

    seen: list[str] = []
    real = analyzer.analyze

    def analyze(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(analyzer, "analyze", analyze)
    out, many, candidates, _ = validation
    cheap = [c for c in candidates if c.name != "teacher_10"]  # teacher_2 becomes the reference
    cfg = ValidationConfig(num_seeds=1, progress_bar=False, grid_formats=[])
    metrics = run_validation(base, cheap, PROMPTS, tmp_path / "one", cfg)
    assert seen and all(name.startswith("validate-score") for name in seen), seen
    for c in cheap:
        one = load_file(tmp_path / "one" / "samples" / c.name / "latents.safetensors")
        two = load_file(out / "samples" / c.name / "latents.safetensors")
        assert sorted(one) == ["0", "1", "2"] and all(torch.equal(one[k], two[k]) for k in one), c.name
        assert all(metrics[f"{c.name}/{k}_std"] == 0.0 for k in SEEDED_METRICS)
    assert set(metrics) == {f"{c.name}/{k}" for c in cheap for k in METRIC_NAMES}  # no floor with one seed
    assert metrics["teacher_2/frechet_distance"] == 0.0 and metrics["teacher_2/distance_to_teacher"] == 0.0
    assert metrics["student/frechet_distance"] > 0
    assert metrics["student/colour"] == pytest.approx(np.mean(
        [r["colour"] for r in json.loads((out / "report.json").read_text())["per_video"]["student"] if r["seed_index"] == 0]))
    with pytest.raises(UserError, match="num_seeds"):
        ValidationConfig(num_seeds=0)


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
    assert cand.nfe() == 2 and Candidate.from_artifact("s", artifact, guidance_scale=4.0).nfe() == 4
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


def test_stored_prompt_embeddings_replace_the_text_encoder(validation, base, tmp_path):
    """Given the embeddings the latents stage stored (each prompt encoded on its own, as there),
    validate loads no text encoder — a base copy without its weights works — and samples the same
    seed-0 latents as a run that re-encoded the prompts."""
    import shutil

    from safetensors.torch import load_file

    from distillery.data.encoders import BaseEncoders
    from distillery.evaluation.sampling_context import PromptEmbeddings

    out, _, candidates, _ = validation
    encoders = BaseEncoders(base)
    stored = PromptEmbeddings(texts=[encoders.encode_prompts([p])[0] for p in PROMPTS],
                              negative=encoders.encode_prompts([""])[0])
    stripped = tmp_path / "base"
    shutil.copytree(base, stripped)
    for weights in (stripped / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    cheap = [c for c in candidates if c.name == "student"]
    cfg = ValidationConfig(num_seeds=1, progress_bar=False, grid_formats=[])
    run_validation(stripped, cheap, PROMPTS, tmp_path / "stored", cfg, prompt_embeddings=stored)
    mine = load_file(tmp_path / "stored" / "samples" / "student" / "latents.safetensors")
    ref = load_file(out / "samples" / "student" / "latents.safetensors")
    for k in mine:
        torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=1e-6)
    with pytest.raises(UserError, match="prompt embeddings do not fit"):
        run_validation(stripped, cheap, PROMPTS, tmp_path / "bad", cfg,
                       prompt_embeddings=PromptEmbeddings(texts=stored.texts[:1], negative=stored.negative))


def test_validation_device_choice():
    """validate.device: auto is the GPU only when the pipeline has one and CUDA is there; an absent
    CUDA device asked for by name is a one-line error; params.yaml refuses other spellings."""
    from distillery.pipeline.launch.device import stage_device
    from distillery.pipeline.params.loading import validate_params

    def validation_device(setting, nproc):
        return stage_device(setting, nproc, "validate.device")

    assert validation_device("auto", 1) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert validation_device("auto", 0) == "cpu"
    assert validation_device("cpu", 4) == "cpu"
    absent = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(UserError, match=f"validate.device: {absent}, but this machine has"):
        validation_device(absent, 1)
    with pytest.raises(UserError, match="validate.device"):
        validate_params({"validate": {"device": "gpu0"}})
    assert validate_params({"validate": {"device": "cuda:1"}}).validate.device == "cuda:1"
    with pytest.raises(UserError, match="validate.precision: 'fp16'"):
        ValidationConfig(precision="fp16")


def test_the_grid_gif_is_a_preview_of_at_most_gif_max_px_a_side():
    from distillery.evaluation.validation_files import GIF_MAX_PX, gif_preview

    small = np.zeros((3, 40, 70, 3), np.uint8)
    assert gif_preview(small) is small  # tiny tiles: the grid itself
    real = np.arange(2 * 1971 * 1735 * 3, dtype=np.int64).astype(np.uint8).reshape(2, 1971, 1735, 3)  # 4×2 real tiles
    preview = gif_preview(real)
    assert preview.shape == (2, 986, 868, 3) and max(preview.shape[1:3]) <= GIF_MAX_PX  # every 2nd pixel
    np.testing.assert_array_equal(preview, real[:, ::2, ::2])
    assert gif_preview(real, max_px=1971).shape == real.shape


def test_scoring_workers_leave_the_sampler_a_core_and_fit_in_memory():
    import os

    from distillery.evaluation.validation_files import scoring_workers

    cores = len(os.sched_getaffinity(0))
    assert scoring_workers(32 * 32 * 17 * 3) == max(1, min(8, cores - 1))  # tiny videos: the cores decide
    assert scoring_workers(1 << 50) == 1  # a video no memory holds twice: one thread, never zero


def test_several_scoring_threads_score_what_one_does_in_the_same_order(validation, base, tmp_path, monkeypatch):
    """With 3 scoring threads (the GPU machine takes up to 8) every record, metric and written file but the
    timings is what the module fixture's run (1 thread on this machine's cores) wrote."""
    import distillery.evaluation.validate as validate_module

    out, metrics, candidates, _ = validation
    monkeypatch.setattr(validate_module, "scoring_workers", lambda video_bytes: 3)
    cfg = ValidationConfig(num_seeds=NUM_SEEDS, progress_bar=False)
    threaded = run_validation(base, candidates, PROMPTS, tmp_path / "threaded", cfg)
    timing = ("latency_s", "latency_s_iqr")
    assert {k: v for k, v in threaded.items() if not k.endswith(timing)} == {k: v for k, v in metrics.items() if not k.endswith(timing)}
    one, three = (json.loads((folder / "report.json").read_text())["per_video"] for folder in (out, tmp_path / "threaded"))
    strip = [{k: v for k, v in row.items() if k != "latency_s"} for c in candidates for row in one[c.name]]
    assert strip == [{k: v for k, v in row.items() if k != "latency_s"} for c in candidates for row in three[c.name]]
    for c in candidates:
        for mp4 in sorted((out / "samples" / c.name).glob("*.mp4")):
            assert mp4.read_bytes() == (tmp_path / "threaded" / "samples" / c.name / mp4.name).read_bytes(), mp4


def test_a_candidates_scoring_runs_on_while_the_next_candidate_samples(validation, base, tmp_path, monkeypatch):
    """The CPU half of candidate k's last video (one scoring thread) waits until candidate k + 1 has started sampling:
    that happens only when the next candidate does not wait for the previous one's scoring (run one after the other,
    the wait would time out). The metrics are the ones the module fixture's run gives."""
    import threading

    import distillery.evaluation.validate as validate_module
    from distillery.evaluation.sampling_context import SamplingContext

    cfg = ValidationConfig(num_seeds=NUM_SEEDS, progress_bar=False, grid_formats=[])
    candidates = teacher_candidates(base, [2], 4.0) + [Candidate("student", base, 2, 1.0, "few_step_x0")]
    second_sampling = threading.Event()
    sample, score = SamplingContext.sample, validate_module.score_video
    scored: list[bool] = []  # per scoring call (one thread: in submission order), whether it saw the next candidate sample

    def sample_and_say(self, cand, *args):
        if cand.name == candidates[1].name:
            second_sampling.set()
        return sample(self, cand, *args)

    def score_last_video_once_the_next_samples(video, analyzer, prompt):
        if len(scored) == len(VIDEO_KEYS) - 1:  # the first candidate's last video
            scored.append(second_sampling.wait(timeout=30))
        else:
            scored.append(second_sampling.is_set())
        return score(video, analyzer, prompt)

    monkeypatch.setattr(validate_module, "scoring_workers", lambda video_bytes: 1)
    monkeypatch.setattr(SamplingContext, "sample", sample_and_say)
    monkeypatch.setattr(validate_module, "score_video", score_last_video_once_the_next_samples)
    overlapped = run_validation(base, candidates, PROMPTS, tmp_path / "overlapped", cfg)
    assert scored[len(VIDEO_KEYS) - 1], "candidate 2 did not start sampling while candidate 1's scoring was running"
    assert len(scored) == 2 * len(VIDEO_KEYS)
    out, metrics, _, _ = validation
    same = [k for k in overlapped if k.startswith(("teacher_2/", "student/"))
            and not k.endswith(("latency_s", "latency_s_iqr")) and not any(w in k for w in ("frechet", "kid", "distance"))]
    assert same and {k: overlapped[k] for k in same} == {k: metrics[k] for k in same}  # the fixture's reference differs


def test_a_batch_of_videos_samples_what_one_at_a_time_does(validation, base, tmp_path):
    """``sample_batch`` 4 over 6 videos (a batch of 4, then 2): each video's latents are batch 1's up to rounding (its
    noise is its own generator either way), its frames within one grey level, and report.json says the batch."""
    from safetensors.torch import load_file

    out, metrics, candidates, _ = validation
    cfg = ValidationConfig(num_seeds=NUM_SEEDS, progress_bar=False, grid_formats=[], sample_batch=4)
    batched = run_validation(base, candidates, PROMPTS, tmp_path / "batched", cfg)
    assert batched.keys() == metrics.keys()
    for c in candidates:
        one, four = (load_file(str(folder / "samples" / c.name / "latents.safetensors")) for folder in (out, tmp_path / "batched"))
        assert one.keys() == four.keys() and len(one) == len(VIDEO_KEYS)
        for key in one:
            assert torch.allclose(one[key], four[key], atol=1e-4, rtol=0), (c.name, key, (one[key] - four[key]).abs().max())
    report = json.loads((tmp_path / "batched" / "report.json").read_text())
    assert report["latency"]["sample_batch"] == 4
    for c in candidates:
        assert abs(batched[f"{c.name}/all"] - metrics[f"{c.name}/all"]) <= 1 / len(VIDEO_KEYS) + 1e-9
    with pytest.raises(UserError, match="sample_batch"):
        ValidationConfig(sample_batch=0)


def test_one_s_own_captions_say_where_the_prompts_came_from_and_mark_adherence_not_applicable(validation, base, tmp_path,
                                                                                             caplog):
    """Prompts that are not the synthetic clips' captions (one's own data): the analyzer cannot read them, so
    adherence is n/a — left out of metrics.json (no 0.00 for every candidate), empty in adherence.csv, no plot, ``n/a``
    in summary.md with the reason — while the scores that apply stay; the log and summary.md say which prompts
    validate used and where they came from. The same candidates on the grammar's prompts keep every key
    (:func:`test_run_validation_metrics`)."""
    import logging

    own = ["a dog runs across a sunny park", "timelapse of clouds over a mountain lake"]
    cheap = [c for c in validation[2] if c.name != "teacher_10"]
    cfg = ValidationConfig(num_seeds=1, progress_bar=False, grid_formats=[], bootstrap_resamples=0)
    source = "the latent set's TRAIN split: the data has no validation/ folder"
    with caplog.at_level(logging.INFO, logger="distillery"):
        metrics = run_validation(base, cheap, own, tmp_path / "own", cfg, prompt_source=source)
    assert set(metrics) == {f"{c.name}/{k}" for c in cheap for k in METRIC_NAMES
                            if k.removesuffix("_std") not in ("colour", "shape", "direction", "all")}
    assert metrics["student/frechet_distance"] > 0 and metrics["student/sharpness"] > 0
    assert headline_metrics(metrics) == {k.replace("/frechet_distance", "/frechet"): v for k, v in metrics.items()
                                         if k.endswith("/frechet_distance")}
    report = json.loads((tmp_path / "own" / "report.json").read_text())
    assert report["prompt_source"] == source and report["adherence"]["applicable"] is False
    assert report["adherence"]["prompts_in_grammar"] == 0 and report["adherence_readings"] is None
    assert not any(k in row for rows in report["per_video"].values() for row in rows for k in ("colour", "all"))
    assert not any("all" in row for rows in report["per_prompt"].values() for row in rows)
    with (tmp_path / "own" / "plots" / "adherence.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["adherence"], r["colour"]) for r in rows] == [("", "")] * 2 and all(float(r["sharpness"]) > 0 for r in rows)
    assert not (tmp_path / "own" / "plots" / "adherence_vs_nfe.png").exists()
    summary = (tmp_path / "own" / "summary.md").read_text()
    row = next(line for line in summary.splitlines() if line.startswith("| student |"))
    assert "| n/a | n/a | n/a | n/a |" in row and "0.00 ±" not in row.split("n/a")[0]
    assert "**Adherence is n/a here**: 0 of 2 prompts are captions of the synthetic clips' grammar" in summary
    assert f"## Prompts (2, from {source})" in summary and "- #1 timelapse of clouds over a mountain lake" in summary
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"validate: 2 prompts from {source}: #0 'a dog runs across a sunny park'") for m in logged), logged
    assert any(m.startswith("validate: prompt adherence n/a: 0 of 2 prompts") for m in logged), logged
    assert any(m.startswith("validate student: 2 NFE, adherence n/a, ") for m in logged), logged


def test_the_log_reads_in_order_a_candidates_line_after_its_videos_and_before_the_next_ones(base, tmp_path, monkeypatch):
    """Issue 58 item 14: candidate k's CPU half is scored while k + 1 samples, so its progress and its line used to come
    after k + 1's progress lines, which named k + 1 while counting k's videos. Each progress line names the candidate
    whose video it counted, and no line of a candidate comes before the line of the one before it — even when k is
    finished only after k + 1 sampled every video (the between-batches finish switched off: the worst case)."""
    import logging
    import re

    import distillery.evaluation.validate as validate_module

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    monkeypatch.setenv("DISTILLERY_PROGRESS", "lines")
    monkeypatch.setenv("DISTILLERY_PROGRESS_INTERVAL_S", "0")  # a line per video
    monkeypatch.setattr(validate_module, "scoring_workers", lambda video_bytes: 2)
    monkeypatch.setattr(validate_module._Run, "finish_if_scored", lambda self, item: 0.0)
    keep, logger = Keep(), logging.getLogger("distillery")
    level = logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        cfg = ValidationConfig(num_seeds=NUM_SEEDS, progress_bar=True, grid_formats=[])
        candidates = teacher_candidates(base, [2], 4.0) + [Candidate("student", base, 2, 1.0, "few_step_x0"),
                                                            Candidate("student_1", base, 1, 1.0, "few_step_x0")]
        run_validation(base, candidates, PROMPTS, tmp_path / "ordered", cfg)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    said = []  # (candidate, "video" | "line") in log order
    for line in lines:
        if (m := re.match(r"validate \d+/\d+ \(\d+%\) candidate (\S+) \(", line)):
            said.append((m.group(1), "video"))
        elif (m := re.match(r"validate (\S+): \d+ NFE", line)):
            said.append((m.group(1), "line"))
    names = [c.name for c in candidates]
    assert [name for name, what in said if what == "line"] == names, said
    order = [names.index(name) + (0.5 if what == "line" else 0) for name, what in said]
    assert order == sorted(order), said  # k's videos, k's line, then k + 1's videos
    counts = [int(re.match(r"validate (\d+)/", line).group(1)) for line in lines if re.match(r"validate \d+/", line)]
    assert counts == sorted(counts) and counts[-1] == len(candidates) * len(VIDEO_KEYS)
