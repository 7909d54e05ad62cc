"""Rectified-flow noise schedule shared by every model and sampler.

Conventions (DESIGN.md §4): ``x_t = (1 − σ) x0 + σ ε``, velocity ``v = ε − x0``,
``x0 = x_t − σ v``. Timesteps live in ``[0, num_train_timesteps]`` and ``σ = t / num_train_timesteps``
after the shift ``σ' = s·σ / (1 + (s − 1)·σ)`` has been applied. One shift per model, read from its
scheduler config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from distillery.errors import UserError

if TYPE_CHECKING:
    from distillery.engine.rng import BatchRNG


@dataclass(frozen=True)
class FlowMatchSchedule:
    shift: float = 1.0  # σ-shift s (Wan 2.1 T2V: 3.0 at 480p, 5.0 at 720p)
    num_train_timesteps: int = 1000  # timesteps are σ × this

    def shift_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """Apply the shift to unshifted σ ∈ [0, 1] (any shape)."""
        s = self.shift
        return s * sigma / (1.0 + (s - 1.0) * sigma)

    def sigma(self, timesteps: torch.Tensor) -> torch.Tensor:
        """σ ∈ [0, 1] for timesteps ∈ [0, num_train_timesteps] (same shape, float32)."""
        return timesteps.float() / self.num_train_timesteps

    def timestep_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Descending shifted timesteps ``[n]``: entry i is ``n · shift((n − i) / n)`` (i = 0 … n−1).

        This is the training grid of diffusers' FlowMatchEulerDiscreteScheduler: index 0 is pure
        noise (t = n), the last index the cleanest level.
        """
        n = self.num_train_timesteps
        unshifted = (n - torch.arange(n, dtype=torch.float64, device=device)) / n
        return (self.shift_sigma(unshifted) * n).float()

    def sample_sigmas(
        self,
        batch_size: int,
        rng: "BatchRNG",
        mode: Literal["uniform", "logit_normal"] = "uniform",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
    ) -> torch.Tensor:
        """Draw shifted σ ``[batch_size]`` (float32, on the generator's device)."""
        if mode == "uniform":
            u = rng.rand((batch_size,))
        elif mode == "logit_normal":
            u = torch.sigmoid(logit_mean + logit_std * rng.randn((batch_size,)))
        else:  # pragma: no cover - guarded by the config Literal
            raise ValueError(f"unknown timestep sampling {mode!r}")
        return self.shift_sigma(u)

    @staticmethod
    def broadcast(sigma: torch.Tensor, ndim: int = 5) -> torch.Tensor:
        """Reshape σ ``[B]`` → ``[B,1,1,1,1]`` or per-frame ``[B,T]`` → ``[B,1,T,1,1]`` for ``[B,C,T,H,W]``."""
        if sigma.ndim == 1:
            return sigma.view(-1, *([1] * (ndim - 1)))
        if sigma.ndim == 2:
            return sigma[:, None, :, None, None]
        raise ValueError(f"σ must be [B] or [B, T], got shape {tuple(sigma.shape)}")


def read_scheduler_shift(folder: Path) -> float:
    """Read ``shift`` (or Wan's UniPC ``flow_shift``) from a diffusers ``scheduler_config.json``."""
    path = folder / "scheduler_config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: scheduler config not found; set the model's `shift` explicitly") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg})") from None
    for key in ("shift", "flow_shift"):
        if key in cfg and cfg[key] is not None:
            return float(cfg[key])
    return 1.0
