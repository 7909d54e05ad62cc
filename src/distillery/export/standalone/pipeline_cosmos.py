"""The diffusers pipeline of a Cosmos Predict 2.5 export of distillery (its ``pipeline_cosmos.py``): sample as
``sampling.json`` says.

A distilled Cosmos student is not sampled by stock ``Cosmos2_5_PredictBasePipeline``'s many-step loop: a DMD2 student
runs its few-step x0 ladder, a Self-Forcing student streams chunk by chunk through its KV cache, a PDD student decodes
blocks of its fine grid through its fused heads. diffusers loads the folder with its own components and
:class:`DistilledCosmosPipeline` (``model_index.json``: ``"_class_name": ["pipeline_cosmos", "DistilledCosmosPipeline"]``),
offline, with only torch, diffusers, transformers and accelerate installed::

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True, safety_checker=checker)
    video = pipe("a red ball moves left", generator=torch.Generator().manual_seed(0)).frames[0]

As the stock pipeline, it does not run without a safety checker (``checker``: NVIDIA's
``cosmos_guardrail.CosmosSafetyChecker``, or the caller's own object with ``to(device)`` and
``check_text_safety(prompt)``): prompts are checked with it and, where it is NVIDIA's, the videos too.

It is ``Cosmos2_5_PredictBasePipeline`` (same components, prompt encoding, VAE) whose denoising loop is the sampler of
the folder's ``sampling.json`` (:mod:`distilled_samplers`) over :class:`distilled_cosmos.CosmosDenoiser`, with
distillery's guidance ``u + w (c − u)`` (the stock pipeline's ``guidance_scale`` is ``w − 1``). For the prompt, seed,
size and settings validate used, it returns the latents validate saved (bit for bit on the CPU). Noise: one
``torch.Generator`` draws the initial latents ``[1, C, T', H', W']`` first, as the stock pipeline draws them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import Cosmos2_5_PredictBasePipeline
from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import CosmosSafetyChecker
from diffusers.pipelines.cosmos.pipeline_output import CosmosPipelineOutput

from .distilled_causal import CausalWanDenoiser  # noqa: F401  (diffusers copies only the modules a pipeline imports)
from .distilled_cosmos import CausalCosmosDenoiser, CosmosDenoiser, PDDCosmosDenoiser
from .distilled_decode import ChunkDecoder  # noqa: F401  (as above: what ContractSampling's decode imports)
from .distilled_fast import SpeedSettings
from .distilled_samplers import Sampler
from .distilled_schedule import inference_sigmas  # noqa: F401  (as above)
from .distilled_sparse import install_sparse  # noqa: F401  (as above)
from .distilled_wan import HEADS_FILE, Conditioning
from .pipeline import ContractSampling
from .sparse_attention import RECORD_KEY  # noqa: F401  (as above)
from .vae_decode import decode_video  # noqa: F401  (as above)
from .vae_kernels import available as _vae_kernels_available  # noqa: F401  (as above)


class DistilledCosmosPipeline(ContractSampling, Cosmos2_5_PredictBasePipeline):
    """``Cosmos2_5_PredictBasePipeline`` sampling through the folder's sampling contract (module doc)."""

    speed_label = "distilled Cosmos pipeline"

    def speed_settings(self) -> SpeedSettings:
        """The switches :meth:`configure_speed` set; ``attention`` stays SDPA (FlashAttention-4 is installed into Wan's
        attention only): ``auto`` becomes ``sdpa``, an explicit ``fa4`` is a ``ValueError``."""
        settings = super().speed_settings()
        if settings.attention == "fa4":
            raise ValueError("attention='fa4': the exported Cosmos pipeline runs diffusers' SDPA attention only")
        if settings.attention == "auto":
            settings = SpeedSettings(**{**vars(settings), "attention": "sdpa"})
        return settings

    def denoiser(self, sampler: Sampler) -> CosmosDenoiser:
        """The denoiser around ``self.transformer`` (built once): a causal student's (block-causal, a KV cache), a PDD
        student's with its heads (``transformer/pdd_heads.safetensors``), else the plain one."""
        if self._denoiser is None:
            kind = sampler.model_kind()
            self.transformer.eval().requires_grad_(False)
            shift, scale = sampler.schedule(self.scheduler_shift())
            if "chunk_size" in kind:
                if kind.get("given_first_frame"):
                    raise ValueError("a causal image-to-video contract: Cosmos students are text-to-world")
                self._denoiser = CausalCosmosDenoiser(self.transformer, shift, kind["chunk_size"], scale)
            elif "pdd_steps" in kind:
                heads = Path(self.name_or_path) / "transformer" / HEADS_FILE
                self._denoiser = PDDCosmosDenoiser(self.transformer, shift, kind["pdd_steps"], heads, scale)
            else:
                self._denoiser = CosmosDenoiser(self.transformer, shift, scale)
            self._denoiser.sigma_grid = sampler.grid(self._denoiser)  # the grid its heads and steps run on
        return self._denoiser

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = "",
        height: int = 704,
        width: int = 1280,
        num_frames: int = 93,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: torch.Generator | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        max_sequence_length: int = 512,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
    ) -> CosmosPipelineOutput | tuple:
        """Videos for ``prompt`` (one per prompt; or per row of ``prompt_embeds`` ``[B, L, D]``). ``num_inference_steps``
        / ``guidance_scale``: None → the contract's (a distilled student: its ladder, no CFG; guidance as distillery's,
        module doc). ``output_type="latent"``: the normalised latents ``[B, C, T', H', W']`` (float32)."""
        if self.safety_checker is None:
            raise ValueError("no safety checker: the Cosmos license asks for one (module doc)")
        sampler, model, prompts = self.begin_call(prompt, prompt_embeds, "prompt_embeds= [B, L, D]")
        self.safety_checker.to(model.device)
        for text_prompt in prompts or []:
            if not self.safety_checker.check_text_safety(text_prompt):
                raise ValueError(f"the safety checker refused the prompt {text_prompt!r}")
        text, negative = self.prompt_pair(sampler, model, prompts, negative_prompt, guidance_scale, prompt_embeds,
                                          negative_prompt_embeds, max_sequence_length)
        latents = sampler.sample(model, Conditioning(text, negative), self.latent_shape(num_frames, height, width), generator,
                                 num_steps=num_inference_steps, guidance_scale=guidance_scale)
        video: Any = latents if output_type == "latent" else self.decode_latents(latents, "np")
        if output_type != "latent" and isinstance(self.safety_checker, CosmosSafetyChecker):  # NVIDIA's: the videos too
            checked = [self.safety_checker.check_video_safety((v * 255).astype(np.uint8)) for v in video]
            video = np.stack(checked).astype(np.float32) / 255.0
        if output_type == "pil":
            video = [self.video_processor.numpy_to_pil(v) for v in video]
        return self.end_call(video, return_dict, CosmosPipelineOutput)
