"""Training components the engine composes: distributed setup, optimizers, precision, RNG, activation checkpointing,
timing, experiment tracking, and the sharded checkpoint (:mod:`~distillery.components.checkpoint`)."""
