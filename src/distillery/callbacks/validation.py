"""Validation during training: sample fixed prompts with the role's registered sampler and log them.

At step 0 (:meth:`ValidationCallback.on_loop_start` of a fresh run) and every ``every_steps``
optimizer steps, the callback samples the first ``num_prompts`` rows of a latent set's split —
their captions and stored text embeddings, zero-padded to ``text_max_length`` as training pads
them, with the stored empty-prompt embedding as the CFG negative — through the sampler that the
method's sampling contract (``ctx.sampling``) names, from the role's model plugin. Prompt ``i``
starts from noise of a ``torch.Generator`` seeded ``seed + i``: the prompts, the noise and the GIF's
rate are the settings it shares with the validate stage
(:class:`~distillery.config.validation.ValidationSampling`, which its config extends).

Every rank samples the same prompts with the same generators (under FSDP2 every rank must run the
forwards; no rank waits on another). Rank 0 then logs through ``ctx.tracker``:

- ``val/latent_std``, ``val/latent_mean`` — statistics of the sampled normalised latents;
- ``val/sample_s`` — wall seconds to sample all prompts; ``val/nfe`` — forwards per video;
- with ``vae_from`` (a diffusers folder holding ``vae/``): the decoded videos as one GIF grid (one
  row, a column per prompt) logged as the artifact ``validation/step_<step>.gif``, and with a
  ``scorer`` plugin that scores that folder's videos, ``val/<name>`` for each name it scores: the
  fraction of the prompts it scored true (``scorer: distillery.clips.analyzer.folder_scorer``, the
  pipeline's analyzer, reads colour, shape and direction back from a tiny base's frames:
  ``val/colour``, ``val/shape``, ``val/direction``, ``val/adherence``);
- ``val/decode_s`` — wall seconds to decode and score (with ``vae_from``).

The scorer is a ``_target_`` the run config names, resolved under the allowed prefixes when the
config is built (:func:`distillery.config.loader.resolve_plugins`): the library never imports the
pipeline that may provide one.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from distillery.callbacks.base import Callback, CallbackContext
from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.config.targets import allowed_prefixes, resolve_target
from distillery.config.typed import bounded
from distillery.config.validation import MAX_PROMPTS, ValidationSampling

if TYPE_CHECKING:
    import numpy as np

    from distillery.models.base import Conditioning, ModelBase

log = get_logger("callbacks.validation")


@dataclass
class ValidationCallbackConfig(ValidationSampling):
    """``num_prompts`` (the first this-many rows of the split), ``seed`` (prompt i: a generator seeded
    seed + i, the same on every rank) and ``fps`` (the logged GIF grid's) are the shared validation
    settings; the rest is the callback's own."""

    where: ClassVar[str] = "callbacks.validation"
    plugin_fields: ClassVar[tuple[str, ...]] = ("scorer",)  # resolved as _target_s when the run config is built

    num_prompts: int = bounded(4, 1, MAX_PROMPTS)  # the first this-many rows of the split are the fixed prompts
    data_path: str = ""  # latent set folder (the latents stage's data/) whose prompts and text embeddings are sampled
    split: str | None = None  # split of data_path to read; null: "validation" when it exists, else "train"
    every_steps: int = 100  # validate at step 0 and every this many optimizer steps
    num_steps: int | None = bounded(None, 1, 1000)  # sampler steps; null: the sampling contract's default
    guidance_scale: float | None = None  # CFG scale (> 1: CFG on); null: the sampling contract's (default 1)
    role: str = "student"  # the role model to sample
    text_max_length: int = bounded(512, 1, 4096)  # embeddings zero-padded/truncated to this many tokens (= training.data.text_max_length)
    vae_from: str | None = None  # diffusers folder whose vae/ decodes the samples; null: no videos
    # _target_ of the video scorer: called with the vae_from folder, it returns None (nothing to score there) or a
    # function (frames uint8 [T, H, W, 3], caption) -> {name: bool}; e.g. distillery.clips.analyzer.folder_scorer; null: none
    scorer: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the shared bounds (num_prompts, seed, fps)
        if not self.data_path:
            raise ValueError("data_path is required: the latent set folder whose prompts are sampled")
        if self.every_steps < 1:
            raise ValueError("every_steps must be >= 1")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ValueError("guidance_scale must be >= 0")


@dataclass
class ValidationPrompts:
    """The fixed prompts of a validation run, read once from a latent set."""

    captions: list[str]  # N captions
    text_embeds: torch.Tensor  # float32 [N, L, D], zero-padded to text_max_length
    negative_text_embeds: torch.Tensor | None  # float32 [N, L, D] empty-prompt embedding, or None (zeros)
    latent_shape: tuple[int, int, int, int]  # (C, T, H, W) of one stored latent
    first_frame: torch.Tensor | None = None  # image-to-video set: float32 [N, M + C, T, H, W] each prompt's clip's frame
    image_embeds: torch.Tensor | None = None  # image-to-video set: float32 [N, K, D_img] its image embeddings

    @classmethod
    def read(cls, root: Path, split: str | None, count: int, text_max_length: int) -> "ValidationPrompts":
        """The first ``count`` rows of ``root/<split>`` (fewer when the split is shorter)."""
        from distillery.data import LatentDataset, collate_latents, data_kind, pad_prompt_embedding, read_empty_prompt_embedding

        root = Path(root)
        if split is None:
            split = "validation" if (root / "validation").is_dir() else "train"
        prompts_only = data_kind(root) == "prompts"  # a prompt-only set: the shape its manifest records, no latents read
        data = LatentDataset(root, split, with_latents=not prompts_only)
        items = [data[i] for i in range(min(count, len(data)))]
        batch = collate_latents(items, text_max_length, dtype=torch.float32)
        empty = read_empty_prompt_embedding(root)
        negative = None
        if empty is not None:
            padded = pad_prompt_embedding(empty, text_max_length, torch.float32)
            negative = padded.unsqueeze(0).expand(len(items), -1, -1).contiguous()
        if prompts_only:
            from distillery.data.dataset import recorded_latent_shape

            recorded = recorded_latent_shape(root, split)
            if recorded is None:
                raise UserError(f"callbacks validation: {root} records no latent_shape; rerun the prompts stage")
            shape = tuple(recorded)
        else:
            shape = tuple(int(s) for s in batch["latents"].shape[1:])
        return cls(batch["captions"], batch["text_embeds"], negative, shape,  # type: ignore[arg-type]
                   batch.get("first_frame"), batch.get("image_embeds"))

    def conditioning(self) -> "Conditioning":
        from distillery.models.base import Conditioning

        return Conditioning(self.text_embeds, self.negative_text_embeds, self.first_frame, self.image_embeds)


Score = Callable[["np.ndarray", str], dict[str, bool]]  # (frames uint8 [T, H, W, 3], caption) -> {name: scored true}


class VideoScorer:
    """A diffusers folder's VAE (decoding normalised latents to frames) and the scorer plugin's
    function for that folder (``score``: None when there is nothing to score)."""

    def __init__(self, folder: Path, device: torch.device, scorer: Callable[[Path], Score | None] | None = None) -> None:
        from distillery.data.vae_codecs import vae_kind

        folder = Path(folder)
        if not (folder / "vae").is_dir():
            raise UserError(f"callbacks validation.vae_from: {folder} has no vae/ folder; point it at a diffusers model folder")
        self.device = device
        self.vae = vae_kind(folder).load(folder / "vae", torch.float32, device)
        self.score: Score | None = scorer(folder) if scorer is not None else None

    @torch.no_grad()
    def decode_raw(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``[1, C, T', H', W']`` → the VAE's video ``float32 [1, 3, T, H, W]`` as decoded, before
        the clamp to ``[-1, 1]`` (a value at or beyond ±1 is a clipped pixel)."""
        from distillery.data.encoders import denormalize_latents

        z = denormalize_latents(self.vae, latents.float().to(self.device))
        return self.vae.decode(z, return_dict=False)[0].float()

    def decode(self, latents: torch.Tensor) -> "np.ndarray":
        """Normalised latents ``[1, C, T', H', W']`` → ``uint8 [T, H, W, 3]`` frames (as the VAE's pipeline decodes)."""
        video = self.decode_raw(latents).clamp(-1, 1)
        return ((video + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 3, 0).cpu().numpy()


class ValidationCallback(Callback):
    """Samples fixed prompts at step 0 and every ``every_steps``; logs numbers and a GIF grid (rank 0)."""

    config_class = ValidationCallbackConfig
    role_fields = ("role",)  # a role of the run, checked before any model loads

    def __init__(self, config: ValidationCallbackConfig, name: str, plugins: dict[str, Any] | None = None) -> None:
        """``plugins``: the resolved ``scorer`` (the run config's, :attr:`Component.plugins`); built
        directly, the callback resolves ``config.scorer`` under the default allowed prefixes."""
        super().__init__(config, name)
        self._prompts: ValidationPrompts | None = None
        self._scorer: VideoScorer | None = None
        plugins = dict(plugins or {})
        if config.scorer is not None and "scorer" not in plugins:
            plugins["scorer"] = resolve_target(config.scorer, f"callbacks.{name}.scorer", allowed_prefixes())
        self._score_plugin: Callable[[Path], Score | None] | None = plugins.get("scorer")

    def on_loop_start(self, ctx: CallbackContext, step: int) -> None:
        if step == 0:
            self.validate(ctx, 0)

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        if step > 0 and step % self.config.every_steps == 0:
            self.validate(ctx, step)
        return {}

    def _model(self, ctx: CallbackContext) -> "ModelBase":
        if self.config.role not in ctx.roles:
            raise UserError(f"callbacks.{self.name}.role: {self.config.role!r} is not a role of this run; "
                            f"valid: {', '.join(sorted(ctx.roles))}")
        return ctx.roles[self.config.role]

    def validate(self, ctx: CallbackContext, step: int) -> dict[str, float]:
        """Sample, (on rank 0) decode, score and log; returns the metrics (every rank: the sampling ones)."""
        from distillery.sampling import build_sampler

        cfg = self.config
        model = self._model(ctx)
        sampler = build_sampler(ctx.sampling if ctx.sampling is not None else {"sampler": "euler"})
        if self._prompts is None:
            self._prompts = ValidationPrompts.read(Path(cfg.data_path), cfg.split, cfg.num_prompts, cfg.text_max_length)
        prompts = self._prompts
        generators = [torch.Generator().manual_seed(cfg.generator_seed(i)) for i in range(len(prompts.captions))]
        started = time.perf_counter()
        with eval_mode(model), torch.no_grad():
            latents = sampler.sample(model, prompts.conditioning(), prompts.latent_shape, generators,
                                     num_steps=cfg.num_steps, guidance_scale=cfg.guidance_scale)
        _synchronize(model.device)
        metrics = {
            "val/latent_std": float(latents.std()),
            "val/latent_mean": float(latents.mean()),
            "val/sample_s": time.perf_counter() - started,
            "val/nfe": float(sampler.nfe(cfg.num_steps, cfg.guidance_scale)),
        }
        if ctx.rank == 0:
            if cfg.vae_from:
                metrics.update(self._videos(ctx, step, latents, model.device))
            if ctx.tracker is not None:
                ctx.tracker.log_metrics(metrics, step)
            log.info("validation at step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def _videos(self, ctx: CallbackContext, step: int, latents: torch.Tensor, device: torch.device) -> dict[str, float]:
        """Decode each sample, score it when the analyzer is known, log the grid; returns the video metrics."""
        from distillery.common.videogrid import VideoGrid, write_gif

        started = time.perf_counter()
        if self._scorer is None:
            self._scorer = VideoScorer(Path(self.config.vae_from), device, self._score_plugin)
        captions = self._prompts.captions
        videos = [self._scorer.decode(latents[i: i + 1]) for i in range(latents.shape[0])]
        frames, height, width = videos[0].shape[:3]
        grid = VideoGrid(1, len(videos), frames, height, width)
        for i, video in enumerate(videos):
            grid.put(0, i, video)
        metrics: dict[str, float] = {}
        if self._scorer.score is not None:
            hits: dict[str, int] = {}
            for video, caption in zip(videos, captions):
                for key, ok in self._scorer.score(video, caption).items():
                    hits[key] = hits.get(key, 0) + int(bool(ok))
            metrics.update({f"val/{k}": n / len(videos) for k, n in hits.items()})
        metrics["val/decode_s"] = time.perf_counter() - started
        if ctx.tracker is not None:
            with tempfile.TemporaryDirectory(prefix="validation-") as tmp:
                path = write_gif(Path(tmp) / f"step_{step:06d}.gif", grid.pixels, self.config.fps)
                ctx.tracker.log_artifact(path, "validation")
        return metrics


class eval_mode:
    """Put a role's modules in eval mode for sampling and restore their training flags after."""

    def __init__(self, model: "ModelBase") -> None:
        self.modules = list({id(m): m for m in (model.transformer, model.forward_module)}.values())
        self.flags: list[bool] = []

    def __enter__(self) -> None:
        self.flags = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()

    def __exit__(self, *exc: Any) -> None:
        for m, flag in zip(self.modules, self.flags):
            m.train(flag)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
