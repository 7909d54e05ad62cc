"""How a training stage starts its training: one torchrun agent per node, on this machine or over Slurm.

``params.yaml: gpus`` says where (:class:`~distillery.pipeline.params.schema.GpusParams`):

- ``nnodes: 1``: one agent, ``torchrun --standalone`` with ``nproc_per_node`` workers (either launcher) —
  but one process on this machine (``launcher: local``, ``nproc_per_node: 1``, the default and the one-GPU case)
  is started as that worker itself: a single-process group needs no agent, and the agent's start (a torch
  import, ~3 s on a 2-core CPU) and its exit after the worker's (~3 s) were spent on every training stage.
- ``launcher: local``, ``nnodes: N > 1``: N agents on this machine, each ``--nnodes N`` with
  ``nproc_per_node`` workers (agent i on GPUs ``i·nproc …``: :func:`local_gpu_slices`), meeting at a
  c10d rendezvous on 127.0.0.1 — a multi-node run on one host (what the tests run, and a way to try
  a multi-node setting before a cluster).
- ``launcher: slurm``: one ``srun --nodes N --ntasks-per-node 1`` step over the Slurm allocation
  this stage runs in (``sbatch``/``salloc``: ``$SLURM_JOB_ID``), one agent per node; the stage itself
  (its lineage, artifacts, locks) stays on the node it runs on and the shared file system is the
  hand-off (``runs/<stage>/run.yaml`` in, checkpoints and ``run_summary.json`` out).

**The rendezvous.** With ``gpus.rdzv_endpoint`` empty, the stage hosts the c10d rendezvous store
itself (:class:`Rendezvous`: a ``TCPStore`` in this process on a free port of this host — 127.0.0.1
for ``local``, this node's name for ``slurm``) and every agent joins it as a client
(``is_host=false``); it lives as long as the launch. A given ``host:port`` is used as is (the agent
on that host serves it, torch's rule). The workers' own process group is served by the agent that
the rendezvous makes node 0. Which agent is node 0 does not change the losses: every rank trains its
slice of the global batch (:mod:`distillery.components.rng`, :mod:`distillery.data.sampler`).

**Kill semantics** (docs/reliability.md): each local agent dies with this process
(``PR_SET_PDEATHSIG`` SIGKILL) and its workers with it; ``srun`` gets SIGTERM when this process dies
and cancels its step, which ends the agent on every node and their workers with them. When one
agent fails, the others are stopped (local: SIGTERM, then SIGKILL after :data:`GRACE_S`; Slurm:
``--kill-on-bad-exit=1``), so a failed node never leaves the others waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.log import get_logger

log = get_logger("stage")
GRACE_S = 10.0  # seconds a stopped agent gets to stop its workers before SIGKILL
WORKER_MODULE = "distillery.cli.train"  # what every process of a launch runs (``python -m``): one training rank
AGENT_MODULE = "distillery.cli.launch"  # what runs the workers of a launch of more than one process: torchrun, contained


@dataclass
class Launch:
    """The processes one training launch starts: ``commands`` (one per process this stage runs: an
    agent each for ``local``, one ``srun`` for ``slurm``), their environment additions, and what the
    artifact's lineage records about it (:attr:`record`)."""

    commands: list[list[str]]
    launcher: str
    nnodes: int
    nproc_per_node: int
    endpoint: str | None = None  # host:port of the c10d rendezvous (None: --standalone)
    record: dict[str, Any] = field(default_factory=dict)
    serve_rendezvous: bool = False  # this process serves the rendezvous store at endpoint (Rendezvous)
    envs: list[dict[str, str]] = field(default_factory=list)  # per command: environment additions (its GPUs)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def slurm_allocation(nnodes: int) -> dict[str, str]:
    """The Slurm allocation this stage runs in: job id, node count, node list; a one-line UserError
    when there is none, or its node count is not ``gpus.nnodes``."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise UserError("params.yaml: gpus.launcher: slurm, but this stage is not inside a Slurm allocation ($SLURM_JOB_ID "
                        "unset); run the pipeline from an sbatch script or salloc (README: a Slurm cluster)")
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "?"
    if nodes != str(nnodes):
        raise UserError(f"params.yaml: gpus.nnodes: {nnodes}, but Slurm job {job} has {nodes} node(s) "
                        "($SLURM_JOB_NUM_NODES); set gpus.nnodes to the allocation's node count")
    return {"slurm_job_id": job, "slurm_nodes": nodes, "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST", "")}


def agent_command(nnodes: int, nproc: int, endpoint: str | None, run_id: str, train_args: list[str],
                  is_host: bool | None = None, local_addr: str | None = None) -> list[str]:
    """``python -m distillery.cli.launch ... -m distillery.cli.train <train_args>``: one torchrun agent."""
    cmd = [sys.executable, "-m", AGENT_MODULE, "--nproc_per_node", str(nproc)]
    if endpoint is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
                "--max_restarts", "0"]
        if is_host is not None:
            cmd += ["--rdzv_conf", f"is_host={str(is_host).lower()}"]
        if local_addr is not None:
            cmd += ["--local_addr", local_addr]
    return cmd + ["-m", WORKER_MODULE, *train_args]


def plan_launch(gpus: Any, train_args: list[str]) -> Launch:
    """The commands of one launch of ``python -m distillery.cli.train <train_args>`` under ``gpus``
    (``params.yaml: gpus``, typed): module doc. Without ``gpus.rdzv_endpoint`` (and more than one
    node, or Slurm) the endpoint is a free port of this host that :func:`run_launch` serves."""
    nnodes, nproc, launcher = int(gpus.nnodes), int(gpus.nproc_per_node), str(gpus.launcher)
    record: dict[str, Any] = {"launcher": launcher, "nnodes": nnodes, "nproc_per_node": nproc, "world_size": int(gpus.world_size)}
    run_id = f"distillery-{os.getpid()}-{time.time_ns()}"
    if launcher == "slurm":
        record.update(slurm_allocation(nnodes))
        host = socket.gethostname()
        hosted = not gpus.rdzv_endpoint
        endpoint = gpus.rdzv_endpoint or f"{host}:{free_port('0.0.0.0')}"
        agent = agent_command(nnodes, nproc, endpoint, record["slurm_job_id"] + "-" + run_id, train_args,
                              is_host=False if hosted else None)
        srun = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                "--export=ALL", f"--job-name=distillery-{Path(train_args[-1]).parent.name}"]
        return Launch([srun + agent], launcher, nnodes, nproc, endpoint, record, hosted)
    if nnodes == 1 and nproc == 1:  # the worker alone (module doc): it dies with this process as an agent would
        return Launch([[sys.executable, "-m", WORKER_MODULE, *train_args]], launcher, 1, 1, None, record)
    if nnodes == 1:
        return Launch([agent_command(1, nproc, None, run_id, train_args)], launcher, 1, nproc, None, record)
    hosted = not gpus.rdzv_endpoint
    endpoint = gpus.rdzv_endpoint or f"127.0.0.1:{free_port('127.0.0.1')}"
    commands = [agent_command(nnodes, nproc, endpoint, run_id, train_args, is_host=False if hosted else (i == 0),
                              local_addr="127.0.0.1") for i in range(nnodes)]
    return Launch(commands, launcher, nnodes, nproc, endpoint, record, hosted, local_gpu_slices(gpus))


def local_gpu_slices(gpus: Any) -> list[dict[str, str]]:
    """``CUDA_VISIBLE_DEVICES`` per local agent: agent i sees GPUs ``i·nproc … (i+1)·nproc − 1`` of the ones
    this process sees (``$CUDA_VISIBLE_DEVICES``, else 0, 1, …), so the agents' workers, each on its
    ``LOCAL_RANK``, never share a GPU. Harmless on a machine without GPUs."""
    nnodes, nproc, world = int(gpus.nnodes), int(gpus.nproc_per_node), int(gpus.world_size)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible is not None else [str(i) for i in range(world)]
    if len(devices) < world:
        return [{} for _ in range(nnodes)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * nproc:(i + 1) * nproc])} for i in range(nnodes)]


class Rendezvous:
    """The c10d rendezvous store served by this process for one launch (``with Rendezvous(endpoint):``)."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self.store: Any = None

    def __enter__(self) -> "Rendezvous":
        if self.endpoint is not None:
            import datetime

            from torch.distributed import TCPStore

            host, _, port = self.endpoint.rpartition(":")
            bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0"
            try:
                self.store = TCPStore(bind, int(port), is_master=True, wait_for_workers=False, multi_tenant=True,
                                      timeout=datetime.timedelta(seconds=60))
            except (RuntimeError, OSError) as exc:
                raise UserError(f"cannot serve the c10d rendezvous on {self.endpoint} ({str(exc).splitlines()[0][:120]}); "
                                "set params.yaml: gpus.rdzv_endpoint to a free host:port") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.store = None  # closes the server socket


