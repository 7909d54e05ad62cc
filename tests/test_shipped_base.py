"""The fitted tiny Wan shipped in the package: loads with stock diffusers, its VAE keeps what the
analyzer reads, it follows prompts, and the numbers its fit_report.json records are recomputed
here from its weights (PSNR and analyzer accuracy on all 24 validation clips; prompt adherence on
the first 8 validation prompts with the fit's seeds)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distillery.clips.analyzer import AnalyzerConfig, evaluate
from distillery.clips.synthetic import ClipSetConfig, make_clip_set
from distillery.data.videos import IngestConfig, load_clips
from distillery.tinybase.fit import derangement
from distillery.tinybase.shipped import copy_shipped_tiny_base, shipped_tiny_base

SCORES = ("colour", "shape", "direction", "all")


@pytest.fixture(scope="module")
def shipped():
    return shipped_tiny_base()


@pytest.fixture(scope="module")
def report(shipped):
    return json.loads((shipped / "fit_report.json").read_text())


@pytest.fixture(scope="module")
def analyzer_cfg(shipped):
    return AnalyzerConfig(**json.loads((shipped / "analyzer.json").read_text()))


@pytest.fixture(scope="module")
def validation_clips(tmp_path_factory, report):
    """The 24 validation clips the base was fitted and measured on (the fit's clip set: seed 0)."""
    c = report["config"]
    cfg = ClipSetConfig(num_train=c["num_train_clips"], num_validation=c["num_validation_clips"], num_frames=c["num_frames"],
                        height=c["size"], width=c["size"], fps=int(c["fps"]), seed=c["seed"])
    clips = make_clip_set(tmp_path_factory.mktemp("clips") / "clips", cfg)
    return load_clips(clips / "validation", IngestConfig(num_frames=17, height=32, width=32, fps=8.0)).items


@pytest.fixture(scope="module")
def reconstructions(shipped, validation_clips):
    """(clips, reconstructions): float ``[N, 3, T, H, W]`` in [-1, 1], through the shipped VAE (encode → mode → decode)."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(shipped / "vae").eval()
    x = torch.from_numpy(np.stack([c.frames for c in validation_clips])).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    with torch.no_grad():
        recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
    return x, recon


def test_card_and_report_record_how_it_was_made(shipped, report):
    card = (shipped / "README.md").read_text()
    assert "distillery base make-tiny --fit" in card and 'weights: "fitted"' in card
    assert f"validation PSNR **{report['vae']['val_psnr_db']} dB**" in card
    assert report["config"]["seed"] == 0 and report["adherence"]["prompts"] == 24
    assert report["vae"]["val_psnr_db"] >= 24.0
    assert report["adherence"]["colour"] >= 0.8 and report["adherence"]["direction"] >= 0.8
    size = sum(p.stat().st_size for p in shipped.rglob("*") if p.is_file())
    assert size < 30 * 2**20


def test_recorded_vae_psnr_is_what_the_weights_give(report, reconstructions):
    """PSNR over all 24 validation clips, recomputed with numpy (frames mapped to [0, 1]); the report
    rounds to 0.01 dB, and CPU kernels may move the last bits: tolerance 0.02 dB."""
    x, recon = reconstructions
    mse = np.mean(((recon.double().numpy() + 1) / 2 - (x.double().numpy() + 1) / 2) ** 2)
    assert 10 * np.log10(1 / mse) == pytest.approx(report["vae"]["val_psnr_db"], abs=0.02)
    black = np.mean(((x.double().numpy() + 1) / 2) ** 2)  # an all-black output
    assert 10 * np.log10(1 / black) == pytest.approx(report["vae"]["val_psnr_black_db"], abs=0.01)


def test_analyzer_on_clips_decoded_through_the_fitted_vae(report, analyzer_cfg, validation_clips, reconstructions):
    _, recon = reconstructions
    frames = list(((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy())
    captions = [c.caption for c in validation_clips]
    real = evaluate(zip(frames, captions), analyzer_cfg)
    shuffled = evaluate(zip(frames, [captions[j] for j in derangement(len(captions), 0)]), analyzer_cfg)
    assert real["colour"] >= 0.95 and real["direction"] >= 0.95 and real["shape"] >= 0.7, real
    assert shuffled["colour"] <= 0.4 and shuffled["direction"] <= 0.5 and shuffled["all"] <= 0.2, shuffled
    one_clip = 1 / len(captions) + 1e-9  # a discrete score may flip on one clip with the last bits of the decode
    for key in SCORES:
        assert real[key] == pytest.approx(report["analyzer"]["real_captions"][key], abs=one_clip), key
        assert shuffled[key] == pytest.approx(report["analyzer"]["shuffled_captions"][key], abs=one_clip), key


def test_recorded_adherence_holds_on_the_first_8_prompts(tmp_path, shipped, report, analyzer_cfg, validation_clips):
    """Stock WanPipeline, the fit's recipe (40 Euler steps, CFG 4.0, seed 1000 + i for prompt i) on the
    first 8 of the 24 validation prompts. The report gives fractions over all 24, so on 8 of them a
    score can have at most the report's hits and at least 8 − its misses (direction 1.0: all 8)."""
    from diffusers import WanPipeline

    base = copy_shipped_tiny_base(tmp_path / "tiny")
    pipe = WanPipeline.from_pretrained(str(base))
    pipe.set_progress_bar_config(disable=True)
    a = report["adherence"]
    prompts = [c.caption for c in validation_clips][:8]
    with torch.no_grad():  # one batch: the same noise per prompt as one call each (a generator per prompt)
        videos = pipe(prompts, negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=a["steps"],
                      guidance_scale=a["guidance_scale"], max_sequence_length=32, output_type="np",
                      generator=[torch.Generator().manual_seed(1000 + i) for i in range(len(prompts))]).frames
    scores = evaluate(zip([(np.clip(v, 0, 1) * 255).round().astype(np.uint8) for v in videos], prompts), analyzer_cfg)
    for key in SCORES:
        hits_all = round(a[key] * a["prompts"])
        hits = round(scores[key] * len(prompts))
        assert len(prompts) - (a["prompts"] - hits_all) <= hits <= hits_all, (key, hits, a)
    assert scores["colour"] >= 0.75 and scores["direction"] == 1.0, scores
