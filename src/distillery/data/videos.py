"""Video ingestion: a user's captioned video folder -> fixed-size RGB clips.

A data folder holds ``videos/...`` and a captions file, either

- ``captions.jsonl``: one ``{"path": "videos/x.mp4", "caption": "..."}`` object per line, or
- ``videos2caption.json``: a JSON list of ``{"path": ..., "cap": str | [str, ...]}`` (first caption
  of a list is used),

with ``path`` relative to the folder. A dataset may instead hold split sub-folders ``train/`` and
``validation/``, each such a folder (:func:`find_splits`).

The whole folder is untrusted input: nothing in it may crash ingestion or make it allocate without
bound. A captions file that is a symlink leading out of the folder is refused (:class:`UserError`);
every bad entry — a path that no filesystem accepts (NUL byte, a component over
:data:`NAME_MAX_BYTES` or a whole path over :data:`PATH_MAX_BYTES` bytes, a lone surrogate), a
caption that is not valid Unicode text or longer than :data:`MAX_CAPTION_CHARS`, a captions line
over :data:`MAX_ENTRY_BYTES`, a path that is not a regular file (a FIFO, a folder, a device: it is
never opened), a source too small for the target size, a header that declares dimensions above
``max_source_side`` — becomes a :class:`SkippedItem` with its reason. :func:`read_entries` does
every check that needs no decoding (file types included, with ``lstat``/``stat`` only), so a
caller can judge the folder's bad fraction before it decodes or writes anything.

Each entry becomes a :class:`ClipItem` (``num_frames`` frames at ``fps``, starting at
``start_seconds``, centre-cropped to the target aspect ratio and resized to ``height × width``)
or a :class:`SkippedItem` with one of :data:`REASONS`. Frames are resampled by picking, for each
target timestamp ``t_i = start_seconds + i / fps``, the decoded source frame whose presentation
time is nearest (ties go to the earlier frame); nothing is interpolated. Decoding streams through
the file and stops once the last needed frame is seen, so a source video is never held whole.

Called by the ``latents`` stage (through :func:`load_clips` or :func:`iter_clips`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import av
import numpy as np
from PIL import Image

from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic

__all__ = [
    "CAPTION_FILES",
    "MAX_CAPTION_CHARS",
    "MAX_ENTRY_BYTES",
    "REASONS",
    "ClipItem",
    "IngestConfig",
    "IngestResult",
    "SkippedItem",
    "clip_id",
    "decode_clip",
    "find_captions_file",
    "find_splits",
    "iter_clips",
    "load_clips",
]

logger = logging.getLogger("distillery.data")

#: Accepted captions files, in order of preference.
CAPTION_FILES = ("captions.jsonl", "videos2caption.json")

#: Every reason a :class:`SkippedItem` can carry.
REASONS = (
    "bad_caption_entry",  # a captions-file entry that is not JSON, not an object, or has no string path
    "bad_path",  # a path no filesystem accepts: NUL byte, lone surrogate, component or whole path too long
    "path_escapes_data_folder",  # absolute path, `..` leaving the folder, or a symlink pointing outside it
    "empty_caption",  # caption missing, not a string, blank or whitespace-only
    "bad_caption",  # caption is not valid Unicode text (a lone surrogate such as "\ud800")
    "caption_too_long",  # caption longer than MAX_CAPTION_CHARS characters (after stripping)
    "duplicate_path",  # the same (normalised) path already claimed by an earlier entry that passed every check above
    "missing_file",  # nothing at the path
    "unreadable",  # not a regular file (FIFO, folder, device, socket: never opened), cannot be opened
    #                (permissions, symlink loop), not a video, corrupt header, no video stream, or no frame decodes
    "dimensions_too_large",  # the header (or a decoded frame) has a side above max_source_side; nothing decoded
    "too_small",  # the source is below the minimum size for the target (see IngestConfig.max_upscale)
    "truncated",  # decoding fails part-way, or ends before the header's length, short of the frames needed
    "too_few_frames",  # the clip is shorter than num_frames at the target fps
)

#: Longest path component, in bytes of its UTF-8 form (Linux NAME_MAX); longer ones are ``bad_path``.
NAME_MAX_BYTES = 255
#: Longest absolute path (data folder + entry path), in bytes, NUL excluded (Linux PATH_MAX is 4096
#: with the NUL); longer ones are ``bad_path``.
PATH_MAX_BYTES = 4095
#: Longest caption kept, in characters (after stripping surrounding whitespace); longer ones are
#: ``caption_too_long``. 2048 characters is about what a 512-token text encoder (Wan 2.1's umT5)
#: reads of English text (the tokenizer truncates the rest), and keeps one caption drawable as one
#: line of validate's grid legend.
MAX_CAPTION_CHARS = 2048
#: Longest ``captions.jsonl`` line, in bytes; a longer line is ``bad_caption_entry`` and is read
#: past in 1 MiB pieces (never held whole), so one line without a newline cannot exhaust memory.
MAX_ENTRY_BYTES = 16 * 2**20
_SHOWN_PATH = 200  # characters of a user's path echoed in skipped.jsonl and messages
_SHOWN_DETAIL = 400  # characters of a skip's detail

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
class SkippedItem:
    """One unusable captions-file entry and why.

    ``path`` and ``detail`` are made readable on construction: characters that are not printable
    (NUL, newlines, lone surrogates) are written as escapes and long values are cut
    (``…``), so every ``skipped.jsonl`` record is one line of valid UTF-8.
    """

    path: str  # the entry's path as written (readable form), or "<captions file>:<line/entry>" when it has none
    reason: str  # one of REASONS
    detail: str  # a one-line human explanation, starting with where the entry is in the captions file

    def __post_init__(self) -> None:
        self.path = _readable(self.path, _SHOWN_PATH)
        self.detail = _readable(self.detail, _SHOWN_DETAIL)

    def to_json(self) -> dict[str, str]:
        """The ``skipped.jsonl`` record."""
        return {"path": self.path, "reason": self.reason, "detail": self.detail}


@dataclass
class IngestResult:
    """Everything :func:`load_clips` read from one folder."""

    items: list[ClipItem]  # usable clips, in captions-file order
    skipped: list[SkippedItem]  # unusable entries, in captions-file order
    num_total: int  # entries in the captions file (usable + skipped; blank lines not counted)
    reason_counts: dict[str, int] = field(default_factory=dict)  # skipped entries per reason, most frequent first


class ClipError(Exception):
    """A clip cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _readable(text: str, limit: int) -> str:
    """``text`` as printable one-line UTF-8 (non-printable characters and lone surrogates escaped),
    cut to ``limit`` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# folders and captions files


def find_captions_file(folder: Path) -> Path:
    """The captions file of a data folder (``captions.jsonl`` preferred); :class:`UserError` if none,
    if one is not a regular file (a FIFO would block the reader forever: it is never opened), or if
    it is a symlink that leads out of the folder (the folder's contents are untrusted: a link must
    not make ingestion read, and echo, a file elsewhere)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"data folder {folder} does not exist or is not a folder")
    for name in CAPTION_FILES:
        kind = _file_kind(folder / name)
        if kind not in ("absent", "a regular file"):
            raise UserError(f"{folder / name} is {kind}, not a regular file; put the captions file itself there")
    found = [folder / name for name in CAPTION_FILES if (folder / name).is_file()]
    if found and folder.resolve() not in found[0].resolve().parents:
        raise UserError(f"{found[0]} is a symlink to {_readable(str(found[0].resolve()), _SHOWN_PATH)}, outside the "
                        f"data folder {folder.resolve()}; copy the captions file into the folder")
    if not found:
        raise UserError(
            f"no captions file in {folder}: expected {CAPTION_FILES[0]} "
            f'(lines of {{"path": "videos/x.mp4", "caption": "..."}}) or {CAPTION_FILES[1]} '
            f'(a JSON list of {{"path": ..., "cap": ...}})'
        )
    if len(found) > 1:
        logger.warning("%s has both %s and %s; using %s", folder, *CAPTION_FILES, found[0].name)
    return found[0]


