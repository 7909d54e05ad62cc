"""Prefect flows built from ``dvc.yaml`` (docs/architecture.md §1): the pipeline's one DAG, observable.

- :mod:`distillery.pipeline.dvcfile` (not here: the stages read it too) — parse ``dvc.yaml`` into
  :class:`~distillery.pipeline.dvcfile.StageSpec` s and dependency levels (no Prefect import).
- :mod:`flows.dag` — the ``distillery-pipeline`` flow: one task per DVC stage, each running
  ``dvc repro --single-item <stage>``, with retries, timeouts and Prefect artifacts.
- :mod:`flows.deploy` — the cron-scheduled ``nightly`` deployment (local serve or a work pool).
- :mod:`flows.server` — the Prefect API a schedule needs: ``PREFECT_API_URL``, else this
  workspace's own persistent server (``<repo>/.prefect/``), started and stopped around ``serve``.

Importing this package sets (only where unset) the offline/quiet environment that TOOLCHAIN.md
asks every process to have (:data:`distillery.common.offline.OFFLINE_ENV`, plus the Prefect server's
start-up timeout); it must happen before Prefect is imported, which reads its settings from the
environment at import time.
"""

from __future__ import annotations

import os

from distillery.common.offline import OFFLINE_ENV

QUIET_ENV: dict[str, str] = {**OFFLINE_ENV, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}

for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)

__all__ = ["QUIET_ENV"]
