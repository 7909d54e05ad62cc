"""A deterministic synthetic set of captioned clips: one coloured shape moving in a straight line.

``make_clip_set(out, cfg)`` writes, once per split (``train``, ``validation``), exactly the layout a
user's own data uses::

    out/train/videos/<id>.mp4           H.264 yuv444p lossless, uint8 RGB within 1 level
    out/train/captions.jsonl            {"path": "videos/<id>.mp4", "caption": "..."} per line
    out/validation/...                  the same
    out/ground_truth.jsonl              split, path, caption and every attribute, start_xy, velocity_xy
    out/README.md                       the caption grammar and how the clips were made

Geometry (pixels; x to the right, y downwards, pixel ``i`` covers ``[i, i+1)``): the shape fits a
``2r × 2r`` box with ``r = min(H, W) / 6``; ``start_xy`` is the box centre at frame 0 and the centre
at frame ``t`` is ``start_xy + t · velocity_xy``. The start is drawn so the whole box stays at least
``margin_px`` inside the frame for the whole clip (no wrap, no bounce). Speeds are the grammar's
px/frame on a 32-px frame times ``min(H, W) / 32``; when the fastest one would not fit in the clip,
every speed is scaled down by the same factor (so "quickly" stays twice "slowly") until the fastest
path spans 90% of the free travel.

Rendering is anti-aliased: coverage is sampled on a ``supersample``× finer grid and box-averaged,
and each pixel is ``background + coverage · (colour − background)`` rounded to uint8.

Balance: in each split, clips cycle through every combination of the *covering* attributes
(train: colour × shape × direction; validation: colour × direction), in a fresh seeded order per
cycle; the other attributes follow a mixed-radix counter on the clip index so each of their
values appears equally often. Train and validation use independent random streams, so changing
``num_train`` does not change the validation clips. Same config → byte-identical files (with the
same FFmpeg/x264 build; decoded frames are identical in any case).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from distillery.clips.grammar import (
    BACKGROUNDS,
    COLOURS,
    DIRECTIONS,
    SHAPES,
    SPEEDS,
    UNSPECIFIED_SPEED,
    ClipAttributes,
    check_vocabulary,
    format_caption,
)
from distillery.clips.video_io import write_video
from distillery.common.errors import UserError
from distillery.common.fsutil import replace_dir

log = logging.getLogger("distillery")

SPLITS = ("train", "validation")
_SPLIT_STREAM = {"train": 0, "validation": 1}  # second seed word of each split's random stream
_COVER = {"train": ("colour", "shape", "direction"), "validation": ("colour", "direction")}
_REFERENCE_SIZE = 32  # frame size (px) at which the grammar's speeds are given
_FIT_FRACTION = 0.9  # when speeds must shrink to fit, the fastest path uses this share of the free travel


@dataclass(frozen=True)
class ClipSetConfig:
    """What :func:`make_clip_set` generates; lists may be given as lists or tuples."""

    num_train: int = 96  # clips in the train split
    num_validation: int = 24  # clips in the validation split
    num_frames: int = 17  # frames per clip
    height: int = 32  # frame height in pixels
    width: int = 32  # frame width in pixels
    fps: int = 8  # frames per second stored in the MP4
    seed: int = 0  # seed of every random choice (start positions, combination order)
    colours: tuple[str, ...] = tuple(COLOURS)  # shape colours to use (grammar words)
    shapes: tuple[str, ...] = SHAPES  # shapes to use
    directions: tuple[str, ...] = tuple(DIRECTIONS)  # motion directions to use
    speeds: tuple[str | None, ...] = ("slowly", "quickly")  # speed words; None = caption without one
    backgrounds: tuple[str, ...] = ("black",)  # background colours to use
    supersample: int = 4  # anti-aliasing: coverage samples per pixel along each axis
    margin_px: float = 1.0  # minimum gap between the shape's box and the frame edge, in pixels
    crf: int = 0  # x264 constant rate factor (0 = lossless in YUV)

    def __post_init__(self) -> None:
        for name in ("colours", "shapes", "directions", "speeds", "backgrounds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_vocabulary("colour", self.colours, COLOURS)
        check_vocabulary("shape", self.shapes, SHAPES)
        check_vocabulary("direction", self.directions, DIRECTIONS)
        check_vocabulary("speed", [s for s in self.speeds if s is not None], SPEEDS)
        check_vocabulary("background", self.backgrounds, BACKGROUNDS)
        for name in ("colours", "shapes", "directions", "speeds", "backgrounds"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise UserError(f"clips.{name} must be a non-empty list without repeats, got {list(values)}")
        if self.num_train < 0 or self.num_validation < 0 or self.num_train + self.num_validation == 0:
            raise UserError("clip counts must be >= 0 and not both 0")
        if self.num_frames < 2:
            raise UserError(f"clips need at least 2 frames to move, got {self.num_frames}")
        if min(self.height, self.width) < 12:
            raise UserError(f"frame size must be at least 12x12, got {self.height}x{self.width}")
        if self.fps <= 0 or self.supersample < 1 or self.margin_px < 0 or not 0 <= self.crf <= 51:
            raise UserError("fps must be > 0, supersample >= 1, margin_px >= 0 and crf in [0, 51]")
        if self._free_travel() <= 0:
            raise UserError(f"a {self.height}x{self.width} frame leaves no room to move the shape")

    @property
    def radius(self) -> float:
        """Half the side of the shape's box, in pixels: ``min(H, W) / 6``."""
        return min(self.height, self.width) / 6

    def _free_travel(self) -> float:
        """Pixels the box centre can travel along the tighter axis used by ``directions``."""
        sizes = [self.width if DIRECTIONS[d][0] else self.height for d in self.directions]
        return min(sizes) - 2 * self.radius - 2 * self.margin_px

    def speed_px(self, speed: str | None) -> float:
        """Speed in pixels per frame of a speed word (None = no word), after size scaling and fitting."""
        scale = min(self.height, self.width) / _REFERENCE_SIZE
        fastest = max(SPEEDS[s] if s else UNSPECIFIED_SPEED for s in self.speeds) * scale
        needed = fastest * (self.num_frames - 1)
        fit = 1.0 if needed <= self._free_travel() else _FIT_FRACTION * self._free_travel() / needed
        return round((SPEEDS[speed] if speed else UNSPECIFIED_SPEED) * scale * fit, 6)


