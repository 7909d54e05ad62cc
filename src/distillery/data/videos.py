"""Video ingestion: the entries of a user's captioned video folder (:mod:`distillery.data.video_folder`) -> fixed-size
RGB clips.

Each entry becomes a :class:`ClipItem` (``num_frames`` frames at ``fps``, starting at
``start_seconds``, centre-cropped to the target aspect ratio and resized to ``height × width``)
or a :class:`~distillery.data.video_folder.SkippedItem` with one of its reasons: a source too small for the target
size, a header that declares dimensions above ``max_source_side``, a file that does not decode. Frames are resampled
by picking, for each target timestamp ``t_i = start_seconds + i / fps``, the decoded source frame whose presentation
time is nearest (ties go to the earlier frame); nothing is interpolated. Decoding streams through
the file and stops once the last needed frame is seen, so a source video is never held whole.

Called by the ``latents`` stage (through :func:`load_clips` or :func:`load_entry`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import av
import numpy as np
from PIL import Image

from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic
from distillery.data.video_folder import (
    ClipError,
    Entry,
    SkippedItem,
    caption_text,
    check_regular_file,
    clip_id,
    read_entries,
    resolve_inside,
)

__all__ = [
    "ClipItem",
    "IngestConfig",
    "IngestResult",
    "decode_clip",
    "iter_clips",
    "load_clips",
    "load_entry",
]

logger = logging.getLogger("distillery.data")

_TIME_EPS = 1e-6  # seconds; timestamps closer than this are equal


@dataclass(frozen=True)
class IngestConfig:
    """What every clip becomes. Validated on construction (:class:`UserError` on bad values).

    Source size limits (the displayed size, after rotation):

    - **too small**: a source is skipped (``too_small``) when its height is below
      ``ceil(height / max_upscale)`` or its width below ``ceil(width / max_upscale)`` — exactly when
      the centre crop to the target aspect ratio would have to be enlarged more than
      ``max_upscale``× to fill ``height × width``. With the default 2.0 a 32×32 clip needs a source
      of at least 16×16; a 480×832 clip at least 240×416. Sources between that and the target
      size are upscaled (Lanczos).
    - **too large**: a source whose container/stream header declares a side above
      ``max_source_side`` is skipped (``dimensions_too_large``) before a frame is decoded; the
      decoder is also capped at ``max_source_side²`` pixels, so a stream that grows mid-way fails
      instead of allocating. The default 8192 admits 8K (7680×4320, 8192×4320) video; one such RGB
      frame is 200 MB. The header's frame count sizes nothing (decoding stops at the last frame
      needed), so it needs no limit.
    """

    num_frames: int  # frames per clip; 4k+1 (the Wan VAE compresses time by 4 after the first frame)
    height: int  # output height in pixels; a positive multiple of 16
    width: int  # output width in pixels; a positive multiple of 16
    fps: float  # target frame rate; frame i is the source frame nearest to start_seconds + i / fps
    start_seconds: float = 0.0  # where each clip starts in its source video, seconds
    max_bad_fraction: float = 0.5  # load_clips fails when more than this fraction of entries is skipped
    max_upscale: float = 2.0  # largest enlargement of the source's centre crop; smaller sources are too_small
    max_source_side: int = 8192  # pixels; a source declaring a larger height or width is dimensions_too_large

    def __post_init__(self) -> None:
        if not isinstance(self.num_frames, int) or self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise UserError(f"num_frames must be 4k+1 (1, 5, 9, 13, 17, ..., 81), got {self.num_frames!r}")
        for name in ("height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v % 16:
                raise UserError(f"{name} must be a positive multiple of 16 pixels, got {v!r}")
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise UserError(f"fps must be a positive number, got {self.fps!r}")
        if not (isinstance(self.start_seconds, (int, float)) and math.isfinite(self.start_seconds)
                and self.start_seconds >= 0):
            raise UserError(f"start_seconds must be >= 0, got {self.start_seconds!r}")
        if not (isinstance(self.max_bad_fraction, (int, float)) and 0.0 <= self.max_bad_fraction <= 1.0):
            raise UserError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction!r}")
        if not (isinstance(self.max_upscale, (int, float)) and math.isfinite(self.max_upscale)
                and self.max_upscale >= 1.0):
            raise UserError(f"max_upscale must be a finite number >= 1, got {self.max_upscale!r}")
        if not isinstance(self.max_source_side, int) or self.max_source_side < max(self.height, self.width):
            raise UserError(f"max_source_side must be an integer >= the target size "
                            f"({max(self.height, self.width)}), got {self.max_source_side!r}")

    def min_source_size(self) -> tuple[int, int]:
        """(height, width): the smallest displayed source size that is not ``too_small``."""
        return math.ceil(self.height / self.max_upscale), math.ceil(self.width / self.max_upscale)

    def target_times(self) -> list[float]:
        """Target timestamps in seconds from the start of the video, one per output frame."""
        return [self.start_seconds + i / self.fps for i in range(self.num_frames)]


@dataclass
class ClipItem:
    """One usable clip."""

    id: str  # stable, filesystem-safe id derived from `path` (see clip_id)
    path: str  # the video path relative to the data folder, as normalised from the captions file
    caption: str  # the caption, stripped of surrounding whitespace
    frames: np.ndarray  # uint8 [T, H, W, 3] RGB, T = num_frames, H × W = the configured size
    source_fps: float  # the source video's average frame rate, frames per second
    source_size: tuple[int, int]  # (height, width) of the source frames as displayed (after rotation)


@dataclass
class IngestResult:
    """Everything :func:`load_clips` read from one folder."""

    items: list[ClipItem]  # usable clips, in captions-file order
    skipped: list[SkippedItem]  # unusable entries, in captions-file order
    num_total: int  # entries in the captions file (usable + skipped; blank lines not counted)
    reason_counts: dict[str, int] = field(default_factory=dict)  # skipped entries per reason, most frequent first


# ---------------------------------------------------------------------------------------------
# decoding


def _stream_fps(stream: av.video.stream.VideoStream) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate and float(rate) > 0:
            return float(rate)
    return None


def _header_seconds(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                    fps: float | None) -> float | None:
    """The stream length the container header claims, seconds (None if unknown)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if stream.frames and fps:
        return stream.frames / fps
    if container.duration:
        return container.duration / av.time_base
    return None


