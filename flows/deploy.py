"""The ``nightly`` deployment: the pipeline flow on a cron schedule (default ``0 2 * * *``, UTC).

Both forms deploy the module-level flow :func:`flows.dag.distillery_pipeline` (entrypoint
``flows/dag.py:distillery_pipeline``) with the DVC repo and the retry/timeout options as
deployment parameters, so every scheduled run re-reads ``dvc.yaml`` and lets ``dvc repro`` decide
what to rerun (a night with no changed code, params or data costs a few no-op repros).

A schedule needs a Prefect server (its scheduler creates the runs): with ``PREFECT_API_URL`` set
(environment or profile) that server is used; without it ``serve`` starts this workspace's own
persistent server — database in ``<repo>/.prefect/`` (git-ignored), UI on http://127.0.0.1:4200
when that port is free — and stops it when ``serve`` exits (see :mod:`flows.server`).

Local serving — one long-running process that owns the schedule and runs the flow in
subprocesses on this machine (``flow.serve``; stop it with Ctrl-C or SIGTERM, which pauses the
schedule and then stops the server it started)::

    python -m flows.deploy serve --repo . [--cron "0 2 * * *"] [--timezone Europe/Paris]
    # in Python: flows.deploy.serve_nightly(Path("."), cron="0 2 * * *")

Work pool — register the deployment with the Prefect API and let workers of a pool run it
(``flow.from_source(...).deploy``; the API server schedules runs, a worker picks them up). This
needs a server that outlives the command: ``PREFECT_API_URL``, or this workspace's server run in
the foreground by ``python -m flows.deploy server --repo .`` (it prints the URL to export for
workers; ``--stop`` stops one left running)::

    prefect work-pool create gpu-pool --type process      # once
    prefect worker start --pool gpu-pool                  # on the machine(s) that run stages
    python -m flows.deploy deploy --repo . --work-pool gpu-pool [--cron ...]
        [--source https://git.example/distillery.git]     # default: this checkout, by path
        [--image registry/distillery:tag]                 # docker/k8s pools: code in the image

  With ``--source`` a git URL the worker clones the project per run, and ``--repo`` is the DVC
  repo path *inside that clone* (usually ``.``); with the default local source it is made absolute.

:func:`nightly_deployment` returns the same deployment ``serve`` registers, for tests and for
``prefect.serve(...)`` together with other deployments. Every function takes ``schedule=`` (a
``prefect.schedules`` object, e.g. ``Interval(60, anchor_date=...)``) instead of ``cron``.
Command-line errors (a broken ``dvc.yaml``, no usable Prefect API) end with one ``error:`` line
and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron, Schedule

import flows  # noqa: F401  (sets the quiet env before Prefect is imported)
from distillery.common.errors import UserError
from distillery.pipeline.dvcfile import load_dvc_stages, stage_order
from flows.dag import (
    DEFAULT_RETRY_DELAYS,
    DEFAULT_TIMEOUT_SECONDS,
    FLOW_NAME,
    check_params_files,
    distillery_pipeline,
    retry_delays,
)
from flows.server import (
    PrefectServerError,
    prefect_api,
    run_workspace_server,
    stop_workspace_server,
)

__all__ = [
    "DEFAULT_CRON",
    "DEPLOYMENT_NAME",
    "ENTRYPOINT",
    "PROJECT_ROOT",
    "deploy_nightly",
    "nightly_deployment",
    "pipeline_parameters",
    "serve_nightly",
]

DEFAULT_CRON = "0 2 * * *"
DEPLOYMENT_NAME = "nightly"
PROJECT_ROOT = Path(__file__).resolve().parent.parent  # the checkout that holds flows/
ENTRYPOINT = "flows/dag.py:distillery_pipeline"  # relative to PROJECT_ROOT
_TAGS = ["distillery", "nightly"]
_DESCRIPTION = "Nightly re-distillation: the dvc.yaml DAG via `dvc repro`, one task per stage."


def _stderr(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def pipeline_parameters(
    repo: Path | str,
    *,
    retries: int = 2,
    retry_delay_seconds: Any = DEFAULT_RETRY_DELAYS,
    timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
    training_stages: set[str] | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Deployment parameters of :func:`flows.dag.distillery_pipeline` (JSON-able)."""
    return {
        "repo": str(repo),
        "retries": retries,
        "retry_delay_seconds": retry_delays(retry_delay_seconds, retries),
        "timeout_seconds": timeout_seconds,
        "training_stages": None if training_stages is None else sorted(training_stages),
    }


def _schedule_kwargs(cron: str, timezone: str | None, schedule: Schedule | None) -> dict[str, Any]:
    if schedule is not None:
        return {"schedule": schedule}
    return {"cron": cron} if timezone is None else {"schedule": Cron(cron, timezone=timezone)}


def _local_repo(repo: Path | str) -> Path:
    root = Path(repo).resolve()
    stages = load_dvc_stages(root)
    stage_order(stages)  # refuse to schedule a broken dvc.yaml
    check_params_files(root, stages)  # ... or a params file DVC's parser would hang on (each run checks again)
    return root


def nightly_deployment(
    repo: Path | str, cron: str = DEFAULT_CRON, *, timezone: str | None = None,
    schedule: Schedule | None = None, **pipeline_kw: Any,
) -> RunnerDeployment:
    """The ``nightly`` deployment that :func:`serve_nightly` serves (``flow.to_deployment``),
    not yet registered: ``.apply()`` it, or give it to a ``Runner`` / ``prefect.serve``."""
    return distillery_pipeline.to_deployment(
        name=DEPLOYMENT_NAME,
        parameters=pipeline_parameters(_local_repo(repo), **pipeline_kw),
        description=_DESCRIPTION,
        tags=_TAGS,
        **_schedule_kwargs(cron, timezone, schedule),
    )


