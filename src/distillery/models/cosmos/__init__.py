"""Cosmos Predict 2.5 model plugins over ``diffusers.CosmosTransformer3DModel``: the ``cosmos-predict2.5`` family.

- :mod:`.common` — locating a diffusers Cosmos folder, the config knobs, building a transformer from its config, its
  input widths (latent = ``out_channels``; text = the Qwen2.5-VL layers it projects, ``crossattn_proj_in_channels``);
- :mod:`.bidirectional` — :class:`CosmosModel`, full attention, text-to-world; how diffusers'
  ``Cosmos2_5_PredictBasePipeline`` conventions (σ as the timestep, the condition-mask channel, its guidance form) map
  onto ours is its module doc;
- :mod:`.causal` — :class:`CausalCosmosModel`, block-causal attention over frame chunks + a KV cache (the block-causal
  half is Wan's module, every family's);
- :mod:`.pdd` — :class:`PDDCosmosModel`, the trunk with a PDD head bank (the bank is Wan's module, every family's);
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain folder (validate, export).

``distillery.models.cosmos.CosmosModel`` / ``CausalCosmosModel`` / ``PDDCosmosModel`` are the run configs' ``_target_``s; the loaders below are
the family's :class:`distillery.models.registry.FamilyLoaders`.
"""

from __future__ import annotations

from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.causal import CausalCosmosModel, CausalCosmosModelConfig
from distillery.models.cosmos.common import (
    TRANSFORMER_CLASS,
    CosmosModelConfig,
    build_transformer,
    image_conditioning,
    input_widths,
    locate_transformer,
)
from distillery.models.cosmos.inference import load_inference_model
from distillery.models.cosmos.pdd import PDDCosmosModel, PDDCosmosModelConfig
from distillery.models.wan.experts import lay_out_given_model  # a given folder's transformer as an artifact holds it (one expert here)
from distillery.models.wan.pdd import HEADS_FILE as HEAD_BANK_FILE
from distillery.models.wan.pdd import empty_head_bank, save_head_bank  # the head bank is every family's (its module doc)

MODEL_CLASSES: dict[str, type] = {"bidirectional": CosmosModel, "causal": CausalCosmosModel, "pdd": PDDCosmosModel}  # by kind (registry.STUDENT_KINDS)

__all__ = ["HEAD_BANK_FILE", "MODEL_CLASSES", "TRANSFORMER_CLASS", "CausalCosmosModel", "CausalCosmosModelConfig", "CosmosModel",
           "CosmosModelConfig", "PDDCosmosModel",
           "PDDCosmosModelConfig", "build_transformer", "empty_head_bank", "image_conditioning", "input_widths",
           "lay_out_given_model", "load_inference_model", "locate_transformer", "save_head_bank"]
