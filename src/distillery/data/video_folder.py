"""A user's captioned video folder, read without decoding: its captions file, its splits and its entries.

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
never opened) — becomes a :class:`SkippedItem` with its reason (one of :data:`REASONS`).
:func:`read_entries` does every check that needs no decoding (file types included, with ``lstat``/``stat`` only),
so a caller can judge the folder's bad fraction before it decodes or writes anything; decoding an entry into a
clip is :mod:`distillery.data.videos`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from distillery.common.errors import UserError

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
class Entry:
    """One well-formed captions-file entry."""

    label: str  # where it is in the captions file ("captions.jsonl:3"), for messages
    path: str  # the path as written
    caption: Any  # the raw caption value (validated later)


def _entry_from_obj(obj: Any, label: str, where: str, caption_keys: tuple[str, ...]) -> Entry | SkippedItem:
    if not isinstance(obj, dict):
        return SkippedItem(label, "bad_caption_entry", f"{where}: not a JSON object")
    path = obj.get("path")
    if not isinstance(path, str) or not path.strip():
        return SkippedItem(label, "bad_caption_entry", f"{where}: no string 'path'")
    caption = next((obj[k] for k in caption_keys if k in obj), None)
    if isinstance(caption, list):
        caption = caption[0] if caption else None
    return Entry(label, path, caption)


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


def _read_entries(captions: Path) -> Iterator[Entry | SkippedItem]:
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


def resolve_inside(root: Path, rel: str) -> tuple[Path, str]:
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


def caption_text(raw: Any) -> str:
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


def check_regular_file(path: Path) -> None:
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


def read_entries(folder: Path) -> list[Entry | SkippedItem]:
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
    out: list[Entry | SkippedItem] = []
    for entry in _read_entries(captions):
        if isinstance(entry, SkippedItem):
            out.append(entry)
            continue
        try:
            abs_path, norm = resolve_inside(root, entry.path)
            caption = caption_text(entry.caption)
            if norm in seen:
                raise ClipError("duplicate_path", f"{norm} is already named by an earlier entry")
        except ClipError as e:
            out.append(SkippedItem(entry.path, e.reason, f"{entry.label}: {e.detail}"))
            continue
        seen.add(norm)
        try:
            check_regular_file(abs_path)
        except ClipError as e:
            out.append(SkippedItem(norm, e.reason, f"{entry.label}: {e.detail}"))
            continue
        out.append(dataclasses.replace(entry, path=norm, caption=caption))
    return out
