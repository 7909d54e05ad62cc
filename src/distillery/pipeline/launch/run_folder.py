"""A training stage's run folder, ``runs/<stage>/``: what it resumes, discards and writes first.

The trainer keeps its DCP checkpoints, log and summary there (not a DVC out), so that a killed stage
resumes. Before a launch, :func:`prepare_run_dir` writes the run config (``run.yaml``: the one the
trainer loads) and its resume key (:mod:`distillery.pipeline.launch.resume_key`); checkpoints made
from another config, other inputs or other code are discarded first (one line says what changed),
and only what runs of the stage wrote (:func:`discard_run`: the trainer's own outputs,
:func:`distillery.engine.run_log.trainer_outputs`, and the two files written here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from distillery.common.fsutil import write_text_atomic
from distillery.common.log import get_logger
from distillery.pipeline.launch.resume_key import KEY_FILE, folder_digest, key_mismatch, read_key, resume_key
from distillery.pipeline.publish.artifacts import RUNS

log = get_logger("stage")
RUN_CONFIG = "run.yaml"  # the run config the trainer loads (its digest is part of the resume key)
LOCK_FILE = ".lock"


def prepare_run_dir(stage: str, raw: dict[str, Any], inputs: dict[str, Path], world_size: int = 1) -> Path:
    """``runs/<stage>/run.yaml`` (``raw``: the run config as plain data) + ``resume_key.json``; returns
    the run.yaml path. Checkpoints made from another config, other inputs or other code are
    discarded (one line says what changed): a stage resumes only what the same inputs made
    (docs/reliability.md). An input's digest from the hash cache never discards them alone: it is
    re-read from the input's bytes first (:func:`rehashed_key`). A previous run's summary is
    removed, so the summary read after training is the one this launch wrote. Only what runs of the
    stage wrote is ever deleted (:func:`discard_run`); ``runs/<stage>`` as a symbolic link, or its
    lock file as a link, folder or FIFO, is one line, nothing touched."""
    from distillery.common.procutil import exclusive_lock
    from distillery.components.checkpoint.manager import list_checkpoints
    from distillery.engine.run_log import LOG_FILE, SUMMARY_FILE

    key = resume_key(stage, raw, inputs, world_size)
    run_dir = RUNS / stage
    if run_dir.exists():
        # a writer still alive there (an orphaned worker, another stage) must not lose its folder
        # under it
        with exclusive_lock(run_dir / LOCK_FILE, f"training output folder {run_dir}"):
            leftovers = list_checkpoints(run_dir) or any(run_dir.glob(".tmp-checkpoint-*")) or (run_dir / LOG_FILE).exists()
            saved = read_key(run_dir)
            why = key_mismatch(saved, key) if leftovers else None
            if why and saved:  # an input's digest may come from the hash cache: re-read it before discarding
                key = rehashed_key(stage, key, saved, inputs)
                why = key_mismatch(saved, key)
            if why:
                log.info("stage %s: not resuming %s (%s): starting from step 0", stage, run_dir, why)
                discard_run(run_dir)
            (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / KEY_FILE, json.dumps(key, indent=2, sort_keys=True))
    path = run_dir / RUN_CONFIG
    write_text_atomic(path, yaml.safe_dump(raw, sort_keys=True))
    return path


def discard_run(run_dir: Path) -> None:
    """Delete what runs of this stage wrote in ``run_dir`` — the trainer's outputs (its recorded
    checkpoints, killed saves' temp folders, its log, summary and checkpoint record), the run config
    and the resume key — and nothing else: a file or folder it did not write (or a symbolic link,
    whatever its name) is left alone, said in one warning line."""
    from distillery.engine.run_log import trainer_outputs

    files, folders = trainer_outputs(run_dir)
    files |= {KEY_FILE, RUN_CONFIG}
    left = []
    for child in sorted(run_dir.iterdir()):
        if child.name == LOCK_FILE:
            continue
        if child.is_symlink():
            left.append(child.name)
        elif child.is_dir() and child.name in folders:
            shutil.rmtree(child)
        elif child.is_file() and child.name in files:
            child.unlink()
        else:
            left.append(child.name)
    if left:
        log.warning("%s holds %d entr%s this stage did not write (%s): left alone", run_dir, len(left),
                    "y" if len(left) == 1 else "ies", ", ".join(left[:5]) + (", …" if len(left) > 5 else ""))


def rehashed_key(stage: str, key: dict[str, str], saved: dict[str, str], inputs: dict[str, Path]) -> dict[str, str]:
    """``key`` with each input whose digest differs from ``saved`` re-hashed from its files' bytes,
    not taken from the hash cache; a cached digest that was wrong is corrected in the cache and
    reported in one warning line."""
    from distillery.common import hashcache

    changed = {role: folder for role, folder in inputs.items() if saved.get(f"input:{role}") != key.get(f"input:{role}")}
    before = len(hashcache.CORRECTED)
    with hashcache.from_bytes():
        fresh = {f"input:{role}": folder_digest(folder) for role, folder in sorted(changed.items())}
    wrong = hashcache.CORRECTED[before:]
    if wrong:
        log.warning("stage %s: the hash cache held a wrong digest for %d input file(s) (first: %s); re-hashed from "
                    "their bytes and corrected in the cache", stage, len(wrong), wrong[0])
    return {**key, **fresh}