def find_splits(folder: Path) -> dict[str, Path]:
    """Map split name -> data folder: ``{"train": folder}`` for a flat folder, or
    ``{"train": folder/train, "validation": folder/validation}`` when split sub-folders exist
    (``train/`` alone is allowed; ``validation/`` alone is a :class:`UserError`).
    Every returned folder is checked to have a captions file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"data folder {folder} does not exist or is not a folder")
    train, val = folder / "train", folder / "validation"
    if val.is_dir() and not train.is_dir():
        raise UserError(f"{folder} has a validation/ split but no train/ split; add {train} or flatten the folder")
    if train.is_dir():
        splits = {"train": train}
        if val.is_dir():
            splits["validation"] = val
        if any((folder / name).is_file() for name in CAPTION_FILES):
            logger.warning("%s has split sub-folders and a top-level captions file; using the splits", folder)
    else:
        splits = {"train": folder}
    for path in splits.values():
        find_captions_file(path)
    return splits


@dataclass
class _Entry:
    """One well-formed captions-file entry."""

    label: str  # where it is in the captions file ("captions.jsonl:3"), for messages
    path: str  # the path as written
    caption: Any  # the raw caption value (validated later)


def _entry_from_obj(obj: Any, label: str, where: str, caption_keys: tuple[str, ...]) -> _Entry | SkippedItem:
    if not isinstance(obj, dict):
        return SkippedItem(label, "bad_caption_entry", f"{where}: not a JSON object")
    path = obj.get("path")
    if not isinstance(path, str) or not path.strip():
        return SkippedItem(label, "bad_caption_entry", f"{where}: no string 'path'")
    caption = next((obj[k] for k in caption_keys if k in obj), None)
    if isinstance(caption, list):
        caption = caption[0] if caption else None
    return _Entry(label, path, caption)


def _bounded_lines(f: Any) -> Iterator[bytes | None]:
    """The lines of a binary file, each at most :data:`MAX_ENTRY_BYTES` long; a longer line is
    read past in 1 MiB pieces and comes back as None."""
    while raw := f.readline(MAX_ENTRY_BYTES + 1):
        if len(raw) <= MAX_ENTRY_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while (piece := f.readline(2**20)) and not piece.endswith(b"\n"):
            pass
        yield None


def _read_entries(captions: Path) -> Iterator[_Entry | SkippedItem]:
    """Entries of a captions file in file order; malformed ones as ``bad_caption_entry`` skips."""
    if captions.name.endswith(".jsonl"):
        with captions.open("rb") as f:
            for lineno, raw in enumerate(_bounded_lines(f), start=1):
                label = f"{captions.name}:{lineno}"
                if raw is None:
                    yield SkippedItem(label, "bad_caption_entry",
                                      f"line {lineno}: longer than {MAX_ENTRY_BYTES} bytes (MAX_ENTRY_BYTES)")
                    continue
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    yield SkippedItem(label, "bad_caption_entry", f"line {lineno}: not valid JSON ({e})")
                    continue
                yield _entry_from_obj(obj, label, f"line {lineno}", ("caption", "cap"))
    else:
        try:
            data = json.loads(captions.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{captions} is not valid JSON ({e}); it must be a list of {{\"path\", \"cap\"}}") from e
        if not isinstance(data, list):
            raise UserError(
                f"{captions} must hold a JSON list of {{\"path\", \"cap\"}} objects, got {type(data).__name__}"
            )
        for index, obj in enumerate(data):
            yield _entry_from_obj(obj, f"{captions.name}[{index}]", f"entry {index}", ("cap", "caption"))


def _check_path_text(rel: str) -> None:
    """:class:`ClipError` ``bad_path`` when no filesystem call could take ``rel`` (checked on the
    text alone, before any call is made)."""
    shown = _readable(repr(rel), 80)
    if "\x00" in rel:
        raise ClipError("bad_path", f"path {shown} holds a NUL byte")
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ClipError("bad_path", f"path {shown} is not valid Unicode text "
                                    f"(lone surrogate U+{ord(rel[e.start]):04X} at character {e.start})") from None
    for part in rel.split("/"):
        if len(part.encode("utf-8")) > NAME_MAX_BYTES:
            raise ClipError("bad_path", f"path {shown} has a component of {len(part.encode('utf-8'))} bytes; "
                                        f"at most {NAME_MAX_BYTES} are allowed")


def _resolve_inside(root: Path, rel: str) -> tuple[Path, str]:
    """(absolute path, normalised relative path) of ``rel`` under ``root``; :class:`ClipError` if it
    cannot be a path (``bad_path``), cannot be resolved (``unreadable``: a symlink loop, no
    permission) or escapes (``path_escapes_data_folder``).

    ``root`` must be resolved. Symlinks are followed: a link inside the folder that points outside
    it escapes."""
    _check_path_text(rel)
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise ClipError("path_escapes_data_folder", f"absolute path {rel!r}; paths must be relative to the data folder")
    norm = os.path.normpath(rel)
    if norm == ".." or norm.startswith(".." + os.sep):
        raise ClipError("path_escapes_data_folder", f"{rel!r} leaves the data folder")
    total = len(os.fsencode(str(root / norm)))
    if total > PATH_MAX_BYTES:
        raise ClipError("bad_path", f"path {_readable(repr(rel), 80)} is {total} bytes long inside the data folder; "
                                    f"at most {PATH_MAX_BYTES} are allowed")
    try:
        resolved = (root / norm).resolve()
    except (RuntimeError, OSError, ValueError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ClipError("unreadable", f"cannot resolve {rel!r}: {e}") from None
    if resolved != root and root not in resolved.parents:
        raise ClipError("path_escapes_data_folder", f"{rel!r} resolves to {resolved}, outside {root}")
    return root / norm, norm.replace(os.sep, "/")


def _caption_text(raw: Any) -> str:
    if not isinstance(raw, str):
        why = "caption missing" if raw is None else f"caption is not a string ({type(raw).__name__})"
        raise ClipError("empty_caption", why)
    text = raw.strip()
    if not text:
        raise ClipError("empty_caption", "caption is blank")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ClipError("bad_caption", f"caption is not valid Unicode text (lone surrogate U+{ord(text[e.start]):04X} "
                                       f"at character {e.start})") from None
    if len(text) > MAX_CAPTION_CHARS:
        raise ClipError("caption_too_long", f"caption is {len(text)} characters; at most {MAX_CAPTION_CHARS} are "
                                            f"kept (MAX_CAPTION_CHARS): shorten it")
    return text


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _file_kind(path: Path) -> str:
    """What is at ``path``, from ``lstat``/``stat`` alone (nothing is opened): ``"absent"``, ``"a
    regular file"``, ``"a broken symlink"``, ``"a folder"``, ``"a FIFO (named pipe)"``, ... A symlink
    is judged by what it points to. ``OSError`` (no permission to look, a symlink loop) propagates."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return "a broken symlink"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")


