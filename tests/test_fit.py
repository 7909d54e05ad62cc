"""``distillery base make-tiny --fit`` end to end, for a few steps of each phase."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_fit_for_a_few_steps_writes_a_loadable_model_with_a_card(tmp_path):
    out = tmp_path / "tiny-fitted"
    cmd = [sys.executable, "-m", "distillery.cli", "base", "make-tiny", "--fit", "--out", str(out), "--seed", "3",
           "--vae-steps", "4", "--dit-steps", "3", "--batch-size", "4", "--num-train-clips", "8",
           "--num-validation-clips", "4", "--eval-prompts", "2", "--eval-steps", "2", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "fit_report.json").read_text())
    assert report["vae"]["steps"] == 4 and report["transformer"]["steps"] == 3
    assert report["adherence"]["prompts"] == 2 and set(report["adherence"]) >= {"colour", "shape", "direction", "all"}
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