@dataclass(frozen=True)
class ClipSpec:
    """One clip to render: what it shows and where the shape goes."""

    split: str  # "train" or "validation"
    clip_id: str  # file stem, e.g. "train-0007"
    attrs: ClipAttributes  # the caption's content
    start_xy: tuple[float, float]  # box centre at frame 0, pixels (x, y)
    velocity_xy: tuple[float, float]  # box centre displacement per frame, pixels (dx, dy)

    @property
    def path(self) -> str:
        """Video path relative to the split folder."""
        return f"videos/{self.clip_id}.mp4"

    @property
    def caption(self) -> str:
        """The clip's caption in the grammar."""
        return format_caption(self.attrs)


def plan_clips(cfg: ClipSetConfig) -> list[ClipSpec]:
    """Every clip of both splits (train first), deterministic in ``cfg``."""
    specs: list[ClipSpec] = []
    for split, count in (("train", cfg.num_train), ("validation", cfg.num_validation)):
        rng = np.random.default_rng([cfg.seed, _SPLIT_STREAM[split]])
        for index, attrs in enumerate(_balanced_attributes(cfg, split, count, rng)):
            start, velocity = _draw_path(cfg, attrs, rng)
            specs.append(ClipSpec(split, f"{split}-{index:04d}", attrs, start, velocity))
    return specs


