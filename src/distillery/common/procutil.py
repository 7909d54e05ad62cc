"""Process containment: a process dies with the one that started it, and one writer per folder.

- :func:`die_with_parent` — Linux ``PR_SET_PDEATHSIG``: the kernel sends ``sig`` to this process
  when the thread that forked it exits. Training workers (started by the torchrun agent in their
  own session, so no terminal signal reaches them) and the agent itself (started by a stage) call
  it first thing, so killing a stage — even with SIGKILL — takes the whole tree down.
- :class:`AncestorWatch` — a daemon thread that polls the process's ancestors (through any shell
  wrappers, up to the first non-shell ancestor) and runs a callback when one of them is gone. A
  stage started by ``dvc repro`` through ``sh -c`` uses it: killing ``dvc`` alone leaves the shell
  and the stage alive, and no kernel mechanism tells the stage. Under ``nohup`` (SIGHUP ignored)
  the process was asked to outlive the user's shell, not the program that runs it: the watch then
  goes only through ``-c`` wrappers (``sh -c CMD``) to the first program (``dvc``, a Prefect
  worker), and watches nothing when the parent is a shell the user types into.
- :func:`exit_now` — how a command-line process of distillery ends: as a normal exit (threads
  joined, atexit handlers run, stdio flushed) minus the interpreter's teardown of every module, which
  takes 1–3 s once torch, diffusers and MLflow are imported (each stage, training worker and CLI run).
- :func:`exclusive_lock` — an ``flock`` on a lock file held for a ``with`` block; a second holder
  gets one :class:`UserError` line naming the folder and the pid that holds it. The lock belongs to
  the open file description, so it is released when the holder dies, however it dies.

Linux-only where it matters (prctl, /proc); elsewhere the calls are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from distillery.common.errors import UserError
from distillery.common.ownpaths import open_regular, require_folder_or_absent

_PR_SET_PDEATHSIG = 1
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "busybox"})


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits; if the parent is
    already gone (we were re-parented before the call), deliver it now."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent == 1 or not process_alive(parent):
        os.kill(os.getpid(), sig)


class Stopped(SystemExit):
    """SIGTERM (a stop asked for: ``kill``, Prefect cancelling, ``srun`` cancelling a step) as an exception of the
    main thread: ``finally`` blocks run — the MLflow run is ended ``KILLED``, children stopped, finished work kept —
    and the process exits with 143, as the signal's default would."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Stopped` in the main thread (entered from another thread: nothing changes);
    the previous handler is back on leaving."""
    def stop(signum: int, frame: object) -> None:
        raise Stopped()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, ppid) of ``pid`` from /proc, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, fields[0], int(fields[1])


def process_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    st = _proc_stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def runs_a_command_string(pid: int) -> bool:
    """True when ``pid``'s arguments hold a short-option cluster with ``c`` (``sh -c CMD``, ``bash
    --norc -ec CMD``): a shell that wraps one command, not one a user types into."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:]
    except OSError:
        return False
    return any(a.startswith(b"-") and not a.startswith(b"--") and b"c" in a[1:] and a[1:].isalpha() for a in args)


def ancestors_to_watch(pid: int | None = None, hangup_ignored: bool = False) -> list[int]:
    """The parent of ``pid`` and, while that parent is a shell, its parents too: the chain whose
    death means nobody is waiting for this process any more.

    ``hangup_ignored`` (the process runs under ``nohup``): it was asked to outlive the user's shell,
    so the chain goes only through shells that wrap one command (:func:`runs_a_command_string`) to
    the first program that is not a shell, and is empty when a shell a user types into comes first
    (``nohup distillery stage X &`` from a terminal: nothing to watch; ``nohup dvc repro``: ``dvc``)."""
    chain: list[int] = []
    current = os.getpid() if pid is None else pid
    for _ in range(8):
        st = _proc_stat(current)
        if st is None:
            break
        parent = st[2]
        if parent <= 1:
            break
        pst = _proc_stat(parent)
        is_shell = pst is not None and pst[0] in SHELLS
        if hangup_ignored and is_shell and not runs_a_command_string(parent):
            return []
        chain.append(parent)
        if not is_shell:
            break
        current = parent
    return chain


class AncestorWatch:
    """Poll ``ancestors_to_watch()`` every ``interval`` seconds; call ``on_orphaned`` once when one
    of them dies (or this process is re-parented). Start with :meth:`start`; a daemon thread."""

    def __init__(self, on_orphaned: Callable[[], None], interval: float = 0.5, hangup_ignored: bool = False) -> None:
        self.on_orphaned = on_orphaned
        self.interval = interval
        self.watched = ancestors_to_watch(hangup_ignored=hangup_ignored)
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ancestor-watch", daemon=True)

    def start(self) -> "AncestorWatch":
        """Start polling (nothing to do when no ancestor is watched)."""
        if self.watched:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if os.getppid() != self.parent or not all(process_alive(p) for p in self.watched):
                self.on_orphaned()
                return


def exit_now(code: int | None) -> NoReturn:
    """End this process with exit status ``code`` (None: 0) the way the interpreter's own exit does — the
    non-daemon threads joined (``threading._shutdown``, which also stops idle thread pools), the atexit
    handlers run (logging and MLflow flushed, temporary folders removed), stdout and stderr flushed — then
    ``os._exit``, skipping the teardown of every imported module. Only for a process's last line (a
    ``__main__`` block, a console script): never where a caller's process continues (tests call ``main``)."""
    import atexit
    import sys

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def exclusive_lock(lock_file: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the block; raise a UserError naming
    ``what`` and the holder's pid when another process holds it. A lock file (or its folder) that is a
    symbolic link, a folder, a FIFO or a device is one UserError line: nothing is opened through a link,
    nothing is written (:mod:`distillery.common.ownpaths`)."""
    lock_file = Path(lock_file)
    require_folder_or_absent(lock_file.parent, f"the folder of the lock of {what}:")
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = open_regular(lock_file, os.O_RDWR | os.O_CREAT, f"the lock file of {what}:")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "another process"
            raise UserError(f"{what} is in use by pid {holder} (lock {lock_file}); wait for it to finish or stop it "
                            f"first — two writers would corrupt its checkpoints") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
