"""Knowledge distillation (ODE-init): the student regresses each point of the teacher's ODE trajectory onto its end.

The data is a trajectory set (:mod:`distillery.sampling.trajectories`): a latent set whose every row holds
the K + 1 points of one teacher ODE trajectory (the teacher's many-step Euler with CFG, from pure noise)
stacked along the channel axis, point-major: ``latents [(K + 1)·C, T, H, W]`` = ``x_{t_0}, …,
x_{t_{K−1}}, x_0`` for ``t_list = [t_0 > t_1 > … > t_{K−1} > t_K = 0]`` — the states at the first K
timesteps, then the trajectory's clean end point.

Per micro-batch (``B`` samples, ``T`` latent frames), one draw ``k ∈ [0, K)`` of a trajectory point:

- **causal student** (a :class:`~distillery.models.base.CausalModelBase`, ``chunk_size`` set and equal
  to the student's): one ``k`` per sample and chunk of ``chunk_size`` latent frames (the last chunk may be
  shorter); frame ``f`` of the input is frame ``f`` of the state at ``t_{k(chunk of f)}``, its timestep
  ``t_{k(chunk of f)}`` (per-frame timesteps ``[B, T]``), attended block-causally in one forward — the
  noise-level patterns of causal generation, as FastVideo's ``KDCausalMethod`` (per-sample, per-block
  draws) and CausVid's ODE regression;
- **bidirectional student** (``chunk_size`` null): one ``k`` per sample, timestep ``t_k`` ``[B]``. FastVideo's
  ``KDMethod`` draws one ``k`` for the whole batch; one per sample here, on purpose (the same expectation,
  lower variance per step).

The student's ``x̂0 = x_t − σ v(x_t, t)`` (σ = t / num_train_timesteps, the conditional prompt: no CFG —
the guidance is in the trajectories) and the loss ``½ · mean_{B,C,T,H,W} (x̂0 − x_0)²`` in float32 — the ½
as FastVideo's KD (``0.5 * mse_loss``): its gradient is ``(x̂0 − x_0) / numel``.

Draws come from ``self.rng`` (:class:`~distillery.components.rng.BatchRNG`): ``randint(0, K, (B,
chunks))``, one per sample (or per sample and chunk), independent of the number of ranks.

**Image-to-video** (the set's rows carry the teacher's first-frame condition and image embeddings,
:mod:`~distillery.sampling.trajectories`): the student is conditioned on them (a set without them for an I2V
student: one line). A causal I2V student (``given_first_frame``) takes latent frame 0 as the given frame — its input
the condition's clean latent (:func:`~distillery.models.base.given_first_latent`) at t = 0 whatever the trajectory's
frame 0 is, no point drawn for it, left out of the loss (the mean runs over frames 1 …) —, and its chunks start at
frame 1 (a length other than ``1 + k · chunk_size``: one line).

The artifact's sampling contract is DFSFT's (many-step Euler; a causal student's under the block-causal
mask, ``chunk_size`` in it), so validate scores it as it scores the DFSFT student; its few-step use is as
the init of ``distill`` (Self-Forcing or DMD2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.config.schema import t_list_problem
from distillery.methods.base import StepOutput, TrainingMethod, causal_contract
from distillery.models.base import CausalModelBase, Conditioning, chunk_bounds, given_first_latent

DEFAULT_T_LIST = (999.0, 937.0, 833.0, 624.0, 0.0)  # the Self-Forcing paper's ODE-init points (48 teacher steps, shift 5)


@dataclass
class KDConfig:
    t_list: list[float] = field(default_factory=lambda: list(DEFAULT_T_LIST))  # trajectory points, descending, ending at 0
    chunk_size: int | None = None  # a causal student's chunk (frames sharing one point); null: a bidirectional student

    def __post_init__(self) -> None:
        self.t_list = [float(t) for t in self.t_list]
        problem = t_list_problem(self.t_list)
        if problem:
            raise ValueError(f"t_list {self.t_list}: {problem}")
        if self.chunk_size is not None:
            if int(self.chunk_size) < 1:
                raise ValueError(f"chunk_size must be >= 1 or null, got {self.chunk_size}")
            self.chunk_size = int(self.chunk_size)


def kd_loss(pred_x0: torch.Tensor, target_x0: torch.Tensor) -> torch.Tensor:
    """``½ · mean (x̂0 − x_0)²`` over every element, in float32 (module doc)."""
    return 0.5 * torch.mean((pred_x0.float() - target_x0.float()) ** 2)


def split_points(latents: torch.Tensor, num_points: int) -> torch.Tensor:
    """A trajectory batch ``[B, (K + 1)·C, T, H, W]`` as ``[B, K + 1, C, T, H, W]`` (a view; point-major)."""
    b, channels = int(latents.shape[0]), int(latents.shape[1])
    if channels % num_points:
        raise UserError(f"training.data: rows of {channels} channels are not {num_points} stacked trajectory points "
                        f"(method.t_list has {num_points}); point it at a trajectory set made with this t_list")
    return latents.reshape(b, num_points, channels // num_points, *latents.shape[2:])


class KDMethod(TrainingMethod):
    """Regression of the teacher's ODE trajectories onto their end points (module doc)."""

    config_class = KDConfig

    def __init__(self, config: KDConfig, role_models: dict, training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        causal = isinstance(self.student, CausalModelBase)
        n = self.student.schedule.num_train_timesteps
        if max(config.t_list) > n:
            raise UserError(f"config error: method.t_list: {config.t_list} exceeds the student's {n} train timesteps")
        if causal and self.student.boundary_timestep is not None:
            raise UserError("config error: models.student: a causal model of two experts (Wan 2.2 A14B); KD gives each "
                            "chunk its own trajectory point and a video's chunks would span both experts in one forward: "
                            "not supported (a bidirectional student of two experts takes KD)")
        if causal and config.chunk_size is None:
            raise UserError("config error: method.chunk_size: the student is causal; set it to the student's chunk_size "
                            f"({self.student.chunk_size})")
        if causal and int(self.student.chunk_size) != config.chunk_size:
            raise UserError(f"config error: method.chunk_size {config.chunk_size} differs from models.student.chunk_size "
                            f"{self.student.chunk_size}: the frames of a chunk share one trajectory point; make them equal")
        if not causal and config.chunk_size is not None:
            raise UserError("config error: method.chunk_size: the student is bidirectional (one trajectory point per "
                            "sample); set it to null, or make the student a causal model")
        self.points = len(config.t_list)  # K + 1

    def sampling_contract(self) -> dict[str, Any]:
        """DFSFT's: many-step Euler; a causal student's adds its ``chunk_size`` (and ``given_first_frame``), module doc."""
        return {**super().sampling_contract(), **causal_contract(self.student)}

    def draw_points(self, batch_size: int, num_frames: int) -> torch.Tensor:
        """Point indices ``[B, T]`` in ``[0, K)``: one draw per sample and chunk (causal), or per sample
        (bidirectional), repeated over the frames it covers."""
        k = self.points - 1
        chunk = self.config.chunk_size or num_frames
        draws = self.rng.randint(0, k, (batch_size, math.ceil(num_frames / chunk)))
        return draws.repeat_interleave(chunk, dim=1)[:, :num_frames]

    def inputs(self, trajectory: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's input ``x_t [B, C, T, H, W]`` and timesteps (``[B, T]`` causal, ``[B]``
        bidirectional) for the point indices ``index [B, T]`` of ``trajectory [B, K + 1, C, T, H, W]``."""
        b, _, c, t, h, w = trajectory.shape
        gather = index[:, None, None, :, None, None].expand(b, 1, c, t, h, w)
        x_t = torch.gather(trajectory, 1, gather).squeeze(1)
        steps = torch.tensor(self.config.t_list, dtype=torch.float32, device=index.device)[index]
        return x_t, (steps if self.config.chunk_size is not None else steps[:, 0])

    def conditioning(self, batch: dict[str, Any]) -> Conditioning:
        """The prompt (conditional only: no CFG here) and, an image-to-video set, the rows' first-frame condition and
        image embeddings; a set without them for an image-to-video student is a one-line :class:`UserError`."""
        device = self.student.device

        def moved(key: str) -> torch.Tensor | None:
            value = batch.get(key)
            return None if value is None else value.to(device, non_blocking=True).float()

        cond = Conditioning(moved("text_embeds"), first_frame=moved("first_frame"), image_embeds=moved("image_embeds"))
        if getattr(self.student, "image_conditioning", None) is not None and cond.first_frame is None:
            raise UserError(f"training.data: {self.training.data.path}: trajectories without first frames for an "
                            "image-to-video student; make them again from the image-to-video latents (the stage's "
                            "trajectories carry each row's first-frame condition and image embeddings)")
        return cond

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        device = self.student.device
        cond = self.conditioning(batch)
        trajectory = split_points(batch["latents"], self.points).to(device, non_blocking=True).float()
        b, c, t = int(trajectory.shape[0]), int(trajectory.shape[2]), int(trajectory.shape[3])
        given = isinstance(self.student, CausalModelBase) and self.student.given_first_frame
        if given:
            chunk_bounds(t, int(self.config.chunk_size), True)  # a length that does not fit: one line
            index = self.draw_points(b, t - 1).to(device)
            index = torch.cat([torch.zeros_like(index[:, :1]), index], dim=1)  # frame 0's point: replaced below
        else:
            index = self.draw_points(b, t).to(device)
        x_t, timesteps = self.inputs(trajectory, index)
        target = trajectory[:, -1]
        if given:  # the given frame: its clean latent at t = 0, out of the loss
            x_t = torch.cat([given_first_latent(cond, c), x_t[:, :, 1:]], dim=2)
            timesteps = torch.cat([torch.zeros_like(timesteps[:, :1]), timesteps[:, 1:]], dim=1)
        pred = self.student.predict_x0(x_t, timesteps, cond, conditional=True)
        loss = kd_loss(pred[:, :, 1:], target[:, :, 1:]) if given else kd_loss(pred, target)
        return StepOutput(losses={"total_loss": loss, "kd_loss": loss.detach()},
                          metrics={"kd_point": index.float().mean().detach(), "mean_timestep": timesteps.float().mean().detach()})
