"""What every candidate of a validation run shares on the device: the base's encoders, the prompts' embeddings
(:class:`PromptEmbeddings`, or made by the base's text encoder), the latent shape and the analyzer
(:class:`SamplingContext`), and how it resolves, loads, warms up and samples one candidate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from distillery.common.errors import UserError
from distillery.evaluation.candidates import SAMPLING_FILE, Candidate
from distillery.evaluation.validation_config import ValidationConfig

if TYPE_CHECKING:
    from distillery.models.base import ModelBase


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """``auto`` / ``fp32`` / ``bf16`` on ``device`` → the dtype: auto is bfloat16 on CUDA, float32 elsewhere."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def resolve_vae_decode(chunk_frames: int | None, device: torch.device) -> tuple[int | None, bool]:
    """The VAE decode's ``(chunk_frames, fused)`` (:mod:`distillery.data.vae_decode`): on CUDA, ``chunk_frames``
    null is sized to the GPU (``auto_chunk_frames``) and the residual blocks are fused (the same function in
    fewer passes); elsewhere diffusers' own frame-by-frame decode (``1``, unfused: the CPU's frames bit for bit
    as before)."""
    if device.type != "cuda":
        return (int(chunk_frames) if chunk_frames is not None else 1), False
    return (int(chunk_frames) if chunk_frames is not None else None), True



@dataclass
class LoadedCandidate:
    """A candidate's model plugin and flow shift, ready to sample."""

    model: "ModelBase"  # frozen plugin of the folder's family (eval; fp32, or bf16 per ValidationConfig.precision) bound to the run device
    shift: float  # flow shift of its schedule


@dataclass
class ResolvedCandidate:
    """Where a candidate's model is and how it is sampled, before anything is loaded."""

    loaders: Any  # its family's registry.FamilyLoaders
    transformer_dir: Path
    scheduler_dir: Path | None
    shift: float  # flow shift of its schedule (the candidate's, its folder's scheduler's, else the base's)
    options: dict[str, Any]  # the model options its sampler asks for (e.g. chunk_size: a causal model)


@dataclass(frozen=True)
class PromptEmbeddings:
    """Prompt embeddings the base's own text encoder made earlier (the latent set stores them):
    ``texts[i]`` is prompt ``i``'s unpadded ``[L_i, D]``, ``negative`` the empty prompt's ``[L, D]``.
    Given to :func:`run_validation`, they replace loading the text encoder and re-encoding."""

    texts: list[torch.Tensor]
    negative: torch.Tensor
    first_frames: list[torch.Tensor] | None = None  # image-to-video: prompt i's first-frame condition [M + C, T, H, W]
    image_embeds: list[torch.Tensor] | None = None  # image-to-video: prompt i's image embeddings [N, D_img]


