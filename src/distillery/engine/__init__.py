"""The training engine: what turns a typed run config into trained, checkpointed weights.

- :mod:`~distillery.engine.loop` — the trainer (gradient accumulation, callbacks, one host sync per step);
- :mod:`~distillery.engine.builder` — role models → method → placement/sharding → optimizers → callbacks;
- :mod:`~distillery.components.optim` — per-role optimizer and LR-schedule factory;
- :mod:`~distillery.components.checkpoint` — DCP checkpoints, their host state, checksums and trust rules;
- :mod:`~distillery.components.distributed`, :mod:`~distillery.components.precision` — ranks, FSDP2, compute copies;
- :mod:`~distillery.components.rng` — the rank-independent random stream; :mod:`~distillery.components.tracking` — MLflow.

Nothing here imports DVC or Prefect (the pipeline adapts the engine, never the reverse).
"""
