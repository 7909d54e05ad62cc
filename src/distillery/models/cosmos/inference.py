"""A frozen Cosmos plugin over a plain diffusers folder, for validation and export (as :mod:`distillery.models.wan.inference`
is Wan's)."""

from __future__ import annotations

from pathlib import Path

import torch

from distillery.common.errors import UserError
from distillery.models.base import ready_for_inference
from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.common import CosmosModelConfig


def load_inference_model(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         shift: float | None = None, role: str = "inference", chunk_size: int | None = None,
                         transformer: torch.nn.Module | None = None, pdd_steps: int | None = None,
                         attention_backend: str = "auto") -> CosmosModel:
    """``folder``'s ``CosmosTransformer3DModel`` as an eval, gradient-free :class:`CosmosModel` on ``device`` in
    ``dtype`` (diffusers' fp32 modules stay fp32) — or, with ``pdd_steps``, as a PDD student whose head bank is the
    folder's (:mod:`.pdd`; :class:`UserError` when it has none) — or, with ``chunk_size``, as a causal student
    attending block-causally over chunks of that many latent frames (:mod:`.causal`). ``shift`` None: the
    scheduler's. ``attention_backend``: ``auto`` and ``native`` run diffusers' SDPA dispatch (Cosmos offers no other)."""
    device = torch.device(device)
    if chunk_size is not None:
        from distillery.models.cosmos.causal import CausalCosmosModel, CausalCosmosModelConfig

        model: CosmosModel = CausalCosmosModel(CausalCosmosModelConfig(init_from=str(folder), trainable=False, shift=shift,
                                                                       chunk_size=int(chunk_size)), role=role,
                                               transformer=transformer)
        return ready_for_inference(model, device, dtype, attention_backend)
    if pdd_steps is not None:
        from distillery.models.cosmos.common import locate_transformer
        from distillery.models.cosmos.pdd import PDDCosmosModel, PDDCosmosModelConfig
        from distillery.models.wan.pdd import HEADS_FILE

        if not (locate_transformer(folder)[0] / HEADS_FILE).is_file():
            raise UserError(f"{folder}: no {HEADS_FILE} beside the transformer weights; a PDD sampling contract needs "
                            "the PDD stage's head bank")
        model: CosmosModel = PDDCosmosModel(PDDCosmosModelConfig(init_from=str(folder), trainable=False, shift=shift,
                                                                 pdd_steps=int(pdd_steps)), role=role, transformer=transformer)
    else:
        model = CosmosModel(CosmosModelConfig(init_from=str(folder), trainable=False, shift=shift), role=role,
                            transformer=transformer)
    ready_for_inference(model, device, dtype, attention_backend)
    return model
