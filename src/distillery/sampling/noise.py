"""Noise sources: where a sampler's Gaussian draws come from.

A sampler asks its source for standard-normal ``float32`` tensors of a shape whose first dimension
is the batch; it does not care whether the draws come from

- :class:`GeneratorNoise` — one ``torch.Generator`` for the whole batch (validation and export: it
  draws exactly what diffusers' ``randn_tensor`` draws for that generator, so stock ``WanPipeline``
  reproduces the samples), or one generator per sample (each sample then draws what it would draw
  alone: a batched run equals per-prompt runs);
- :class:`RNGNoise` — the training run's :class:`~distillery.components.rng.BatchRNG` (rollouts: draws
  independent of how the global batch is split over ranks).

:func:`as_noise_source` turns any of these (or a generator/BatchRNG itself) into a source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Union, runtime_checkable

import torch

from distillery.components.rng import BatchRNG


@runtime_checkable
class NoiseSource(Protocol):
    def randn(self, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
        """Standard normal ``float32`` tensor of ``shape`` (first dim = batch) on ``device``."""


class GeneratorNoise:
    """Draws from one ``torch.Generator`` (or the global RNG when None), or one generator per sample."""

    def __init__(self, generators: torch.Generator | Sequence[torch.Generator] | None) -> None:
        self.generators = generators

    def randn(self, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
        shape = tuple(shape)
        gens = self.generators
        if gens is None or isinstance(gens, torch.Generator):
            draw_device = gens.device if gens is not None else torch.device(device)
            return torch.randn(shape, generator=gens, device=draw_device, dtype=torch.float32).to(device)
        if len(gens) != shape[0]:
            raise ValueError(f"{len(gens)} generators for a batch of {shape[0]}")
        rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=torch.float32).to(device) for g in gens]
        return torch.cat(rows)


class RNGNoise:
    """Draws from a training run's :class:`BatchRNG` (the first dim is this rank's part of the batch)."""

    def __init__(self, rng: BatchRNG) -> None:
        self.rng = rng

    def randn(self, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
        return self.rng.randn(tuple(shape)).to(device)


NoiseLike = Union[NoiseSource, torch.Generator, Sequence[torch.Generator], BatchRNG, None]


def as_noise_source(noise: NoiseLike) -> NoiseSource:
    """A :class:`NoiseSource` for a source, a generator (or a list of them, one per sample), a
    :class:`BatchRNG`, or None (torch's global RNG)."""
    if isinstance(noise, BatchRNG):
        return RNGNoise(noise)
    if noise is None or isinstance(noise, (torch.Generator, list, tuple)):
        return GeneratorNoise(noise)
    if isinstance(noise, NoiseSource):
        return noise
    raise TypeError(f"not a noise source: {type(noise).__name__}")
