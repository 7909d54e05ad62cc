"""What distillery may write or delete: only its own files, never through a symbolic link.

The rule (docs/reliability.md): the project deletes or overwrites only files it created, never follows a
symbolic link to write or delete, and says so in one line when it meets one. A link where the pipeline
keeps its own state (``runs/<stage>``, a lock file, ``artifacts/<stage>``, its staging folder) would
let a write or a clean-up reach a folder of the user's outside the workspace: it is refused, one
:class:`UserError` line naming the link and what it points at, and nothing is touched — neither the
link nor its target.

- :func:`refuse_link` — a ``UserError`` when ``path`` itself is a symbolic link.
- :func:`require_folder_or_absent` — ``path`` is absent or a real folder (not a link, not a file).
- :func:`open_regular` — ``os.open`` that never follows a final link, never blocks on a FIFO, and
  refuses anything but a regular file (a folder, a FIFO, a device) in one line.

Only the last component is checked: the workspace's top folders (``runs/``, ``artifacts/``) may
themselves be links a user made to put them on another disk; everything distillery creates inside them
is checked here before it is written or removed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind


def _target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def link_refusal(path: str | Path, what: str) -> UserError:
    """The one line for a symbolic link found at ``path`` where distillery would write or delete."""
    path = Path(path)
    return UserError(f"{what} {path} is a symbolic link (to {_target(path)}); distillery never writes or deletes "
                     "through a link: remove the link (what it points at is left alone) and rerun")


def refuse_link(path: str | Path, what: str) -> None:
    """Raise :func:`link_refusal` when ``path`` is a symbolic link (dangling or not); nothing else is checked."""
    if os.path.islink(path):
        raise link_refusal(path, what)


def require_folder_or_absent(path: str | Path, what: str) -> None:
    """``path`` must be absent or a real folder: a link (to anything) or another kind of file is one
    ``UserError`` line; nothing is touched."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{what} {path} cannot be examined ({exc.strerror or exc})") from None
    if stat.S_ISLNK(mode):
        raise link_refusal(path, what)
    if not stat.S_ISDIR(mode):
        raise UserError(f"{what} {path} is {file_kind(mode)}, not a folder; move it away and rerun")


def open_regular(path: str | Path, flags: int, what: str, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` added; returns the descriptor of a
    regular file. A final symbolic link, a folder, a FIFO, a device or a socket there is one ``UserError``
    line (the descriptor closed, nothing written); other ``OSError`` s propagate."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise link_refusal(path, what) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.EINVAL):
            kind = file_kind(os.lstat(path).st_mode) if os.path.lexists(path) else "not a regular file"
            raise UserError(f"{what} {path} is {kind}, not a regular file; move it away and rerun") from None
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise UserError(f"{what} {path} is {file_kind(st_mode)}, not a regular file; move it away and rerun")
    return fd
