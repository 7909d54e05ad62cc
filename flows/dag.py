"""The ``distillery-pipeline`` Prefect flow, built from ``dvc.yaml`` (docs/architecture.md §1).

One task per DVC stage (task name = stage name). Each task runs

    python -m dvc --wait-for-lock repro --single-item <stage>

in the repo (env ``DVC_NO_ANALYTICS=1``), so DVC decides whether the stage's code, params or
inputs changed, runs it or skips it, and ``dvc.lock`` stays the truth; Prefect adds retries,
timeouts, logs, artifacts and schedules on top, never a second DAG.

Scheduling: every task is *submitted* at once with ``wait_for=`` the futures of its upstream
stages (from :func:`distillery.pipeline.dvcfile.stage_order`), so a stage starts as soon as its own inputs are done
and independent stages (e.g. two distillation branches) run concurrently, instead of waiting for
the slowest stage of a level. DVC allows this: it releases its repo lock while a stage's command
runs and ``--wait-for-lock`` makes concurrent ``dvc`` calls queue for the short locked parts
(reading/writing ``dvc.lock``) instead of failing.

Before any ``dvc`` runs (when the flow is built and at the start of every run), every YAML params
file the DAG reads (``params.yaml`` and each ``file:key`` a stage lists) is read with the bounded
parser, as DVC reads it (:func:`check_params_files`): DVC's own parser hangs, memory growing, on a
billion-laughs or merge-chain file, before any stage could refuse it; here it is one ``error:`` line
and exit 2.

Per task:
- output of ``dvc repro`` (and so of the stage command) is streamed line by line into the task's
  Prefect log; the last lines go into the error when the stage fails;
- training stages (``training_stages``; default: every stage) get ``retries`` with
  ``retry_delay_seconds`` (a list is a per-attempt backoff, like Prefect's
  ``exponential_backoff``) — for crashes only (docs/reliability.md): a stage whose command exits 2
  (a user error: bad config, missing file; it printed one ``error: ...`` line) fails at once with
  :class:`StageUserError` and is never retried, since rerunning cannot fix it. The stage's exit
  code is read from DVC's last line (``ERROR: failed to reproduce '<stage>': failed to run:
  <cmd>, exited with <code>``; ``dvc`` itself exits 255); any other code, a signal (negative
  code), a DVC failure without that line or a timeout is a crash and is retried;
- every task gets ``timeout_seconds`` (the task is async, so Prefect's timeout really interrupts
  it; the stage's process group is then terminated);
- artifacts: ``<stage>-metrics`` (table of the stage's ``metrics`` JSON/YAML files, flattened to
  dotted keys) and, when the stage's outputs hold ``*.gif``/``*.mp4`` files,
  ``<stage>-validation-grid`` (markdown list of their paths). Keys are the stage name lower-cased
  with other characters turned into ``-`` (Prefect's key alphabet).

The flow returns ``{stage: {"status", "seconds", "metrics"}}`` where status is ``ran``,
``skipped`` (DVC: "didn't change"), ``restored`` (from DVC's run cache) or, only in the error of
a failed run, ``failed`` / ``not-run``. Any failed stage fails the flow with
:class:`PipelineFailedError` naming the stages and carrying the dvc output tail of crashed
stages. A user error's ``error:`` line is shown once, in the stage's streamed log; the errors
built on it point there instead of repeating it. ``python -m flows.dag`` exits 2 with one
``error:`` line when every failed stage failed on a user error, else 1.

Use: ``build_pipeline_flow(repo, ...)()`` or ``run_pipeline(repo, ...)`` or
``python -m flows.dag --repo . [--retries N] [--retry-delay S ...] [--timeout S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import yaml
from prefect import Flow, flow, get_run_logger, task
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import CancelledRun
from prefect.futures import wait

import flows  # noqa: F401  (sets the quiet env before Prefect is imported)
from distillery.common.errors import UserError
from distillery.common.treeutil import flatten
from distillery.config.limits import show_path
from distillery.pipeline.dvcfile import StageSpec, load_dvc_stages, stage_order
from distillery.pipeline.params.file import read_params_file

__all__ = [
    "FLOW_NAME",
    "PipelineFailedError",
    "StageFailedError",
    "StageUserError",
    "WorkspaceBusyError",
    "artifact_key",
    "build_pipeline_flow",
    "check_params_files",
    "distillery_pipeline",
    "dvc_repro_command",
    "media_files",
    "retry_delays",
    "retry_unless_user_error",
    "read_stage_metrics",
    "run_pipeline",
    "run_stage",
    "stage_exit_code",
    "workspace_busy_line",
]

FLOW_NAME = "distillery-pipeline"
DEFAULT_RETRY_DELAYS: tuple[int, ...] = (10, 60)  # seconds before retry 1, 2 (then the last)
DEFAULT_TIMEOUT_SECONDS = 6 * 3600.0
TAIL_LINES = 40  # dvc output lines kept for the error of a failed stage
MEDIA_SUFFIXES = (".gif", ".mp4")
USER_ERROR_EXIT_CODE = 2  # distillery's exit code for a user error (distillery.common.errors.UserError)
_DVC_STAGE_FAILED = re.compile(r"failed to run: .*, exited with (-?\d+)\s*\Z", re.DOTALL)
_DVC_BUSY = re.compile(r"'(?P<path>[^']+)' is busy, it is being blocked by:")  # dvc/rwlock.py's LockError
_DVC_BLOCKER = re.compile(r"\(PID \d+\): .+")


class StageFailedError(RuntimeError):
    """``dvc repro`` of one stage exited non-zero (a crash: retried); the message ends with its
    output tail. ``stage_exit``: the stage command's exit code as DVC reported it, or None."""

    def __init__(self, stage: str, returncode: int, tail: Sequence[str],
                 stage_exit: int | None = None):
        self.stage, self.returncode, self.tail = stage, returncode, list(tail)
        self.stage_exit = stage_exit
        super().__init__(
            f"stage {stage!r}: `dvc repro --single-item {stage}` exited with {returncode}"
            + (f" (the stage's command exited with {stage_exit})" if stage_exit is not None else "")
            + f"; last {len(self.tail)} lines of its output:\n" + "\n".join(self.tail)
        )


