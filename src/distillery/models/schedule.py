"""Rectified-flow maths shared by every model and sampler — the one place it is written down.

Conventions (docs/architecture.md §3): ``x_t = (1 − σ) x0 + σ ε``, velocity ``v = ε − x0``,
``x0 = x_t − σ v``. Timesteps live in ``[0, num_train_timesteps]`` and ``σ = t / num_train_timesteps``
after the shift ``σ' = s·σ / (1 + (s − 1)·σ)`` has been applied. One shift per model, read from its
scheduler config.

- :class:`FlowMatchSchedule` — a model's shift, timestep scale and σ-grid form: training σ draws, the training
  timestep table, and the inference σ grid (:meth:`FlowMatchSchedule.inference_sigmas`, bit-for-bit
  diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` as the family's pipeline calls it: :data:`SIGMA_GRIDS`);
- :func:`x0_from_velocity`, :func:`velocity_from_x0`, :func:`renoise` — conversions between the
  clean sample, the velocity and a noisy sample at σ (σ a Python float, ``[B]`` or per-frame ``[B, T]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from distillery.common.errors import UserError

if TYPE_CHECKING:
    from distillery.components.rng import BatchRNG


#: How a family's pipeline asks diffusers' ``FlowMatchEulerDiscreteScheduler`` for its n-step σ grid (the form is the
#: family's: its plugin sets it, a sampling contract records it as ``sigma_grid`` where it is not ``table``):
#: ``table`` — ``set_timesteps(n)``: the ends of the scheduler's training table, ``linspace(σ_max, σ_min, n)`` shifted
#: (Wan's and Cosmos' pipelines); ``linspace`` — ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])``: the unshifted
#: grid ``1, (n−1)/n, …, 1/n`` cast to float32 and shifted in float32 (HunyuanVideo 1.5's pipeline; LTX-2's
#: ``linspace(1, 1/n, n)`` is the same float32 grid for every n < 500, a test checks).
SIGMA_GRIDS = ("table", "linspace")


@dataclass(frozen=True)
class FlowMatchSchedule:
    shift: float = 1.0  # σ-shift s (Wan 2.1 T2V: 3.0 at 480p, 5.0 at 720p)
    num_train_timesteps: int = 1000  # timesteps are σ × this
    sigma_grid: str = "table"  # the inference grid's form (:data:`SIGMA_GRIDS`)

    def __post_init__(self) -> None:
        if self.sigma_grid not in SIGMA_GRIDS:
            raise UserError(f"sigma_grid {self.sigma_grid!r}: expected one of {', '.join(SIGMA_GRIDS)}")

    def contract(self) -> dict[str, float | int | str]:
        """The schedule as a sampling contract records it: ``shift``, ``num_train_timesteps`` and — a grid other than
        ``table`` — ``sigma_grid``."""
        own: dict[str, float | int | str] = {"shift": self.shift, "num_train_timesteps": self.num_train_timesteps}
        if self.sigma_grid != "table":
            own["sigma_grid"] = self.sigma_grid
        return own

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

    def inference_sigmas(self, num_steps: int) -> torch.Tensor:
        """Inference σ grid ``float32 [num_steps + 1]``, descending from 1, ending with an appended 0.

        Bit-for-bit ``FlowMatchEulerDiscreteScheduler(shift=s)``'s ``sigmas`` after the call of :attr:`sigma_grid`, on
        the CPU (static shift, no Karras/exponential/beta/terminal options). ``table``: ``set_timesteps(num_steps)`` —
        the scheduler's training table gives σ_max = shift(1) = 1 and σ_min = shift(1/n) (fp32); the inference grid
        is ``linspace(σ_max, σ_min, num_steps)`` in float64, shifted *again*, then cast to fp32. ``linspace``:
        ``set_timesteps(sigmas=linspace(1, 0, num_steps + 1)[:-1])`` — that grid cast to float32, shifted in float32.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        if self.sigma_grid == "linspace":
            grid32 = np.linspace(1.0, 0.0, num_steps + 1)[:-1].astype(np.float32)
            shifted = self.shift * grid32 / (1 + (self.shift - 1) * grid32)  # float32 (a Python float is weak in numpy 2)
            return torch.cat([torch.from_numpy(shifted.astype(np.float32)), torch.zeros(1, device="cpu")])
        n, s = self.num_train_timesteps, self.shift
        ends = torch.tensor([float(n), 1.0], dtype=torch.float32, device="cpu") / n  # table ends, as the scheduler's __init__
        ends = s * ends / (1 + (s - 1) * ends)
        sigma_max, sigma_min = ends[0].item(), ends[1].item()
        grid = np.linspace(sigma_max * n, sigma_min * n, num_steps) / n
        grid = s * grid / (1 + (s - 1) * grid)
        return torch.cat([torch.from_numpy(grid).to(torch.float32), torch.zeros(1, device="cpu")])  # CPU, whatever the default device

    def inference_timesteps(self, num_steps: int) -> torch.Tensor:
        """Timesteps ``float32 [num_steps]`` in ``[0, n]`` of :meth:`inference_sigmas` (σ × n, the final 0 dropped):
        diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps).timesteps``."""
        return self.inference_sigmas(num_steps)[:-1] * self.num_train_timesteps

    @staticmethod
    def broadcast(sigma: torch.Tensor, ndim: int = 5) -> torch.Tensor:
        """Reshape σ ``[B]`` → ``[B,1,1,1,1]`` or per-frame ``[B,T]`` → ``[B,1,T,1,1]`` for ``[B,C,T,H,W]``."""
        if sigma.ndim == 1:
            return sigma.view(-1, *([1] * (ndim - 1)))
        if sigma.ndim == 2:
            return sigma[:, None, :, None, None]
        raise ValueError(f"σ must be [B] or [B, T], got shape {tuple(sigma.shape)}")


