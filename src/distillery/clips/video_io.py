"""Write and read small RGB videos as H.264 MP4 (through PyAV's bundled FFmpeg and x264).

Default encoding: H.264 High 4:4:4 Predictive, ``yuv444p``, ``crf 0`` (x264's lossless mode), one
encoder thread, BT.601 limited-range colour tagged in the stream, no B-frames, bit-exact muxing
(no library version string, no creation time). Decoding gives back the RGB frames to within one
uint8 level (the RGB→YUV rounding), and the same frames with the same FFmpeg/x264 build always give
byte-identical files. ``yuv420p`` (``pix_fmt="yuv420p"``, ``crf`` ≈ 18) plays in browsers but halves
the colour resolution, which loses most of the colour of a 32×32 clip: use it for previews only.

:func:`iter_captioned_videos` reads a clip folder (``videos/`` + ``captions.jsonl``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import Colorspace

from distillery.common.errors import UserError

log = logging.getLogger("distillery")

_AVCOL_SMPTE170M = 6  # AVColorSpace / AVColorPrimaries / AVColorTransferCharacteristic: BT.601 (525)
_AVCOL_RANGE_MPEG = 1  # AVColorRange: limited ("tv") range


X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


def write_video(
    path: Path | str, frames: np.ndarray, fps: float, *, crf: int = 0, pix_fmt: str = "yuv444p", preset: str = "medium"
) -> Path:
    """Encode ``frames`` (uint8 ``[T, H, W, 3]`` RGB, T ≥ 1) as an H.264 MP4 at ``fps`` frames/s.

    ``crf`` 0 is lossless in YUV; ``pix_fmt`` is ``"yuv444p"`` (default) or ``"yuv420p"`` (needs
    even H and W). ``preset`` is x264's speed/size trade (one of :data:`X264_PRESETS`): at ``crf`` 0 every
    preset decodes to the same YUV frames, only the time and the file's size differ (81×480×832: medium
    ~16 s, ultrafast ~1.5 s and ~15 % larger, one thread). Overwrites ``path``; returns it.
    """
    path = Path(path)
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise UserError(f"write_video needs uint8 frames [T, H, W, 3] with T >= 1, got {frames.dtype} {frames.shape}")
    _, height, width, _ = frames.shape
    if pix_fmt not in ("yuv444p", "yuv420p"):
        raise UserError(f"pix_fmt must be yuv444p or yuv420p, got {pix_fmt!r}")
    if pix_fmt == "yuv420p" and (height % 2 or width % 2):
        raise UserError(f"yuv420p needs an even frame size, got {height}x{width}")
    if fps <= 0:
        raise UserError(f"fps must be positive, got {fps}")
    if preset not in X264_PRESETS:
        raise UserError(f"preset must be one of {', '.join(X264_PRESETS)}, got {preset!r}")
    rate = Fraction(fps).limit_denominator(1001)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width = width
        stream.height = height
        stream.pix_fmt = pix_fmt
        stream.codec_context.time_base = 1 / rate
        stream.codec_context.colorspace = _AVCOL_SMPTE170M
        stream.codec_context.color_primaries = _AVCOL_SMPTE170M
        stream.codec_context.color_trc = _AVCOL_SMPTE170M
        stream.codec_context.color_range = _AVCOL_RANGE_MPEG
        stream.options = {"crf": str(crf), "preset": preset, "threads": "1", "bframes": "0"}
        for index, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame = frame.reformat(format=pix_fmt, dst_colorspace=Colorspace.ITU601)
            frame.pts = index
            frame.time_base = 1 / rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_video(path: Path | str) -> tuple[np.ndarray, float]:
    """Decode every frame of a video file: (uint8 RGB frames ``[T, H, W, 3]``, frames per second).

    YUV is converted with the colour matrix the stream is tagged with (FFmpeg's default when untagged).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"video not found: {path}")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise UserError(f"{path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else 0.0
            decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    except av.FFmpegError as exc:
        raise UserError(f"cannot decode {path}: {exc}") from exc
    if not decoded:
        raise UserError(f"{path} has no decodable frames")
    return np.stack(decoded), fps


def iter_captioned_videos(split_dir: Path | str) -> Iterator[tuple[np.ndarray, str]]:
    """``(frames uint8 [T, H, W, 3], caption)`` for each line of ``split_dir/captions.jsonl``.

    Each line is ``{"path": <video path relative to split_dir>, "caption": <text>}``.
    """
    split_dir = Path(split_dir)
    captions = split_dir / "captions.jsonl"
    if not captions.is_file():
        raise UserError(f"{captions} not found (a clip folder holds videos/ and captions.jsonl)")
    with captions.open() as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rel, caption = record["path"], record["caption"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{captions}:{number}: expected {{\"path\": ..., \"caption\": ...}}") from exc
            frames, _ = read_video(split_dir / rel)
            yield frames, caption
