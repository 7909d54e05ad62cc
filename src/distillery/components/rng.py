"""Random draws that do not depend on how a global batch is split over ranks.

Every rank holds one generator seeded with the run seed (identical on all ranks). A draw for
the per-rank batch ``[B, ...]`` generates the whole global batch ``[world_size·B, ...]`` and keeps
this rank's slice, so sample ``k`` of the global batch gets the same noise, timestep and caption
dropout whether the run uses 1 rank or 8: a run reproduces across world sizes and a checkpoint
resumes on another world size with the same random stream. Cost: the draw itself is repeated
on each rank (a few MB per step at Wan-1.3B scale).
"""

from __future__ import annotations

from typing import Any

import torch


class BatchRNG:
    def __init__(self, seed: int, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _slice(self, full: torch.Tensor, per_rank: int) -> torch.Tensor:
        return full[self.rank * per_rank : (self.rank + 1) * per_rank]

    def randn(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal ``shape`` (first dim = per-rank batch) on the generator's device."""
        shape = tuple(shape)
        full = torch.randn((shape[0] * self.world_size, *shape[1:]), generator=self.generator, device=self.device, dtype=dtype)
        return self._slice(full, shape[0])

    def rand(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """Uniform [0, 1) ``shape`` (first dim = per-rank batch)."""
        shape = tuple(shape)
        full = torch.rand((shape[0] * self.world_size, *shape[1:]), generator=self.generator, device=self.device)
        return self._slice(full, shape[0])

    def randint(self, low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Integers in ``[low, high)`` of ``shape`` (first dim = per-rank batch)."""
        full = torch.randint(low, high, (shape[0] * self.world_size, *shape[1:]), generator=self.generator, device=self.device)
        return self._slice(full, shape[0])

    def shared_randint(self, high: int) -> int:
        """One integer in ``[0, high)`` from the generator itself — the same on every rank (the generator
        is): a draw every rank must agree on (an exit step, a supervised head). One host sync."""
        return int(torch.randint(0, high, (1,), generator=self.generator, device=self.device).item())

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
