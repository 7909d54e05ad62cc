"""A real pipeline workspace for the reliability tests: git + DVC in a temp folder, the project's
dvc.yaml/params.yaml/stages, small params; and the process helpers those tests need."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

TRAINED: dict[str, float] = {}  # facts of the session's `trained` workspace (conftest.py)
SMALL = {"clips.num_train": 16, "clips.num_validation": 4, "teacher.steps": 6, "teacher.batch_size": 4,
         "teacher.save_every": 2, "pretrain.steps": 6, "pretrain.batch_size": 4, "pretrain.save_every": 2,
         "validate.num_prompts": 2, "validate.teacher_steps": [6, 2], "validate.pretrain_steps": 4,
         "distill.steps": 4, "distill.batch_size": 4, "distill.save_every": 2, "distill.generator_update_interval": 2,
         "pdd.steps": 4, "pdd.batch_size": 4, "pdd.save_every": 2, "validate.pdd_nfe": [1, 4]}


def committed_params(root: Path = ROOT) -> str:
    """``params.yaml`` as committed at HEAD of ``root`` (``git show HEAD:params.yaml``); the file itself outside git."""
    try:
        out = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        out = None
    return out.stdout if out is not None and out.returncode == 0 and out.stdout else (root / "params.yaml").read_text()


@functools.lru_cache(maxsize=None)
def shipped_params_text() -> str:
    """``params.yaml`` as the checkout ships it: as committed (:func:`committed_params`), not the file in the checkout —
    which ``dvc exp run -S`` (as the docs teach) leaves holding an experiment's values. Tests build their workspaces and
    take the defaults from this."""
    return committed_params(ROOT)


def copy_pipeline(dst: Path, names: tuple[str, ...] = ("dvc.yaml", "params.yaml", "stages")) -> Path:
    """The checkout's pipeline files ``names`` into ``dst``: ``params.yaml`` as shipped (:func:`shipped_params_text`),
    ``stages/`` without a local run's bytecode, the others as they are."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name == "params.yaml":
            (dst / name).write_text(shipped_params_text())
        elif name == "stages":
            copy_stages(dst)
        else:
            shutil.copy2(ROOT / name, dst / name)
    return dst


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"}


def sh(args: list[str], cwd: Path, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def set_params(repo: Path, updates: dict[str, object]) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in updates.items():
        node = params
        *head, last = dotted.split(".")
        for part in head:
            node = node[part]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def copy_stages(repo: Path) -> Path:
    """The checkout's stage layer (``stages/``: the adapter modules ``distillery stage`` imports from its workspace,
    and the run-config templates) into ``repo``, without a local run's bytecode."""
    return Path(shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__")))


def make_workspace(repo: Path, updates: dict[str, object] | None = None, dvc_cache_type: str | None = None) -> Path:
    """A git + DVC repository holding the pipeline (code included, as a user's clone would). ``dvc_cache_type``:
    DVC's ``cache.type`` (default: DVC's own, copies), e.g. ``hardlink,symlink`` as docs/gpus.md advises at real shape."""
    copy_pipeline(repo, ("dvc.yaml", "params.yaml", "stages", ".gitignore"))
    with (repo / ".gitignore").open("a") as fh:
        fh.write("/.dvc-site/\n")  # the site cache dir set below
    shutil.copytree(ROOT / "src" / "distillery", repo / "src" / "distillery", ignore=shutil.ignore_patterns("__pycache__"))
    set_params(repo, {**SMALL, **(updates or {})})
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"],
                ["dvc", "config", "core.site_cache_dir", str(repo / ".dvc-site")],
                *([["dvc", "config", "cache.type", dvc_cache_type]] if dvc_cache_type else [])):
        sh(cmd, repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "pipeline"], repo)
    return repo