class StageUserError(StageFailedError):
    """The stage's command exited 2: a user error, never retried (docs/reliability.md).

    Its one ``error: ...`` line was already streamed into the task log; the message points
    there rather than repeating it (``error_line`` holds it for callers).
    """

    def __init__(self, stage: str, returncode: int, tail: Sequence[str], error_line: str | None):
        RuntimeError.__init__(
            self,
            f"stage {stage!r} stopped on a user error (its command exited with "
            f"{USER_ERROR_EXIT_CODE}; not retried): the `error:` line in the stage's log says "
            "what to fix",
        )
        self.stage, self.returncode, self.tail = stage, returncode, list(tail)
        self.stage_exit = USER_ERROR_EXIT_CODE
        self.error_line = error_line


class WorkspaceBusyError(StageUserError):
    """Another DVC run in the same workspace (a ``dvc repro`` in a shell beside this flow) holds an out or dep
    of the stage: not a crash, never retried — the one line names the holder and what it holds."""

    def __init__(self, stage: str, returncode: int, tail: Sequence[str], error_line: str):
        RuntimeError.__init__(self, error_line)
        self.stage, self.returncode, self.tail = stage, returncode, list(tail)
        self.stage_exit = None
        self.error_line = error_line


class PipelineFailedError(RuntimeError):
    """One or more stages failed; ``results`` is the flow's per-stage dict so far,
    ``user_errors`` the failed stages that failed on a user error (exit 2, not retried)."""

    def __init__(self, message: str, results: dict[str, dict[str, Any]],
                 user_errors: Sequence[str] = ()):
        super().__init__(message)
        self.results = results
        self.user_errors = list(user_errors)

    @property
    def only_user_errors(self) -> bool:
        """Every failed stage failed on a user error (the CLI then exits 2)."""
        failed = [n for n, r in self.results.items() if r.get("status") == "failed"]
        return bool(failed) and set(failed) <= set(self.user_errors)


# --------------------------------------------------------------------------------------------
# helpers (plain functions, unit-testable without Prefect)


