"""Wan 2.1 model plugins over ``diffusers.WanTransformer3DModel``.

- :mod:`.common` — locating a diffusers Wan folder, the shared config knobs;
- :mod:`.bidirectional` — :class:`WanModel`, the full-attention text-to-video transformer.

``distillery.models.wan.WanModel`` is the name run configs use as ``_target_``.
"""

from distillery.models.wan.bidirectional import TRANSFORMER_CLASS, WanModel, WanModelConfig, locate_transformer

__all__ = ["TRANSFORMER_CLASS", "WanModel", "WanModelConfig", "locate_transformer"]
