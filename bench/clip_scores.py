"""Benchmark: what validate's CLIP scores (``validate.clip_model``) cost per real-shape video, on the machine it runs on.

The CLIP scores are read from every candidate's frames on every validate run (the sample cache keeps none), so
their cost is paid again by a run that reuses every sample. This builds CLIP folders with the towers' shapes of
``openai/clip-vit-base-patch32`` and ``openai/clip-vit-large-patch14`` (random weights — the time does not depend
on them — and a byte-level tokenizer; nothing is downloaded), then times
:meth:`~distillery.evaluation.clip_scores.ClipScorer.score` on ``--videos`` synthetic videos of
``--frames``×``--height``×``--width`` (Wan2.1 at 480p: 81×480×832) after one untimed warm-up video, on
``--device``. It also checks the device's scores against the CPU's on one video (float32 both; the largest
difference is reported).

Usage: ``python bench/clip_scores.py [--device cuda] [--videos 8] [--out bench/results/x.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {  # the towers of OpenAI's CLIP checkpoints (transformers' CLIPConfig fields)
    "vit-b-32": dict(vision=dict(image_size=224, patch_size=32, hidden_size=768, intermediate_size=3072,
                                 num_hidden_layers=12, num_attention_heads=12),
                     text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
                     projection_dim=512),
    "vit-l-14": dict(vision=dict(image_size=224, patch_size=14, hidden_size=1024, intermediate_size=4096,
                                 num_hidden_layers=24, num_attention_heads=16),
                     text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                     projection_dim=768),
}


def _byte_chars() -> list[str]:
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        out.append(chr(b) if b in keep else chr(256 + shifted))
        shifted += b not in keep
    return out


def clip_folder(where: Path, shape: dict) -> Path:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    text = dict(shape["text"], vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
                eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=shape["vision"], projection_dim=shape["projection_dim"])).save_pretrained(where)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(where)
    return where


def video(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """A square moving over a gradient, with noise (texture for the towers; the time does not depend on it)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, None, :, None]
    out = np.broadcast_to(x, (frames, height, width, 3)).copy()
    for t in range(frames):
        top, left = (height // 3), (t * 7) % max(1, width - 64)
        out[t, top:top + 64, left:left + 64] = (220, 40, 40)
    out += rng.normal(0, 8, out.shape).astype(np.float32)
    return out.clip(0, 255).astype(np.uint8)


def main() -> None:
    from distillery.evaluation.clip_scores import ClipScorer

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--models", default="vit-b-32,vit-l-14")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    clips = [video(args.frames, args.height, args.width, s) for s in range(args.videos + 1)]
    result = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "shape": [args.frames, args.height, args.width], "videos": args.videos, "models": {}}
    prompt = "a red square moving right over a grey gradient, photographed in daylight"
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = clip_folder(Path(tmp) / name, SHAPES[name])
            t0 = time.perf_counter()
            scorer = ClipScorer(folder, args.device)
            load_s = time.perf_counter() - t0
            scorer.score(clips[0], prompt)  # warm-up: kernels selected, the text embedded
            times = []
            for clip in clips[1:]:
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                scorer.score(clip, prompt)
                times.append(time.perf_counter() - t0)
            on_device = scorer.score(clips[1], prompt)
            on_cpu = ClipScorer(folder, "cpu").score(clips[1], prompt) if args.device != "cpu" else on_device
            row = {"load_s": round(load_s, 3), "median_s_per_video": round(statistics.median(times), 4),
                   "min_s": round(min(times), 4), "max_s": round(max(times), 4),
                   "frames_per_s": round(args.frames / statistics.median(times), 1),
                   "max_abs_diff_vs_cpu": max(abs(on_device[k] - on_cpu[k]) for k in on_device), "scores": on_device}
            result["models"][name] = row
            print(name, json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
