"""``distillery stage <name>``: run one pipeline stage = params.yaml → work → ``artifacts/<name>/``.

Around every stage (:func:`run_stage`): ``params.yaml`` is validated whole first; the stage reads
only the params its ``dvc.yaml`` entry lists
(:class:`distillery.pipeline.params.reader.StageParams`); one writer per stage (a lock in
``runs/.locks/``); the stage dies with the process that started it; the output folders are checked
for writability and room before any work; a disk error becomes one line; a failure leaves the
previous artifact as it was (:mod:`distillery.pipeline.publish.artifacts`).

The stages are a table of dotted paths (:data:`STAGES`): each names its adapter, a module of the
workspace's top-level ``stages/`` package (beside ``dvc.yaml`` and ``params.yaml``), imported by
name only when its stage runs (:func:`stage_function`): a stage's process imports its own adapter
and nothing of the others', so its ``dvc.yaml`` code deps are only what it runs (and the recipes'
knob declarations, read to check ``params.yaml`` whole: :mod:`distillery.pipeline.params.recipes`).
Nothing else of ``distillery`` imports ``stages``: the library and this package stay importable
without a workspace.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path

from distillery.common import hashcache
from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind
from distillery.common.log import get_logger
from distillery.pipeline.params.reader import Params, StageParams
from distillery.pipeline.params.recipes import find_module
from distillery.pipeline.params.schema import TRAINING_STAGES
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS, keep_only

log = get_logger("stage")
HASH_CACHE_FILE = ".hash_cache.json"  # in runs/: the workspace's hash cache (distillery.common.hashcache)

# stage -> "module:function" of the workspace's ``stages/`` package that runs it with the stage's
# params (a training
# stage's also takes its table row's name)
STAGES: dict[str, str] = {
    "clips": "stages.clips:stage_clips",
    "base": "stages.base:stage_base",
    "latents": "stages.latents:stage_latents",
    "prompts": "stages.prompts:stage_prompts",
    **{name: "stages.training:run_training_stage" for name in TRAINING_STAGES},
    "validate": "stages.validate:stage_validate",
    "export": "stages.export:stage_export",
}
# stages whose staging folder's ``data/`` holds finished shards a rerun keeps (each written by rename, its record last;
# :func:`distillery.pipeline.publish.artifacts.resumable_staging`): a killed run's are not encoded again
KEEPS_SHARDS = ("latents", "prompts")


def find_stage(name: str, workspace: Path = Path(".")) -> str:
    """Put ``workspace`` (the folder holding ``dvc.yaml`` and ``params.yaml``) first on ``sys.path``
    and check that its ``stages/`` package has the adapter module of stage ``name`` (found, not
    run); return the module's name. None there (run outside a workspace) is one line
    (:class:`UserError`)."""
    return find_module(STAGES[name].split(":")[0], workspace, f"stage {name}")


def stage_function(name: str, workspace: Path = Path(".")) -> Callable[[StageParams], None]:
    """Import the adapter module of stage ``name`` (only it) from ``workspace``'s ``stages/`` package
    (:func:`find_stage`) and return its ``fn(params)``."""
    fn = getattr(importlib.import_module(find_stage(name, workspace)), STAGES[name].split(":")[1])
    return functools.partial(fn, name) if name in TRAINING_STAGES else fn


def _orphaned(stage: str) -> None:
    """The process that started this stage (dvc, a Prefect task, a shell) is gone: stop now, and
    the launcher and its workers with us (they die with their parent)."""
    log.warning("stage %s: the process that started it is gone: stopping (a rerun resumes)", stage)
    from distillery.pipeline.launch.launcher import kill_children

    kill_children()  # a training stage's launch: its workers die with it (checkpoints are atomic: nothing half-written)
    os._exit(143)


def cleanup_failed(stage: str, keep_shards: bool = False) -> None:
    """Remove what a failed run of ``stage`` left half-written beside its artifact — with ``keep_shards`` (a run that
    was stopped, not refused), the finished shards a :data:`KEEPS_SHARDS` stage keeps in ``<stage>.tmp/data`` aside."""
    staging = ARTIFACTS / f"{stage}.tmp"
    if not (keep_shards and stage in KEEPS_SHARDS and keep_only(staging, "data")):
        shutil.rmtree(staging, ignore_errors=True)
    for old in ARTIFACTS.glob(f".{stage}.old-*"):
        shutil.rmtree(old, ignore_errors=True)


def end_stopped_runs(stage: str, params_path: str) -> None:
    """A stage stopped by SIGTERM: its MLflow runs still ``RUNNING`` under this pipeline run (a worker killed before it
    could say so) are ended ``KILLED``, said in one line; a store that cannot be written is one warning, nothing more."""
    from distillery.pipeline.publish.mlflow_runs import end_running_stage_runs

    try:
        ended = end_running_stage_runs(stage, Path(params_path).read_text())
    except Exception as exc:  # noqa: BLE001 - the stop is the outcome: MLflow's trouble is only worth a line
        log.warning("stage %s: stopped; its MLflow runs could not be marked KILLED (%s)", stage, " ".join(str(exc).split())[:200])
        return
    if ended:
        log.info("stage %s: stopped; MLflow run(s) %s marked KILLED (a rerun resumes)", stage, ", ".join(ended))


_CACHE_SET_HERE: str | None = None  # the cache path this process put in the environment, if any


def _use_workspace_hash_cache() -> None:
    """Hash once: digests of unchanged files are reused across stages (and by the trainers a stage
    launches) through ``runs/.hash_cache.json`` of the current workspace — unless the user's
    environment names another cache file. Something there that is not a regular file (a FIFO, a
    folder) turns the cache off for this stage and its trainers, said in one warning line."""
    global _CACHE_SET_HERE
    if os.environ.get(hashcache.ENV_VAR) not in (None, _CACHE_SET_HERE):
        return
    path = (RUNS / HASH_CACHE_FILE).resolve()
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # absent (created on first write) or unreachable (its writer says so)
    if mode is not None and not stat.S_ISREG(mode):
        log.warning("hash cache %s is %s, not a regular file: ignored, every digest is read from the files "
                    "(remove it to get a cache again)", path, file_kind(mode))
        os.environ.pop(hashcache.ENV_VAR, None)
        _CACHE_SET_HERE = None
        return
    _CACHE_SET_HERE = str(path)
    os.environ[hashcache.ENV_VAR] = _CACHE_SET_HERE


def run_stage(name: str, params_path: str = "params.yaml") -> int:
    """Run one stage: one writer at a time, dies with whoever started it, checked for room before
    working, and on any failure leaves the previous ``artifacts/<name>`` as it was."""
    from distillery.common.procutil import AncestorWatch, Stopped, exclusive_lock, stop_on_sigterm
    from distillery.pipeline.dvcfile import stage_params
    from distillery.pipeline.launch.preflight import (
        check_batch,
        check_free_space,
        check_memory,
        check_own_folders,
        check_paths,
        check_recipe_families,
        check_workspace_path,
        check_writable,
        disk_error,
    )
    from distillery.pipeline.launch.sparse_preflight import check_attention

    if name not in STAGES:
        raise UserError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
    params = Params.load(params_path)
    check_workspace_path(name)  # SQLite (MLflow's store) cannot open a path past ~500 bytes
    check_paths(params, name, tuple(STAGES))  # the folders params.yaml names, as the stages reading them will (this one and later)
    check_recipe_families(params, name, tuple(STAGES))  # a recipe the base's family builds no student for (this one and later)
    check_memory(name, params)  # from the params (and the latent set's counts) alone: before anything is touched
    check_batch(name, params, ARTIFACTS, stages=tuple(STAGES)[tuple(STAGES).index(name):])  # this and every later training stage
    check_attention(params, name, tuple(STAGES))  # a sparse student this or a later stage cannot train: one line now
    declared = StageParams(params, name, stage_params(name))
    if name == "distill":  # a chain that runs but is no recipe (DMD2 from the causal DFSFT student): said in one line
        from distillery.pipeline.params.recipes import chain_notes

        for note in chain_notes(params.typed, params.recipes):
            log.warning("stage %s: %s", name, note)
    workspace = Path(params_path).parent
    find_stage(name, workspace)  # its adapter is there (a workspace's stages/), before anything is written
    _use_workspace_hash_cache()
    # under `nohup` the stage outlives the user's shell, never the program that runs it (dvc, a
    # Prefect worker)
    watch = AncestorWatch(lambda: _orphaned(name), hangup_ignored=signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)
    watch.start()
    try:
        check_own_folders(name, ARTIFACTS, RUNS, name in TRAINING_STAGES)  # no link where it writes or cleans up
        check_writable([ARTIFACTS, RUNS / ".locks"] + ([RUNS] if name in TRAINING_STAGES else []), name)
        with exclusive_lock(RUNS / ".locks" / f"{name}.lock", f"stage {name}"):
            cleanup_failed(name, keep_shards=True)  # what a killed earlier run of this stage left half-written
            check_free_space(name, params, ARTIFACTS, RUNS)
            try:
                with stop_on_sigterm():  # stopped: the launch's workers stop, finished shards are kept, MLflow is told
                    stage_function(name, workspace)(declared)
            except BaseException as exc:
                cleanup_failed(name, keep_shards=not isinstance(exc, Exception))  # stopped (a signal): shards kept
                if isinstance(exc, Stopped):
                    end_stopped_runs(name, params_path)
                problem = disk_error(name, exc) if isinstance(exc, Exception) else None
                if problem is None:
                    raise
                raise problem from None
    finally:
        watch.stop()
    stats = hashcache.STATS
    log.info("stage %s: hashed %.1f MiB (%d files) from disk, reused %.1f MiB (%d files) from the hash cache", name,
             stats.read_bytes / 2**20, stats.files_read, stats.cached_bytes / 2**20, stats.files_cached)
    log.info("stage %s done: %s", name, ARTIFACTS / name)
    return 0
