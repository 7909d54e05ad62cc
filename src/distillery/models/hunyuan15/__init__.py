"""HunyuanVideo 1.5 model plugins over ``diffusers.HunyuanVideo15Transformer3DModel``: the ``hunyuanvideo1.5`` family.

- :mod:`.common` — locating a diffusers HunyuanVideo 1.5 folder, the config knobs, building a transformer from its
  config, its input widths (latent = ``out_channels``; prompt = the Qwen2.5-VL and ByT5 streams side by side), why a
  causal student is refused (:data:`CAUSAL_REFUSAL`);
- :mod:`.bidirectional` — :class:`HunyuanVideo15Model`, full attention, text-to-video; how diffusers'
  ``HunyuanVideo15Pipeline`` conventions (its σ grid, the 65-channel input, two masked prompt streams, zero image
  tokens, a scaled VAE) map onto ours is its module doc;
- :mod:`.pdd` — :class:`PDDHunyuanVideo15Model`, the trunk with a PDD head bank (the bank is Wan's module, every family's);
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain folder (validate, export).

``distillery.models.hunyuan15.HunyuanVideo15Model`` / ``PDDHunyuanVideo15Model`` are the run configs' ``_target_``s;
the loaders below are the family's :class:`distillery.models.registry.FamilyLoaders`.
"""

from __future__ import annotations

from distillery.models.hunyuan15.bidirectional import HunyuanVideo15Model
from distillery.models.hunyuan15.common import (
    CAUSAL_REFUSAL,
    TRANSFORMER_CLASS,
    HunyuanVideo15ModelConfig,
    build_transformer,
    image_conditioning,
    input_widths,
    locate_transformer,
)
from distillery.models.hunyuan15.inference import load_inference_model
from distillery.models.hunyuan15.pdd import PDDHunyuanVideo15Model, PDDHunyuanVideo15ModelConfig
from distillery.models.wan.experts import lay_out_given_model  # a given folder's transformer as an artifact holds it (one expert here)
from distillery.models.wan.pdd import HEADS_FILE as HEAD_BANK_FILE
from distillery.models.wan.pdd import empty_head_bank, save_head_bank  # the head bank is every family's (its module doc)

MODEL_CLASSES: dict[str, type] = {"bidirectional": HunyuanVideo15Model, "pdd": PDDHunyuanVideo15Model}  # no causal student (registry: its refusal)

__all__ = ["CAUSAL_REFUSAL", "HEAD_BANK_FILE", "MODEL_CLASSES", "TRANSFORMER_CLASS", "HunyuanVideo15Model", "HunyuanVideo15ModelConfig",
           "PDDHunyuanVideo15Model", "PDDHunyuanVideo15ModelConfig", "build_transformer", "empty_head_bank",
           "image_conditioning", "input_widths", "lay_out_given_model", "load_inference_model", "locate_transformer",
           "save_head_bank"]
