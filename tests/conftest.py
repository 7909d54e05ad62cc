"""Test fixtures: offline environment, a session-wide tiny Wan base and latent set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distillery.common.offline import OFFLINE_ENV  # noqa: E402

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


# The longest test files first: `-n 2 --dist loadfile` hands files to the two workers in collection order, so a long
# file collected last (test_pipeline.py sorts late) would run alone at the end. Longest-first keeps both workers busy
# until the end (minutes measured on 2 cores; the rest keep their order).
LONGEST_FIRST = ("tests/test_pipeline.py", "tests/reliability/test_stage_trust.py", "tests/test_flows.py",
                 "tests/reliability/test_stage_faults.py", "tests/test_dmd2.py", "tests/test_preprocess.py",
                 "tests/test_distributed.py", "tests/test_roles.py", "tests/test_training.py")


def pytest_collection_modifyitems(session, config, items):
    root = Path(__file__).resolve().parent.parent
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> int:
        try:
            return order.get(Path(str(item.fspath)).resolve().relative_to(root).as_posix(), len(order))
        except ValueError:
            return len(order)

    items.sort(key=rank)  # stable: within a file and among the rest, collection order is kept
