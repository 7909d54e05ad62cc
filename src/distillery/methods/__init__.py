"""Training methods, each a ``_target_`` of a run config's ``method``: :mod:`.sft` (flow-matching SFT), :mod:`.dfsft`
(Diffusion-Forcing SFT of a causal student), :mod:`.kd` (knowledge distillation onto a teacher's ODE trajectories:
ODE-init), :mod:`.dmd2` (DMD2), :mod:`.self_forcing` (Self-Forcing: DMD2 on the causal student's own rollouts),
:mod:`.pdd` (parallel-decoding distillation) and :mod:`.dm_pdd` (PDD with a distribution-matching term)."""

from distillery.methods.base import StepOutput, TrainingMethod

__all__ = ["StepOutput", "TrainingMethod"]
