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
    exit code 2, Ctrl-C exit code 130; anything else propagates (a crash, with its traceback)."""
    set_offline_env()
    try:
        return fn()
    except UserError as exc:
        message = " ".join(str(exc).split())
        if report_worker_error(message):
            return UserError.exit_code
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            sys.stderr.write(f"error: {message}\n")
        return UserError.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
