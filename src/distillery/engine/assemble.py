"""Assemble a :class:`~distillery.engine.loop.Trainer` from a typed run config.

:func:`build_trainer` builds every part the trainer is handed, in the order the random draws and
collectives of a run depend on: the output folder checked (before any model is loaded), the global
seeds, the run (:func:`~distillery.engine.builder.build_run`: models → method → placement →
optimizers → callbacks), this rank's batches, the frozen roles' sources and the LoRA roles' bases (hashed once on rank 0),
the checkpoint manager and the metrics logger.
"""

from __future__ import annotations

from distillery.common.log import quiet_library_progress
from distillery.components.checkpoint.manager import CheckpointManager
from distillery.components.distributed import DistEnv, broadcast_object
from distillery.config.schema import RunConfig
from distillery.engine.batches import build_batches
from distillery.engine.builder import build_run, check_data_path, check_output_dir, seed_everything
from distillery.engine.loop import Trainer
from distillery.engine.run_log import RunLogger
from distillery.models.lora import lora_records


def build_trainer(config: RunConfig, env: DistEnv) -> Trainer:
    """The trainer of ``config`` on this rank (collective: every rank calls it)."""
    quiet_library_progress()
    t = config.training
    check_output_dir(t.checkpoint.output_dir)  # a plain mistake (a file, /dev/null) before any model is loaded
    seed_everything(t.loop.seed)
    run = build_run(config, env)
    # the data the method declared: collated latent batches, or prompt embeddings only
    batches = build_batches(check_data_path(t.data.path), t.data, t.loop.seed, env, with_latents=run.method.data_kind == "latents")
    frozen_sources = broadcast_object(run.method.frozen_sources() if env.is_main else None)
    lora = broadcast_object(lora_records(run.models) if env.is_main else None)
    checkpoints = CheckpointManager(t.checkpoint.output_dir, t.checkpoint.keep_last, env.rank, env.world_size)
    logger = RunLogger(t.checkpoint.output_dir, t.tracker, t.loop, env.is_main)
    return Trainer(config, env, run=run, batches=batches, checkpoints=checkpoints, logger=logger, frozen_sources=frozen_sources,
                   lora=lora)
