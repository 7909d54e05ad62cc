"""Every entry point's error contract (docs/reliability.md): a user error is one line and exit code 2.

:func:`run_guarded` wraps a command (``distillery ...``, ``python -m distillery.cli.train``, a torchrun
worker). Under :mod:`distillery.cli.launch` a worker leaves its one line in the folder named by
:data:`WORKER_ERRORS_ENV` and the launcher prints it once for the whole job. This module imports
no command, so every entry point can use it (no ``train`` ↔ ``cli`` cycle).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from distillery.common.diskerrors import disk_problem
from distillery.common.errors import UserError
from distillery.common.offline import set_offline_env

WORKER_ERRORS_ENV = "DISTILLERY_WORKER_ERRORS"  # set by distillery.cli.launch: where workers leave their one line


def report_worker_error(message: str) -> bool:
    """Under ``distillery.cli.launch``: leave this rank's one-line user error for the launcher (which
    prints it once for the whole job) and return True; otherwise return False."""
    folder = os.environ.get(WORKER_ERRORS_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(folder, f"rank-{rank}.txt"), "w", encoding="utf-8") as fh:
            fh.write(message)
    except OSError:
        return False
    return True


def run_guarded(fn: Callable[[], int]) -> int:
    """Run ``fn`` in the offline environment; a UserError becomes one line on stderr (rank 0) and
    exit code 2, Ctrl-C exit code 130; a write the disk refused (full, quota, read-only: also wrapped by
    DCP, safetensors or SQLite, :mod:`distillery.common.diskerrors`) one line and exit code 2; anything
    else propagates (a crash, with its traceback)."""
    set_offline_env()
    try:
        return fn()
    except UserError as exc:
        return _one_line(str(exc))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # Exception, and DCP's CheckpointException (a BaseException)
        problem = disk_problem(exc)  # a full or read-only disk is the user's to fix, not a crash
        if problem is None:
            raise
        return _one_line(f"{problem.why}{problem.where()}; what was published before is unchanged: free space and rerun "
                         "(a training run resumes from its last complete checkpoint)")


def _one_line(text: str) -> int:
    message = " ".join(text.split())
    if report_worker_error(message):
        return UserError.exit_code
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"error: {message}\n")
    return UserError.exit_code
