"""Cosmos Predict 2.5 text-to-world plugin over ``diffusers.CosmosTransformer3DModel``: full attention over the video.

How diffusers' ``Cosmos2_5_PredictBasePipeline`` drives the transformer, and how that maps onto our convention
(docs/architecture.md §3: ``x_t = (1 − σ) x0 + σ ε``, ``v = ε − x0``, timesteps ``t = 1000 σ``):

- **the flow is ours**: the pipeline is rectified flow (no EDM preconditioning: that was Cosmos Predict 2's
  pipeline), its latents start as pure noise at σ = 1, the transformer's output is the velocity ``ε − x0`` (the
  pipeline's ``gt_velocity = latents − cond_latent`` for given frames) and the scheduler steps ``x + (σ' − σ) v``;
- **the timestep is σ, not 1000 σ**: the pipeline feeds ``scheduler.sigmas[i]`` per latent frame, shaped
  ``[B, 1, T, 1, 1]`` (given frames get 0.0001); we feed ``t / 1000`` in that same per-frame form (a per-sample
  ``[B]`` timestep broadcast over the frames, a per-frame ``[B, T]`` one as it is);
- **the condition mask is an input channel**: ``in_channels`` = latent + 1; text-to-world passes a mask of zeros
  (no given frame) and, where the config concatenates a padding mask (``concat_padding_mask``), zeros for it too;
- **guidance is written ``c + g (c − u)``** in the pipeline: our ``u + w (c − u)`` is its ``guidance_scale = w − 1``
  (the pipeline guides only above 1, so our ``w`` in (1, 2] has no stock equivalent);
- **the prompt is not trimmed**: the pipeline pads every prompt to ``max_sequence_length`` and passes no attention
  mask, so the pad tokens' embeddings are part of the condition (:mod:`distillery.data.text_encoders` stores them).

The shift is the folder's scheduler's (``flow_shift`` of its UniPC scheduler, or ``shift`` of a flow-matching Euler
one); our σ grids are :class:`~distillery.models.schedule.FlowMatchSchedule`'s.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from distillery.models.base import Conditioning, TrainingBatch
from distillery.models.cosmos.common import (
    TRANSFORMER_CLASS,
    CosmosModelConfig,
    image_conditioning,
    latent_channels,
    locate_transformer,
    text_width,
)
from distillery.models.diffusers_family import DiffusersFamilyModel


def padding_mask_problem(config: Any) -> str | None:
    """Why a transformer of ``config`` cannot run in this process: one that concatenates a padding mask resizes it with
    torchvision (diffusers' Cosmos imports it only where it is installed); None when it can."""
    if config.get("concat_padding_mask") and importlib.util.find_spec("torchvision") is None:
        return ("its config concatenates a padding mask (concat_padding_mask: true), which diffusers' "
                f"{TRANSFORMER_CLASS} resizes with torchvision; install torchvision (the build matching torch)")
    return None


class CosmosModel(DiffusersFamilyModel):
    """One role backed by a diffusers ``CosmosTransformer3DModel`` (:class:`DiffusersFamilyModel`: fp32 master weights on
    CPU at build; ``transformer``: an already loaded one of ``config.init_from`` to wrap)."""

    config_class = CosmosModelConfig
    TRANSFORMER_CLASS = TRANSFORMER_CLASS
    FAMILY_LOG = "models.cosmos"
    locate_transformer = staticmethod(locate_transformer)

    def config_problem(self, config: dict[str, Any]) -> str | None:
        return padding_mask_problem(config)

    def read_config(self, config: dict[str, Any]) -> None:
        image_conditioning(config)  # a config of another layout: one line
        self.patch_size = tuple(config["patch_size"])
        self.in_channels = latent_channels(config)
        self.text_dim = text_width(config)
        self.concat_padding_mask = bool(config.get("concat_padding_mask"))

    def model_timestep(self, timesteps: torch.Tensor, num_frames: int) -> torch.Tensor:
        """Our timesteps ``[B]`` or per-frame ``[B, T]`` in [0, 1000] → the transformer's: σ per latent frame
        ``[B, 1, T, 1, 1]`` float32 (module doc)."""
        sigma = self.schedule.sigma(timesteps)
        if sigma.ndim == 1:
            sigma = sigma[:, None].expand(-1, num_frames)
        elif sigma.shape[1] != num_frames:
            raise ValueError(f"per-frame timesteps {tuple(timesteps.shape)} do not match {num_frames} latent frames")
        return sigma[:, None, :, None, None].float()

    def transformer_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                           conditional: bool) -> dict[str, Any]:
        """The keyword arguments of one transformer call, as ``Cosmos2_5_PredictBasePipeline`` builds them for
        text-to-world (module doc), in the compute dtype."""
        text = batch.text_embeds if conditional else batch.negative_text_embeds
        if text is None:
            text = torch.zeros_like(batch.text_embeds)
        dtype = self.input_dtype()
        b, _, t, h, w = noisy_latents.shape
        hidden = noisy_latents.to(dtype)
        inputs: dict[str, Any] = {
            "hidden_states": hidden,
            "timestep": self.model_timestep(timesteps, t),
            "encoder_hidden_states": text.to(dtype),
            "condition_mask": hidden.new_zeros(b, 1, t, h, w),
            "return_dict": False,
        }
        if self.concat_padding_mask:
            inputs["padding_mask"] = hidden.new_zeros(1, 1, h, w)
        return inputs
