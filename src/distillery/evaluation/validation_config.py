"""What a validation run samples and how: :class:`ValidationConfig` (``params.yaml: seed`` and ``validate``) and
the seed of each video's noise (:func:`generator_seed`). Contracts: :mod:`distillery.evaluation.validate`'s module doc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from distillery.common.errors import UserError
from distillery.config.validation import ValidationSampling
from distillery.evaluation.clip_scores import check_clip_folder

GRID_FORMATS = ("gif", "mp4")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class ValidationConfig(ValidationSampling):
    """What to sample and how; one per validation run (``params.yaml: seed`` and ``validate``). The
    prompts, the noise and the video rate are the fields every validation shares
    (:class:`~distillery.config.validation.ValidationSampling`: ``num_prompts``, the captions the
    validate stage takes from the latent set; ``seed``; ``fps``). Which models at which steps and guidance
    are the candidates, not this (:func:`~distillery.evaluation.candidates.teacher_candidates`, the validate
    stage's training-table rows)."""

    where: ClassVar[str] = "validate"

    prompts: list[str] | None = None  # prompts to sample; None: the clip validation captions given to run_validation
    num_frames: int = 17  # frames per video (VAE temporal factor × k + 1)
    height: int = 32  # video height, pixels
    width: int = 32  # video width, pixels
    num_seeds: int = 2  # noise draws per prompt (seed indices 0 .. num_seeds − 1); spreads are across them
    bootstrap_resamples: int = 200  # resamples of a candidate's videos for frechet_distance_std (< 2: std 0)
    grid_formats: list[str] = field(default_factory=lambda: ["gif", "mp4"])  # grid files to write
    max_sequence_length: int | None = None  # prompt length; None: the base model's (model card / tokenizer)
    device: str = "cpu"  # where the models run ("cpu", "cuda", "cuda:1", ...)
    precision: str = "auto"  # the candidates' weights and compute: fp32, bf16, or auto (bf16 on CUDA, fp32 elsewhere)
    vae_precision: str = "fp32"  # the VAE's decode: fp32 (the Wan model card's), bf16, or auto (bf16 on CUDA, fp32 elsewhere)
    vae_chunk_frames: int | None = None  # latent frames per VAE decoder call after the first; null: sized to the GPU, 1 on CPU
    compile: bool | None = None  # compile each transformer block of the candidates (regional); null: on for bf16 on CUDA
    progress_bar: bool = True  # progress over the videos: a bar on a terminal, else a log line per 10 % or minute
    clip_model: str | None = None  # a CLIP folder in transformers' layout: CLIP text/consistency and motion scores; None: off
    sample_batch: int = 1  # videos sampled and decoded in one batch (consecutive in sampling order); > 1: a GPU at small
    # shapes runs many videos in the time of one, each video's latency is then the batch's wall time / its size, and the
    # samples equal batch 1's up to floating-point rounding (the noise is each video's own generator either way)

    def __post_init__(self) -> None:
        super().__post_init__()  # the shared bounds (num_prompts, seed, fps)
        if self.num_frames < 1 or self.height < 1 or self.width < 1:
            raise UserError(f"validate: num_frames, height and width must be >= 1, got {self.num_frames}, "
                            f"{self.height}, {self.width}")
        bad = [f for f in self.grid_formats if f not in GRID_FORMATS]
        if bad:
            raise UserError(f"validate.grid_formats: unknown format {bad[0]!r}; valid: {', '.join(GRID_FORMATS)}")
        if self.num_seeds < 1:
            raise UserError(f"validate.num_seeds must be >= 1, got {self.num_seeds}")
        for name in ("precision", "vae_precision"):
            if getattr(self, name) not in PRECISIONS:
                raise UserError(f"validate.{name}: {getattr(self, name)!r}; valid: {', '.join(PRECISIONS)}")
        if self.vae_chunk_frames is not None and int(self.vae_chunk_frames) < 1:
            raise UserError(f"validate.vae_chunk_frames must be >= 1 or null, got {self.vae_chunk_frames}")
        if self.bootstrap_resamples < 0:
            raise UserError(f"validate.bootstrap_resamples must be >= 0, got {self.bootstrap_resamples}")
        if self.sample_batch < 1:
            raise UserError(f"validate.sample_batch must be >= 1, got {self.sample_batch}")
        if self.prompts is not None and not self.prompts:
            raise UserError("validate.prompts is empty; give at least one prompt or null for the validation captions")
        if self.clip_model is not None and not str(self.clip_model).strip():
            self.clip_model = None  # empty: off, as unset
        if self.clip_model is not None:  # one line before anything loads or samples
            self.clip_model = str(check_clip_folder(self.clip_model))


def generator_seed(cfg: ValidationConfig, prompt_index: int, seed_index: int) -> int:
    """Seed of the ``torch.Generator`` that draws the noise of video (prompt ``prompt_index``, seed index
    ``seed_index``): ``cfg.seed + prompt_index + SEED_STRIDE·seed_index`` (seed index 0: ``cfg.seed + i``;
    :meth:`~distillery.config.validation.ValidationSampling.generator_seed`, the callback's too)."""
    return cfg.generator_seed(prompt_index, seed_index)
