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
- ``distilled_causal.py`` — block-causal self-attention and its KV cache (the Self-Forcing student).

The training library keeps its own implementations (:mod:`distillery.sampling`, :mod:`distillery.models`);
these reproduce their latents (the same operations in the same order; tests compare them bit for bit on the CPU).
This ``__init__`` is not copied.
"""
