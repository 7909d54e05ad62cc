"""``distillery base make-tiny --fit`` end to end, for a few steps of each phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_fit_for_a_few_steps_writes_a_loadable_model_with_a_card(tmp_path):
    out = tmp_path / "tiny-fitted"
    cmd = [sys.executable, "-m", "distillery.cli.main", "base", "make-tiny", "--fit", "--out", str(out), "--seed", "3",
           "--vae-steps", "4", "--dit-steps", "3", "--batch-size", "4", "--num-train-clips", "8",
           "--num-validation-clips", "4", "--eval-prompts", "2", "--eval-steps", "2", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "fit_report.json").read_text())
    assert report["vae"]["steps"] == 4 and report["transformer"]["steps"] == 3
    assert report["adherence"]["prompts"] == 2 and set(report["adherence"]) >= {"colour", "shape", "direction", "all"}
    _check_report_against_the_weights(out, tmp_path / "work" / "clips" / "validation", report)
    card = (out / "README.md").read_text()
    assert "--fit" in card and "validation PSNR" in card and "weights: \"fitted\"" in card
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(out))
    video = pipe("a red circle moving left on a black background", num_frames=9, height=32, width=32,
                 num_inference_steps=2, max_sequence_length=32, output_type="np").frames[0]
    assert video.shape == (9, 32, 32, 3)
    tok = pipe.tokenizer("a magenta triangle moving up quickly on a black background").input_ids
    assert pipe.tokenizer.unk_token_id not in tok  # the tokenizer knows the caption words
    # the shipped latents statistics are the fitted ones, not the zeros/ones placeholders
    assert pipe.vae.config.latents_std != [1.0] * 8
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr.strip().splitlines()[-1]


def _check_report_against_the_weights(model: Path, validation: Path, report: dict) -> None:
    """The card's numbers recomputed from the written weights: VAE PSNR over the validation clips (numpy,
    frames mapped to [0, 1]; the report rounds to 0.01 dB) and adherence of the 2 evaluated prompts
    (stock WanPipeline, the fit's seeds 1000 + seed + i, scored with the model's analyzer.json)."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    from distillery.clips.analyzer import AnalyzerConfig, evaluate
    from distillery.data.videos import IngestConfig, load_clips

    clips = load_clips(validation, IngestConfig(num_frames=17, height=32, width=32, fps=8.0)).items
    assert len(clips) == 4
    x = torch.from_numpy(np.stack([c.frames for c in clips])).permute(0, 4, 1, 2, 3).double().numpy() / 255.0
    vae = AutoencoderKLWan.from_pretrained(model / "vae").eval()
    with torch.no_grad():
        recon = vae.decode(vae.encode(torch.from_numpy(x * 2 - 1).float()).latent_dist.mode()).sample.double().numpy()
    psnr = 10 * np.log10(1 / np.mean(((recon + 1) / 2 - x) ** 2))
    assert report["vae"]["val_psnr_db"] == pytest.approx(psnr, abs=0.011)
    pipe = WanPipeline.from_pretrained(str(model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prompts = [c.caption for c in clips][:2]
    videos = [pipe(p, negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                   generator=torch.Generator().manual_seed(3 + 1000 + i), max_sequence_length=32, output_type="np").frames[0]
              for i, p in enumerate(prompts)]
    analyzer = AnalyzerConfig(**json.loads((model / "analyzer.json").read_text()))
    scores = evaluate(zip([(np.clip(v, 0, 1) * 255).round().astype(np.uint8) for v in videos], prompts), analyzer)
    for key in ("colour", "shape", "direction", "all"):
        assert report["adherence"][key] == pytest.approx(scores[key], abs=1e-4), key
