"""The diffusers pipeline of a HunyuanVideo 1.5 export of distillery (its ``pipeline_hunyuan15.py``): sample as
``sampling.json`` says.

A distilled HunyuanVideo 1.5 student is not sampled by stock ``HunyuanVideo15Pipeline``'s many-step loop: a DMD2
student runs its few-step x0 ladder, a PDD student decodes blocks of its fine grid through its fused heads. diffusers
loads the folder with its own components and :class:`DistilledHunyuanVideo15Pipeline` (``model_index.json``:
``"_class_name": ["pipeline_hunyuan15", "DistilledHunyuanVideo15Pipeline"]``), offline, with only torch, diffusers,
transformers and accelerate installed::

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    video = pipe("a red ball moves left", generator=torch.Generator().manual_seed(0)).frames[0]

It is ``HunyuanVideo15Pipeline`` (same components, prompt encoding — its two streams, Qwen2.5-VL's and ByT5's —,
VAE decode and output) whose denoising loop is the sampler of the folder's ``sampling.json`` (:mod:`distilled_samplers`,
on the pipeline's own σ grid: the contract's ``sigma_grid`` ``linspace``) over
:class:`distilled_hunyuan15.HunyuanVideo15Denoiser`, guided ``u + w (c − u)`` against the negative prompt's streams
(``""`` by default) as the stock pipeline's guider does. For the prompt, seed, size and settings validate used, it
returns the latents validate saved (bit for bit on the CPU). Noise: one ``torch.Generator`` draws the initial latents
``[1, C, T', H', W']`` first, as the stock pipeline draws them.

Speed: diffusers' SDPA attention (FlashAttention-4 is installed into Wan's attention only), each transformer block
compiled on a GPU, the VAE's own ``decode`` (the fused chunked decode is Wan's VAE's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.pipelines.hunyuan_video1_5.pipeline_output import HunyuanVideo15PipelineOutput

from .distilled_causal import CausalWanDenoiser  # noqa: F401  (diffusers copies only the modules a pipeline imports)
from .distilled_decode import ChunkDecoder  # noqa: F401  (as above: what ContractSampling's decode imports)
from .distilled_fast import SpeedSettings
from .distilled_hunyuan15 import HunyuanVideo15Denoiser, PDDHunyuanVideo15Denoiser, pack_streams
from .distilled_samplers import Sampler, cfg_enabled
from .distilled_schedule import inference_sigmas  # noqa: F401  (as above)
from .distilled_sparse import install_sparse  # noqa: F401  (as above)
from .distilled_wan import HEADS_FILE, Conditioning
from .pipeline import ContractSampling
from .sparse_attention import RECORD_KEY  # noqa: F401  (as above)
from .vae_decode import decode_video  # noqa: F401  (as above)
from .vae_kernels import available as _vae_kernels_available  # noqa: F401  (as above)


class DistilledHunyuanVideo15Pipeline(ContractSampling, HunyuanVideo15Pipeline):
    """``HunyuanVideo15Pipeline`` sampling through the folder's sampling contract (module doc)."""

    speed_label = "distilled HunyuanVideo 1.5 pipeline"

    def speed_settings(self) -> SpeedSettings:
        """The switches :meth:`configure_speed` set; ``attention`` stays SDPA and ``decode`` the VAE's own (module doc):
        ``auto`` becomes ``sdpa`` / ``stock``, an explicit ``fa4`` or ``fused`` is a ``ValueError``."""
        settings = super().speed_settings()
        if settings.attention == "fa4":
            raise ValueError("attention='fa4': the exported HunyuanVideo 1.5 pipeline runs diffusers' SDPA attention only")
        if settings.decode == "fused":
            raise ValueError("decode='fused': the fused chunked decode is Wan's VAE's; HunyuanVideo 1.5 decodes with its own")
        return SpeedSettings(**{**vars(settings), "attention": "sdpa", "decode": "stock"})

    def denoiser(self, sampler: Sampler) -> HunyuanVideo15Denoiser:
        """The denoiser around ``self.transformer`` (built once): a PDD student's with its heads
        (``transformer/pdd_heads.safetensors``), else the plain one; a causal contract is a ``ValueError``."""
        if self._denoiser is None:
            kind = sampler.model_kind()
            self.transformer.eval().requires_grad_(False)
            shift, scale = sampler.schedule(self.scheduler_shift())
            tokens = (int(self.tokenizer_max_length), int(self.tokenizer_2_max_length))
            if "chunk_size" in kind:
                raise ValueError("a causal contract: distillery trains no causal HunyuanVideo 1.5 student")
            if "pdd_steps" in kind:
                heads = Path(self.name_or_path) / "transformer" / HEADS_FILE
                self._denoiser = PDDHunyuanVideo15Denoiser(self.transformer, shift, kind["pdd_steps"], heads, scale, tokens,
                                                           int(self.vision_num_semantic_tokens))
            else:
                self._denoiser = HunyuanVideo15Denoiser(self.transformer, shift, scale, tokens,
                                                        int(self.vision_num_semantic_tokens))
            self._denoiser.sigma_grid = sampler.grid(self._denoiser)  # the grid its heads and steps run on
        return self._denoiser

    def packed_prompts(self, prompts: list[str] | None, streams: tuple | None, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, L, D]`` float32: ``prompts`` (None: ``""`` each) or the given ``streams`` ``(embeds, mask, embeds_2,
        mask_2)``, by the pipeline's own ``encode_prompt``, the two streams side by side (:func:`pack_streams`)."""
        given = dict(zip(("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"), streams or ()))
        embeds, mask, embeds_2, mask_2 = self.encode_prompt(prompts, device=device, dtype=torch.float32, batch_size=batch,
                                                            **given)
        return pack_streams([(embeds, mask), (embeds_2, mask_2)])

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """``(C, T', H', W')`` of a video of ``num_frames`` × ``height`` × ``width`` in the VAE's latent space."""
        tf, sf = int(self.vae_scale_factor_temporal), int(self.vae_scale_factor_spatial)
        return (int(self.vae.config.latent_channels), (num_frames - 1) // tf + 1, height // sf, width // sf)

    def decode_latents(self, latents: torch.Tensor, output_type: str = "np") -> Any:
        """Normalised latents ``[B, C, T', H', W']`` → videos, as ``HunyuanVideo15Pipeline`` decodes them."""
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        with torch.no_grad():
            video = self.vae.decode(z, return_dict=False)[0]
        return self.video_processor.postprocess_video(video, output_type=output_type)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = "",
        height: int = 480,
        width: int = 848,
        num_frames: int = 121,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: torch.Generator | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        prompt_streams: tuple | None = None,
        negative_prompt_streams: tuple | None = None,
    ) -> HunyuanVideo15PipelineOutput | tuple:
        """Videos for ``prompt`` (one per prompt; or per row of ``prompt_streams``, the stock ``encode_prompt``'s
        ``(embeds, mask, embeds_2, mask_2)``). ``num_inference_steps`` / ``guidance_scale``: None → the contract's (a
        distilled student: its ladder, no CFG; guidance ``u + w (c − u)``, module doc). ``output_type="latent"``: the
        normalised latents ``[B, C, T', H', W']`` (float32)."""
        sampler, model, prompts = self.begin_call(prompt, prompt_streams, "prompt_streams= (embeds, mask, embeds_2, mask_2)")
        batch = len(prompts) if prompts is not None else int(prompt_streams[0].shape[0])
        text = self.packed_prompts(prompts, prompt_streams, batch, model.device)
        negative = None
        if cfg_enabled(sampler.resolve_guidance(guidance_scale)):
            negatives = None if negative_prompt_streams is not None else (
                [negative_prompt] * batch if isinstance(negative_prompt, str) or negative_prompt is None else list(negative_prompt))
            negative = self.packed_prompts([n if n is not None else "" for n in negatives] if negatives else None,
                                           negative_prompt_streams, batch, model.device)
        latents = sampler.sample(model, Conditioning(text, negative), self.latent_shape(num_frames, height, width), generator,
                                 num_steps=num_inference_steps, guidance_scale=guidance_scale)
        video: Any = latents if output_type == "latent" else self.decode_latents(latents, output_type)
        return self.end_call(video, return_dict, HunyuanVideo15PipelineOutput)
