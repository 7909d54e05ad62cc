"""Recognising a write that failed on the disk's account, however the library that hit it reports it.

A full disk reaches us as an ``OSError`` (``ENOSPC``) from our own writes, but also wrapped: torch's
distributed checkpoint gathers each rank's failure into a ``CheckpointException``; ``shutil.copytree``
gathers ``(src, dst, message)`` triples into a ``shutil.Error``; safetensors raises its own error whose
text holds ``os error 28``; SQLite (MLflow's store) says ``database or disk is full``. :func:`disk_problem`
walks an exception, its causes and contexts and those wrappers, and returns what went wrong in words
and the file it was writing (when known), or ``None`` when the failure is not the disk's.
"""

from __future__ import annotations

import errno
import re
import shutil
from dataclasses import dataclass

DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file grew past the file system's (or the process's) size limit",
}
_TEXTS = (  # what wrapped errors say for a full disk, in their own words
    (re.compile(r"No space left on device|os error 28|StorageFull", re.I), errno.ENOSPC),
    (re.compile(r"database or disk is full", re.I), errno.ENOSPC),
    (re.compile(r"Disk quota exceeded|os error 122", re.I), errno.EDQUOT),
    (re.compile(r"Read-only file system|os error 30", re.I), errno.EROFS),
    (re.compile(r"File too large|os error 27", re.I), errno.EFBIG),
)
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
MAX_DEPTH = 32  # links of the chain followed (a cycle of contexts cannot loop forever)


@dataclass(frozen=True)
class DiskProblem:
    """A failed write: ``why`` in words (``DISK_ERRNOS``), ``errno``, and ``filename`` when known."""

    why: str
    errno: int
    filename: str | None = None

    def where(self) -> str:
        return f" writing {self.filename}" if self.filename else ""


def _nested(exc: BaseException) -> list[BaseException]:
    """The exceptions ``exc`` carries: its cause and context, a DCP CheckpointException's per-rank failures."""
    found = [e for e in (exc.__cause__, exc.__context__) if e is not None]
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict):
        for value in failures.values():
            if isinstance(value, BaseException):
                found.append(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], BaseException):  # (exc, traceback)
                found.append(value[0])
    return found


def _own(exc: BaseException, by_text: bool) -> DiskProblem | None:
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        _, dst, message = exc.args[0][0]  # copytree gathers (src, dst, str(error)) triples
        found = _ERRNO_IN_TEXT.search(str(message))
        code = int(found.group(1)) if found else None
        if code in DISK_ERRNOS:
            return DiskProblem(DISK_ERRNOS[code], code, str(dst))
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return DiskProblem(DISK_ERRNOS[exc.errno], exc.errno, str(exc.filename) if exc.filename else None)
    if not by_text:
        return None
    text = str(exc)
    for pattern, code in _TEXTS:
        if pattern.search(text):
            return DiskProblem(DISK_ERRNOS[code], code, None)
    return None


def disk_problem(exc: BaseException) -> DiskProblem | None:
    """The disk failure ``exc`` is, or carries anywhere in its chain (module doc); ``None`` if none. An
    ``OSError`` found anywhere (it names the file) wins over a wrapper's words."""
    chain, queue, seen = [], [exc], set()
    while queue and len(seen) < MAX_DEPTH:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        queue.extend(_nested(current))
    for by_text in (False, True):
        for current in chain:
            problem = _own(current, by_text)
            if problem is not None:
                return problem
    return None
