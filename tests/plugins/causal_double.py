"""A test double of the causal contract built from the tiny real Wan.

:class:`CausalWanDouble` keeps, per ``cache_tag``, the chunks stored so far (latents and their
timesteps) and answers a streaming call by running the real bidirectional transformer over
``[cached chunks ⊕ this chunk]`` and returning the chunk's frames. The chunk sees exactly its past
(nothing later exists), so the contract's bookkeeping — tags, ``store_kv``, ``cur_start_frame``,
``clear_caches`` — is real; only the speed-up of reusing keys/values is not (and the context's own
activations see the chunk, which a block-causal mask would forbid). The causal Wan of the
Self-Forcing issue replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distillery.methods.sft import SFTMethod
from distillery.models.base import CausalModelBase, Conditioning, TrainingBatch
from distillery.models.wan import WanModel, WanModelConfig


@dataclass
class CausalDoubleConfig(WanModelConfig):
    chunk_size: int = 1  # latent frames per causal chunk


class CausalWanDouble(WanModel, CausalModelBase):
    config_class = CausalDoubleConfig

    def __init__(self, config: CausalDoubleConfig, role: str) -> None:
        super().__init__(config, role)
        self.chunk_size = config.chunk_size
        self._cache: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def clear_caches(self, cache_tag: str | None = None) -> None:
        if cache_tag is None:
            self._cache.clear()
        else:
            self._cache.pop(cache_tag, None)

    def cached_frames(self, cache_tag: str) -> int:
        return sum(x.shape[2] for x, _ in self._cache.get(cache_tag, []))

    def predict_noise_streaming(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                                batch: Conditioning | TrainingBatch, *, cache_tag: str, store_kv: bool,
                                cur_start_frame: int, conditional: bool = True) -> torch.Tensor:
        held = self.cached_frames(cache_tag)
        if cur_start_frame != held:
            raise ValueError(f"cache {cache_tag!r} holds {held} frames; a chunk starting at frame {cur_start_frame} does not follow them")
        frames = noisy_latents.shape[2]
        per_frame = timesteps if timesteps.ndim == 2 else timesteps[:, None].expand(-1, frames)
        context = self._cache.get(cache_tag, [])
        x = torch.cat([c for c, _ in context] + [noisy_latents.float()], dim=2)
        t = torch.cat([ct for _, ct in context] + [per_frame.float()], dim=1)
        v = self.predict_noise(x, t, batch, conditional)[:, :, -frames:]
        if store_kv:
            self._cache.setdefault(cache_tag, []).append((noisy_latents.detach().float(), per_frame.detach().float()))
        return v


class CausalSFTMethod(SFTMethod):
    """SFT that declares it needs a causal student (the kind check is what is under test)."""

    role_kinds = {"student": CausalModelBase}