class SamplingContext:
    """Base-model parts shared by every candidate: encoders, prompt embeddings, latent shape, analyzer."""

    def __init__(self, base_dir: Path, prompts: list[str], cfg: ValidationConfig,
                 embeddings: PromptEmbeddings | None = None) -> None:
        from distillery.clips.analyzer import AnalyzerConfig
        from distillery.components.precision import compile_wanted
        from distillery.data.encoders import BaseEncoders
        from distillery.models.registry import latent_shape_for

        self.base_dir = base_dir
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = resolve_dtype(cfg.precision, self.device)  # the candidates' (as WanPipeline(torch_dtype=...) runs them)
        self.vae_dtype = resolve_dtype(cfg.vae_precision, self.device)
        self.compile = compile_wanted(cfg.compile, self.device, self.dtype)  # training's rule
        decode = resolve_vae_decode(cfg.vae_chunk_frames, self.device)  # decided here, told to the encoders once
        self.encoders = BaseEncoders(base_dir, self.device, cfg.max_sequence_length, text_encoder=embeddings is None,
                                     vae_dtype=self.vae_dtype, decode=decode)
        length = self.encoders.max_sequence_length
        if embeddings is None:
            embeds = self.encoders.encode_prompts(list(prompts) + [""])
        else:
            embeds = [t.float() for t in [*embeddings.texts, embeddings.negative]]
            if len(embeddings.texts) != len(prompts) or any(t.ndim != 2 or t.shape[1] != self.encoders.text_dim for t in embeds):
                raise UserError(f"validate: the given prompt embeddings do not fit: {len(embeddings.texts)} for {len(prompts)} "
                                f"prompts, shapes {[list(t.shape) for t in embeds[:3]]}…, the base's text width is "
                                f"{self.encoders.text_dim}; rerun the latents stage with this base")
        self.text = [self._pad(e, length).to(self.device) for e in embeds[:-1]]  # each [1, L, D], on the device
        self.negative = self._pad(embeds[-1], length).to(self.device)  # [1, L, D]
        self.latent_shape = tuple(latent_shape_for(base_dir, cfg.num_frames, cfg.height, cfg.width, "validate"))
        self.first_frames, self.image_embeds = self._image_conditioning(embeddings, len(prompts))
        # what the frames depend on: the resolved chunk and whether the fused blocks apply to this VAE
        self.vae_decode = (self.encoders.chunk_frames_for(self.latent_shape), self.encoders.fused_decode)
        analyzer_json = base_dir / "analyzer.json"
        self.analyzer = AnalyzerConfig(**json.loads(analyzer_json.read_text())) if analyzer_json.is_file() else None
        self.base_shift = self._scheduler_shift(base_dir / "scheduler")
        self._last: tuple[tuple, "ModelBase"] | None = None  # (folder, shift, model options), model: the last loaded
        # (the teacher's step counts share it)
        self._digests: dict[tuple[str, ...], dict[str, str]] = {}  # a candidate's folders → their files' sha256

    def _image_conditioning(self, embeddings: PromptEmbeddings | None, count: int,
                            ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Each prompt's first-frame condition ``[1, M + C, T, H, W]`` and image embeddings ``[1, N, D]`` on the device
        (an image-to-video base: the frames the latents stored, every candidate is given them); ``(None, None)`` for a
        text-to-video base. One :class:`UserError` line when an I2V base has no first frames or they do not fit."""
        if not self.encoders.image_to_video:
            return None, None
        frames = embeddings.first_frames if embeddings is not None else None
        if frames is None or len(frames) != count:
            raise UserError(f"validate: {self.base_dir} is an image-to-video base: every prompt needs its first frame, "
                            "which the latents stage stores (validate.prompts cannot give them); validate on the latent set")
        if any(tuple(f.shape[1:]) != tuple(self.latent_shape[1:]) for f in frames):
            raise UserError(f"validate: the stored first frames are {list(frames[0].shape)}, the samples' latents "
                            f"{list(self.latent_shape)}; validate at the latents' frames and size")
        images = embeddings.image_embeds if embeddings is not None else None
        return ([f.float()[None].to(self.device) for f in frames],
                [e.float()[None].to(self.device) for e in images] if images is not None else None)

    def _image_inputs(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The ``first_frame`` / ``image_embeds`` of :class:`Conditioning` for prompts ``indices`` (none: text-to-video)."""
        if self.first_frames is None:
            return {}
        out = {"first_frame": torch.cat([self.first_frames[i] for i in indices])}
        if self.image_embeds is not None:
            out["image_embeds"] = torch.cat([self.image_embeds[i] for i in indices])
        return out

    @staticmethod
    def _pad(embed: torch.Tensor, length: int) -> torch.Tensor:
        """Unpadded ``[L_i, D]`` → zero-padded ``[1, length, D]`` (as WanPipeline pads)."""
        out = embed.new_zeros(length, embed.shape[1])
        out[: embed.shape[0]] = embed[:length]
        return out[None]

    @staticmethod
    def _scheduler_shift(folder: Path | None) -> float | None:
        from distillery.models.schedule import read_scheduler_shift

        if folder is None or not (folder / "scheduler_config.json").is_file():
            return None
        return read_scheduler_shift(folder)

    def resolve(self, cand: Candidate) -> ResolvedCandidate:
        """Where a candidate's weights are, its flow shift and the model options its sampler asks for
        (nothing loaded)."""
        from distillery.models.registry import family_of

        loaders = family_of(cand.model_dir).loaders()  # a folder of no registered family: one line
        transformer_dir, scheduler_dir = loaders.locate_transformer(cand.model_dir)
        shift = cand.shift if cand.shift is not None else self._scheduler_shift(scheduler_dir)
        shift = shift if shift is not None else self.base_shift
        if shift is None:
            raise UserError(f"candidate {cand.name}: no scheduler config beside {transformer_dir} or in {self.base_dir}; "
                            "set the candidate's shift")
        options = cand.build_sampler(float(shift)).model_options()  # e.g. a causal model for causal_streaming
        return ResolvedCandidate(loaders, transformer_dir, scheduler_dir, float(shift), options)

    def context_material(self, prompts: list[str], seed_grid: list[list[int]]) -> dict[str, Any]:
        """What every candidate's samples of this run depend on besides the candidate (the sample cache's
        ``context`` material, :mod:`distillery.evaluation.sample_cache`)."""
        from distillery.evaluation.sample_cache import CACHE_FORMAT, code_digest, file_digests, machine_facts, tensor_digest

        cfg = self.cfg
        return {"format": CACHE_FORMAT, "code": code_digest(), "machine": machine_facts(self.device, self.dtype),
                "prompts": list(prompts), "text": tensor_digest([*self.text, self.negative]), "seed_grid": seed_grid,
                **({"first_frames": tensor_digest([*self.first_frames, *(self.image_embeds or [])])}
                   if self.first_frames is not None else {}),  # image-to-video: the frames every candidate is given
                "latent_shape": list(self.latent_shape),
                **({"sample_batch": cfg.sample_batch} if cfg.sample_batch != 1 else {}),  # batched: other rounding
                **({"vae_dtype": str(self.vae_dtype)} if self.vae_dtype != torch.float32 else {}),  # other frames
                **({"vae_decode": list(self.vae_decode)} if self.vae_decode != (1, False) else {}),  # other rounding
                **({"compiled": "blocks"} if self.compile else {}),  # Inductor's kernels: other rounding
                "video": {"num_frames": cfg.num_frames, "height": cfg.height, "width": cfg.width, "fps": cfg.fps},
                "vae": file_digests([self.base_dir / "vae"], self.base_dir),
                "analyzer": asdict(self.analyzer) if self.analyzer is not None else None}

    def candidate_material(self, cand: Candidate, resolved: ResolvedCandidate) -> dict[str, Any]:
        """What a candidate's samples depend on: its sampling contract and every byte of its weights
        (transformer and scheduler folders, ``sampling.json``)."""
        from distillery.evaluation.sample_cache import file_digests

        parts = [resolved.transformer_dir, *([resolved.scheduler_dir] if resolved.scheduler_dir else [])]
        if (cand.model_dir / SAMPLING_FILE).is_file():
            parts.append(cand.model_dir / SAMPLING_FILE)
        where = tuple(str(Path(p).resolve()) for p in parts)
        if where not in self._digests:  # the teacher's step counts share one folder: read once
            self._digests[where] = file_digests(parts, cand.model_dir)
        return {"sampler": cand.sampler, "num_steps": cand.num_steps, "guidance_scale": cand.guidance_scale,
                "timesteps": list(cand.timesteps) if cand.timesteps is not None else None, "options": cand.options,
                "shift": resolved.shift, "model_options": resolved.options, "model_files": self._digests[where]}

    def load(self, cand: Candidate, resolved: ResolvedCandidate) -> LoadedCandidate:
        """Load a candidate's model plugin and check it fits the base's latents and text embeddings."""
        loaders, transformer_dir, shift, options = resolved.loaders, resolved.transformer_dir, resolved.shift, resolved.options
        key = (transformer_dir.resolve(), shift, tuple(sorted(options.items())))
        if self._last is not None and self._last[0] == key:
            model = self._last[1]
        else:
            self._last = None
            model = loaders.load_inference_model(transformer_dir, self.device, self.dtype, shift=shift, role=cand.name,
                                                 **options)
            if self.compile:  # regional: one graph for every block, reused by the next candidate of the same family
                for block in model.shardable_blocks():
                    block.compile()
        channels, text_dim = loaders.input_widths(model.transformer_config())
        if channels != self.latent_shape[0] or text_dim != self.encoders.text_dim:
            raise UserError(f"candidate {cand.name}: {transformer_dir} takes {channels} latent channels and "
                            f"text_dim {text_dim}, but the base {self.base_dir} gives {self.latent_shape[0]} and "
                            f"{self.encoders.text_dim}; validate it against the base it was trained from")
        self._last = (key, model)
        return LoadedCandidate(model, shift)

    def sample(self, cand: Candidate, loaded: LoadedCandidate, indices: list[int], seeds: list[int]) -> torch.Tensor:
        """Normalised latents ``[B, C, T, H, W]``, row ``b`` for prompt ``indices[b]`` with the noise of a generator
        seeded ``seeds[b]`` (:func:`generator_seed`), from the registered sampler the candidate's sampling contract
        names. One video (``B = 1``) draws from its generator exactly as a batch of it alone does."""
        from distillery.models.base import Conditioning

        if len(indices) != len(seeds) or not indices:
            raise ValueError(f"sample: {len(indices)} prompt indices for {len(seeds)} seeds")
        sampler = cand.build_sampler(loaded.shift)
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        if len(indices) == 1:
            cond, noise = Conditioning(self.text[indices[0]], self.negative, **self._image_inputs(indices)), generators[0]
        else:
            cond = Conditioning(torch.cat([self.text[i] for i in indices]), self.negative.expand(len(indices), -1, -1),
                                **self._image_inputs(indices))
            noise = generators
        with torch.no_grad():
            return sampler.sample(loaded.model, cond, self.latent_shape, noise, num_steps=cand.num_steps,
                                  guidance_scale=cand.guidance_scale)

    def warm_up(self, loaded: LoadedCandidate) -> None:
        """One untimed forward (and decode) so lazy initialisation does not count as latency."""
        from distillery.models.base import Conditioning

        with torch.no_grad():
            x = torch.zeros(1, *self.latent_shape, device=self.device)
            loaded.model.predict_noise(x, torch.zeros(1, device=self.device), Conditioning(self.negative, **self._image_inputs([0])))
            self.encoders.decode_latents(x)
        synchronize(self.device)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; elsewhere nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
