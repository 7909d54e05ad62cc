"""Crash-safe file-system publishing, and reading the small JSON files a run keeps.

Publishing: outputs are written to a temporary sibling, then renamed. A reader (or a rerun after a
kill) sees either the previous complete output or the new complete output, never a half-written one.

Reading: :func:`read_json_file` reads state we wrote ourselves but that anything may have replaced
since (a checkpoint's ``metadata.json``, the hash cache): it never blocks on a FIFO or a device,
refuses what is not a regular file, and bounds the size and the nesting before parsing, so a
200,000-deep document is a ``ValueError``, not a ``RecursionError``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # nesting of arrays/objects read_json_file accepts (what we write: at most 5)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_KINDS = {stat.S_IFREG: "a file", stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFLNK: "a symbolic link"}


def replace_dir(staging: Path, final: Path) -> Path:
    """Rename the folder ``staging`` to ``final`` (same file system), replacing a folder there.

    The old folder is first moved aside into a temporary sibling and deleted only after the rename
    succeeded; if the rename fails it is put back. Returns ``final``.
    """
    staging, final = Path(staging), Path(final)
    if not final.exists():
        os.replace(staging, final)
        return final
    trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    os.replace(final, trash / "old")
    try:
        os.replace(staging, final)
    except BaseException:
        os.replace(trash / "old", final)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def umask_mode(executable: bool = False) -> int:
    """The permission bits a new file gets from the process's umask: ``0o666 & ~umask`` (``0o777`` for a folder or
    an executable). Read by setting the umask and putting it back at once (no other thread of ours creates files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def follow_umask(path: Path) -> None:
    """Give the regular file ``path`` — or every regular file and folder under the folder ``path`` — the
    permissions the umask gives a new file (:func:`umask_mode`). A writer that creates through a private
    temporary file (safetensors' ``save_file``, ``tempfile.mkstemp``: mode 0600) leaves its output unreadable by
    the group and others, unlike every other file of an artifact; this puts it right. Symlinks are left alone."""
    path = Path(path)
    file_mode, dir_mode = umask_mode(), umask_mode(executable=True)
    if path.is_symlink():
        return
    if path.is_file():
        path.chmod(file_mode)
        return
    for root, dirs, files in os.walk(path):
        for name in dirs:
            p = Path(root) / name
            if not p.is_symlink():
                p.chmod(dir_mode)
        for name in files:
            p = Path(root) / name
            if not p.is_symlink() and p.is_file():
                p.chmod(file_mode)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def human_bytes(n: float) -> str:
    """``n`` bytes in words for a message: ``512 B``, ``72.9 MiB``, ``1.2 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def file_kind(mode: int) -> str:
    """What a file is, in words ("a file", "a folder", "a named pipe", ...), from its ``st_mode``."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in JSON ``text`` (brackets inside strings not counted);
    linear time, no recursion."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def read_json_file(path: str | Path, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of the regular file ``path``.

    Opened non-blocking (a FIFO or a device never makes it wait) and checked with ``fstat`` on the
    opened descriptor. Raises ``OSError`` when it cannot be opened or read (``FileNotFoundError``
    when absent), and ``ValueError`` with a short reason when it is not a regular file, is larger
    than ``max_bytes``, nests deeper than ``max_depth``, or is not UTF-8 JSON.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({file_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes, more than the {max_bytes} expected")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"more than the {max_bytes} bytes expected")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    if json_depth(text) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({str(exc).split(':')[0][:80]})") from None
