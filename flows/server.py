"""The Prefect API a deployment talks to: ``PREFECT_API_URL`` when set, else this workspace's own
local, persistent Prefect server.

A schedule needs a real Prefect server: its scheduler service creates the runs that ``flow.serve``
and workers execute. Prefect's ephemeral server (what a process gets without ``PREFECT_API_URL``)
has no scheduler, so a served cron never fires. :func:`prefect_api` therefore:

1. uses ``PREFECT_API_URL`` when it is set (environment or Prefect profile), untouched;
2. else reuses this workspace's server when one is already answering (recorded in
   ``<workspace>/.prefect/server.json``, e.g. left by ``python -m flows.deploy server``);
3. else starts one — ``python -m prefect server start --host 127.0.0.1 --port P`` with
   ``PREFECT_HOME=<workspace>/.prefect`` (so its SQLite database, ``prefect.db``, persists there
   and run history survives restarts), in its own session so Ctrl-C of the caller does not reach
   it first; port ``PREFECT_SERVER_API_PORT`` if set, else 4200 when free, else any free port;
   its output goes to ``.prefect/server.log``. It is stopped (SIGTERM, then SIGKILL after
   ``STOP_TIMEOUT_S``) when the ``with`` block ends; a server found running is left running.

``.prefect/`` holds a ``.gitignore`` of ``*`` so git never tracks it. A server that cannot start
or does not answer within ``startup_timeout`` raises :class:`PrefectServerError`, one line
naming the log. :func:`run_workspace_server` runs the workspace server in the foreground (for
``deploy`` and workers, which need it to outlive one command) and :func:`stop_workspace_server`
stops one left running (a ``serve`` killed with SIGKILL leaves its server up; the next ``serve``
reuses it). No DVC import; Prefect is imported lazily (settings only).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import flows  # noqa: F401  (sets the quiet env before Prefect is imported)

__all__ = [
    "DEFAULT_PORT",
    "PrefectServer",
    "PrefectServerError",
    "configured_api_url",
    "find_workspace_server",
    "prefect_api",
    "run_workspace_server",
    "server_answers",
    "start_workspace_server",
    "stop_server",
    "stop_workspace_server",
    "workspace_home",
]

DEFAULT_PORT = 4200  # Prefect's own default: the UI at the address its docs name
HOST = "127.0.0.1"
RECORD = "server.json"
LOG = "server.log"
STARTUP_TIMEOUT_S = 180.0  # the first start migrates a fresh database (~25 s on 2 busy cores)
STOP_TIMEOUT_S = 30.0
_ECHO_MAX = 200  # characters of a log line echoed into an error


class PrefectServerError(RuntimeError):
    """No usable Prefect API: the workspace server could not start, or none is running where one
    is required. The message is one line."""


@dataclass(frozen=True)
class PrefectServer:
    """A Prefect API endpoint and, for a workspace server, the process behind it."""

    api_url: str  # e.g. http://127.0.0.1:4200/api (what PREFECT_API_URL holds)
    home: Path | None = None  # PREFECT_HOME of a workspace server (its prefect.db lives there)
    pid: int | None = None  # server process of a workspace server
    owned: bool = False  # started by this process, so stopped by it
    process: subprocess.Popen | None = None  # our child when owned

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")


def workspace_home(workspace: Path | str) -> Path:
    """``<workspace>/.prefect``: PREFECT_HOME (database, log, record) of the workspace server."""
    return Path(workspace).resolve() / ".prefect"


def configured_api_url() -> str | None:
    """``PREFECT_API_URL`` from the environment or the active Prefect profile, if set."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return str(url) if url else None