def _check_regular_file(path: Path) -> None:
    """:class:`ClipError` unless ``path`` is a regular file (or a symlink to one): ``missing_file``
    when nothing is there, ``unreadable`` for a FIFO, folder, device, socket or broken link. Uses
    ``lstat``/``stat`` only: a FIFO is never opened (opening one for reading blocks until a writer
    comes)."""
    try:
        kind = _file_kind(path)
    except OSError as e:  # e.g. no permission to look into a folder on the path, a symlink loop
        raise ClipError("unreadable", f"cannot look up {path}: {e}") from None
    if kind == "absent":
        raise ClipError("missing_file", f"no file at {path}")
    if kind != "a regular file":
        raise ClipError("unreadable", f"{path} is {kind}, not a regular file")


def clip_id(rel_path: str) -> str:
    """A stable, filesystem-safe id for a relative video path: a readable slug of the path without
    its extension plus 8 hex digits of its SHA-1 (so distinct paths never collide).
    ``"videos/a b.mp4"`` -> ``"videos_a_b-<hash>"``."""
    stem = rel_path.rsplit(".", 1)[0] if "." in rel_path.rsplit("/", 1)[-1] else rel_path
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:80] or "clip"
    digest = hashlib.sha1(rel_path.encode("utf-8")).hexdigest()[:8]
    return f"{slug}-{digest}"


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


