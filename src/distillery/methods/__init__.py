"""Training methods: SFT, DFSFT (and the distillation methods of later stages)."""

from distillery.methods.base import StepOutput, TrainingMethod

__all__ = ["StepOutput", "TrainingMethod"]
