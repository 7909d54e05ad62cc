"""Teacher-Forcing SFT: a causal student learns to denoise each chunk given the *clean* earlier chunks.

Diffusion-Forcing SFT's draws and loss (:mod:`distillery.methods.dfsft`: one table index per chunk, the
index-weighted per-frame flow-matching loss, caption dropout, ``precondition_outputs``), with one difference — the
forward: DFSFT's student sees every frame at its own noise level under the block-causal mask (its context is noisy),
TFSFT's sees the noisy video beside its clean copy
(:meth:`~distillery.models.base.CausalModelBase.predict_noise_teacher_forcing`): a chunk attends to its own noisy
frames and to the clean frames of every earlier chunk, the context it would hold while generating had it generated
the data exactly (the "teacher forcing" of autoregressive training; FastVideo 0.2.1's ``TeacherForcingSFTMethod``,
Causal Forcing's first stage). Gradients reach the weights through both halves of that forward.

The student must be a :class:`~distillery.models.base.CausalModelBase` (a bidirectional one is refused from the config,
before any weights load), text-to-video (an image-to-video student: one line), with ``chunk_size`` equal to the
method's. Its sampling contract is DFSFT's (many-step Euler, ``chunk_size`` in it): the artifact feeds ``distill`` as an
ODE-init student does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.methods.dfsft import DFSFTConfig, DFSFTMethod
from distillery.models.base import CausalModelBase, TrainingBatch


@dataclass
class TFSFTConfig(DFSFTConfig):
    """DFSFT's knobs: ``chunk_size`` (latent frames sharing one timestep: the student's chunk), the drawn index range,
    ``precondition_outputs``, ``caption_dropout``."""


class TFSFTMethod(DFSFTMethod):
    """DFSFT's draws and loss through the teacher-forcing forward (module doc)."""

    config_class = TFSFTConfig
    role_kinds = {"student": CausalModelBase}
    sequence_parallel = False  # its teacher-forcing forward is not checked under sequence parallelism yet
    tensor_parallel = False  # nor under tensor parallelism

    def __init__(self, config: TFSFTConfig, role_models: dict, training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        if self.causal.given_first_frame:
            raise UserError("config error: method: Teacher-Forcing SFT of an image-to-video student is not supported; "
                            "use DFSFT (dfsft) for it")

    @property
    def causal(self) -> CausalModelBase:
        """The student, typed as the causal model ``role_kinds`` made sure it is."""
        return self.student  # type: ignore[return-value]

    def predict(self, tb: TrainingBatch) -> torch.Tensor:
        """The velocity of the noisy latents with the batch's clean latents as the earlier chunks' context."""
        return self.causal.predict_noise_teacher_forcing(tb.noisy_latents, tb.timesteps, tb, tb.latents, conditional=True)