def copy_workspace(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    sh(["dvc", "config", "core.site_cache_dir", str(dst / ".dvc-site")], dst)
    return dst


def committed_copy(src: Path, dst: Path, params: dict[str, object], message: str = "params") -> Path:
    """A copy of the workspace ``src`` (:func:`copy_workspace`) with ``params`` set in params.yaml, committed."""
    copy_workspace(src, dst)
    set_params(dst, params)
    sh(["git", "commit", "-qam", message], dst)
    return dst


def stage(repo: Path, name: str, check: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
    """``distillery stage <name>`` in ``repo``, as dvc.yaml's cmd runs it."""
    return sh(["distillery", "stage", name], repo, check=check, timeout=timeout)


def tree_sha(folder: Path) -> str:
    """One digest of every file (path + bytes) under ``folder``."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def processes_in(folder: Path) -> list[int]:
    """Pids of live (non-zombie) processes whose working directory is ``folder`` or below it."""
    found = []
    folder = folder.resolve()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X") and (cwd == folder or folder in cwd.parents):
            found.append(int(entry.name))
    return found


def wait_no_processes(folder: Path, timeout: float = 30) -> list[int]:
    """Wait until no process works in ``folder``; return those still there at the timeout."""
    deadline = time.time() + timeout
    while True:
        left = processes_in(folder)
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def kill_all_in(folder: Path) -> None:
    for pid in processes_in(folder):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_log_steps(run_dir: Path) -> list[int]:
    path = run_dir / "train_log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def training_workers(folder: Path) -> list[int]:
    """Pids of the `distillery.cli.train` worker processes working in ``folder``."""
    found = []
    for pid in processes_in(folder):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"distillery.cli.train" in cmd:
            found.append(pid)
    return found


def pause_training(folder: Path, run_dir: Path | None = None, timeout: float = 300) -> list[int]:
    """SIGSTOP the training workers in ``folder`` (waiting for them to start — and, with ``run_dir``,
    until one of them holds ``run_dir/.lock``); returns their pids. A paused run holds its locks and
    writes nothing: the test decides what happens next."""
    deadline = time.time() + timeout

    def ready() -> list[int]:
        if run_dir is None:
            return training_workers(folder)
        try:  # the lock's holder first: reading one file is cheap, a scan of /proc every few ms is not
            holder = int((run_dir / ".lock").read_text().strip() or 0)
        except (OSError, ValueError):
            return []
        pids = training_workers(folder) if holder else []
        return pids if holder in pids else []

    while not (pids := ready()):
        assert time.time() < deadline, "no training worker started"
        time.sleep(0.005)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def resume_training(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def kill_after_checkpoint(args: list[str], repo: Path, stage_name: str, step: int = 2) -> None:
    """``args`` (``dvc repro <stage>``, ``distillery stage <stage>``) in ``repo``: once its ``runs/<stage_name>/checkpoint-<step>``
    exists the training is paused (mid-run for sure) and the whole tree is SIGKILLed from the top process down — no
    process left, no artifact published."""
    proc = subprocess.Popen(args, cwd=repo, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (repo / "runs" / stage_name / f"checkpoint-{step}" / "metadata.json").is_file():
            assert proc.poll() is None and time.time() < deadline, f"the stage ended before its step-{step} checkpoint"
            time.sleep(0.01)
        pause_training(repo)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_no_processes(repo, timeout=30) == []
    finally:
        kill_all_in(repo)
    assert not (repo / "artifacts" / stage_name).exists()


def repro_killed_beside_whole(killed: Path, whole: Path, stage_name: str, log: Path) -> subprocess.CompletedProcess:
    """``dvc repro <stage_name>`` in ``whole`` uninterrupted (its output into ``log``) and, side by side, in ``killed``:
    once its ``runs/<stage_name>/checkpoint-2`` exists the training is paused (mid-run for sure) and the whole tree is
    SIGKILLed from dvc down, no process left and no artifact published; then ``dvc repro <stage_name>`` there again.
    Returns that rerun, once the uninterrupted run has exited 0 (two workspaces, nothing shared: one core each)."""
    with log.open("w") as printed:
        uninterrupted = subprocess.Popen(["dvc", "repro", stage_name], cwd=whole, env=env(), stdout=printed,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        kill_after_checkpoint(["dvc", "repro", stage_name], killed, stage_name)
        out = sh(["dvc", "repro", stage_name], killed)
        assert uninterrupted.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        if uninterrupted.poll() is None:
            os.killpg(uninterrupted.pid, signal.SIGKILL)
            uninterrupted.wait()
        kill_all_in(whole)
    return out


@contextlib.contextmanager
def project_log(level: int = logging.INFO) -> Iterator[list[str]]:
    """The project logger's messages at ``level`` and above while the block runs, by a handler of its own (a CLI call
    earlier in the process may have stopped the logger propagating to pytest's capture)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("distillery"), Keep(level)
    was = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(was)