def server_answers(api_url: str, timeout: float = 2.0) -> bool:
    """True when ``<api_url>/health`` answers ``true`` (a Prefect server is up there)."""
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200 and r.read().strip() == b"true"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _read_record(home: Path) -> dict | None:
    try:
        data = json.loads((home / RECORD).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and isinstance(data.get("api_url"), str) else None
    except (OSError, ValueError):
        return None


def _write_record(home: Path, server: PrefectServer) -> None:
    tmp = home / f".{RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"api_url": server.api_url, "pid": server.pid}), encoding="utf-8")
    os.replace(tmp, home / RECORD)


def find_workspace_server(workspace: Path | str) -> PrefectServer | None:
    """This workspace's server when its record names one that answers now, else None."""
    home = workspace_home(workspace)
    rec = _read_record(home)
    if rec is None or not server_answers(rec["api_url"]):
        return None
    pid = rec.get("pid")
    return PrefectServer(rec["api_url"], home, pid if isinstance(pid, int) else None, owned=False)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is free
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_port() -> int:
    wanted = os.environ.get("PREFECT_SERVER_API_PORT")
    if wanted:
        try:
            port = int(wanted)
        except ValueError:
            raise PrefectServerError(f"PREFECT_SERVER_API_PORT must be a port number, got {wanted[:40]!r}") from None
        if not _port_free(port):  # else another server there could answer for ours
            raise PrefectServerError(
                f"port {port} (PREFECT_SERVER_API_PORT) is in use on {HOST}: free it, choose another "
                "port, or set PREFECT_API_URL to the Prefect server running there")
        return port
    if _port_free(DEFAULT_PORT):
        return DEFAULT_PORT
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _last_log_message(log: Path, offset: int = 0) -> str:
    """The last paragraph written to ``log`` after byte ``offset``, on one line (Prefect's console
    wraps a message over lines)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
        lines = [ln.strip() for ln in text.splitlines()]
    except OSError:
        return "no output"
    while lines and not lines[-1]:
        lines.pop()
    block: list[str] = []
    while lines and lines[-1]:
        block.insert(0, lines.pop())
    text = " ".join(block) or "no output"
    return text if len(text) <= _ECHO_MAX else "..." + text[-(_ECHO_MAX - 3):]


def _server_env(home: Path) -> dict[str, str]:
    env = {**flows.QUIET_ENV, **os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)  # the server is the API; it must not point elsewhere
    return env


def start_workspace_server(
    workspace: Path | str, *, startup_timeout: float = STARTUP_TIMEOUT_S
) -> PrefectServer:
    """Start this workspace's Prefect server and wait until it answers; returns it (owned).

    Raises :class:`PrefectServerError` (one line, naming ``.prefect/server.log``) when the
    process exits early or does not answer within ``startup_timeout`` seconds; the process is
    stopped first.
    """
    home = workspace_home(workspace)
    try:
        home.mkdir(parents=True, exist_ok=True)
        (home / ".gitignore").write_text("# the workspace Prefect server's state (flows/server.py)\n*\n")
    except OSError as e:
        raise PrefectServerError(f"cannot create {home} for the Prefect server: {e.strerror or e}") from None
    port = _pick_port()
    api_url = f"http://{HOST}:{port}/api"
    log_path = home / LOG
    offset = log_path.stat().st_size if log_path.exists() else 0  # the log keeps earlier starts
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=str(home), env=_server_env(home), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    server = PrefectServer(api_url, home, proc.pid, owned=True, process=proc)
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise PrefectServerError(
                    f"the Prefect server for {home.parent} exited with {proc.returncode} while "
                    f"starting on {HOST}:{port}: {_last_log_message(log_path, offset)} (log: {log_path}; "
                    "PREFECT_SERVER_API_PORT picks the port, PREFECT_API_URL a running server)")
            if server_answers(api_url, timeout=1.0):
                break
            if time.monotonic() > deadline:
                raise PrefectServerError(
                    f"the Prefect server for {home.parent} did not answer on {api_url} within "
                    f"{startup_timeout:.0f} s: {_last_log_message(log_path, offset)} (log: {log_path})")
            time.sleep(0.5)
    except BaseException:
        stop_server(server)
        raise
    _write_record(home, server)
    return server


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def stop_server(server: PrefectServer, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop a server this process started (SIGTERM to its process group, SIGKILL after
    ``timeout``) and remove its record; a server not owned is left alone."""
    if not server.owned or server.process is None:
        return
    proc = server.process
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    if server.home is not None:
        rec = _read_record(server.home)
        if rec is not None and rec.get("pid") == proc.pid:
            (server.home / RECORD).unlink(missing_ok=True)


def _stderr(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so ``finally`` blocks (stopping the
    server) run; Prefect's runner installs its own graceful handler while it serves."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def prefect_api(
    workspace: Path | str, *, start: bool = True, say: Callable[[str], None] = _stderr,
    startup_timeout: float = STARTUP_TIMEOUT_S,
) -> Iterator[PrefectServer]:
    """A Prefect API for the ``with`` block (see the module docstring for the order).

    Inside the block ``PREFECT_API_URL`` is set in Prefect's settings and in ``os.environ`` (so
    flow-run subprocesses inherit it). ``start=False`` never starts a server: with neither
    ``PREFECT_API_URL`` nor a running workspace server it raises :class:`PrefectServerError`.
    ``say`` gets one line naming the API in use (and how it ends).
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = configured_api_url()
    if url is not None:
        say(f"Prefect API: {url} (PREFECT_API_URL)")
        yield PrefectServer(url)
        return
    with _terminate_as_exit():
        server = find_workspace_server(workspace)
        if server is not None:
            say(f"Prefect API: {server.api_url} (this workspace's server, already running"
                f"{f', pid {server.pid}' if server.pid else ''}; left running)")
        elif not start:
            raise PrefectServerError(
                "no Prefect API: set PREFECT_API_URL, or start this workspace's server with "
                f"`python -m flows.deploy server --repo {Path(workspace)}`")
        else:
            home = workspace_home(workspace)
            say(f"starting this workspace's Prefect server (database {home / 'prefect.db'}, "
                f"log {home / LOG}) ...")
            server = start_workspace_server(workspace, startup_timeout=startup_timeout)
            say(f"Prefect API: {server.api_url} (UI {server.ui_url}; pid {server.pid}; "
                "stopped when this command exits)")
        saved = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = server.api_url
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                yield server
        finally:
            if saved is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = saved
            if server.owned:
                stop_server(server)
                say(f"stopped this workspace's Prefect server (pid {server.pid})")


def run_workspace_server(repo: Path | str, say: Callable[[str], None] = _stderr) -> None:
    """``server``: run this workspace's Prefect server in the foreground until Ctrl-C/SIGTERM
    (for work pools and workers); if one is already running, say where and return."""
    running = find_workspace_server(repo)
    if running is not None:
        say(f"this workspace's Prefect server is already running: export PREFECT_API_URL={running.api_url}")
        return
    home = workspace_home(repo)
    say(f"starting this workspace's Prefect server (database {home / 'prefect.db'}, log {home / LOG}) ...")

    def stop_on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop_on_term)
    server = None
    try:
        server = start_workspace_server(repo)
        say(f"Prefect server up (UI {server.ui_url}); for workers and `deploy`: "
            f"export PREFECT_API_URL={server.api_url}   (Ctrl-C stops it)")
        assert server.process is not None
        rc = server.process.wait()  # until Ctrl-C/SIGTERM here, or the server ends by itself
        stop_server(server)  # forgets its record
        if rc not in (0, -signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM):
            raise PrefectServerError(f"the Prefect server exited with {rc} (log: {home / LOG})")
        say(f"this workspace's Prefect server (pid {server.pid}) was stopped")
    except KeyboardInterrupt:
        if server is not None:
            stop_server(server)
            say(f"stopped this workspace's Prefect server (pid {server.pid})")
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_workspace_server(repo: Path | str, say: Callable[[str], None] = _stderr,
                          timeout: float = 30.0) -> bool:
    """``server --stop``: stop this workspace's server left running (e.g. by a ``serve`` that was
    killed hard); False when none answers."""
    running = find_workspace_server(repo)
    if running is None or running.pid is None:
        say("no Prefect server of this workspace is running")
        return False
    try:
        os.killpg(running.pid, signal.SIGTERM)  # it leads its own session
    except (ProcessLookupError, PermissionError) as e:
        raise PrefectServerError(f"cannot stop the Prefect server pid {running.pid}: {e}") from None
    deadline = time.monotonic() + timeout
    while server_answers(running.api_url, timeout=1.0) and time.monotonic() < deadline:
        time.sleep(0.5)
    (workspace_home(repo) / RECORD).unlink(missing_ok=True)
    say(f"stopped this workspace's Prefect server (pid {running.pid})")
    return True
