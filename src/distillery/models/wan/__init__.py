"""Wan 2.1 model plugins over ``diffusers.WanTransformer3DModel``.

- :mod:`.common` — locating a diffusers Wan folder, the shared config knobs;
- :mod:`.bidirectional` — :class:`WanModel`, the full-attention text-to-video transformer;
- :mod:`.causal` — :class:`CausalWanModel`, block-causal attention over frame chunks + a KV cache
  for chunk-by-chunk streaming (same weights and layout);
- :mod:`.pdd` — :class:`PDDWanModel`, the trunk with a bank of per-interval output heads (PDD);
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain diffusers folder
  (validate, export, in-training validation of a teacher folder);
- :mod:`.attention` — the attention backends (``auto``: FlashAttention-4 on SM90+ GPUs, else SDPA).

``distillery.models.wan.WanModel`` / ``CausalWanModel`` / ``PDDWanModel`` are the names run
configs use as ``_target_``.
"""

from distillery.models.wan.bidirectional import WanModel
from distillery.models.wan.causal import CausalWanModel, CausalWanModelConfig
from distillery.models.wan.common import TRANSFORMER_CLASS, WanModelConfig, locate_transformer
from distillery.models.wan.inference import load_inference_model
from distillery.models.wan.pdd import PDDWanModel, PDDWanModelConfig

__all__ = ["TRANSFORMER_CLASS", "CausalWanModel", "CausalWanModelConfig", "PDDWanModel", "PDDWanModelConfig", "WanModel", "WanModelConfig",
           "load_inference_model", "locate_transformer"]
