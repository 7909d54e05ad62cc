"""Benchmark: validate's CPU half at the real Wan2.1 shape (81×480×832), before and after, one process.

On the H200 the validate stage at real shape ran 220 s for 16 videos and was cut at its time limit with the GPU
28% busy: the CPU work of each video — the analyzer, sharpness, the features, its mp4 — and the candidate's
paired distances and the grid came after (or beside) a few GPU seconds of sampling. This times that CPU work
on the machine it runs on, for a video like a real-shape sample (a coloured square moving over a gradient,
plus noise so the encoders see texture):

- **per video, one thread**: the old path (the analyzer, ``sharpness``, ``video_features`` computing sharpness
  again, the mp4 at x264's ``medium`` preset; the paired distance as float64 ``mean((a/255 − b/255)²)``) against
  the new one (sharpness once, the mp4 at validate's ``MP4_PRESET``, lossless either way,
  :func:`~distillery.evaluation.video_metrics.paired_mse` on the uint8 frames);
- **throughput**: ``--videos`` videos' new CPU half on 1 thread and on
  :func:`~distillery.evaluation.validation_files.scoring_workers` threads (what validate uses here);
- **the grid** of ``--rows`` candidates × 2 prompts: GIF at full size then mp4 (old) against the GIF preview
  (:func:`~distillery.evaluation.validation_files.gif_preview`) and the mp4 (``MP4_PRESET``) encoded at once (new).

Usage: ``python bench/validate_cpu_half.py [--videos 8] [--rows 4] [--out bench/results/x.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

T, H, W = 81, 480, 832


def sample_like(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    frames = np.empty((T, H, W, 3), np.uint8)
    frames[:] = np.linspace(0, 60, W, dtype=np.uint8)[None, None, :, None]
    for t in range(T):
        x = 40 + t * (W - 200) // T
        frames[t, 180:300, x:x + 120] = (230, 40, 40)
    noise = rng.integers(0, 12, size=frames.shape, dtype=np.uint8)
    return np.minimum(frames.astype(np.uint16) + noise, 255).astype(np.uint8)


def old_half(video: np.ndarray, reference: np.ndarray, folder: Path, key: str) -> float:
    from distillery.clips.analyzer import analyze
    from distillery.clips.video_io import write_video
    from distillery.evaluation.video_metrics import sharpness, video_features

    analysis = analyze(video)
    rgb = video.astype(np.float64) / 255.0
    sharpness(rgb)
    video_features(rgb, analysis)
    write_video(folder / f"{key}.mp4", video, 16)
    return float(np.mean((video.astype(np.float64) / 255.0 - reference.astype(np.float64) / 255.0) ** 2))


def new_half(video: np.ndarray, reference: np.ndarray, folder: Path, key: str) -> float:
    """What validate now runs per video: its scoring function, the mp4, then the paired distance."""
    from distillery.clips.video_io import write_video
    from distillery.evaluation.validation_files import MP4_PRESET
    from distillery.evaluation.video_metrics import paired_mse
    from distillery.evaluation.video_scores import score_video

    score_video(video, None, "a red square moving right")
    write_video(folder / f"{key}.mp4", video, 16, preset=MP4_PRESET)
    return paired_mse(video, reference)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> int:
    from distillery.clips.video_io import write_video
    from distillery.common.videogrid import VideoGrid, write_gif
    from distillery.evaluation.validation_files import gif_preview, scoring_workers, write_grid

    parser = argparse.ArgumentParser()
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    workers = scoring_workers(T * H * W * 3)
    videos = [sample_like(s) for s in range(args.videos)]
    reference = sample_like(1000)
    result: dict = {"shape": [T, H, W], "cores": len(os.sched_getaffinity(0)), "scoring_workers": workers,
                    "load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result["per_video_old_s"] = round(timed(old_half, videos[0], reference, folder, "old"), 2)
        result["per_video_new_s"] = round(timed(new_half, videos[0], reference, folder, "new"), 2)
        print(json.dumps(result), flush=True)
        for threads in sorted({1, workers}):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(lambda iv: new_half(iv[1], reference, folder, f"v{iv[0]}"), enumerate(videos)))
            seconds = time.perf_counter() - t0
            result[f"videos_{threads}_threads_s"] = round(seconds, 2)
            result[f"per_video_{threads}_threads_s"] = round(seconds / len(videos), 2)
            print(json.dumps(result), flush=True)
        grid = VideoGrid(args.rows, 2, T, H, W)
        for r in range(args.rows):
            for c in range(2):
                grid.put(r, c, videos[(r + c) % len(videos)])
        pixels, _ = grid.labelled([f"candidate_{r} · 4 NFE" for r in range(args.rows)], ["#0", "#1"], ["#0  a", "#1  b"])
        result["grid_hw"] = list(pixels.shape[1:3])
        t0 = time.perf_counter()
        write_gif(folder / "old.gif", pixels, 16)
        write_video(folder / "old.mp4", pixels, 16)
        result["grid_old_s"] = round(time.perf_counter() - t0, 2)
        result["grid_old_gif_mib"] = round((folder / "old.gif").stat().st_size / 2**20, 1)

        result["grid_new_s"] = round(timed(write_grid, pixels, folder, ["gif", "mp4"], 16), 2)
        result["grid_new_gif_mib"] = round((folder / "grid.gif").stat().st_size / 2**20, 1)
        result["grid_gif_preview_hw"] = list(gif_preview(pixels).shape[1:3])
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
