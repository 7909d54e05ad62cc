"""HunyuanVideo 1.5 text-to-video plugin over ``diffusers.HunyuanVideo15Transformer3DModel``: full attention.

How diffusers' ``HunyuanVideo15Pipeline`` drives the transformer, and how that maps onto our convention
(docs/architecture.md §3: ``x_t = (1 − σ) x0 + σ ε``, ``v = ε − x0``, timesteps ``t = 1000 σ``):

- **the flow is ours**: latents start as pure noise at σ = 1, the transformer's output is the velocity ``ε − x0`` and
  the Euler scheduler steps ``x + (σ' − σ) v``; the timestep is ``1000 σ``, one per sample, cast to the transformer's
  dtype as the pipeline casts it (a per-frame timestep ``[B, T]`` is taken when its frames agree; the transformer
  modulates every token of a sample with one timestep, so frames at other noise levels are refused);
- **the σ grid is the pipeline's own**: ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])`` shifted by the
  scheduler's ``shift`` (:attr:`sigma_grid` ``linspace``, :data:`~distillery.models.schedule.SIGMA_GRIDS`), not the
  scheduler's table ends; a sampling contract records it;
- **the input is 65 channels**: the noisy latent, a condition latent and its 1-channel mask — zeros for text-to-video,
  as the pipeline's ``prepare_cond_latents_and_mask`` makes them — and the image tokens are zeros
  ``[B, 729, image_embed_dim]`` (the transformer then masks them out);
- **two prompt streams, each with its mask**: Qwen2.5-VL's hidden states (1000 tokens) and ByT5's glyph embeddings
  (256); we carry them side by side in one prompt tensor, each stream's mask its non-zero rows
  (:mod:`distillery.components.prompt_streams`), and hand them over padded to the pipeline's budgets — the pad tokens'
  embeddings the pipeline passes are zeroed and masked by the transformer, so zeros there give its output bit for bit;
- **guidance** is the pipeline's guider's ``u + w (c − u)`` (``ClassifierFreeGuidance``: ours), the negative prompt
  the empty one (its Qwen stream: the template's turn of ``" "``), which the latent set stores — an unconditional
  pass without it is one line (an all-zero prompt has no valid token: the transformer would divide by zero);
- **the VAE** is scaled, not centred: training latents are ``z · scaling_factor`` (:mod:`distillery.data.vae_codecs`).

The shift is the folder's scheduler's (``shift`` of its ``FlowMatchEulerDiscreteScheduler``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from distillery.common.errors import UserError
from distillery.components.prompt_streams import hunyuan15_budgets, split_streams
from distillery.models.base import Conditioning, TrainingBatch
from distillery.models.diffusers_family import DiffusersFamilyModel
from distillery.models.hunyuan15.common import (
    IMAGE_TOKENS,
    TRANSFORMER_CLASS,
    HunyuanVideo15ModelConfig,
    image_conditioning,
    latent_channels,
    locate_transformer,
    stream_widths,
)


def layout_problem(config: dict[str, Any]) -> str | None:
    """Why a transformer of ``config`` is not one distillery trains (a text-to-video one), None when it is: the
    super-resolution models' MeanFlow timestep (``use_meanflow``) takes a second timestep the pipeline does not give."""
    if config.get("use_meanflow"):
        return ("a MeanFlow transformer (use_meanflow: true, HunyuanVideo 1.5's super-resolution stage) takes a second "
                "timestep; distillery trains the text-to-video transformer")
    return None


class HunyuanVideo15Model(DiffusersFamilyModel):
    """One role backed by a diffusers ``HunyuanVideo15Transformer3DModel`` (:class:`DiffusersFamilyModel`: fp32 master
    weights on CPU at build; ``transformer``: an already loaded one of ``config.init_from`` to wrap)."""

    config_class = HunyuanVideo15ModelConfig
    sigma_grid: ClassVar[str] = "linspace"  # HunyuanVideo15Pipeline's grid (module doc)
    TRANSFORMER_CLASS = TRANSFORMER_CLASS
    FAMILY_LOG = "models.hunyuan15"
    locate_transformer = staticmethod(locate_transformer)

    def config_problem(self, config: dict[str, Any]) -> str | None:
        return layout_problem(config)

    def read_config(self, config: dict[str, Any]) -> None:
        image_conditioning(config)  # a config of another layout: one line
        self.patch_size = (int(config["patch_size_t"]), int(config["patch_size"]), int(config["patch_size"]))
        self.in_channels = latent_channels(config)
        self.stream_widths = stream_widths(config)
        self.stream_tokens = hunyuan15_budgets()
        self.image_dim = int(config["image_embed_dim"])

    @staticmethod
    def sample_timestep(timesteps: torch.Tensor) -> torch.Tensor:
        """Our timesteps ``[B]``, or per frame ``[B, T]`` whose frames agree, → the transformer's one per sample ``[B]``
        (module doc); ``ValueError`` for frames at different timesteps."""
        if timesteps.ndim == 1:
            return timesteps
        if timesteps.ndim == 2 and bool((timesteps == timesteps[:, :1]).all()):
            return timesteps[:, 0]
        raise ValueError(f"HunyuanVideo 1.5 modulates every token of a sample with one timestep; got per-frame timesteps "
                         f"{tuple(timesteps.shape)} that differ across frames")

    def transformer_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                           conditional: bool) -> dict[str, Any]:
        """The keyword arguments of one transformer call, as ``HunyuanVideo15Pipeline`` builds them for text-to-video
        (module doc), in the compute dtype."""
        text = batch.text_embeds if conditional else batch.negative_text_embeds
        if text is None:
            raise UserError("HunyuanVideo 1.5 guides against the empty prompt's embedding and none was given (the "
                            "latents stage stores it beside the set: empty_prompt.safetensors)")
        dtype = self.input_dtype()
        b, c, t, h, w = noisy_latents.shape
        hidden = noisy_latents.to(dtype)
        (qwen, qwen_mask), (glyph, glyph_mask) = split_streams(text, self.stream_widths, self.stream_tokens)
        if not bool(qwen_mask.any(dim=1).all()):
            raise UserError("a HunyuanVideo 1.5 prompt embedding without a Qwen2.5-VL token (all zeros); the pipeline's "
                            "encoder always gives one (its template's turn)")
        return {
            "hidden_states": torch.cat([hidden, hidden.new_zeros(b, c + 1, t, h, w)], dim=1),
            "timestep": self.sample_timestep(timesteps).to(dtype),
            "encoder_hidden_states": qwen.to(dtype),
            "encoder_attention_mask": qwen_mask.to(dtype),
            "encoder_hidden_states_2": glyph.to(dtype),
            "encoder_attention_mask_2": glyph_mask.to(dtype),
            "image_embeds": hidden.new_zeros(b, IMAGE_TOKENS, self.image_dim),
            "return_dict": False,
        }