def read_entries(folder: Path) -> list[_Entry | SkippedItem]:
    """The captions file's entries in file order, with the checks that need no decoding done.

    Malformed or over-long entries, bad or escaping paths, bad or over-long captions, repeated
    paths, and paths where no regular file is (``missing_file``; ``unreadable`` for a FIFO, folder,
    device or socket, found with ``lstat``/``stat``: nothing is opened) come back as
    :class:`SkippedItem`; the rest as entries whose ``path`` is normalised, known to lie inside the
    folder and to name a regular file, and whose caption is stripped, valid text.
    :func:`load_entry` finishes each one.
    Raises :class:`UserError` when the folder has no captions file (or it links out of the folder).
    (Used by preprocessing, which assigns entries to shards before decoding.)

    Only an entry that passes every one of these checks claims its path, so an entry skipped for,
    say, an empty caption does not make a later good entry of the same path a ``duplicate_path``.
    (A claimed entry that later fails on its file — missing, unreadable, too small — keeps its
    claim: a later entry naming the same file would fail the same way.)
    """
    folder = Path(folder)
    captions = find_captions_file(folder)
    root = folder.resolve()
    seen: set[str] = set()
    out: list[_Entry | SkippedItem] = []
    for entry in _read_entries(captions):
        if isinstance(entry, SkippedItem):
            out.append(entry)
            continue
        try:
            abs_path, norm = _resolve_inside(root, entry.path)
            caption = _caption_text(entry.caption)
            if norm in seen:
                raise ClipError("duplicate_path", f"{norm} is already named by an earlier entry")
        except ClipError as e:
            out.append(SkippedItem(entry.path, e.reason, f"{entry.label}: {e.detail}"))
            continue
        seen.add(norm)
        try:
            _check_regular_file(abs_path)
        except ClipError as e:
            out.append(SkippedItem(norm, e.reason, f"{entry.label}: {e.detail}"))
            continue
        out.append(dataclasses.replace(entry, path=norm, caption=caption))
    return out


def load_entry(folder: Path, entry: _Entry | SkippedItem, cfg: IngestConfig) -> ClipItem | SkippedItem:
    """Finish one entry of :func:`read_entries`: check the caption and file, decode the clip."""
    if isinstance(entry, SkippedItem):
        logger.debug("skip %s: %s (%s)", entry.path, entry.reason, entry.detail)
        return entry
    try:
        abs_path, norm = _resolve_inside(Path(folder).resolve(), entry.path)
        caption = _caption_text(entry.caption)
        _check_regular_file(abs_path)  # again: the file may have changed since read_entries
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
