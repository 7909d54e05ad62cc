"""The video VAEs of the families' pipelines, by class: how each one's latents are normalised and loaded, exactly as
its diffusers pipeline does it, so latents made here condition a transformer as the stock pipeline's do (their
geometry: :mod:`distillery.components.vae_geometry`).

Which VAE a base has: :func:`~distillery.components.vae_geometry.vae_class`. A class no :class:`VaeKind` knows is one
line (:class:`UserError`).

- ``AutoencoderKLWan`` (Wan 2.1 / 2.2, Cosmos Predict 2.5): training space ``(z − latents_mean) / latents_std`` per
  channel, undone as ``WanPipeline`` does (``x / (1 / std) + mean``); decoded in time chunks where
  :mod:`distillery.data.vae_decode` applies.
- ``AutoencoderKLHunyuanVideo15`` (HunyuanVideo 1.5): training space ``z · scaling_factor`` (no mean), undone as
  ``HunyuanVideo15Pipeline`` does (``x / scaling_factor``); decoded by ``vae.decode``.

Encoding takes the posterior's mode (no sampling) for every kind. Nothing here loads a model unless asked
(:meth:`VaeKind.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.components.vae_geometry import HUNYUAN15, WAN, geometry, vae_class


def _wan_stats(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, int(vae.config.z_dim)) + (1,) * (z.ndim - 2)
    mean = torch.tensor(vae.config.latents_mean, dtype=z.dtype, device=z.device).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=z.dtype, device=z.device).view(shape)
    return mean, std


def _wan_normalize(vae: Any, z: torch.Tensor) -> torch.Tensor:
    mean, std = _wan_stats(vae, z)
    return (z - mean) / std


def _wan_denormalize(vae: Any, x: torch.Tensor) -> torch.Tensor:
    mean, std = _wan_stats(vae, x)
    return x / (1.0 / std) + mean


def _wan_problem(vae: Any) -> str | None:
    cfg = vae.config
    z_dim = int(cfg.z_dim)
    if len(cfg.latents_mean) != z_dim or len(cfg.latents_std) != z_dim:
        return f"latents_mean/latents_std have {len(cfg.latents_mean)}/{len(cfg.latents_std)} entries, z_dim is {z_dim}"
    return None


def _scaled(vae: Any, z: torch.Tensor) -> torch.Tensor:
    return z * float(vae.config.scaling_factor)


def _unscaled(vae: Any, x: torch.Tensor) -> torch.Tensor:
    return x / float(vae.config.scaling_factor)


@dataclass(frozen=True)
class VaeKind:
    """One VAE class: its training-space normalisation and its inverse (both on ``[B, C, T', H', W']``), and what makes
    a loaded one unfit (None: nothing)."""

    class_name: str
    normalize: Callable[[Any, torch.Tensor], torch.Tensor]
    denormalize: Callable[[Any, torch.Tensor], torch.Tensor]
    formula: str  # the normalisation in words (a latent set's manifest records it)
    problem: Callable[[Any], str | None] = lambda vae: None
    #: encode and decode one clip per VAE call: diffusers 0.42's ``AutoencoderKLHunyuanVideo15`` builds its mid-block
    #: attention mask ``[B, S, S]``, which SDPA broadcasts against ``[B, 1, S, d]`` into a wrong shape for B > 1 (the
    #: original code unsqueezes it; diffusers PR #13133, open) — so a batch of its clips goes through one at a time
    one_clip_per_call: bool = False

    def calls(self, batch: int) -> list[slice]:
        """The batch rows of each VAE call for ``batch`` clips (all at once, or one by one: :attr:`one_clip_per_call`)."""
        return [slice(i, i + 1) for i in range(batch)] if self.one_clip_per_call else [slice(0, batch)]

    def geometry(self, config: dict[str, Any]) -> tuple[int, int, int]:
        """``(latent channels, temporal factor, spatial factor)`` of a VAE of this class with ``config``."""
        return geometry(self.class_name, config, self.class_name)

    def load(self, folder: Path, dtype: torch.dtype, device: torch.device) -> Any:
        """The VAE of ``folder`` (its ``config.json`` and weights), frozen, eval, on ``device`` in ``dtype``."""
        import diffusers

        vae = getattr(diffusers, self.class_name).from_pretrained(folder, torch_dtype=dtype).to(device).eval()
        problem = self.problem(vae)
        if problem:
            raise UserError(f"{folder}: {problem}")
        return vae.requires_grad_(False)


KINDS = {kind.class_name: kind for kind in (
    VaeKind(WAN, _wan_normalize, _wan_denormalize,
            "latents = (posterior_mean - vae.latents_mean) / vae.latents_std", _wan_problem),
    VaeKind(HUNYUAN15, _scaled, _unscaled, "latents = posterior_mean * vae.scaling_factor", one_clip_per_call=True),
)}


def vae_kind(base: Path) -> VaeKind:
    """The :class:`VaeKind` of ``base``'s VAE (one line for a class none knows)."""
    name = vae_class(base)
    if name not in KINDS:
        raise UserError(f"{base}: a {name} VAE; distillery encodes videos with {', '.join(KINDS)}")
    return KINDS[name]
