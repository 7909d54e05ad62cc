"""Wan 2.1 model plugins over ``diffusers.WanTransformer3DModel``.

- :mod:`.common` — locating a diffusers Wan folder, the shared config knobs;
- :mod:`.bidirectional` — :class:`WanModel`, the full-attention text-to-video transformer;
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain diffusers folder
  (validate, export, in-training validation of a teacher folder).

``distillery.models.wan.WanModel`` is the name run configs use as ``_target_``.
"""

from distillery.models.wan.bidirectional import TRANSFORMER_CLASS, WanModel, WanModelConfig, locate_transformer
from distillery.models.wan.inference import load_inference_model

__all__ = ["TRANSFORMER_CLASS", "WanModel", "WanModelConfig", "load_inference_model", "locate_transformer"]