_CHILDREN: list[subprocess.Popen] = []  # the running agents (or srun), stopped if this stage is orphaned


def _child_death_signal(launcher: str) -> int:
    # an agent dies at once with us (its workers die with it, checkpoints are atomic); srun must get a
    # catchable signal so it cancels its step on every node (SIGKILL would leave the remote agents running)
    return signal.SIGTERM if launcher == "slurm" else signal.SIGKILL


def run_launch(launch: Launch, env: dict[str, str], while_running: Callable[[], None] | None = None) -> int:
    """Start every command of ``launch`` (each dies with this process), wait for all; the first
    non-zero exit code stops the others and is returned (0 when all succeed). ``while_running`` is
    called once every child has started (after the forks: a thread it starts cannot be inside a
    lock that a child's ``preexec_fn`` needs), before the wait."""
    from distillery.common.procutil import die_with_parent

    sig = _child_death_signal(launch.launcher)
    with Rendezvous(launch.endpoint if launch.serve_rendezvous else None):
        if launch.nnodes > 1 or launch.launcher == "slurm":
            log.info("launch: %s, %d node(s) x %d process(es), rendezvous %s%s", launch.launcher, launch.nnodes,
                     launch.nproc_per_node, launch.endpoint, f" (Slurm job {launch.record['slurm_job_id']})"
                     if "slurm_job_id" in launch.record else "")
        for i, cmd in enumerate(launch.commands):
            extra = launch.envs[i] if i < len(launch.envs) else {}
            _CHILDREN.append(subprocess.Popen(cmd, env={**env, **extra}, preexec_fn=lambda: die_with_parent(sig)))
        try:
            if while_running is not None:
                while_running()
            return _wait_all(list(_CHILDREN))
        finally:
            stop_children()


def _wait_all(children: list[subprocess.Popen]) -> int:
    """Wait for every child; on the first failure stop the rest (module doc) and return its code."""
    while True:
        codes = [c.poll() for c in children]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def stop_children(grace: float = GRACE_S) -> None:
    """SIGTERM every running child, SIGKILL what is left after ``grace`` seconds; forget them."""
    running = [c for c in _CHILDREN if c.poll() is None]
    for c in running:
        c.terminate()
    deadline = time.monotonic() + grace
    for c in running:
        try:
            c.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    _CHILDREN.clear()


def kill_children() -> None:
    """Kill the running launch now (an orphaned stage): local agents with SIGKILL (their workers die
    with them), ``srun`` with SIGTERM (it cancels its step on every node)."""
    for c in list(_CHILDREN):
        if c.poll() is None:
            c.send_signal(signal.SIGTERM) if c.args and c.args[0] == "srun" else c.kill()