Sigma = float | torch.Tensor  # a Python float, or σ [B] / per-frame [B, T] (broadcast over [B, C, T, H, W])


def _as_factor(sigma: Sigma, like: torch.Tensor) -> float | torch.Tensor:
    """σ ready to multiply a ``[B, C, T, H, W]`` tensor: floats stay floats (exact scalar maths)."""
    if isinstance(sigma, torch.Tensor):
        if sigma.ndim == 0:
            return sigma.to(like.device, torch.float32)
        return FlowMatchSchedule.broadcast(sigma.to(like.device, torch.float32), like.ndim)
    return float(sigma)


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """Clean sample ``x0 = x_t − σ v`` (float32, shape of ``x_t`` ``[B, C, T, H, W]``)."""
    return x_t.float() - _as_factor(sigma, x_t) * velocity.float()


def velocity_from_x0(x_t: torch.Tensor, x0: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """Velocity ``v = ε − x0 = (x_t − x0) / σ`` (float32 ``[B, C, T, H, W]``); σ must be > 0."""
    return (x_t.float() - x0.float()) / _as_factor(sigma, x_t)


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """Noisy sample ``x_t = (1 − σ) x0 + σ ε`` at σ (float32, shape of ``x0`` ``[B, C, T, H, W]``)."""
    factor = _as_factor(sigma, x0)
    return (1.0 - factor) * x0.float() + factor * noise.float()


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, sigma: Sigma, sigma_next: Sigma) -> torch.Tensor:
    """One Euler step of the flow ODE from σ to σ_next: ``x + (σ_next − σ) v`` (float32 ``[B, C, T, H, W]``)."""
    return x_t + (_as_factor(sigma_next, x_t) - _as_factor(sigma, x_t)) * velocity


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


def block_partition(num_intervals: int, num_blocks: int) -> list[int]:
    """Node indices ``[num_blocks + 1]`` (0 … ``num_intervals``) of the balanced split of a
    ``num_intervals``-interval grid into ``num_blocks`` contiguous blocks: node i is
    ``⌊i · num_intervals / num_blocks⌋``, so block widths differ by at most one (all equal when
    ``num_blocks`` divides ``num_intervals``). ValueError unless ``1 ≤ num_blocks ≤ num_intervals``."""
    if not 1 <= num_blocks <= num_intervals:
        raise ValueError(f"cannot split {num_intervals} grid intervals into {num_blocks} blocks")
    return [(i * num_intervals) // num_blocks for i in range(num_blocks + 1)]


def widest_block(nodes: list[int]) -> int:
    """The widest block (in grid intervals) of a partition given by its node indices."""
    return max(b - a for a, b in zip(nodes, nodes[1:]))


def block_weights(sigmas: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Weights ``[end − start]`` (float64) that fuse the per-interval velocities of the block
    ``[start, end)`` of the σ grid ``sigmas`` into its mean velocity: ``Δ_k / Σ Δ`` with
    ``Δ_k = σ_{k+1} − σ_k``, so ``x_end = x_start + (σ_end − σ_start) · Σ_k w_k v_k``."""
    deltas = (sigmas[start + 1:end + 1].double() - sigmas[start:end].double())
    return deltas / deltas.sum()
