"""The fitted tiny Wan shipped in the package: loads with stock diffusers, its VAE keeps what the
analyzer reads, and it follows prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distillery.base.fit import derangement
from distillery.base.shipped import copy_shipped_tiny_base, shipped_tiny_base
from distillery.clips.analyzer import AnalyzerConfig, evaluate, score
from distillery.clips.synthetic import ClipSetConfig, make_clip_set
from distillery.data.videos import IngestConfig, load_clips


@pytest.fixture(scope="module")
def shipped():
    return shipped_tiny_base()


@pytest.fixture(scope="module")
def analyzer_cfg(shipped):
    return AnalyzerConfig(**json.loads((shipped / "analyzer.json").read_text()))


def test_card_and_report_record_how_it_was_made(shipped):
    card = (shipped / "README.md").read_text()
    report = json.loads((shipped / "fit_report.json").read_text())
    assert "distillery base make-tiny --fit" in card and 'weights: "fitted"' in card
    assert report["config"]["seed"] == 0
    assert report["vae"]["val_psnr_db"] >= 24.0
    assert report["adherence"]["colour"] >= 0.8 and report["adherence"]["direction"] >= 0.8
    size = sum(p.stat().st_size for p in shipped.rglob("*") if p.is_file())
    assert size < 30 * 2**20


def test_analyzer_on_clips_decoded_through_the_fitted_vae(tmp_path, shipped, analyzer_cfg):
    from diffusers import AutoencoderKLWan

    clips = make_clip_set(tmp_path / "clips", ClipSetConfig(seed=0))  # the clip set the base was fitted on
    val = load_clips(clips / "validation", IngestConfig(num_frames=17, height=32, width=32, fps=8.0)).items
    vae = AutoencoderKLWan.from_pretrained(shipped / "vae").eval()
    x = torch.from_numpy(np.stack([c.frames for c in val])).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    with torch.no_grad():
        recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
    frames = list(((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy())
    captions = [c.caption for c in val]
    real = evaluate(zip(frames, captions), analyzer_cfg)
    shuffled = evaluate(zip(frames, [captions[j] for j in derangement(len(captions), 0)]), analyzer_cfg)
    assert real["colour"] >= 0.95 and real["direction"] >= 0.95 and real["shape"] >= 0.7, real
    assert shuffled["colour"] <= 0.4 and shuffled["direction"] <= 0.5 and shuffled["all"] <= 0.2, shuffled


def test_stock_pipeline_follows_prompts(tmp_path, shipped, analyzer_cfg):
    from diffusers import WanPipeline

    base = copy_shipped_tiny_base(tmp_path / "tiny")
    pipe = WanPipeline.from_pretrained(str(base))
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle moving left slowly on a black background", "a blue square moving up quickly on a black background",
               "a yellow triangle moving right slowly on a black background", "a cyan circle moving down quickly on a black background"]
    hits = {"colour": 0, "direction": 0}
    for i, prompt in enumerate(prompts):
        video = pipe(prompt, negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=40,
                     guidance_scale=4.0, max_sequence_length=32, generator=torch.Generator().manual_seed(i),
                     output_type="np").frames[0]
        s = score((np.clip(video, 0, 1) * 255).round().astype(np.uint8), prompt, analyzer_cfg)
        hits["colour"] += s["colour"]
        hits["direction"] += s["direction"]
    assert hits["colour"] >= 3 and hits["direction"] >= 3, hits
