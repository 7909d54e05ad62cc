"""The offline, quiet environment every distillery process runs in (TOOLCHAIN.md): the one definition.

No downloads (Hugging Face hub offline), no telemetry (MLflow, DVC, Prefect, HF). Set only where
unset, so a user may still override any of them. The ``distillery`` CLI applies it around every
command (:func:`distillery.cli.guard.run_guarded`), the Prefect flows when ``flows`` is imported (before
Prefect reads its settings), the test suite at start.
"""

from __future__ import annotations

import os

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def set_offline_env() -> None:
    """Put :data:`OFFLINE_ENV` into ``os.environ`` where a variable is not set yet."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
