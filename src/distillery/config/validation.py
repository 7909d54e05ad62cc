"""What a validation samples: the settings the validate stage and the in-training validation callback share.

Both sample the first ``num_prompts`` captions of a latent set (its validation split, else its train
split) through a model's registered sampler; prompt ``i`` with seed index ``j`` starts from the noise of
a ``torch.Generator`` seeded :meth:`ValidationSampling.generator_seed` (``seed + i + SEED_STRIDE·j``:
seed index 0 is ``seed + i``), so the callback's samples during training are the validate stage's
seed-0 samples of the same prompts; videos and grids are written at ``fps`` frames per second.

:class:`distillery.evaluation.validation_config.ValidationConfig` (the ``validate`` stage, filled from
``params.yaml: seed`` and ``validate``) and :class:`distillery.callbacks.validation.ValidationCallbackConfig`
(a run config's ``callbacks.<name>``) extend :class:`ValidationSampling`. Its bounds hold however the
config is made: read from a run config (:func:`distillery.config.typed.from_mapping`) or built in Python
(:func:`distillery.config.typed.check_fields`, from ``__post_init__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distillery.config.schema import MAX_SEED
from distillery.config.typed import bounded, check_fields

SEED_STRIDE = 1000  # seed index j shifts every prompt's generator seed by SEED_STRIDE·j
MAX_PROMPTS = 10_000  # validation prompts of one run
MIN_FPS, MAX_FPS = 1.0, 240.0  # frames per second of a written video (a ratio of small integers)


@dataclass
class ValidationSampling:
    """The prompts, the noise and the video rate of a validation (module doc)."""

    where: ClassVar[str] = "validation"  # how errors name the config (a subclass names its own)

    num_prompts: int = bounded(8, 1, MAX_PROMPTS)  # the first this-many captions of the latent set are the prompts
    seed: int = bounded(0, 0, MAX_SEED)  # prompt i, seed index j: noise of a generator seeded seed + i + SEED_STRIDE·j
    fps: float = bounded(8.0, MIN_FPS, MAX_FPS)  # frame rate of the written videos and grids

    def __post_init__(self) -> None:
        check_fields(self, self.where)

    def generator_seed(self, prompt_index: int, seed_index: int = 0) -> int:
        """Seed of the ``torch.Generator`` that draws the noise of prompt ``prompt_index``, seed index ``seed_index``."""
        return self.seed + prompt_index + SEED_STRIDE * seed_index
