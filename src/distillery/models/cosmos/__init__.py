"""Cosmos Predict 2.5 model plugins over ``diffusers.CosmosTransformer3DModel``: the ``cosmos-predict2.5`` family.

- :mod:`.common` — locating a diffusers Cosmos folder, the config knobs, building a transformer from its config, its
  input widths (latent = ``out_channels``; text = the Qwen2.5-VL layers it projects, ``crossattn_proj_in_channels``);
- :mod:`.bidirectional` — :class:`CosmosModel`, full attention, text-to-world; how diffusers'
  ``Cosmos2_5_PredictBasePipeline`` conventions (σ as the timestep, the condition-mask channel, its guidance form) map
  onto ours is its module doc;
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain folder (validate, export).

A causal (chunk-by-chunk) or PDD Cosmos student is one line (:data:`.inference.CAUSAL_REFUSAL`,
:data:`.inference.PDD_REFUSAL`). ``distillery.models.cosmos.CosmosModel`` is the run configs' ``_target_``; the loaders
below are the family's :class:`distillery.models.registry.FamilyLoaders`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.common import (
    TRANSFORMER_CLASS,
    CosmosModelConfig,
    build_transformer,
    image_conditioning,
    input_widths,
    locate_transformer,
)
from distillery.models.cosmos.inference import CAUSAL_REFUSAL, PDD_REFUSAL, load_inference_model

HEAD_BANK_FILE = "pdd_heads.safetensors"  # the name a PDD head bank would have (none is built: PDD_REFUSAL)


def empty_head_bank(transformer: Any, num_heads: int) -> Any:
    """Refused (one line): no PDD head bank is built for Cosmos (:data:`PDD_REFUSAL`)."""
    del transformer, num_heads
    raise UserError(PDD_REFUSAL)


def save_head_bank(path: Path, bank: Any) -> None:
    """Refused (one line): no PDD head bank is built for Cosmos (:data:`PDD_REFUSAL`)."""
    del path, bank
    raise UserError(PDD_REFUSAL)


__all__ = ["CAUSAL_REFUSAL", "HEAD_BANK_FILE", "PDD_REFUSAL", "TRANSFORMER_CLASS", "CosmosModel", "CosmosModelConfig",
           "build_transformer", "empty_head_bank", "image_conditioning", "input_widths", "load_inference_model",
           "locate_transformer", "save_head_bank"]
