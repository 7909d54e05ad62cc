"""Process containment with real process trees: what a stage's ancestor watch follows, with and without ``nohup``.

A stage started by ``dvc repro`` runs under ``$SHELL -c CMD``; a user may start ``dvc repro`` (or the stage itself)
under ``nohup``, which leaves SIGHUP ignored in every process below it. The watch must then still stop the stage when
the program that runs it dies (dvc killed: nobody records the stage's outputs any more), and must not stop it when
the user's own shell goes away (that is what ``nohup`` asks for).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # real process trees

# The "stage": reports its chains, then watches its ancestors as the stage runner does and says when it was orphaned.
STAGE = """
import json, os, signal, sys, time
from distillery.common.procutil import AncestorWatch, ancestors_to_watch
out = sys.argv[1]
nohup = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
chains = {"pid": os.getpid(), "nohup": nohup, "default": ancestors_to_watch(), "hangup_ignored": ancestors_to_watch(hangup_ignored=True)}
open(out + ".chains.tmp", "w").write(json.dumps(chains))
os.replace(out + ".chains.tmp", out + ".chains")  # whole when it appears: the test reads it as soon as it exists
def orphaned():
    open(out + ".orphaned", "w").write("1")
    os._exit(143)
AncestorWatch(orphaned, interval=0.05, hangup_ignored=nohup).start()
time.sleep(60)
"""

# The "runner" (dvc's place): a program that is not a shell and runs the stage through `bash -c` (a compound command,
# so bash stays the stage's parent instead of exec'ing it).
RUNNER = """
import subprocess, sys
subprocess.run(["bash", "--noprofile", "--norc", "-c", f"{sys.executable} -c '{sys.argv[1]}' {sys.argv[2]}; true"])
"""


def _ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what `nohup` does before it execs the command


def _default_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # without nohup, even when the test suite itself runs under nohup


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def _child_env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch reads /proc")
@pytest.mark.parametrize("nohup", [False, True], ids=["default", "nohup"])
def test_killing_the_program_that_runs_a_stage_stops_it_with_or_without_nohup(tmp_path, nohup):
    out = tmp_path / "stage"
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, STAGE.replace("'", '"'), str(out)], env=_child_env(),
                              preexec_fn=_ignore_hangup if nohup else _default_hangup, start_new_session=True)
    try:
        _wait_for(out.with_suffix(".chains"))
        chains = json.loads(out.with_suffix(".chains").read_text())
        assert chains["nohup"] is nohup
        # through the `bash -c` wrapper to the runner in both modes: the wrapper wraps one command, it is no user's shell
        bash = chains["default"][0]
        assert chains["default"] == [bash, runner.pid]
        assert chains["hangup_ignored"] == [bash, runner.pid]
        runner.send_signal(signal.SIGKILL)  # `kill -9` of dvc alone
        runner.wait()
        _wait_for(out.with_suffix(".orphaned"), timeout=10)
        deadline = time.monotonic() + 10
        while _alive(chains["pid"]):
            assert time.monotonic() < deadline, "the stage outlived the program that ran it"
            time.sleep(0.02)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch reads /proc")
def test_under_nohup_a_stage_typed_into_a_shell_watches_nothing(tmp_path):
    """``nohup distillery stage X &`` from a terminal: the shell it was typed into may go, the stage stays; without
    nohup the same stage watches that shell and the shell's parent."""
    out = tmp_path / "stage"
    stage = STAGE.replace("time.sleep(60)", "")
    shell = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, env=_child_env(), text=True,
                             preexec_fn=_ignore_hangup, start_new_session=True)
    try:
        shell.communicate(f"{sys.executable} -c '{stage}' {out}; exit\n", timeout=60)
        chains = json.loads(out.with_suffix(".chains").read_text())
        assert chains["nohup"] is True
        assert chains["hangup_ignored"] == []
        assert chains["default"] == [shell.pid, os.getpid()]
    finally:
        if shell.poll() is None:
            shell.kill()


# A process that ends through exit_now: what a normal exit would have done must still happen.
ENDS_NOW = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from distillery.common.procutil import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # an idle pool, never shut down: a plain join of its thread would wait forever
def late():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
sys.stdout.write("buffered, no newline")  # still in the buffer (stdout is a pipe)
exit_now(7)
"""


def test_exit_now_joins_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ENDS_NOW, str(tmp_path)], env=_child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