class _Resizer:
    """Display rotation, centre crop to the target aspect ratio, area/Lanczos resize to H × W."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        img = frame.to_image()  # RGB, stored orientation
        turn = round((frame.rotation or 0) / 90) % 4  # counter-clockwise quarter turns to display it
        if turn:
            img = img.transpose({1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180,
                                 3: Image.Transpose.ROTATE_270}[turn])
        w, h = img.size
        if w * self.height > h * self.width:  # source wider than target: crop columns
            cw = h * self.width / self.height
            box = ((w - cw) / 2, 0.0, (w + cw) / 2, float(h))
        else:  # source taller: crop rows
            ch = w * self.height / self.width
            box = (0.0, (h - ch) / 2, float(w), (h + ch) / 2)
        downscale = (box[2] - box[0]) >= self.width and (box[3] - box[1]) >= self.height
        resample = Image.Resampling.BOX if downscale else Image.Resampling.LANCZOS
        out = img.resize((self.width, self.height), resample=resample, box=box)
        return np.asarray(out, dtype=np.uint8)


def _display_size(frame: av.VideoFrame) -> tuple[int, int]:
    turn = round((frame.rotation or 0) / 90) % 4
    return (frame.width, frame.height) if turn % 2 else (frame.height, frame.width)


def _check_size(size: tuple[int, int], cfg: IngestConfig, what: str) -> None:
    """:class:`ClipError` when a source of ``size`` = (height, width) must not be used."""
    h, w = size
    if h > cfg.max_source_side or w > cfg.max_source_side:
        raise ClipError("dimensions_too_large", f"{what} {h}×{w} (height×width); at most {cfg.max_source_side} "
                                                f"per side is decoded (max_source_side)")
    min_h, min_w = cfg.min_source_size()
    if h < min_h or w < min_w:
        raise ClipError("too_small", f"{what} {h}×{w} (height×width); a {cfg.height}×{cfg.width} clip needs at "
                                     f"least {min_h}×{min_w} (max_upscale={cfg.max_upscale:g})")


def _check_header_size(stream: av.video.stream.VideoStream, cfg: IngestConfig) -> None:
    """``dimensions_too_large`` from the stream header alone, before anything is decoded
    (0 = not declared: the decoder cap and the per-frame check still apply)."""
    h, w = stream.codec_context.height or 0, stream.codec_context.width or 0
    if h > cfg.max_source_side or w > cfg.max_source_side:
        _check_size((h, w), cfg, "the header declares")


def _check_text_header(path: Path, cfg: IngestConfig) -> None:
    """``dimensions_too_large`` for a YUV4MPEG2 file whose plain-text header declares a side above
    ``max_source_side`` (FFmpeg fails to open such a file with an unrelated error, so its size
    is read here, from the first bytes, before FFmpeg sees it). The first open of the file: it is
    non-blocking and checks (``fstat``) that a regular file was opened, ``unreadable`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there since the scan does not block this
    except OSError as e:
        raise ClipError("unreadable", f"cannot read {path.name}: {e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ClipError("unreadable", f"{path} is not a regular file")
        try:
            head = f.read(256)
        except OSError as e:
            raise ClipError("unreadable", f"cannot read {path.name}: {e}") from None
    if not head.startswith(b"YUV4MPEG2 "):
        return
    fields = {t[:1]: t[1:] for t in head.split(b"\n", 1)[0].split()[1:]}
    try:
        h, w = int(fields.get(b"H", b"0")), int(fields.get(b"W", b"0"))
    except ValueError:
        return  # malformed: FFmpeg will say so
    if h > cfg.max_source_side or w > cfg.max_source_side:
        _check_size((h, w), cfg, "the header declares")


def _open(path: Path, cfg: IngestConfig) -> tuple[av.container.InputContainer, av.video.stream.VideoStream]:
    """Open ``path`` with the decoder capped at ``max_source_side²`` pixels (also while FFmpeg
    probes the streams); return the container and its first video stream, header size checked."""
    cap = {"max_pixels": str(cfg.max_source_side * cfg.max_source_side)}
    try:
        container = av.open(str(path), mode="r", options=cap)
    except (av.FFmpegError, ValueError, OSError) as e:
        raise ClipError("unreadable", f"cannot open as a video ({e})") from e
    try:
        if not container.streams.video:
            raise ClipError("unreadable", "no video stream")
        stream = container.streams.video[0]
        _check_header_size(stream, cfg)
        stream.codec_context.options = dict(cap)
    except BaseException:
        container.close()
        raise
    return container, stream


class _NeedRestart(Exception):
    """A seek landed after the first target time; decode again from the start."""


def _pick_frames(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                 cfg: IngestConfig, src_fps: float | None, seek: bool) -> tuple[np.ndarray, tuple[int, int]]:
    """Stream-decode and pick the frame nearest each target time. Returns (frames, source_size)."""
    tb = stream.time_base or Fraction(1, 1)
    origin = stream.start_time
    targets = cfg.target_times()
    if seek:
        base = origin or 0
        container.seek(base + int(max(0.0, cfg.start_seconds - 0.5) / tb), backward=True, stream=stream)
    resize = _Resizer(cfg.height, cfg.width)
    out = np.empty((cfg.num_frames, cfg.height, cfg.width, 3), dtype=np.uint8)
    k = 0  # next target index
    decoded = 0
    prev: tuple[float, av.VideoFrame] | None = None
    converted: tuple[av.VideoFrame, np.ndarray] | None = None  # the last converted frame and its pixels
    size: tuple[int, int] | None = None

    def emit(frame: av.VideoFrame) -> None:
        nonlocal converted, k
        if converted is None or converted[0] is not frame:
            converted = (frame, resize(frame))
        out[k] = converted[1]
        k += 1

    try:
        for frame in container.decode(stream):
            if origin is None:
                origin = frame.pts if frame.pts is not None else 0
            if frame.pts is not None:
                t = float((frame.pts - origin) * tb)
            else:
                t = decoded / (src_fps or cfg.fps)
            decoded += 1
            frame_size = _display_size(frame)
            if frame_size != size:
                _check_size(frame_size, cfg, "the source is" if size is None else "the source changes size to")
            if size is None:
                size = frame_size
                if seek and t > targets[0] + _TIME_EPS:
                    raise _NeedRestart
            while k < len(targets) and t >= targets[k] - _TIME_EPS:
                if prev is not None and targets[k] - prev[0] <= t - targets[k] + _TIME_EPS:
                    emit(prev[1])
                else:
                    emit(frame)
            if k == len(targets):
                return out, size
            prev = (t, frame)
    except _NeedRestart:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        if decoded == 0:
            raise ClipError("unreadable", f"no frame could be decoded ({e})") from e
        raise ClipError("truncated", f"decoding failed after {decoded} frames ({e})") from e
    if prev is None:
        raise ClipError("unreadable", "the video stream holds no frames")
    # the stream ended: the last frame covers targets inside its display interval
    t_last, last = prev
    if last.duration and last.time_base:
        dur = float(last.duration * last.time_base)
    else:
        dur = 1.0 / (src_fps or cfg.fps)
    while k < len(targets) and targets[k] < t_last + dur - _TIME_EPS:
        emit(last)
    if k == len(targets):
        return out, size  # type: ignore[return-value]
    got_s = t_last + dur
    need = f"needs {cfg.num_frames} frames at {cfg.fps:g} fps from {cfg.start_seconds:g} s (until {targets[-1]:.3f} s)"
    header = _header_seconds(container, stream, src_fps)
    step = 1.0 / (src_fps or cfg.fps)
    if header is not None and got_s < header - 0.5 * step:
        raise ClipError("truncated", f"decoding ended at {got_s:.3f} s but the header says {header:.3f} s; {need}")
    raise ClipError("too_few_frames", f"video is {got_s:.3f} s long; {need}")


def decode_clip(path: Path, cfg: IngestConfig) -> tuple[np.ndarray, float, tuple[int, int]]:
    """Decode one video into ``(frames uint8 [T, H, W, 3] RGB, source_fps, (src_h, src_w))``.

    Frames are picked at ``cfg.target_times()`` (nearest source frame by presentation time,
    relative to the stream start), display rotation applied, centre-cropped and resized.
    Raises :class:`ClipError` with reason ``unreadable``, ``dimensions_too_large`` (from the header,
    before decoding; see :class:`IngestConfig`), ``too_small``, ``truncated`` or ``too_few_frames``.
    """
    _check_text_header(path, cfg)
    container, stream = _open(path, cfg)
    try:
        src_fps = _stream_fps(stream)
        try:
            frames, size = _pick_frames(container, stream, cfg, src_fps, seek=cfg.start_seconds > 0)
        except _NeedRestart:
            container.close()
            container, stream = _open(path, cfg)
            frames, size = _pick_frames(container, stream, cfg, src_fps, seek=False)
        return frames, float(src_fps or cfg.fps), size
    finally:
        container.close()


# ---------------------------------------------------------------------------------------------
# folders -> clips


def load_entry(folder: Path, entry: Entry | SkippedItem, cfg: IngestConfig) -> ClipItem | SkippedItem:
    """Finish one entry of :func:`read_entries`: check the caption and file, decode the clip."""
    if isinstance(entry, SkippedItem):
        logger.debug("skip %s: %s (%s)", entry.path, entry.reason, entry.detail)
        return entry
    try:
        abs_path, norm = resolve_inside(Path(folder).resolve(), entry.path)
        caption = caption_text(entry.caption)
        check_regular_file(abs_path)  # again: the file may have changed since read_entries
        frames, src_fps, size = decode_clip(abs_path, cfg)
    except ClipError as e:
        skipped = SkippedItem(entry.path, e.reason, f"{entry.label}: {e.detail}")
        logger.debug("skip %s: %s (%s)", skipped.path, skipped.reason, skipped.detail)
        return skipped
    return ClipItem(id=clip_id(norm), path=norm, caption=caption, frames=frames, source_fps=src_fps, source_size=size)


def iter_clips(folder: Path, cfg: IngestConfig) -> Iterator[ClipItem | SkippedItem]:
    """Yield one :class:`ClipItem` or :class:`SkippedItem` per captions-file entry, in file order.

    Raises :class:`UserError` (before yielding anything) when the folder has no captions file.
    Checks, in order: entry well-formed, path usable and inside the folder, caption non-blank and
    valid text, path not claimed by an earlier entry that passed these checks, file exists, header
    size (dimensions_too_large), then decode (unreadable / too_small / truncated / too_few_frames).
    """
    for entry in read_entries(folder):
        yield load_entry(folder, entry, cfg)


def _write_jsonl_atomic(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def load_clips(folder: Path, cfg: IngestConfig, skipped_path: Path | None = None) -> IngestResult:
    """Load every usable clip of a data folder into memory.

    Writes ``skipped_path`` (``skipped.jsonl``: one ``{"path", "reason", "detail"}`` per skipped
    entry, possibly empty; atomically) when given, before any failure is raised. Raises
    :class:`UserError` (one line: how many of how many are bad, the top reasons, the skipped file)
    when no clip is usable or more than ``cfg.max_bad_fraction`` of the entries are skipped.
    """
    folder = Path(folder)
    items: list[ClipItem] = []
    skipped: list[SkippedItem] = []
    for x in iter_clips(folder, cfg):
        (skipped if isinstance(x, SkippedItem) else items).append(x)
    total = len(items) + len(skipped)
    counts = dict(Counter(s.reason for s in skipped).most_common())
    if skipped_path is not None:
        _write_jsonl_atomic(Path(skipped_path), [s.to_json() for s in skipped])
    result = IngestResult(items=items, skipped=skipped, num_total=total, reason_counts=counts)
    top = ", ".join(f"{r}: {n}" for r, n in list(counts.items())[:3])
    where = f"see {skipped_path}" if skipped_path is not None else "pass skipped_path to list them"
    if not items:
        if total == 0:
            raise UserError(f"the captions file of {folder} lists no videos")
        raise UserError(f"none of the {total} videos in {folder} is usable ({top}); {where}")
    if len(skipped) > cfg.max_bad_fraction * total:
        raise UserError(
            f"{len(skipped)} of {total} videos in {folder} are unusable ({top}), more than "
            f"max_bad_fraction={cfg.max_bad_fraction:g}; {where}"
        )
    if skipped:
        logger.warning("%s: skipped %d of %d videos (%s)%s", folder, len(skipped), total, top,
                       f"; see {skipped_path}" if skipped_path is not None else "")
    logger.info("%s: loaded %d clips of %d×%d×%d", folder, len(items), cfg.num_frames, cfg.height, cfg.width)
    return result