def _balanced_attributes(cfg: ClipSetConfig, split: str, count: int, rng: np.random.Generator) -> list[ClipAttributes]:
    """``count`` attribute sets: covering attributes cycle over their full product, others count."""
    values = {"colour": cfg.colours, "shape": cfg.shapes, "direction": cfg.directions,
              "speed": cfg.speeds, "background": cfg.backgrounds}
    cover = _COVER[split]
    rest = [name for name in values if name not in cover]
    combos = list(itertools.product(*(values[name] for name in cover)))
    out: list[ClipAttributes] = []
    order: list[int] = []
    for index in range(count):
        if index % len(combos) == 0:
            order = [int(i) for i in rng.permutation(len(combos))]
        chosen = dict(zip(cover, combos[order[index % len(combos)]]))
        radix = 1
        for name in rest:
            chosen[name] = values[name][(index // radix) % len(values[name])]
            radix *= len(values[name])
        out.append(ClipAttributes(**chosen))
    return out


def _draw_path(
    cfg: ClipSetConfig, attrs: ClipAttributes, rng: np.random.Generator
) -> tuple[tuple[float, float], tuple[float, float]]:
    """A start (box centre, px) and velocity (px/frame) keeping the box inside the frame throughout."""
    speed = cfg.speed_px(attrs.speed)
    unit = DIRECTIONS[attrs.direction]
    velocity = (unit[0] * speed, unit[1] * speed)
    travel = (cfg.num_frames - 1) * speed
    if travel > cfg._free_travel() + 1e-9:
        raise UserError(f"a {speed:.3g} px/frame path of {cfg.num_frames} frames does not fit the frame")
    start = []
    for axis, size in ((0, cfg.width), (1, cfg.height)):
        lo = cfg.radius + cfg.margin_px
        hi = size - cfg.radius - cfg.margin_px
        if unit[axis] > 0:
            hi -= travel
        elif unit[axis] < 0:
            lo += travel
        hi = max(hi, lo)
        # Round to a grid the ground truth can state exactly, staying inside [lo, hi].
        start.append(float(np.clip(np.round(rng.uniform(lo, hi), 3), lo, hi)))
    return (start[0], start[1]), (float(velocity[0]), float(velocity[1]))


def render_clip(spec: ClipSpec, cfg: ClipSetConfig) -> np.ndarray:
    """The clip's frames: uint8 RGB ``[T, H, W, 3]``, anti-aliased."""
    s = cfg.supersample
    t = np.arange(cfg.num_frames, dtype=np.float64)[:, None, None]
    ys = ((np.arange(cfg.height * s) + 0.5) / s)[None, :, None]
    xs = ((np.arange(cfg.width * s) + 0.5) / s)[None, None, :]
    dx = xs - (spec.start_xy[0] + t * spec.velocity_xy[0])  # [T, 1, W·s] offsets from the box centre
    dy = ys - (spec.start_xy[1] + t * spec.velocity_xy[1])  # [T, H·s, 1]
    r = cfg.radius
    shape = spec.attrs.shape
    if shape == "circle":
        inside = dx**2 + dy**2 <= r**2
    elif shape == "square":
        inside = (np.abs(dx) <= r) & (np.abs(dy) <= r)
    else:  # triangle: apex at (0, -r), base from (-r, r) to (r, r)
        inside = (dy <= r) & (np.abs(dx) <= (dy + r) / 2)
    coverage = inside.reshape(cfg.num_frames, cfg.height, s, cfg.width, s).mean(axis=(2, 4))[..., None]
    background = np.asarray(BACKGROUNDS[spec.attrs.background], dtype=np.float64)
    colour = np.asarray(COLOURS[spec.attrs.colour], dtype=np.float64)
    frames = background + coverage * (colour - background)
    return np.rint(frames).astype(np.uint8)


def make_clip_set(out: Path | str, cfg: ClipSetConfig | None = None, overwrite: bool = False) -> Path:
    """Write the clip set of ``cfg`` to ``out`` (layout in the module docstring); returns ``out``.

    Builds in a sibling temp folder and renames it into place, so ``out`` is either absent/old or
    complete. Refuses a non-empty ``out`` unless ``overwrite`` (then replaces it).
    """
    cfg = cfg or ClipSetConfig()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    started = time.perf_counter()
    try:
        _write_clip_set(tmp, cfg)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log.info("wrote %d train + %d validation clips to %s in %.1f s",
             cfg.num_train, cfg.num_validation, out, time.perf_counter() - started)
    return out


def _write_clip_set(root: Path, cfg: ClipSetConfig) -> None:
    specs = plan_clips(cfg)
    captions: dict[str, list[str]] = {split: [] for split in SPLITS}
    truth: list[str] = []
    counts = {"train": cfg.num_train, "validation": cfg.num_validation}
    splits = [split for split in SPLITS if counts.get(split, 1) > 0]  # no folder for an empty split: the data has none
    for split in splits:
        (root / split / "videos").mkdir(parents=True)
    for spec in specs:
        write_video(root / spec.split / spec.path, render_clip(spec, cfg), cfg.fps, crf=cfg.crf)
        captions[spec.split].append(json.dumps({"path": spec.path, "caption": spec.caption}))
        record = {"split": spec.split, "path": spec.path, "caption": spec.caption}
        record.update(asdict(spec.attrs))
        record.update({"start_xy": list(spec.start_xy), "velocity_xy": list(spec.velocity_xy)})
        truth.append(json.dumps(record))
    for split in splits:
        (root / split / "captions.jsonl").write_text("".join(line + "\n" for line in captions[split]))
    (root / "ground_truth.jsonl").write_text("".join(line + "\n" for line in truth))
    (root / "README.md").write_text(_readme(cfg))


def _readme(cfg: ClipSetConfig) -> str:
    speeds = ", ".join(f"{s or '(no word)'} = {cfg.speed_px(s):.3g} px/frame" for s in cfg.speeds)
    return f"""# Synthetic captioned clips

Made by `distillery clips make` (`distillery.clips.make_clip_set`), deterministic in its settings:
{json.dumps(asdict(cfg))}

Each clip is {cfg.num_frames} frames of {cfg.height}x{cfg.width} RGB at {cfg.fps} fps: one flat-coloured
shape moving in a straight line at constant speed over a flat background, never leaving the frame.

## Caption grammar

    a <colour> <shape> moving <direction> [slowly|quickly] on a <background> background

- colours: {", ".join(f"{c} {COLOURS[c]}" for c in cfg.colours)}
- shapes: {", ".join(cfg.shapes)} (all fit a {2 * cfg.radius:.3g}-px box; the triangle points up)
- directions: {", ".join(cfg.directions)} (up = towards the top row)
- speeds: {speeds}
- backgrounds: {", ".join(f"{b} {BACKGROUNDS[b]}" for b in cfg.backgrounds)}

## Layout

- `train/videos/<id>.mp4`, `train/captions.jsonl` ({cfg.num_train} clips): lines
  `{{"path": "videos/<id>.mp4", "caption": "..."}}`, paths relative to the split folder.
- `validation/...` the same ({cfg.num_validation} clips).
- `ground_truth.jsonl`: split, path, caption, colour, shape, direction, speed, background,
  `start_xy` (box centre at frame 0, px, x right / y down) and `velocity_xy` (px/frame).

Videos are H.264 High 4:4:4 (yuv444p, crf {cfg.crf}; crf 0 is lossless up to the RGB/YUV rounding of one
level). They decode with FFmpeg-based readers (PyAV, imageio, torchvision) but not in most browsers.
Every combination of colour x shape x direction appears in train; validation covers every colour x
direction pair.
"""
