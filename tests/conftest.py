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


# The longest test files first: `-n 2 --dist loadfile` hands files to the two workers in the order of the
# collection, as each worker runs low on tests; a long file handed out last would run alone at the end.
# Longest-first keeps both workers busy until the end (the seconds each took in whole-suite runs on 2 cores,
# 2026-12-02: pipeline 600, stage_trust 480, stage_faults 330, flows 250, scale 170, dmd2 150, artifact_trust 110,
# roles 100, preprocess 85, slurm 85, distributed 80, training 75, preflight_space 40; the rest keep their order).
LONGEST_FIRST = ("tests/test_pipeline.py", "tests/reliability/test_stage_trust.py", "tests/reliability/test_stage_faults.py",
                 "tests/test_flows.py", "tests/test_scale.py", "tests/test_dmd2.py", "tests/reliability/test_artifact_trust.py",
                 "tests/test_roles.py", "tests/test_preprocess.py", "tests/reliability/test_slurm.py", "tests/test_distributed.py",
                 "tests/test_training.py", "tests/test_preflight_space.py")


def pytest_configure(config):
    """xdist (3.x) hands out the files of ``--dist loadfile`` sorted by their number of tests unless told not to,
    which would undo :data:`LONGEST_FIRST` (a file of few long tests, as test_stage_trust.py, would start last).
    (An earlier session turned this off again because test_killing_dvc_leaves_no_orphan failed in whole-suite runs:
    those runs were started under ``nohup``, and the stage took an ignored SIGHUP as "outlive dvc" — fixed in
    ``procutil.ancestors_to_watch``, tests/test_procutil.py; the order had nothing to do with it.)"""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    root = Path(__file__).resolve().parent.parent
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> int:
        try:
            return order.get(Path(str(item.fspath)).resolve().relative_to(root).as_posix(), len(order))
        except ValueError:
            return len(order)

    items.sort(key=rank)  # stable: within a file and among the rest, collection order is kept