def stage_exit_code(lines: Sequence[str]) -> int | None:
    """The stage command's exit code from ``dvc repro`` output, or None when DVC did not report
    one (it failed before or after running the command). DVC ends a failed command with
    ``ERROR: failed to reproduce '<stage>': failed to run: <cmd>, exited with <code>`` (the
    command may span lines; a signal is a negative code)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("ERROR: failed to reproduce")]
    if not starts:
        return None
    m = _DVC_STAGE_FAILED.search("\n".join(lines[starts[-1]:]))
    return int(m.group(1)) if m else None


def workspace_busy_line(lines: Sequence[str]) -> str | None:
    """The one line for DVC's refusal when another DVC process in the workspace holds a path of the stage
    (``ERROR: '<path>' is busy, it is being blocked by:`` then ``(PID <n>): <cmd>`` lines), or None."""
    for i, line in enumerate(lines):
        busy = _DVC_BUSY.search(line)
        if busy:
            holders = [m.group(0) for m in (_DVC_BLOCKER.search(x) for x in lines[i + 1 : i + 6]) if m]
            who = "; ".join(holders) or "another process"
            return (f"error: another DVC run in this workspace holds {busy.group('path')} ({who}): wait for it to "
                    "finish (or stop it), then rerun — two runs of one workspace would write the same artifacts")
    return None


def _user_error_line(lines: Sequence[str]) -> str | None:
    """The last ``error: ...`` line the stage printed (distillery's one-line user error)."""
    return next((line for line in reversed(lines) if line.startswith("error: ")), None)


def check_params_files(repo: Path, stages: Mapping[str, StageSpec]) -> None:
    """Read ``params.yaml`` and every other YAML params file the stages list within the input bounds and as
    DVC reads it (:func:`distillery.pipeline.params.file.read_params_file`); a UserError at the first bad
    one. A file that does not exist is left to DVC (it names it)."""
    files = {"params.yaml"} | {p.rpartition(":")[0] for spec in stages.values() for p in spec.params if ":" in p}
    for rel in sorted(files):
        path = Path(repo) / rel
        if path.suffix in (".yaml", ".yml") and path.is_file():
            read_params_file(path, show_path(path), "not a readable file")


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry a failed stage unless it failed on a user error, or the flow run is being
    stopped (SIGTERM: :func:`stop_stages_on_sigterm` ended its stages)."""
    return not isinstance(state.data, StageUserError) and not _STOPPING.is_set()


_RUNNING: set[int] = set()  # process groups of the `dvc repro` this flow-run process runs now (one per stage task)
_STOPPING = threading.Event()  # set once SIGTERM asked the flow run to stop: no task retries, no new stage


@contextlib.contextmanager
def stop_stages_on_sigterm() -> Iterator[None]:
    """While the flow body runs (its main thread): SIGTERM — Prefect cancelling the run, ``serve`` stopping — ends every
    running stage (SIGTERM to each ``dvc repro`` process group: DVC, the stage and its workers: a training stage stops
    its workers and keeps its checkpoints, a rerun resumes) and starts no other; the stage tasks then return
    ``stopped`` and the flow ends ``Cancelled`` (:func:`_run_stages`), quietly — no task traceback, no "Crash detected".
    Prefect's own handler would raise in this thread while the stage tasks' threads kept the process alive until it was
    SIGKILLed, their ``dvc repro`` (in its own session) outliving the run."""
    _STOPPING.clear()  # a new flow run in this process (tests, `python -m flows.dag` twice)
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        _STOPPING.set()
        for pgid in list(_RUNNING):
            try:
                os.killpg(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def dvc_repro_command(stage: str) -> list[str]:
    """The command a stage task runs: DVC of this interpreter, queueing on DVC's repo lock."""
    return [sys.executable, "-m", "dvc", "--wait-for-lock", "repro", "--single-item", stage]


def stage_env() -> dict[str, str]:
    """Environment for ``dvc repro``: ours + quiet defaults, this interpreter's bin first on PATH
    (so a stage ``cmd`` of ``python ...`` / ``distillery ...`` resolves to the same venv), and
    ``DISTILLERY_PIPELINE_RUN=prefect-<flow run id>`` inside a flow run (one MLflow parent run)."""
    env = {**flows.QUIET_ENV, **os.environ, "DVC_NO_ANALYTICS": "1"}
    if "DISTILLERY_PIPELINE_RUN" not in env:  # every stage of one flow run logs under one MLflow parent run
        from prefect.runtime import flow_run

        if flow_run.id:
            env["DISTILLERY_PIPELINE_RUN"] = f"prefect-{flow_run.id}"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    return env


def artifact_key(stage: str, suffix: str) -> str:
    """Prefect artifact key: lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-") or "stage"
    return f"{slug}-{suffix}"


def read_stage_metrics(repo: Path, spec: StageSpec) -> dict[str, dict[str, Any]]:
    """``{metrics file: flat metrics}`` for the stage's ``metrics`` files that exist (JSON or
    YAML); an unreadable file maps to ``{"error": "..."}`` rather than failing the stage."""
    found: dict[str, dict[str, Any]] = {}
    for rel in spec.metrics:
        path = Path(repo) / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            found[rel] = flatten(data, lists=True) if isinstance(data, (Mapping, list)) else {"value": data}
        except (OSError, ValueError, yaml.YAMLError) as e:
            found[rel] = {"error": f"{type(e).__name__}: {e}"}
    return found


def media_files(repo: Path, spec: StageSpec) -> list[str]:
    """Repo-relative paths of ``*.gif``/``*.mp4`` files among (or inside) the stage's outputs."""
    repo = Path(repo)
    hits: set[str] = set()
    for rel in spec.all_outs:
        path = repo / rel
        if path.is_file() and path.suffix.lower() in MEDIA_SUFFIXES:
            hits.add(path.relative_to(repo).as_posix())
        elif path.is_dir():
            for p in path.rglob("*"):
                if p.is_file() and p.suffix.lower() in MEDIA_SUFFIXES:
                    hits.add(p.relative_to(repo).as_posix())
    return sorted(hits)


