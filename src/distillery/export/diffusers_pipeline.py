"""The diffusers pipeline an export folder ships as its own ``pipeline.py``: sample as ``sampling.json`` says.

A distilled student is not sampled by stock ``WanPipeline``'s many-step Euler loop: a DMD2 student
runs its few-step x0 ladder, a Self-Forcing student streams chunk by chunk through its KV cache.
The export stage copies this file into the folder as ``pipeline.py``; diffusers then loads the
folder with its own components and this class, offline::

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)
    video = pipe("a red ball moves left", generator=torch.Generator().manual_seed(0)).frames[0]

:class:`DistilledWanPipeline` is ``WanPipeline`` (same components, prompt encoding, VAE decode and
output) whose denoising loop is the registered sampler of the folder's ``sampling.json``
(:mod:`distillery.sampling`), run through the model plugin that contract needs (a causal Wan for
``causal_streaming``; the folder's model family, :mod:`distillery.models.registry`, loads it)
wrapped around the pipeline's own transformer — the code the validate stage
samples with, so for the same prompt, seed and settings it returns the latents validate saved.
It needs the ``distillery`` package installed (the folder's ``lineage.json`` names the version).

Noise: one ``torch.Generator`` draws everything the sampler asks for (the initial latents first,
``[1, C, T', H', W']`` as ``WanPipeline`` draws them, then any re-noise draws), on the generator's
device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

SAMPLING_FILE = "sampling.json"


class DistilledWanPipeline(WanPipeline):
    """``WanPipeline`` sampling through the folder's sampling contract (module doc)."""

    _plugin: Any = None

    def sampling_contract(self) -> dict[str, Any]:
        """The folder's ``sampling.json`` (the folder this pipeline was loaded from)."""
        path = Path(self.name_or_path) / SAMPLING_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: load the pipeline from an export folder of distillery")
        return json.loads(path.read_text())

    def _model_plugin(self, sampler: Any) -> Any:
        """The frozen model plugin around ``self.transformer`` that ``sampler`` needs (built once)."""
        from distillery.models.registry import load_inference_model

        if self._plugin is None:
            param = next(self.transformer.parameters())
            self._plugin = load_inference_model(self.name_or_path, param.device, param.dtype, shift=sampler.shift,
                                                role="export", transformer=self.transformer, **sampler.model_options())
        return self._plugin

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = "",
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: torch.Generator | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        max_sequence_length: int = 512,
    ) -> WanPipelineOutput | tuple:
        """Videos for ``prompt`` (one per prompt). ``num_inference_steps`` / ``guidance_scale``: None
        → the contract's (a distilled student: its ladder, no CFG). ``output_type="latent"``: the
        normalised latents ``[B, C, T', H', W']`` (float32); else decoded as ``WanPipeline`` does."""
        from distillery.models.base import Conditioning
        from distillery.sampling import build_sampler

        sampler = build_sampler(self.sampling_contract())
        model = self._model_plugin(sampler)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device = model.device
        text, negative = self.encode_prompt(prompts, negative_prompt=negative_prompt if negative_prompt is not None else "",
                                            do_classifier_free_guidance=True, max_sequence_length=max_sequence_length,
                                            device=device, dtype=torch.float32)
        if negative.shape[0] != text.shape[0]:
            negative = negative.expand_as(text)
        z_dim = int(self.vae.config.z_dim)
        tf, sf = int(self.vae_scale_factor_temporal), int(self.vae_scale_factor_spatial)
        shape = (z_dim, (num_frames - 1) // tf + 1, height // sf, width // sf)
        latents = sampler.sample(model, Conditioning(text, negative), shape, generator, num_steps=num_inference_steps,
                                 guidance_scale=guidance_scale)
        if output_type == "latent":
            video: Any = latents
        else:
            z = latents.to(self.vae.device, self.vae.dtype)
            mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
            std = torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
            decoded = self.vae.decode(z * std + mean, return_dict=False)[0]
            video = self.video_processor.postprocess_video(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        return WanPipelineOutput(frames=video) if return_dict else (video,)
