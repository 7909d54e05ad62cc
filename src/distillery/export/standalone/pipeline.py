"""The diffusers pipeline of an export folder of distillery (its ``pipeline.py``): sample as ``sampling.json`` says.

A distilled student is not sampled by stock ``WanPipeline``'s many-step Euler loop: a DMD2 student
runs its few-step x0 ladder, a Self-Forcing student streams chunk by chunk through its KV cache, a
PDD student decodes blocks of its fine grid through fused heads. diffusers loads the folder with its
own components and this class, offline, with only torch, diffusers, transformers and accelerate installed
(diffusers loads Wan's transformer only where accelerate is)::

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)
    video = pipe("a red ball moves left", generator=torch.Generator().manual_seed(0)).frames[0]

:class:`DistilledWanPipeline` is ``WanPipeline`` (same components, prompt encoding, VAE decode and
output) whose denoising loop is the sampler of the folder's ``sampling.json``
(:mod:`distilled_samplers`) over a denoiser wrapped around the pipeline's own transformer
(:mod:`distilled_wan`; block-causal with a KV cache for ``causal_streaming``, :mod:`distilled_causal`).
Every module it needs is in the folder beside it and imported relatively (diffusers copies those).
For the prompt, seed, size and settings the validate stage used, it returns the latents validate saved (bit for
bit where both ran the same kernels, e.g. on the CPU; on a GPU to the precision of the kernels each ran).

Speed (:mod:`distilled_fast`): on a GPU the pipeline uses FlashAttention-4 where ``flash-attn-4`` is installed,
compiles each transformer block and decodes with the fused chunked VAE decoder, each part only where it can run
(:meth:`DistilledWanPipeline.configure_speed` switches each; the first video prints one line saying which path it
took). On the CPU everything is stock: diffusers' attention and frame-by-frame ``vae.decode``.

Image-to-video (an export of a Wan 2.1 I2V base: its ``model_index.json`` names the image encoder and processor too,
and the transformer takes the first frame): pass the frame as ``image=`` (a PIL image, array or tensor, as diffusers'
``VideoProcessor.preprocess`` takes it) and the pipeline builds what ``WanImageToVideoPipeline`` builds from it — the
VAE's latent (its mode, normalised) of ``[frame, zeros…]`` after the mask of the first latent frame, and the image
encoder's penultimate hidden states where the folder has an image encoder — or pass them precomputed as
``first_frame=`` ``[1 or B, M + C, T', H', W']`` and ``image_embeds=`` ``[1 or B, N, D]``
(:meth:`DistilledWanPipeline.encode_first_frame`, :meth:`DistilledWanPipeline.encode_image_embeds`)::

    video = pipe("a red ball moves left", image=Image.open("first_frame.png"), height=480, width=832,
                 generator=torch.Generator().manual_seed(0)).frames[0]

Wan 2.2 (an export of a Wan 2.2 base: its ``model_index.json`` as diffusers lays it out, :meth:`DistilledWanPipeline.layout`):
TI2V-5B's ``expand_timesteps`` feeds the transformer one timestep per token; A14B's two experts are both loaded
(``transformer``, ``transformer_2``) and each step goes through the expert of its timestep (``transformer`` at
``t >= boundary_ratio · 1000``, ``transformer_2`` below), as distillery's validate samples them: a causal student
keeps a KV cache per expert, a PDD student a head bank per expert; ``guidance_scale_2`` is the low-noise expert's
CFG scale, as ``WanPipeline``'s.

Noise: one ``torch.Generator`` draws everything (the initial latents ``[1, C, T', H', W']`` first, as
``WanPipeline`` draws them, then any re-noise draws), on the generator's device.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from .distilled_causal import CausalWanDenoiser
from .distilled_decode import ChunkDecoder, decode_frames
from .distilled_fast import SpeedPlan, SpeedSettings, apply_speed_plan, decode_chunk_frames, plan_speed
from .distilled_samplers import Sampler, build_sampler, cfg_enabled
from .distilled_schedule import inference_sigmas  # noqa: F401  (diffusers copies the modules a pipeline imports)
from .distilled_sparse import folder_spec, install_sparse
from .distilled_wan import HEADS_FILE, Conditioning, PDDWanDenoiser, WanDenoiser, WanLayout
from .sparse_attention import RECORD_KEY  # noqa: F401  (diffusers copies a module the pipeline imports)
from .vae_decode import decode_video  # noqa: F401  (diffusers copies a module the pipeline imports)
from .vae_kernels import available as _vae_kernels_available  # noqa: F401  (diffusers copies a module the pipeline imports)

SAMPLING_FILE = "sampling.json"


class ContractSampling:
    """What a distilled pipeline of any family shares (a mixin before the family's diffusers pipeline class): the
    folder's sampling contract, its scheduler's shift, the forwards per video, the GPU path's switches, the VAE decode
    (``AutoencoderKLWan`` latents: Wan's and Cosmos Predict 2.5's)."""

    _denoiser: Any = None
    _speed_settings: SpeedSettings | None = None
    speed_plan: SpeedPlan | None = None  # what ran (set on the first video)
    speed_label = "distilled Wan pipeline"  # what the plan's line names

    def configure_speed(self, **switches: Any) -> SpeedSettings:
        """Choose the GPU path's parts before the first video (:class:`distilled_fast.SpeedSettings`: ``attention``
        auto|fa4|sdpa, ``compile`` auto|blocks|off, ``decode`` auto|fused|stock, ``fp8`` off|on, ``compile_mode``,
        ``decode_chunk_frames``); every part ``auto`` by default. Refused once a video has been sampled."""
        if self.speed_plan is not None:
            raise RuntimeError("configure_speed must come before the first video (the modules are already changed)")
        self._speed_settings = SpeedSettings(**switches)
        return self._speed_settings

    def speed_settings(self) -> SpeedSettings:
        """The switches :meth:`configure_speed` set (every part ``auto`` when it was not called)."""
        return self._speed_settings or SpeedSettings()

    def prepare_speed(self, model: Any) -> SpeedPlan:
        """Plan the path for where the transformer and VAE are now and change them as planned (once); prints
        the plan's one line (:meth:`distilled_fast.SpeedPlan.describe`)."""
        if self.speed_plan is None:
            plan = plan_speed(self.speed_settings(), model.device, model.dtype, self.vae)
            apply_speed_plan(plan, self.transformer, self.vae)
            second = getattr(getattr(model, "layout", None), "second", None)
            if second is not None:  # the low-noise expert takes the same path (the VAE is changed once)
                apply_speed_plan(plan, second, None)
            self.speed_plan = plan
            print(plan.describe(self.speed_label), file=sys.stderr, flush=True)
        return self.speed_plan

    def sampling_contract(self) -> dict[str, Any]:
        """The folder's ``sampling.json`` (the folder this pipeline was loaded from)."""
        path = Path(self.name_or_path) / SAMPLING_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: load the pipeline from an export folder of distillery")
        return json.loads(path.read_text())

    def scheduler_shift(self) -> float:
        """The flow shift of the folder's scheduler config (``shift``, or UniPC's ``flow_shift``; else 1)."""
        cfg = self.scheduler.config
        for key in ("shift", "flow_shift"):
            if cfg.get(key) is not None:
                return float(cfg[key])
        return 1.0

    def begin_call(self, prompt: str | list[str] | None, given: Any, given_as: str) -> tuple[Sampler, Any, list[str] | None]:
        """What every family's call starts with: ``(sampler, denoiser, prompts)`` — the folder's sampler, the denoiser it
        needs (the speed plan made on the first call) and ``prompt`` as a list (None: none given). A ``ValueError`` when
        neither ``prompt`` nor ``given`` (the precomputed prompt, passed as ``given_as``) is there."""
        if prompt is None and given is None:
            raise ValueError(f"pass prompt= (text) or {given_as}")
        sampler = build_sampler(self.sampling_contract())
        model = self.denoiser(sampler)
        self.prepare_speed(model)
        return sampler, model, None if prompt is None else [prompt] if isinstance(prompt, str) else list(prompt)

    def end_call(self, video: Any, return_dict: bool, output_class: type) -> Any:
        """What every family's call ends with: the model hooks freed, ``video`` in the family's output (or a tuple)."""
        self.maybe_free_model_hooks()
        return output_class(frames=video) if return_dict else (video,)

    def nfe(self, num_frames: int = 81, num_inference_steps: int | None = None, guidance_scale: float | None = None) -> int:
        """Transformer forwards per video of ``num_frames`` frames for a call with these arguments."""
        sampler = build_sampler(self.sampling_contract())
        latent_frames = (num_frames - 1) // int(self.vae_scale_factor_temporal) + 1
        return sampler.nfe(num_inference_steps, guidance_scale, num_frames=latent_frames)

    def prompt_pair(self, sampler: Sampler, model: Any, prompts: list[str] | None, negative_prompt: Any,
                    guidance_scale: float | None, prompt_embeds: torch.Tensor | None,
                    negative_prompt_embeds: torch.Tensor | None, max_sequence_length: int,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(text [B, L, D], negative or None)`` float32 on the model's device, by the pipeline's own ``encode_prompt``:
        the negative prompt (``""`` when None) only where ``sampler`` guides, expanded to the batch."""
        cfg = cfg_enabled(sampler.resolve_guidance(guidance_scale))  # the negative prompt is encoded only for CFG
        text, negative = self.encode_prompt(prompts, negative_prompt=negative_prompt if negative_prompt is not None else "",
                                            do_classifier_free_guidance=cfg, prompt_embeds=prompt_embeds,
                                            negative_prompt_embeds=negative_prompt_embeds,
                                            max_sequence_length=max_sequence_length, device=model.device, dtype=torch.float32)
        if negative is not None and negative.shape[0] != text.shape[0]:
            negative = negative.expand_as(text)
        return text, negative

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """``(C, T', H', W')`` of a video of ``num_frames`` × ``height`` × ``width`` in the VAE's latent space."""
        tf, sf = int(self.vae_scale_factor_temporal), int(self.vae_scale_factor_spatial)
        return (int(self.vae.config.z_dim), (num_frames - 1) // tf + 1, height // sf, width // sf)

    def decode_latents(self, latents: torch.Tensor, output_type: str = "np") -> Any:
        """Normalised latents ``[B, C, T', H', W']`` → videos, as ``WanPipeline`` decodes them
        (:func:`distilled_decode.decode_frames`: on the GPU's fused path the frames reach the host while the decoder
        still works)."""
        chunk = decode_chunk_frames(self.speed_plan or SpeedPlan(), self.vae, tuple(latents.shape))
        return decode_frames(self.vae, latents, chunk, output_type, self.video_processor)

    def stream_frames(self, sampler: Sampler, model: Any, cond: Any, shape: tuple, generator: torch.Generator | None,
                      num_steps: int | None, guidance_scale: float | None, output_type: str,
                      guidance_scale_2: float | None = None) -> Iterator[Any]:
        """A causal student's chunks as they finish (``sampler.stream``), each decoded through the VAE's causal cache
        on a CUDA stream of higher priority while the next chunk denoises (:class:`distilled_decode.ChunkDecoder`);
        ``latent``: the chunks' normalised latents. A ``ValueError`` for a sampler that does not stream."""
        if not hasattr(sampler, "stream"):
            raise ValueError(f"stream() yields a causal student's chunks; this folder's sampler is {sampler.name!r}: "
                             "call the pipeline")
        chunks = sampler.stream(model, cond, shape, generator, num_steps=num_steps, guidance_scale=guidance_scale,
                                guidance_scale_2=guidance_scale_2)
        if output_type == "latent":
            yield from (x0 for _, x0 in chunks)
            return
        chunk = decode_chunk_frames(self.speed_plan or SpeedPlan(), self.vae, (1, *shape))
        decoder = ChunkDecoder(self.vae, chunk, output_type, self.video_processor)
        pending = None
        for _, x0 in chunks:  # the next chunk's denoising is queued before the last one's frames are waited for
            piece = decoder.launch(x0)
            if pending is not None:
                yield pending.result()
            pending = piece
        if pending is not None:
            yield pending.result()


class DistilledWanPipeline(ContractSampling, WanPipeline):
    """``WanPipeline`` sampling through the folder's sampling contract (module doc); an image-to-video folder's
    image encoder and processor are its optional components."""

    _optional_components = ["transformer", "transformer_2", "image_encoder", "image_processor"]

    def __init__(self, tokenizer: Any, text_encoder: Any, vae: Any, scheduler: Any, transformer: Any = None,
                 transformer_2: Any = None, boundary_ratio: float | None = None, expand_timesteps: bool = False,
                 image_encoder: Any = None, image_processor: Any = None) -> None:
        super().__init__(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer,
                         transformer_2=transformer_2, boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
        self.register_modules(image_encoder=image_encoder, image_processor=image_processor)

    @property
    def components(self) -> dict[str, Any]:
        """diffusers' ``components``, without the image encoder and processor where the folder has none (a
        text-to-video folder: its parts still make a stock ``WanPipeline(**parts)``)."""
        parts = super().components
        return {k: v for k, v in parts.items() if not (k in ("image_encoder", "image_processor") and v is None)}

    def image_to_video(self) -> bool:
        """Whether the transformer takes a first frame (``in_channels`` > ``out_channels``: Wan 2.1 I2V)."""
        cfg = self.transformer.config
        return int(cfg.in_channels) > int(cfg.get("out_channels") or cfg.in_channels)

    @torch.no_grad()
    def encode_first_frame(self, image: Any, num_frames: int, height: int, width: int) -> torch.Tensor:
        """The first-frame condition ``float32 [B, M + C, T', H', W']`` of ``image`` (one frame or a batch, as
        ``VideoProcessor.preprocess`` takes them), as ``WanImageToVideoPipeline`` builds it: the mask (``M`` = the VAE's
        temporal factor channels, ones at the first latent frame, zeros after) then the normalised latent (the VAE's
        mode) of the ``num_frames`` video whose first frame is ``image`` and the rest zeros."""
        tf, sf = int(self.vae_scale_factor_temporal), int(self.vae_scale_factor_spatial)
        pixels = self.video_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(self.vae.device, self.vae.dtype).unsqueeze(2)  # [B, 3, 1, H, W] in [-1, 1]
        b = pixels.shape[0]
        video = torch.cat([pixels, pixels.new_zeros(b, 3, num_frames - 1, height, width)], dim=2)
        z = self.vae.encode(video).latent_dist.mode().float()
        z_dim = int(self.vae.config.z_dim)
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = (z - mean) / std
        mask = torch.zeros(b, tf, z.shape[2], height // sf, width // sf, dtype=z.dtype, device=z.device)
        mask[:, :, 0] = 1.0
        return torch.cat([mask, z], dim=1)

    @torch.no_grad()
    def encode_image_embeds(self, image: Any) -> torch.Tensor | None:
        """The image encoder's penultimate hidden states ``float32 [B, N, D]`` of ``image`` (the processor first), as
        ``WanImageToVideoPipeline.encode_image``; None where the folder has no image encoder."""
        if getattr(self, "image_encoder", None) is None or getattr(self, "image_processor", None) is None:
            return None
        pixels = self.image_processor(images=image, return_tensors="pt").to(self.image_encoder.device)
        return self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2].float()

    def layout(self) -> WanLayout:
        """How the folder's transformer(s) are fed, from its ``model_index.json`` as ``WanPipeline`` reads it: Wan 2.2
        TI2V-5B's ``expand_timesteps`` (one timestep per token), A14B's ``transformer_2`` and ``boundary_ratio`` (the
        low-noise expert and where it takes over); Wan 2.1's (neither) otherwise."""
        ratio = self.config.get("boundary_ratio")
        second = getattr(self, "transformer_2", None)
        if (ratio is None) != (second is None):
            raise ValueError(f"{self.name_or_path}: model_index.json's boundary_ratio {ratio} and its transformer_2 "
                             f"({'none' if second is None else 'loaded'}): two experts need both, one transformer neither")
        if second is not None:
            second.eval().requires_grad_(False)
        return WanLayout(bool(self.config.get("expand_timesteps", False)), second, None if ratio is None else float(ratio))

    def denoiser(self, sampler: Sampler) -> WanDenoiser:
        """The denoiser around ``self.transformer`` (and ``self.transformer_2``, two experts) that ``sampler`` needs
        (built once)."""
        if self._denoiser is None:
            self.transformer.eval().requires_grad_(False)
            shift, scale = sampler.schedule(self.scheduler_shift())
            kind, layout = sampler.model_kind(), self.layout()
            if "chunk_size" in kind:
                self._denoiser = CausalWanDenoiser(self.transformer, shift, kind["chunk_size"], scale,
                                                   given_first_frame=bool(kind.get("given_first_frame", False)),
                                                   layout=layout)
            elif "pdd_steps" in kind:
                heads = Path(self.name_or_path) / "transformer" / HEADS_FILE
                self._denoiser = PDDWanDenoiser(self.transformer, shift, kind["pdd_steps"], heads, scale, layout=layout)
            else:
                self._denoiser = WanDenoiser(self.transformer, shift, scale, layout=layout)
            spec = folder_spec(Path(self.name_or_path) / "transformer")  # trained sparse: sampled sparse
            if spec is not None:
                if layout.second is not None:
                    raise ValueError("a transformer trained with sparse attention on two experts: not supported")
                install_sparse(self.transformer, spec)
            self._denoiser.sigma_grid = sampler.grid(self._denoiser)  # the grid its heads and steps run on
        return self._denoiser

    def _inputs(self, a: dict[str, Any]) -> tuple[Sampler, WanDenoiser, Conditioning, tuple]:
        """``(sampler, denoiser, conditioning, latent shape [C, T', H', W'])`` of a call whose arguments are ``a`` (by
        name, :meth:`__call__`'s; the speed plan made on the first): the prompt encoded, an image-to-video model's first
        frame taken."""
        sampler, model, prompts = self.begin_call(a["prompt"], a["prompt_embeds"], "prompt_embeds= [B, L, D]")
        text, negative = self.prompt_pair(sampler, model, prompts, a["negative_prompt"], a["guidance_scale"],
                                          a["prompt_embeds"], a["negative_prompt_embeds"], a["max_sequence_length"])
        image, first_frame, image_embeds = a["image"], a["first_frame"], a["image_embeds"]
        num_frames, height, width = a["num_frames"], a["height"], a["width"]
        shape = self.latent_shape(num_frames, height, width)
        if image is not None and first_frame is None:
            first_frame = self.encode_first_frame(image, num_frames, height, width)
        if image is not None and image_embeds is None:
            image_embeds = self.encode_image_embeds(image)
        if first_frame is None and self.image_to_video():
            raise ValueError("this is an image-to-video model: pass the first frame as image= (or first_frame= and "
                             "image_embeds=)")
        cond = Conditioning(text, negative, None if first_frame is None else first_frame.float(),
                            None if image_embeds is None else image_embeds.float())
        return sampler, model, cond, shape

    @torch.no_grad()
    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """A causal (``causal_streaming``) student's video chunk by chunk, for :meth:`__call__`'s arguments (bound to its
        signature, written once; ``return_dict`` aside): yields each finished chunk's frames (``np``: float32
        ``[B, f, H, W, 3]``; ``pt``: ``[B, f, 3, H, W]``; ``pil``: per video a list of images; ``latent``: the chunk's
        normalised latents ``[B, C, f', H', W']``) — the first chunk's 1 + 4 (f' − 1) frames, then 4 f' a chunk.
        Concatenated in time they are the frames ``__call__`` returns for the same arguments (bit for bit on the CPU,
        where both decode with diffusers' loop; on a GPU the fused decode's calls are the chunks, so the sums differ by
        rounding). Each finished chunk is decoded through the VAE's causal cache on a CUDA stream of higher priority
        while the next chunk denoises (:class:`distilled_decode.ChunkDecoder`); a ``ValueError`` for another sampler."""
        if "return_dict" in kwargs:
            raise TypeError("stream() yields frames: it takes __call__'s arguments but return_dict")
        call = inspect.signature(type(self).__call__).bind(self, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        sampler, model, cond, shape = self._inputs(a)
        yield from self.stream_frames(sampler, model, cond, shape, a["generator"], a["num_inference_steps"],
                                      a["guidance_scale"], a["output_type"], a["guidance_scale_2"])
        self.maybe_free_model_hooks()

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = "",
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: torch.Generator | None = None,
        output_type: str = "np",
        guidance_scale_2: float | None = None,
        return_dict: bool = True,
        max_sequence_length: int = 512,
        image: Any = None,
        first_frame: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
    ) -> WanPipelineOutput | tuple:
        """Videos for ``prompt`` (one per prompt; or per row of ``prompt_embeds`` ``[B, L, D]``). ``num_inference_steps``
        / ``guidance_scale`` / ``guidance_scale_2``: None → the contract's (a distilled student: its ladder, no CFG); of
        two experts, ``guidance_scale`` is the high-noise expert's and ``guidance_scale_2`` the low-noise one's, as
        ``WanPipeline``'s. ``output_type="latent"``:
        the normalised latents ``[B, C, T', H', W']`` (float32); else decoded as ``WanPipeline`` does. An
        image-to-video model needs ``image`` or ``first_frame`` (+ ``image_embeds`` where it takes them; module doc).
        A causal student's chunks, as they finish: :meth:`stream`."""
        sampler, model, cond, shape = self._inputs(locals())  # every argument, by name
        latents = sampler.sample(model, cond, shape, generator, num_steps=num_inference_steps, guidance_scale=guidance_scale,
                                 guidance_scale_2=guidance_scale_2)
        video: Any = latents if output_type == "latent" else self.decode_latents(latents, output_type)
        return self.end_call(video, return_dict, WanPipelineOutput)
