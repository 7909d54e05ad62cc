"""Benchmark: what VBench's quality dimensions (``distillery.evaluation.vbench``) cost per real-shape video, and what
the standard protocol would cost, on the machine it runs on.

Builds every model at the size VBench runs — DINO ViT-B/16 (transformers' ViTModel), CLIP ViT-B/32 and ViT-L/14
(transformers' CLIPModel, half precision on CUDA as VBench's ``clip.load``), the LAION aesthetic head, AMT-S, RAFT,
MUSIQ and ViCLIP-L/14 (our modules) — with random weights (the time does not depend on them; nothing is downloaded),
then scores ``--videos`` synthetic videos of ``--frames``×``--height``×``--width`` (81×480×832: Wan2.1 at 480p, 16 fps)
after one untimed warm-up video, timing each dimension (device synchronised). It prints, and writes to ``--out``:
seconds a video for each dimension, for the quality score (the 7 quality dimensions on one video) and with overall
consistency; and the standard protocol's cost — VBench's 946 prompts × 5 videos, each dimension on its own prompts
(:mod:`~distillery.evaluation.vbench.protocol`) — scoring only, sampling not included. ``--small-models`` swaps in
small models of the same classes for a quick check on the CPU (its times mean nothing).

Usage: ``python bench/vbench_speed.py [--device cuda] [--videos 3] [--out bench/results/x.json]``; on the GPU machine, in
the project's GPU setup (``bench/gpu_job.sh``'s wheels environment, ``.whl/`` carried): ``bash bench/gpu_job.sh run
python3 bench/vbench_speed.py --device cuda --videos 3 --out $OUT/vbench-speed.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_models(device: torch.device, small: bool) -> dict:
    """Every model key's :class:`~distillery.evaluation.vbench.models.LoadedModel`, random weights (module doc)."""
    from transformers import CLIPConfig, CLIPModel, ViTModel

    from distillery.evaluation.vbench.amt import AMTS
    from distillery.evaluation.vbench.bpe import ClipBPE
    from distillery.evaluation.vbench.dino import dino_vit_config, use_dino_position_interpolation
    from distillery.evaluation.vbench.models import LoadedModel
    from distillery.evaluation.vbench.musiq import MUSIQ
    from distillery.evaluation.vbench.raft import RAFT
    from distillery.evaluation.vbench.viclip import ViCLIP

    torch.manual_seed(0)
    if small:
        vit = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=128)
        tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1)
        clips = {k: dict(vision=dict(tower, image_size=224, patch_size=p), text=tower, projection_dim=32)
                 for k, p in (("clip_b32", 32), ("clip_l14", 14))}
    else:
        vit = {}
        from clip_scores import SHAPES  # OpenAI CLIP's tower shapes (bench/clip_scores.py, beside this file)

        clips = {"clip_b32": SHAPES["vit-b-32"], "clip_l14": SHAPES["vit-l-14"]}
    modules = {"dino": use_dino_position_interpolation(ViTModel(dino_vit_config(**vit), add_pooling_layer=False))}
    for key, shape in clips.items():
        modules[key] = CLIPModel(CLIPConfig(text_config=dict(shape["text"], hidden_act="quick_gelu"),
                                            vision_config=dict(shape["vision"], hidden_act="quick_gelu"),
                                            projection_dim=shape["projection_dim"]))
    modules["aesthetic"] = torch.nn.Linear(clips["clip_l14"]["projection_dim"], 1)
    modules.update(amt=AMTS(), raft=RAFT(), musiq=MUSIQ(), viclip=ViCLIP("tiny" if small else "l14"))
    bpe = Path(tempfile.mkdtemp()) / "bpe.txt.gz"
    with gzip.open(bpe, "wt") as f:
        f.write("#version: bench\nt h\nth e</w>\na n\n")
    loaded = {}
    for key, module in modules.items():
        module = module.float().eval().to(device)
        if key.startswith("clip") and device.type == "cuda":
            module = module.half()
        for p in module.parameters():
            p.requires_grad_(False)
        loaded[key] = LoadedModel(key, module, Path("(random)"), {}, not small, ClipBPE(bpe) if key == "viclip" else None)
    return loaded


def synthetic_video(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """A textured gradient with a moving block and noise: ``uint8 [T, H, W, 3]``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 200 / width, yy * 200 / height, 100 + 50 * np.sin(xx / 9.0)], axis=-1)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        f = base + rng.normal(0, 3, base.shape)
        top, left = (t * 3) % (height - 64), (t * 5) % (width - 64)
        f[top:top + 64, left:left + 64] = (240, 30, 30)
        out[t] = np.clip(f, 0, 255)
    return out


def main() -> None:
    from distillery.evaluation.vbench.dimensions import VBenchScorer
    from distillery.evaluation.vbench.protocol import SEEDS_PER_PROMPT, Protocol
    from distillery.evaluation.vbench.score import COMPUTED, QUALITY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--videos", type=int, default=3)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--fps", type=float, default=16.0)
    parser.add_argument("--small-models", action="store_true", help="small models of the same classes (a CPU check)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    scorer = VBenchScorer({}, COMPUTED, args.device, loaded=build_models(device, args.small_models))
    build_s = time.perf_counter() - t0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {d: [] for d in COMPUTED}
    for i in range(args.videos + 1):  # video 0 warms up
        video = synthetic_video(args.frames, args.height, args.width, i)
        for d in COMPUTED:
            sync()
            start = time.perf_counter()
            scorer.score(video, args.fps, "a red block moving across a textured wall", (d,), f"v{i}")
            sync()
            if i:
                times[d].append(time.perf_counter() - start)
    per_video = {d: statistics.median(v) for d, v in times.items()}
    quality_s = sum(per_video[d] for d in QUALITY)
    protocol = Protocol("vbench_standard")
    prompts = {d: sum(d in e.dimensions for e in protocol.entries) for d in COMPUTED}
    protocol_s = {d: prompts[d] * SEEDS_PER_PROMPT * per_video[d] for d in COMPUTED}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "shape": [args.frames, args.height, args.width], "fps": args.fps,
        "videos_timed": args.videos, "small_models": args.small_models, "build_s": build_s,
        "seconds_per_video": per_video, "quality_score_seconds_per_video": quality_s,
        "with_overall_consistency_seconds_per_video": quality_s + per_video["overall_consistency"],
        "standard_protocol": {"prompts_per_dimension": prompts, "videos_per_prompt": SEEDS_PER_PROMPT,
                              "seconds_per_dimension": protocol_s, "quality_seconds": sum(protocol_s[d] for d in QUALITY),
                              "all_seconds": sum(protocol_s.values()),
                              "every_dimension_on_all_946x5_videos_seconds": 946 * SEEDS_PER_PROMPT * (
                                  quality_s + per_video["overall_consistency"])},
    }
    print(json.dumps(result, indent=1))
    for d in COMPUTED:
        print(f"{d:24s} {per_video[d]:8.3f} s/video   standard protocol: {prompts[d]:3d} prompts x 5 = {protocol_s[d] / 60:7.1f} min")
    print(f"quality score: {quality_s:.2f} s/video; standard protocol (quality + overall consistency): "
          f"{result['standard_protocol']['all_seconds'] / 3600:.2f} h of scoring on this device")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
