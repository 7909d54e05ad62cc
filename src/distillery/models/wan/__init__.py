"""Wan model plugins over ``diffusers.WanTransformer3DModel``: the ``wan2.1``, ``wan2.2-ti2v-5b`` and
``wan2.2-a14b`` model families (one package: the layout of a folder, :mod:`.experts`, is what differs).

- :mod:`.common` — locating a diffusers Wan folder, the shared config knobs, building a transformer
  from its config;
- :mod:`.bidirectional` — :class:`WanModel`, the full-attention text-to-video transformer;
- :mod:`.causal` — :class:`CausalWanModel`, block-causal attention over frame chunks + a KV cache
  for chunk-by-chunk streaming (same weights and layout);
- :mod:`.pdd` — :class:`PDDWanModel`, the trunk with a bank of per-interval output heads (PDD);
- :mod:`.experts` — Wan 2.2's layouts: per-token timesteps (TI2V-5B) and the two experts of A14B
  (:class:`WanExperts`, each sample to the expert of its timestep);
- :mod:`.inference` — :func:`load_inference_model`, a frozen plugin over a plain diffusers folder
  (validate, export, in-training validation of a teacher folder);
- :mod:`.attention` — the attention backends (``auto``: FlashAttention-4 on SM90+ GPUs, else SDPA).

``distillery.models.wan.WanModel`` / ``CausalWanModel`` / ``PDDWanModel`` are the names run
configs use as ``_target_``. The family's loaders — :func:`locate_transformer`,
:func:`load_inference_model`, :func:`build_transformer`, :func:`input_widths`, :func:`image_conditioning`
(a transformer config's first-frame conditioning, Wan 2.1 image-to-video; None for text-to-video), :data:`HEAD_BANK_FILE`,
:func:`empty_head_bank`, :func:`save_head_bank`, :func:`lay_out_given_model` (a given folder's transformer laid out
as a trained artifact holds it: both experts, the layout in its config) — are what :mod:`distillery.models.registry` hands
the stages, validate and export for a folder whose transformer is a ``WanTransformer3DModel``
(:class:`distillery.models.registry.FamilyLoaders` is the contract); they never import this package.
"""

from distillery.models.wan.bidirectional import WanModel
from distillery.models.wan.causal import CausalWanModel, CausalWanModelConfig
from distillery.models.wan.common import (
    TRANSFORMER_CLASS,
    ImageConditioning,
    WanModelConfig,
    build_transformer,
    image_conditioning,
    input_widths,
    locate_transformer,
)
from distillery.models.wan.experts import lay_out_given_model
from distillery.models.wan.inference import load_inference_model
from distillery.models.wan.pdd import HEADS_FILE as HEAD_BANK_FILE
from distillery.models.wan.pdd import PDDWanModel, PDDWanModelConfig, empty_head_bank, save_head_bank

MODEL_CLASSES: dict[str, type] = {"bidirectional": WanModel, "causal": CausalWanModel, "pdd": PDDWanModel}  # by kind (registry.STUDENT_KINDS)

__all__ = ["HEAD_BANK_FILE", "MODEL_CLASSES", "TRANSFORMER_CLASS", "CausalWanModel", "CausalWanModelConfig", "ImageConditioning", "PDDWanModel",
           "PDDWanModelConfig", "WanModel", "WanModelConfig", "build_transformer", "empty_head_bank", "image_conditioning",
           "input_widths", "lay_out_given_model", "load_inference_model",
           "locate_transformer", "save_head_bank"]
