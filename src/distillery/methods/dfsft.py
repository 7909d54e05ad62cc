"""Diffusion-Forcing SFT: independent noise levels per chunk of latent frames (student only).

Each chunk of ``chunk_size`` latent frames gets one timestep, drawn as an index ``i`` into the
descending shifted timestep table (``FlowMatchSchedule.timestep_table``, n = 1000 entries) within
``[min_timestep_ratio·n, max_timestep_ratio·n)``. The per-frame MSE is weighted by
``w(i) = g(i) − min g`` with ``g(i) = exp(−2((i − n/2)/n)²)`` over all table indices ``i < n``,
scaled so that the mean of ``w`` over the table is 1. This trains the student for the mixed noise
levels of causal / streaming generation. With a causal student (a
:class:`~distillery.models.base.CausalModelBase`, whose ``chunk_size`` must equal the method's) the
artifact's sampling contract is Euler under the block-causal mask (``chunk_size`` in it).

A causal image-to-video student (``given_first_frame``): latent frame 0 is the given frame — its input is the
condition's clean latent of the frame (:func:`~distillery.models.base.given_first_latent`, what sampling writes to the
cache) at t = 0, it draws no timestep and is left out of the loss; the chunks of ``chunk_size`` start at frame 1 (a
clip of other than ``1 + k · chunk_size`` latent frames: one line). The noise is still drawn for the whole video. The
contract adds ``given_first_frame: true``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.methods.base import StepOutput, TrainingMethod, apply_caption_dropout, causal_contract, flow_matching_loss
from distillery.models.base import CausalModelBase, TrainingBatch, chunk_bounds, given_first_latent
from distillery.models.schedule import FlowMatchSchedule


@dataclass
class DFSFTConfig:
    chunk_size: int = bounded(3, 1, 1024)  # latent frames that share one timestep
    min_timestep_ratio: float = 0.0  # lowest table index drawn, as a fraction of the table
    max_timestep_ratio: float = 1.0  # highest table index drawn (exclusive), as a fraction
    precondition_outputs: bool = False  # loss on x0 instead of on the velocity
    caption_dropout: float = 0.0  # probability of the empty prompt per sample

    def __post_init__(self) -> None:
        check_fields(self, "method")  # the declared ranges, for a config built in Python
        if not 0.0 <= self.min_timestep_ratio < self.max_timestep_ratio <= 1.0:
            raise ValueError("need 0 <= min_timestep_ratio < max_timestep_ratio <= 1")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError("caption_dropout must be in [0, 1]")


def dfsft_index_weights(n: int) -> torch.Tensor:
    """``w(i)`` for i = 0 … n−1: ``g(i) − min g`` with ``g(i) = exp(−2((i − n/2)/n)²)``, mean 1."""
    i = torch.arange(n, dtype=torch.float64)
    g = torch.exp(-2.0 * ((i - n / 2) / n) ** 2)
    w = g - g.min()
    return (w / w.mean()).float()


def index_range(n: int, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """Half-open table index range ``[lo, hi)`` for the ratio bounds (at least one index)."""
    lo = int(math.floor(min_ratio * n))
    hi = min(n, int(math.ceil(max_ratio * n)))
    return lo, max(hi, lo + 1)


class DFSFTMethod(TrainingMethod):
    """SFT with per-chunk timesteps ``[B, T]`` and the table-index loss weighting above."""

    config_class = DFSFTConfig

    def __init__(self, config: DFSFTConfig, role_models: dict, training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        schedule: FlowMatchSchedule = self.student.schedule
        self.table = schedule.timestep_table()
        self.weights = dfsft_index_weights(len(self.table))
        self.index_lo, self.index_hi = index_range(len(self.table), config.min_timestep_ratio, config.max_timestep_ratio)
        if self.student.boundary_timestep is not None:  # one forward per video: its chunks would fall to both experts
            raise UserError("config error: models.student: a model of two experts (Wan 2.2 A14B); DFSFT draws one timestep "
                            "per chunk and a video's chunks would span both experts in one forward: not supported (train "
                            "its causal student by Self-Forcing, whose every call is one expert's)")
        chunk = getattr(self.student, "chunk_size", None) if isinstance(self.student, CausalModelBase) else None
        if chunk is not None and int(chunk) != config.chunk_size:
            raise UserError(f"config error: method.chunk_size {config.chunk_size} differs from models.student.chunk_size "
                            f"{chunk}: a causal student attends over the chunks DFSFT noises independently; make them equal")

    def sampling_contract(self) -> dict[str, Any]:
        """Many-step Euler; a causal student's contract adds its ``chunk_size`` (every frame denoised in
        step under the block-causal mask: one of the noise-level patterns DF trains on, and one
        forward per step — the chunk-by-chunk ``causal_streaming`` sampler also runs it)."""
        return {**super().sampling_contract(), **causal_contract(self.student)}

    def sample_frame_indices(self, batch_size: int, num_frames: int) -> torch.Tensor:
        """Table indices ``[B, T]``: one draw per chunk, repeated over the chunk's frames."""
        num_chunks = math.ceil(num_frames / self.config.chunk_size)
        chunk_idx = self.rng.randint(self.index_lo, self.index_hi, (batch_size, num_chunks))
        return chunk_idx.repeat_interleave(self.config.chunk_size, dim=1)[:, :num_frames]

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        latents = batch["latents"]
        b, c, t = latents.shape[:3]
        given = isinstance(self.student, CausalModelBase) and self.student.given_first_frame
        if given:
            chunk_bounds(int(t), self.config.chunk_size, True)  # a length that does not fit: one line
        skip = 1 if given else 0  # frame 0 of an I2V student is the given frame: no draw, no loss
        idx = self.sample_frame_indices(b, t - skip).to(self.student.device)
        table = self.table.to(self.student.device)
        timesteps = table[idx]  # [B, T − skip]
        if given:
            timesteps = torch.cat([torch.zeros_like(timesteps[:, :1]), timesteps], dim=1)  # the given frame at t = 0
        tb = self.student.prepare_batch(batch, self.rng, timesteps=timesteps)
        if given:
            tb.noisy_latents = torch.cat([given_first_latent(tb, int(c)), tb.noisy_latents[:, :, 1:]], dim=2)
        apply_caption_dropout(tb, self.config.caption_dropout, self.rng)
        return self.loss(tb, idx, skip)

    def loss(self, tb: TrainingBatch, idx: torch.Tensor, skip: int = 0) -> StepOutput:
        """The weighted loss of a prepared batch ``tb`` (its noise, per-frame timesteps and noisy latents drawn) whose
        frames after the first ``skip`` (given, not generated) were drawn at table indices ``idx`` ``[B, T − skip]``."""
        pred = self.predict(tb)
        per_frame = flow_matching_loss(pred, tb, self.config.precondition_outputs).mean(dim=(1, 3, 4))[:, skip:]  # [B, T − skip]
        weights = self.weights.to(per_frame.device)[idx]
        loss = (weights * per_frame).mean()
        return StepOutput(
            losses={"total_loss": loss, "flow_loss": per_frame.detach().mean()},
            metrics={"mean_timestep": tb.timesteps[:, skip:].float().mean().detach()},
        )

    def predict(self, tb: TrainingBatch) -> torch.Tensor:
        """The student's velocity of the batch's noisy latents ``[B, C, T, H, W]``: every frame at its own timestep
        under the student's attention (block-causal for a causal student)."""
        return self.student.predict_noise(tb.noisy_latents, tb.timesteps, tb, conditional=True)
