"""Test fixtures: offline environment, a session-wide tiny Wan base and latent set, and the session-wide pipeline
workspaces ``prepared`` (clips → base → latents) and ``trained`` (+ teacher) that tests copy (``workspace.copy_workspace``)."""

from __future__ import annotations

import atexit
import inspect
import os
import re
import shutil
import sys
import tempfile
import time
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

# diffusers copies a folder's own pipeline.py (trust_remote_code) into HF_MODULES_CACHE, read when diffusers is first
# imported: one shared folder would let two xdist workers (or two sessions) loading exports at once read each other's
# half-written copies — each test process gets its own, removed at exit
_MODULES = Path(tempfile.gettempdir()) / f"distillery-tests-hf-modules-{os.getpid()}"
os.environ.setdefault("HF_MODULES_CACHE", str(_MODULES))
atexit.register(shutil.rmtree, _MODULES, True)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.tinybase.tiny import make_tiny_base

    return make_tiny_base(tmp_path_factory.mktemp("base") / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan 2.2 A14B folder: two experts (``transformer``, ``transformer_2``), boundary_ratio 0.875."""
    from distillery.tinybase.wan22 import make_tiny_wan22

    return make_tiny_wan22(tmp_path_factory.mktemp("a14b") / "a14b", "a14b")


@pytest.fixture(scope="session")
def latent_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distillery.data.demo import make_demo_latents

    return make_demo_latents(tmp_path_factory.mktemp("latents") / "latents")


def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> tuple[Path, dict]:
    """``build(folder) -> facts`` run once per test run, its folder and facts returned to every caller.

    Alone, the folder is a fresh temp dir of this session. Under xdist (``-n 2``) it is one folder in
    the run's temp root, shared by the workers: the first worker to need it builds it while holding a
    lock, the others wait on the lock and reuse it (``built.json`` marks a finished build; a build a
    failed worker left half done is removed and made again). The workspaces built here are read-only
    for tests (each takes a copy), so sharing them changes nothing a test sees; it saves one build of
    each per extra worker (a `dvc repro` of several stages)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (folder := tmp_path_factory.mktemp(name)), build(folder)
    import fcntl
    import json
    import shutil

    folder = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    with open(folder.parent / f"shared-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this worker dies
        done = folder / "built.json"
        if done.is_file():
            return folder, json.loads(done.read_text())
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        facts = build(folder)
        done.write_text(json.dumps(facts))
        return folder, facts


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real git + DVC pipeline workspace (small params) where `dvc repro latents` ran: clips,
    base and latents are there. Read-only for tests: take a copy (``workspace.copy_workspace``);
    built once per run (:func:`_built_once`)."""
    from workspace import make_workspace, sh

    def build(folder: Path) -> dict:
        sh(["dvc", "repro", "latents"], make_workspace(folder / "ws"))
        return {}

    return _built_once(tmp_path_factory, "reliability", build)[0] / "ws"


@pytest.fixture(scope="session")
def trained(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``prepared`` + `dvc repro teacher` run to completion, uninterrupted (read-only: copy it; built
    once per run). ``workspace.TRAINED["seconds"]`` holds how long the teacher stage took."""
    from workspace import TRAINED, copy_workspace, sh

    def build(folder: Path) -> dict:
        repo = copy_workspace(prepared, folder / "ws")
        started = time.perf_counter()
        sh(["dvc", "repro", "teacher"], repo)
        return {"seconds": time.perf_counter() - started}

    folder, facts = _built_once(tmp_path_factory, "trained", build)
    TRAINED["seconds"] = facts["seconds"]
    return folder / "ws"


# The longest test files first: `-n 2 --dist loadfile` hands files to the two workers in the order of the
# collection, as each worker runs low on tests; a long file handed out last would run alone at the end.
# Longest-first keeps both workers busy until the end. The seconds each took in whole-suite runs on 2 cores,
# 2026-12-02: pipeline 600, stage_trust 480, stage_faults 330, flows 250, scale 170, dmd2 150, artifact_trust 110,
# roles 100, preprocess 85, slurm 85, distributed 80, training 75; the files added since, alone on 2 cores
# (2026-12-03; about 1.5× that in a whole-suite run): prompts_stage 270, ode_init_stage 165, given_teacher 90,
# lora_dag 90, stage_ema 65, ...; beside other agents on 2 cores (2026-12-03): wan22_dag 420, i2v_dag 500; the
# conformance kit, under heavy (2026-12-07): 350.
# Files not named here come next if any of their tests is marked slow (they run stages or torchrun: the long kind),
# then the rest; each group in collection order (see :func:`_file_rank`).
LONGEST_FIRST = ("tests/test_pipeline.py", "tests/test_model_parallel.py", "tests/test_i2v_dag.py",
                 "tests/reliability/test_stage_trust.py", "tests/reliability/test_stage_faults.py",
                 "tests/test_method_conformance.py",
                 "tests/test_prompts_stage.py", "tests/test_flows.py", "tests/test_ode_init_stage.py", "tests/test_scale.py",
                 "tests/test_dmd2.py", "tests/test_nft_runs.py", "tests/test_posttrain_dag.py", "tests/test_given_teacher.py", "tests/test_wan22_dag.py",
                 "tests/test_family_dag.py",
                 "tests/test_lora_dag.py", "tests/test_sp_stage.py",
                 "tests/reliability/test_artifact_trust.py", "tests/test_roles.py", "tests/test_stage_ema.py",
                 "tests/test_preprocess.py", "tests/reliability/test_slurm.py", "tests/test_distributed.py", "tests/test_training.py",
                 "tests/test_sparse_methods.py", "tests/test_a14b_dag.py", "tests/test_a14b_ranks.py")

def pytest_configure(config):
    """xdist (3.x) hands out the files of ``--dist loadfile`` sorted by their number of tests unless told not to,
    which would undo :data:`LONGEST_FIRST` (a file of few long tests, as test_stage_trust.py, would start last).
    (An earlier session turned this off again because test_killing_dvc_leaves_no_orphan failed in whole-suite runs:
    those runs were started under ``nohup``, and the stage took an ignored SIGHUP as "outlive dvc" — fixed in
    ``procutil.ancestors_to_watch``, tests/test_procutil.py; the order had nothing to do with it.)"""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_rank(items) -> dict[str, tuple[int, int]]:
    """Each test file's place in the hand-out order: ``(0, i)`` for the i-th of :data:`LONGEST_FIRST`, ``(1, 0)`` for
    another file with a test marked slow, ``(2, 0)`` for the rest."""
    root = Path(__file__).resolve().parent.parent
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    ranks: dict[str, tuple[int, int]] = {}
    for item in items:
        path = str(item.fspath)
        try:
            name = Path(path).resolve().relative_to(root).as_posix()
        except ValueError:
            name = path
        rank = (0, order[name]) if name in order else (1, 0) if item.get_closest_marker("slow") else (2, 0)
        ranks[path] = min(ranks.get(path, rank), rank)
    return ranks


# The fast tier (`-m "not slow and not process"`, README "Test") is the tests that take well under a second each: a test
# that starts one of these programs, builds `prepared`/`trained` or calls torch.compile is marked `process` (or slow).
PROCESS_PROGRAMS = re.compile(r"(python[0-9.]*|dvc|distillery|torchrun|prefect|bash|sh)")
SESSION_WORKSPACES = ("prepared", "trained")


def _in_fast_tier(item) -> bool:
    return item.get_closest_marker("slow") is None and item.get_closest_marker("process") is None


def _unmarked_workspace_users(items) -> list[str]:
    """The tests of the fast tier that use this file's session workspaces (a test module's own fixture of the same
    name, as test_lora.py's ``trained``, is not one)."""
    here = Path(__file__).resolve()
    found = []
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if _in_fast_tier(item) and any(name in defs and Path(inspect.getsourcefile(defs[name][-1].func)).resolve() == here
                                       for name in SESSION_WORKSPACES):
            found.append(item.nodeid)
    return found


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """A test of the fast tier that starts a python / dvc / distillery / torchrun / shell process or calls
    torch.compile fails, saying to mark it ``process``: the fast tier stays what its marker expression promises.
    (Session and module fixtures are set up before this one: only what the test itself starts is seen.)"""
    if not _in_fast_tier(request.node):
        return
    import subprocess

    import torch

    popen_init = subprocess.Popen.__init__

    def init(self, *a, **k):
        args = a[0] if a else k.get("args")
        first = args if isinstance(args, (str, bytes, os.PathLike)) else (list(args) or [""])[0]
        words = os.fsdecode(first).split()
        program = Path(words[0]).name if words else ""
        if PROCESS_PROGRAMS.fullmatch(program):
            pytest.fail(f"{request.node.nodeid} starts `{program}`: mark it @pytest.mark.process", pytrace=False)
        popen_init(self, *a, **k)

    def compile(*a, **k):
        pytest.fail(f"{request.node.nodeid} calls torch.compile: mark it @pytest.mark.process", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    monkeypatch.setattr(torch, "compile", compile)


def pytest_collection_modifyitems(session, config, items):
    if unmarked := _unmarked_workspace_users(items):
        raise pytest.UsageError("these tests use the session workspace `prepared`/`trained` but are marked neither "
                                "slow nor process: " + ", ".join(unmarked))
    ranks = _file_rank(items)
    items.sort(key=lambda item: ranks[str(item.fspath)])  # stable: within a file and within a group, collection order is kept
