"""distillery.common.diskerrors: a full disk is recognised however the library that hit it reports it."""

from __future__ import annotations

import errno
import shutil
import sqlite3

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from distillery.common.diskerrors import disk_problem


def _chained(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise RuntimeError("while saving") from exc
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("exc,filename", [
    (OSError(errno.ENOSPC, "No space left on device", "/runs/teacher/x.distcp"), "/runs/teacher/x.distcp"),
    (CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device", "/r/a"), None)}), "/r/a"),
    (shutil.Error([("/src/a", "/dst/a", "[Errno 28] No space left on device: '/dst/a'")]), "/dst/a"),
    (sqlite3.OperationalError("database or disk is full"), None),
    (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left\" })"), None),
])
def test_a_full_disk_is_found_in_its_wrappings(exc, filename):
    for candidate in (exc, _chained(exc)):
        problem = disk_problem(candidate)
        assert problem is not None and problem.errno == errno.ENOSPC and problem.filename == filename


def test_other_failures_are_not_the_disks():
    assert disk_problem(ValueError("bad value")) is None
    assert disk_problem(OSError(errno.ENOENT, "No such file or directory")) is None
    assert disk_problem(CheckpointException("load", {0: (KeyError("w"), None)})) is None
