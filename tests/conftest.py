"""Test fixtures: offline environment, a session-wide tiny Wan base and latent set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distillery.offline import OFFLINE_ENV  # noqa: E402

for _k, _v in {
    **OFFLINE_ENV,
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.tinybase.tiny import make_tiny_base

    return make_tiny_base(tmp_path_factory.mktemp("base") / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def latent_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.data.demo import make_demo_latents

    return make_demo_latents(tmp_path_factory.mktemp("latents") / "latents")
