"""``python -m distillery.cli.launch [torchrun options] -m distillery.cli.train --config X``: torchrun, contained.

The same options and behaviour as ``torchrun`` (it runs torch's own launcher in this process), plus:

- this launcher dies at once (SIGKILL) with the process that started it (``PR_SET_PDEATHSIG``), and
  each worker dies at once with this launcher (``distillery.cli.train`` asks for it), so a killed stage
  never leaves a training process behind (checkpoints are written atomically: nothing is lost but
  the steps since the last one);
- a worker that fails with a user error (a ``UserError``: bad data, a corrupt checkpoint, a
  non-finite loss) leaves its one line in a folder named by ``$DISTILLERY_WORKER_ERRORS``; the
  launcher prints that line once (``error: ...``) and exits 2, instead of torch's multi-line
  ``ChildFailedError`` report. Any other failure prints one line naming the rank and exit code and
  exits 1 (the worker's own traceback is above it).

That folder is ``distillery-worker-errors-<launcher pid>@<host>-*`` in the temp folder, removed when the launcher
ends; one left by a launcher that was killed (SIGKILL skips the removal) is removed by the next launcher on the same
host (:func:`remove_orphaned_error_folders`). Unless ``--log-dir`` (or ``PET_LOG_DIR``) names one, torch's own log
folder of the launch is ``torch-logs`` in it, removed with it (torch's default, a ``torchelastic_*`` temp folder, is
never removed).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from pathlib import Path

from distillery.cli.guard import WORKER_ERRORS_ENV
from distillery.common.errors import UserError
from distillery.common.procutil import die_with_parent, process_alive

ERRORS_PREFIX = "distillery-worker-errors-"  # + "<launcher pid>@<host>-" + mkdtemp's random part


def error_folder_prefix(pid: int | None = None) -> str:
    """The name a launcher's worker-error folder starts with: its pid and this host (a temp folder shared by
    several hosts holds their launchers' folders side by side; a pid is alive or dead on its own host only)."""
    return f"{ERRORS_PREFIX}{os.getpid() if pid is None else pid}@{socket.gethostname()}-"


def remove_orphaned_error_folders(temp: Path | None = None) -> list[Path]:
    """Remove the worker-error folders in ``temp`` (default: the temp folder) that launchers killed before their
    own cleanup left: a real folder of this user named ``distillery-worker-errors-<pid>@<this host>-*`` whose
    launcher ``<pid>`` is no longer alive. A live launcher's folder, another host's, a link, a file or another user's
    folder is left alone. Returns what was removed."""
    temp = Path(temp or tempfile.gettempdir())
    host = f"@{socket.gethostname()}-"
    removed = []
    try:
        entries = [f for f in temp.glob(f"{ERRORS_PREFIX}*") if host in f.name]
    except OSError:
        return removed
    for folder in entries:
        pid, _, rest = folder.name[len(ERRORS_PREFIX):].partition(host)
        if not rest or "-" in rest:  # mkdtemp's part has no "-": "-" there means a host named "<this host>-…"
            continue
        try:
            st = folder.lstat()
        except OSError:
            continue
        if not (pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()) or process_alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def first_worker_error(folder: Path) -> str | None:
    """The one-line user error a worker left in ``folder`` (the lowest rank's), if any."""
    files = sorted(folder.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit() else 0)
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            return text
    return None


def _quiet_torch_launcher() -> None:
    """torch's agent logs each failure as a multi-line ERROR report; this launcher says it in one line."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # at once: a stopped or hung worker must not keep us waiting; saves are atomic
    argv = sys.argv[1:] if argv is None else argv
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    remove_orphaned_error_folders()
    errors = Path(tempfile.mkdtemp(prefix=error_folder_prefix()))
    os.environ[WORKER_ERRORS_ENV] = str(errors)
    _quiet_torch_launcher()
    try:
        args = parse_args(argv)
        if args.log_dir is None:  # torch's default: a new torchelastic_* temp folder per launch, never removed
            args.log_dir = str(errors / "torch-logs")
        run(args)
        return 0
    except ChildFailedError as exc:
        message = first_worker_error(errors)
        if message:
            sys.stderr.write(f"error: {message}\n")
            return UserError.exit_code
        rank, failure = min(exc.failures.items()) if exc.failures else (0, None)
        code = getattr(failure, "exitcode", "?")
        how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
        sys.stderr.write(f"error: training worker rank {rank} failed ({how}); its traceback is above\n")
        return 1
    except SignalException as exc:  # we were told to stop (the stage died): torch stopped the workers
        sys.stderr.write(f"error: training stopped by signal {exc.sigval.name}\n")
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


if __name__ == "__main__":
    from distillery.common.procutil import exit_now

    exit_now(main())
