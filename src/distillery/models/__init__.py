"""Model plugins: one role's transformer and noise schedule behind :class:`ModelBase`."""

from distillery.models.base import ModelBase, TrainingBatch
from distillery.models.schedule import FlowMatchSchedule

__all__ = ["FlowMatchSchedule", "ModelBase", "TrainingBatch"]
