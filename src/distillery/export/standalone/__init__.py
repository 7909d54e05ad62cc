"""The code an export folder carries: plain modules that import only the standard library, torch,
diffusers and transformers (``tests/test_export_standalone.py`` parses their imports), copied by the
export stage into the folder's top level (:data:`distillery.export.code.SHIPPED_MODULES`) — so a
distilled model samples with nothing of distillery installed:

- ``pipeline.py`` — :class:`DistilledWanPipeline`, the pipeline diffusers loads with
  ``custom_pipeline=<folder>``; it imports the other modules relatively (diffusers copies exactly the
  modules a custom pipeline imports that way);
- ``distilled_schedule.py`` — the flow-matching maths (σ grids, x0 ↔ velocity, re-noise, PDD blocks);
- ``distilled_samplers.py`` — the samplers of a ``sampling.json`` (``euler``, ``few_step_x0``,
  ``causal_streaming``, ``pdd_fused``);
- ``distilled_wan.py`` — the denoisers over the pipeline's ``WanTransformer3DModel`` (plain, PDD heads);
- ``distilled_causal.py`` — block-causal self-attention and its KV cache (the Self-Forcing student);
- ``pipeline_cosmos.py`` — :class:`DistilledCosmosPipeline`, a Cosmos Predict 2.5 export's own pipeline (its
  ``model_index.json`` names ``["pipeline_cosmos", "DistilledCosmosPipeline"]``), on ``pipeline.py``'s shared parts;
- ``distilled_cosmos.py`` — the denoiser over the pipeline's ``CosmosTransformer3DModel``;
- ``pipeline_hunyuan15.py`` — :class:`DistilledHunyuanVideo15Pipeline`, a HunyuanVideo 1.5 export's own pipeline (its
  ``model_index.json`` names ``["pipeline_hunyuan15", "DistilledHunyuanVideo15Pipeline"]``);
- ``distilled_hunyuan15.py`` — the denoiser over the pipeline's ``HunyuanVideo15Transformer3DModel`` (its two prompt
  streams packed side by side, as distillery stores them);
- ``distilled_fast.py`` — the GPU path: FlashAttention-4, compiled blocks, fused chunked VAE decode, fp8 on request;
- ``distilled_sparse.py`` — a student trained with block-sparse video attention samples with it;
- ``distilled_decode.py`` — latents to frames: the whole video's decode with its host copy overlapped, and a causal
  student's chunks decoded as they finish (``DistilledWanPipeline.stream``);
- ``sparse_attention.py`` — that attention, shipped from :mod:`distillery.models.wan.sparse_attention` (the code the
  student trained with; registered below like the VAE decode's modules);
- ``vae_decode.py``, ``vae_kernels.py`` — the fused chunked VAE decode, shipped from :mod:`distillery.data` (the code
  validate decodes with). In the folder they sit beside ``pipeline.py``; in this package the same relative imports
  (``from .vae_decode import …``) find :mod:`distillery.data.vae_decode` and :mod:`distillery.data.vae_kernels`
  under these names (registered below), so the package and the folder run one and the same code.

The training library keeps its own implementations (:mod:`distillery.sampling`, :mod:`distillery.models`);
these reproduce their latents (the same operations in the same order; tests compare them bit for bit on the CPU).
This ``__init__`` is not copied.
"""

import sys

from distillery.data import vae_decode as _vae_decode
from distillery.data import vae_kernels as _vae_kernels
from distillery.models.wan import sparse_attention as _sparse_attention

sys.modules[f"{__name__}.vae_decode"] = _vae_decode
sys.modules[f"{__name__}.vae_kernels"] = _vae_kernels
sys.modules[f"{__name__}.sparse_attention"] = _sparse_attention
