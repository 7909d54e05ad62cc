"""The files a validation writes besides its samples: the labelled grid (grid.gif, a preview cut to
:data:`GIF_MAX_PX`, and grid.mp4, :func:`write_grid`), metrics.json, plots/adherence.csv and report.json
(:func:`write_tables`), and how many threads score and encode the videos (:func:`scoring_workers`).
"""

from __future__ import annotations

import csv
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from distillery.common.videogrid import write_gif
from distillery.evaluation.clip_scores import CLIP_METRICS

# x264 preset of the sample and grid mp4s: lossless (crf 0) at any preset, so the decoded frames are the same; ultrafast
# encodes an 81×480×832 video ~10× faster than medium (1.5 s vs 16 s on one thread) for ~15 % more bytes
MP4_PRESET = "ultrafast"


GIF_MAX_PX = 1280  # the grid GIF is a preview: a grid longer than this on a side is written every k-th pixel (the mp4 is full size)
WORKING_SET_PER_VIDEO = 48  # bytes of scoring working set per byte of a uint8 video (float64 copies in the analyzer)


CSV_COLUMNS = ("candidate", "sampler", "nfe", "adherence", "adherence_std", "colour", "shape", "direction", "latency_s",
               "distance_to_teacher", "sharpness", "frechet_distance", "frechet_distance_std")


def scoring_workers(video_bytes: int) -> int:
    """Threads for the CPU half of the videos: the cores but one (the sampler's), at most 8, and no more than
    the available memory holds at :data:`WORKING_SET_PER_VIDEO` × ``video_bytes`` each; at least 1."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 0
    by_memory = available // max(1, WORKING_SET_PER_VIDEO * video_bytes) if available else 1
    return int(max(1, min(8, cores - 1, by_memory)))


def gif_preview(grid: np.ndarray, max_px: int = GIF_MAX_PX) -> np.ndarray:
    """``grid`` ``uint8 [T, H, W, 3]`` as the GIF shows it: every k-th row and column, k the smallest integer that
    brings both sides to ``max_px`` or less (k = 1: the grid itself)."""
    k = max(1, -(-max(grid.shape[1], grid.shape[2]) // max_px))
    return grid if k == 1 else np.ascontiguousarray(grid[:, ::k, ::k])


def write_grid(grid: np.ndarray, stage: Path, formats: list[str], fps: int) -> None:
    """grid.gif (:func:`gif_preview`) and grid.mp4 in ``stage``, as ``formats`` asks (ValidationConfig.grid_formats),
    at ``fps``, the two encoded at once."""
    from distillery.clips.video_io import write_video

    jobs = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="validate-grid") as pool:
        if "gif" in formats:
            jobs.append(pool.submit(write_gif, stage / "grid.gif", gif_preview(grid), fps))
        if "mp4" in formats:
            jobs.append(pool.submit(write_video, stage / "grid.mp4", grid, fps, preset=MP4_PRESET))
        for job in jobs:
            job.result()


def write_tables(stage: Path, metrics: dict[str, float], rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """metrics.json (the flat ``metrics``), plots/adherence.csv (``rows``, :data:`CSV_COLUMNS` + the CLIP scores'
    columns when scored) and report.json in ``stage``."""
    (stage / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (stage / "plots").mkdir()
    with (stage / "plots" / "adherence.csv").open("w", newline="") as fh:  # + the CLIP scores' columns when scored
        writer = csv.DictWriter(fh, fieldnames=[*CSV_COLUMNS, *(k for k in CLIP_METRICS if rows and k in rows[0])])
        writer.writeheader()
        writer.writerows(rows)
    (stage / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
