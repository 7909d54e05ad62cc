"""Flow-matching maths of an exported distilled Wan (stdlib + torch + numpy only).

Conventions: latents ``[B, C, T, H, W]`` in the VAE's normalised space; ``x_t = (1 − σ) x0 + σ ε``;
velocity ``v = ε − x0``, so ``x0 = x_t − σ v``; timesteps ``t = σ · num_train_timesteps`` after the
shift ``σ' = s·σ / (1 + (s − 1)·σ)``. :func:`inference_sigmas` is bit for bit the grid diffusers'
``FlowMatchEulerDiscreteScheduler(shift=s)`` builds as the family's pipeline asks for it (``grid``, :data:`SIGMA_GRIDS`):
``table``, ``set_timesteps(n)`` (Wan, Cosmos); ``linspace``, ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])``
(HunyuanVideo 1.5).
"""

from __future__ import annotations

import numpy as np
import torch

SIGMA_GRIDS = ("table", "linspace")


def inference_sigmas(shift: float, num_steps: int, num_train_timesteps: int = 1000, grid: str = "table") -> torch.Tensor:
    """σ grid ``float32 [num_steps + 1]`` on the CPU, descending from 1, ending with an appended 0 (module doc)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if grid not in SIGMA_GRIDS:
        raise ValueError(f"sigma_grid {grid!r}: expected one of {', '.join(SIGMA_GRIDS)}")
    if grid == "linspace":
        grid32 = np.linspace(1.0, 0.0, num_steps + 1)[:-1].astype(np.float32)
        shifted = shift * grid32 / (1 + (shift - 1) * grid32)
        return torch.cat([torch.from_numpy(shifted.astype(np.float32)), torch.zeros(1, device="cpu")])
    n, s = num_train_timesteps, shift
    ends = torch.tensor([float(n), 1.0], dtype=torch.float32, device="cpu") / n
    ends = s * ends / (1 + (s - 1) * ends)
    sigma_max, sigma_min = ends[0].item(), ends[1].item()
    grid = np.linspace(sigma_max * n, sigma_min * n, num_steps) / n
    grid = s * grid / (1 + (s - 1) * grid)
    return torch.cat([torch.from_numpy(grid).to(torch.float32), torch.zeros(1, device="cpu")])


def inference_timesteps(shift: float, num_steps: int, num_train_timesteps: int = 1000, grid: str = "table") -> torch.Tensor:
    """Timesteps ``float32 [num_steps]`` of :func:`inference_sigmas` (σ × n, the final 0 dropped)."""
    return inference_sigmas(shift, num_steps, num_train_timesteps, grid)[:-1] * num_train_timesteps


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """Clean sample ``x0 = x_t − σ v`` (float32; σ a Python float)."""
    return x_t.float() - float(sigma) * velocity.float()


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """Noisy sample ``x_t = (1 − σ) x0 + σ ε`` (float32; σ a Python float)."""
    sigma = float(sigma)
    return (1.0 - sigma) * x0.float() + sigma * noise.float()


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor | float,
               sigma_next: torch.Tensor | float) -> torch.Tensor:
    """One Euler step of the flow ODE: ``x + (σ_next − σ) v`` (σ, σ_next: 0-d tensors, or Python floats: exact scalar
    maths, as distillery's own)."""
    as_factor = lambda s: s.to(x_t.device, torch.float32) if isinstance(s, torch.Tensor) else float(s)  # noqa: E731
    return x_t + (as_factor(sigma_next) - as_factor(sigma)) * velocity


def block_partition(num_intervals: int, num_blocks: int) -> list[int]:
    """Node indices ``[num_blocks + 1]`` of the balanced split of a grid of ``num_intervals``
    intervals into ``num_blocks`` contiguous blocks: node i is ``⌊i · num_intervals / num_blocks⌋``."""
    if not 1 <= num_blocks <= num_intervals:
        raise ValueError(f"cannot split {num_intervals} grid intervals into {num_blocks} blocks")
    return [(i * num_intervals) // num_blocks for i in range(num_blocks + 1)]


def widest_block(nodes: list[int]) -> int:
    """The widest block (in grid intervals) of a partition given by its node indices."""
    return max(b - a for a, b in zip(nodes, nodes[1:]))


def block_weights(sigmas: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Weights ``[end − start]`` (float64) fusing the per-interval velocities of block ``[start, end)``
    into its mean velocity: ``Δ_k / Σ Δ`` with ``Δ_k = σ_{k+1} − σ_k``."""
    deltas = sigmas[start + 1:end + 1].double() - sigmas[start:end].double()
    return deltas / deltas.sum()


def chunk_bounds(num_frames: int, chunk_size: int, given_first_frame: bool = False) -> list[tuple[int, int]]:
    """``[(start frame, frames)]`` of the chunks a causal sampler denoises: from frame 0 (the last may be shorter);
    ``given_first_frame`` (an image-to-video student: frame 0 is the given frame, never denoised): from frame 1, all
    ``chunk_size`` long — a ``ValueError`` for a length other than ``1 + k · chunk_size``."""
    if not given_first_frame:
        return [(s, min(chunk_size, num_frames - s)) for s in range(0, num_frames, chunk_size)]
    if num_frames < 2 or (num_frames - 1) % chunk_size:
        raise ValueError(f"{num_frames} latent frames do not fit this image-to-video student's layout: the given first "
                         f"frame, then chunks of {chunk_size} latent frames (1 + k·{chunk_size} latent frames: "
                         f"num_frames = 4·k·{chunk_size} + 1)")
    return [(s, chunk_size) for s in range(1, num_frames, chunk_size)]