def serve_nightly(
    repo: Path | str, cron: str = DEFAULT_CRON, *, timezone: str | None = None,
    schedule: Schedule | None = None, say: Callable[[str], None] = _stderr, **pipeline_kw: Any,
) -> None:
    """Serve the ``nightly`` deployment from this process until interrupted (``flow.serve``).

    The API is :func:`flows.server.prefect_api` of ``repo``: ``PREFECT_API_URL`` if set, else the
    workspace server in ``<repo>/.prefect/`` (reused if running, else started here and stopped
    when serving ends). Raises ``PrefectServerError`` when that server cannot start.
    """
    root = _local_repo(repo)
    with prefect_api(root, say=say) as api:
        # Prefect's own hint below (`$ prefect deployment run ...`) reaches this server only with its URL exported
        say(f"to start a run from another shell: PREFECT_API_URL={api.api_url} prefect deployment run "
            f"'{FLOW_NAME}/{DEPLOYMENT_NAME}'")
        distillery_pipeline.serve(
            name=DEPLOYMENT_NAME,
            parameters=pipeline_parameters(root, **pipeline_kw),
            description=_DESCRIPTION,
            tags=_TAGS,
            **_schedule_kwargs(cron, timezone, schedule),
        )


def deploy_nightly(
    repo: Path | str,
    work_pool: str,
    cron: str = DEFAULT_CRON,
    *,
    timezone: str | None = None,
    schedule: Schedule | None = None,
    source: str | Path | None = None,
    image: str | None = None,
    say: Callable[[str], None] = _stderr,
    **pipeline_kw: Any,
) -> UUID:
    """Register the ``nightly`` deployment for ``work_pool``; returns its id.

    Code comes from ``source`` (a git URL or a directory the workers can read; default this
    checkout) through ``flow.from_source``, or, with ``image``, from a prebuilt image that
    contains the project (``build=False, push=False``: we never build images here).
    The API is ``PREFECT_API_URL``, else a running workspace server of the local repo (never a
    temporary one: the schedule must outlive this call); neither raises ``PrefectServerError``.
    """
    if image is not None:
        target = distillery_pipeline
        extra: dict[str, Any] = {"image": image, "build": False, "push": False}
        repo_param: Path | str = repo
    else:
        src = str(source) if source is not None else str(PROJECT_ROOT)
        target = distillery_pipeline.from_source(source=src, entrypoint=ENTRYPOINT)
        extra = {}
        repo_param = _local_repo(repo) if source is None else repo
    workspace = Path(repo) if Path(repo).is_dir() else Path.cwd()
    with prefect_api(workspace, start=False, say=say):
        return target.deploy(
            name=DEPLOYMENT_NAME,
            work_pool_name=work_pool,
            parameters=pipeline_parameters(repo_param, **pipeline_kw),
            description=_DESCRIPTION,
            tags=_TAGS,
            print_next_steps=False,
            ignore_warnings=True,
            **_schedule_kwargs(cron, timezone, schedule),
            **extra,
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("serve", "deploy"):
        s = sub.add_parser(name, help=f"{name} the nightly deployment")
        s.add_argument("--repo", default=".", help="DVC repo root (has dvc.yaml)")
        s.add_argument("--cron", default=DEFAULT_CRON, help=f"cron schedule (default {DEFAULT_CRON!r})")
        s.add_argument("--timezone", default=None, help="IANA timezone of the cron (default UTC)")
        s.add_argument("--retries", type=int, default=2)
        s.add_argument("--retry-delay", type=float, nargs="+", default=list(DEFAULT_RETRY_DELAYS))
        s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="0: none")
        s.add_argument("--training-stage", action="append", dest="training_stages", default=None)
        if name == "deploy":
            s.add_argument("--work-pool", required=True)
            s.add_argument("--source", default=None, help="git URL or directory with the code")
            s.add_argument("--image", default=None, help="prebuilt image with the project")
    s = sub.add_parser("server", help="run this workspace's Prefect server in the foreground")
    s.add_argument("--repo", default=".", help="workspace (its server state is in <repo>/.prefect)")
    s.add_argument("--stop", action="store_true", help="stop this workspace's server left running")
    a = p.parse_args(argv)
    try:
        if a.command == "server":
            if a.stop:
                stop_workspace_server(a.repo)
            else:
                run_workspace_server(a.repo)
            return 0
        kw = dict(
            timezone=a.timezone,
            retries=a.retries,
            retry_delay_seconds=a.retry_delay,
            timeout_seconds=a.timeout or None,
            training_stages=a.training_stages,
        )
        if a.command == "serve":
            serve_nightly(a.repo, a.cron, **kw)
        else:
            dep_id = deploy_nightly(a.repo, a.work_pool, a.cron, source=a.source, image=a.image, **kw)
            print(f"deployment {DEPLOYMENT_NAME!r} ({dep_id}) on work pool {a.work_pool!r}, cron {a.cron!r}")
    except (PrefectServerError, FileNotFoundError, ValueError, UserError) as e:
        message = " ".join(str(e).split())
        sys.stderr.write(f"error: {message[:400]}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
