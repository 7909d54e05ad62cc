"""The training engine: what turns a typed run config into trained, checkpointed weights.

- :mod:`~distillery.engine.loop` — the trainer (gradient accumulation, callbacks, one host sync per step, checkpoints);
- :mod:`~distillery.engine.assemble` — ``build_trainer``: the run, its batches, checkpoint manager and logger, handed to it;
- :mod:`~distillery.engine.builder` — role models → method → placement/sharding → optimizers → callbacks;
- :mod:`~distillery.engine.batches` — a rank's resumable training batches (with the empty-prompt embedding);
- :mod:`~distillery.engine.step_metrics` — a step's metrics to the host: one copy per step, read one step late;
- :mod:`~distillery.engine.nonfinite` — NaN/Inf losses and grad norms: skipped within a budget, else the run stops;
- :mod:`~distillery.engine.run_log` — the run's metrics: ``train_log.jsonl``, MLflow, the progress line, ``run_summary.json``;
- :mod:`~distillery.components.optim` — per-role optimizer and LR-schedule factory;
- :mod:`~distillery.components.checkpoint` — DCP checkpoints, their host state, checksums and trust rules;
- :mod:`~distillery.components.distributed`, :mod:`~distillery.components.precision` — ranks, FSDP2, compute copies;
- :mod:`~distillery.components.rng` — the rank-independent random stream; :mod:`~distillery.components.tracking` — MLflow.

Nothing here imports DVC or Prefect (the pipeline adapts the engine, never the reverse).
"""
