"""Test fixtures: offline environment, a session-wide tiny Wan base and latent set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.base.tiny import make_tiny_base

    return make_tiny_base(tmp_path_factory.mktemp("base") / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def latent_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.data.demo import make_demo_latents

    return make_demo_latents(tmp_path_factory.mktemp("latents") / "latents")