def _status_from_output(lines: Iterable[str]) -> str:
    status = "ran"
    for line in lines:
        if "didn't change, skipping" in line:
            status = "skipped"
        elif "is cached - skipping run" in line:
            status = "restored"
    return status


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


async def _run_dvc(repo: Path, stage: str, on_line: Callable[[str], None]) -> tuple[int, list[str]]:
    """Run ``dvc repro --single-item stage``; every output line goes to ``on_line``.

    Returns (exit code, all lines). If cancelled (Prefect timeout), the process group gets
    SIGTERM, then SIGKILL after 10 s, before the cancellation propagates.
    """
    proc = await asyncio.create_subprocess_exec(
        *dvc_repro_command(stage),
        cwd=str(repo),
        env=stage_env(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    _RUNNING.add(proc.pid)  # its process group: what stop_stages_on_sigterm ends
    lines: list[str] = []

    def emit(raw: bytes) -> None:
        # progress bars rewrite a line with "\r": keep what a terminal would finally show
        text = raw.decode("utf-8", errors="replace").rstrip("\r").split("\r")[-1].rstrip()
        if text:
            lines.append(text)
            on_line(text)

    try:
        assert proc.stdout is not None
        buf = b""
        while chunk := await proc.stdout.read(65536):
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                emit(raw)
        if buf:
            emit(buf)
        rc = await proc.wait()
    finally:
        _RUNNING.discard(proc.pid)
        if proc.returncode is None:
            with anyio.CancelScope(shield=True):
                _signal_group(proc, signal.SIGTERM)
                with anyio.move_on_after(10):
                    await proc.wait()
                if proc.returncode is None:
                    _signal_group(proc, signal.SIGKILL)
                    await proc.wait()
    return rc, lines


# --------------------------------------------------------------------------------------------
# the task


@task(name="dvc-stage", cache_policy=NO_CACHE, persist_result=False,
      retry_condition_fn=retry_unless_user_error)
async def run_stage(repo: str, spec: StageSpec) -> dict[str, Any]:
    """Reproduce one stage through DVC, log its output, publish its artifacts.

    Returns ``{"status", "seconds", "metrics"}``. A non-zero exit raises
    :class:`StageUserError` when the stage's command exited 2 (never retried) and
    :class:`StageFailedError` otherwise (retried if the task was given retries).
    """
    logger = get_run_logger()
    root = Path(repo)
    if _STOPPING.is_set():  # the flow run is being stopped: no new stage
        return {"status": "stopped", "seconds": 0.0, "metrics": {}}
    logger.info("$ dvc %s  (cwd %s)", " ".join(dvc_repro_command(spec.name)[3:]), root)
    t0 = time.monotonic()
    rc, lines = await _run_dvc(root, spec.name, logger.info)
    seconds = round(time.monotonic() - t0, 3)
    if rc != 0 and _STOPPING.is_set():  # ended by stop_stages_on_sigterm, not failed
        logger.info("stage %s: stopped (SIGTERM to the flow run) after %.1f s", spec.name, seconds)
        return {"status": "stopped", "seconds": seconds, "metrics": {}}
    if rc != 0:
        busy = workspace_busy_line(lines)
        if busy is not None:
            logger.error("%s", busy)
            raise WorkspaceBusyError(spec.name, rc, lines[-TAIL_LINES:], busy)
        stage_exit = stage_exit_code(lines)
        if stage_exit == USER_ERROR_EXIT_CODE:
            raise StageUserError(spec.name, rc, lines[-TAIL_LINES:], _user_error_line(lines))
        raise StageFailedError(spec.name, rc, lines[-TAIL_LINES:], stage_exit)
    status = _status_from_output(lines)

    per_file = read_stage_metrics(root, spec)
    flat: dict[str, Any] = {}
    for rel, values in per_file.items():
        prefix = "" if len(per_file) == 1 else f"{rel}:"
        flat.update({f"{prefix}{k}": v for k, v in values.items()})
    if per_file:
        await acreate_table_artifact(
            key=artifact_key(spec.name, "metrics"),
            table=[
                {"file": rel, "metric": k, "value": v}
                for rel, values in per_file.items()
                for k, v in values.items()
            ],
            description=f"Metrics of DVC stage `{spec.name}` ({status}, {seconds:.1f} s): "
            + ", ".join(f"`{rel}`" for rel in per_file),
        )
    media = media_files(root, spec)
    if media:
        body = "\n".join(
            f"- [{rel}]({(root / rel).resolve().as_uri()}) ({(root / rel).stat().st_size} bytes)"
            for rel in media
        )
        await acreate_markdown_artifact(
            key=artifact_key(spec.name, "validation-grid"),
            markdown=f"### Videos written by stage `{spec.name}`\n\n{body}\n",
            description=f"GIF/MP4 outputs of DVC stage `{spec.name}`",
        )
    logger.info("stage %s: %s in %.1f s, %d metrics, %d videos", spec.name, status, seconds,
                len(flat), len(media))
    return {"status": status, "seconds": seconds, "metrics": flat}


# --------------------------------------------------------------------------------------------
# the flow


def retry_delays(retry_delay_seconds: Any, retries: int) -> list[int | float] | int | float:
    """Seconds, a per-retry list, or a callable like ``exponential_backoff(10)`` → the JSON-able
    value Prefect's ``retry_delay_seconds`` takes (a callable is evaluated for ``retries``)."""
    if callable(retry_delay_seconds):  # e.g. prefect.tasks.exponential_backoff(10)
        retry_delay_seconds = retry_delay_seconds(max(retries, 1))
    if isinstance(retry_delay_seconds, (int, float)):
        return retry_delay_seconds
    return [int(d) if float(d).is_integer() else float(d) for d in retry_delay_seconds]


def _run_stages(
    repo: str,
    retries: int,
    retry_delay_seconds: Any,
    timeout_seconds: float | None,
    training_stages: Iterable[str] | None,
) -> dict[str, dict[str, Any]]:
    """Body of the flow: read dvc.yaml now (so each run sees the current DAG), submit one task
    per stage with ``wait_for`` its upstream, wait for all, fail loudly on any failure; a SIGTERM meanwhile ends the
    running stages first (:func:`stop_stages_on_sigterm`)."""
    with stop_stages_on_sigterm():
        results = _run_stages_until_done(repo, retries, retry_delay_seconds, timeout_seconds, training_stages)
    if _STOPPING.is_set():  # SIGTERM: the run was stopped, not failed
        from prefect.states import Cancelled

        stopped = [name for name, r in results.items() if r["status"] == "stopped"]
        get_run_logger().info("stopped by SIGTERM: stage(s) %s ended (a rerun resumes them)", ", ".join(stopped) or "none")
        return Cancelled(message=f"stopped by SIGTERM; stages ended: {', '.join(stopped) or 'none'}", data=results)
    return results


def _run_stages_until_done(
    repo: str,
    retries: int,
    retry_delay_seconds: Any,
    timeout_seconds: float | None,
    training_stages: Iterable[str] | None,
) -> dict[str, dict[str, Any]]:
    """:func:`_run_stages` inside its SIGTERM handler."""
    logger = get_run_logger()
    root = Path(repo).resolve()
    stages = load_dvc_stages(root)
    levels = stage_order(stages)
    check_params_files(root, stages)  # before DVC's own parser reads them
    logger.info("dvc.yaml DAG (%d stages): %s", len(stages),
                " -> ".join("[" + ", ".join(lvl) + "]" for lvl in levels))
    training = None if training_stages is None else set(training_stages)
    delays = retry_delays(retry_delay_seconds, retries)

    futures = {}
    for level in levels:
        for name in level:
            spec = stages[name]
            is_training = training is None or name in training
            stage_task = run_stage.with_options(
                name=name,
                task_run_name=name,
                retries=retries if is_training else 0,
                retry_delay_seconds=delays if is_training else 0,
                retry_condition_fn=retry_unless_user_error,
                timeout_seconds=timeout_seconds,
            )
            futures[name] = stage_task.submit(
                str(root), spec, wait_for=[futures[u] for u in spec.upstream]
            )
    wait(list(futures.values()))

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    user_errors: list[str] = []
    for level in levels:
        for name in level:
            fut = futures[name]
            if fut.state.is_completed():
                results[name] = fut.result()
                continue
            try:
                fut.result()  # raises the stage's own exception (StageFailedError, timeout ...)
                message = f"ended in state {fut.state.name}"
            except Exception as e:  # noqa: BLE001 — collected, re-raised below
                message = f"{type(e).__name__}: {e}"
                if isinstance(e, StageUserError):
                    user_errors.append(name)
            upstream_failed = any(u in errors for u in stages[name].upstream)
            status = "not-run" if upstream_failed else "failed"
            results[name] = {"status": status, "seconds": None, "metrics": {}}
            errors[name] = message
    if errors:
        failed = [n for n, r in results.items() if r["status"] == "failed"]
        skipped = [n for n, r in results.items() if r["status"] == "not-run"]
        msg = f"pipeline failed: stage(s) {', '.join(failed)} failed"
        if skipped:
            msg += f"; not run (upstream failed): {', '.join(skipped)}"
        msg += "".join(f"\n\n--- {n} ---\n{errors[n]}" for n in failed)
        raise PipelineFailedError(msg, dag_ordered(results, stages, levels), user_errors)
    return dag_ordered(results, stages, levels)


def dag_ordered(results: dict[str, Any], stages: Mapping[str, Any], levels: list[list[str]]) -> dict[str, Any]:
    """``results`` in the DAG's order: by dependency level, and within a level as ``dvc.yaml`` lists the stages (clips
    before base), so the summary reads as the pipeline runs."""
    position = {name: i for i, name in enumerate(stages)}
    level = {name: k for k, names in enumerate(levels) for name in names}
    return {name: results[name] for name in sorted(results, key=lambda n: (level.get(n, 0), position.get(n, 0)))}


@flow(name=FLOW_NAME, description="The dvc.yaml DAG, one task per stage via `dvc repro`.")
def distillery_pipeline(
    repo: str = ".",
    retries: int = 2,
    retry_delay_seconds: list[float] | float = list(DEFAULT_RETRY_DELAYS),  # noqa: B006
    timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
    training_stages: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Module-level form of the pipeline flow, loadable by entrypoint
    (``flows/dag.py:distillery_pipeline``): what deployments run, with ``repo`` etc. as
    deployment parameters. Same arguments as :func:`build_pipeline_flow`."""
    return _run_stages(repo, retries, retry_delay_seconds, timeout_seconds, training_stages)


def build_pipeline_flow(
    repo: Path,
    *,
    retries: int = 2,
    retry_delay_seconds: Sequence[float] | float | Callable[[int], list[float]] = DEFAULT_RETRY_DELAYS,
    timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
    training_stages: set[str] | None = None,
) -> Flow[..., dict[str, dict[str, Any]]]:
    """The ``distillery-pipeline`` flow for ``repo`` with these options bound as parameter
    defaults: ``build_pipeline_flow(repo)()`` runs it.

    ``dvc.yaml`` is parsed now (a bad file or a cycle fails here) and again at each run.
    ``retries``/``retry_delay_seconds`` apply to ``training_stages`` (None: all stages);
    ``retry_delay_seconds`` is seconds, a per-retry list, or a callable like
    ``prefect.tasks.exponential_backoff(backoff_factor=10)``. ``timeout_seconds`` applies to every
    stage task (None: no timeout).
    """
    root = Path(repo).resolve()
    stages = load_dvc_stages(root)
    stage_order(stages)  # fail fast on a broken dvc.yaml
    check_params_files(root, stages)  # ... or a params file DVC's parser would hang on
    bound_repo = str(root)
    bound_delays = retry_delays(retry_delay_seconds, retries)
    bound_training = None if training_stages is None else sorted(training_stages)
    bound_retries, bound_timeout = retries, timeout_seconds

    def distillery_pipeline(  # noqa: F811 — same name so an entrypoint resolves to the module flow
        repo: str = bound_repo,
        retries: int = bound_retries,
        retry_delay_seconds: list[float] | float = bound_delays,
        timeout_seconds: float | None = bound_timeout,
        training_stages: list[str] | None = bound_training,
    ) -> dict[str, dict[str, Any]]:
        return _run_stages(repo, retries, retry_delay_seconds, timeout_seconds, training_stages)

    # a deployment made from this flow records `flows/dag.py:distillery_pipeline` as its
    # entrypoint, i.e. the module-level flow above (pass `parameters={"repo": ...}` to it)
    distillery_pipeline.__qualname__ = "distillery_pipeline"
    return flow(
        name=FLOW_NAME,
        description=f"The dvc.yaml DAG of {bound_repo}, one task per stage via `dvc repro`.",
    )(distillery_pipeline)


def run_pipeline(repo: Path, **kw: Any) -> dict[str, dict[str, Any]]:
    """Build the flow for ``repo`` (keywords as :func:`build_pipeline_flow`) and run it once."""
    return build_pipeline_flow(repo, **kw)()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.dag", description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, default=Path("."), help="DVC repo root (has dvc.yaml)")
    p.add_argument("--retries", type=int, default=2, help="retries of training stages")
    p.add_argument("--retry-delay", type=float, nargs="+", default=list(DEFAULT_RETRY_DELAYS),
                   help="seconds before each retry (last value repeats)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                   help="per-stage timeout in seconds (0: none)")
    p.add_argument("--training-stage", action="append", dest="training_stages", default=None,
                   help="stage that gets retries (repeatable; default: all stages)")
    a = p.parse_args(argv)
    from flows.server import configured_api_url, find_workspace_server, prefect_api

    kept = configured_api_url() is not None or find_workspace_server(a.repo) is not None
    try:
        # a kept record: PREFECT_API_URL's server, else this workspace's when it is up; else Prefect's temporary one
        with prefect_api(a.repo, start=False) if kept else contextlib.nullcontext():
            results = run_pipeline(
                a.repo,
                retries=a.retries,
                retry_delay_seconds=a.retry_delay,
                timeout_seconds=a.timeout or None,
                training_stages=set(a.training_stages) if a.training_stages else None,
            )
    except UserError as e:  # a params file refused before any stage ran
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CancelledRun:  # SIGTERM: the running stages were ended (stop_stages_on_sigterm); a rerun resumes them
        print("pipeline stopped (SIGTERM): the running stages were ended; `python -m flows.dag` again resumes",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    except PipelineFailedError as e:
        if e.only_user_errors:  # each stage's `error:` line is in the log above: one line here
            print(f"error: pipeline stopped: stage(s) {', '.join(e.user_errors)} failed on a user "
                  "error (exit 2, not retried); the stage's `error:` line above says what to fix",
                  file=sys.stderr)
            return 2
        print(str(e), file=sys.stderr)
        return 1
    for name, r in results.items():
        print(f"{name:24s} {r['status']:9s} {r['seconds']:8.1f} s  {len(r['metrics'])} metrics")
    if not kept:
        print("this run's Prefect record was on a temporary server, gone with it (its stages' record: dvc.lock, "
              "mlflow.db); to keep the next one, run `python -m flows.deploy server --repo "
              f"{a.repo}` in another shell first: runs then go to this workspace's server (UI and history in "
              f"{Path(a.repo) / '.prefect'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
