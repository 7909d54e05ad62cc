"""A frozen HunyuanVideo 1.5 plugin over a plain diffusers folder, for validation and export (as
:mod:`distillery.models.wan.inference` is Wan's)."""

from __future__ import annotations

from pathlib import Path

import torch

from distillery.common.errors import UserError
from distillery.models.base import ready_for_inference
from distillery.models.hunyuan15.bidirectional import HunyuanVideo15Model
from distillery.models.hunyuan15.common import CAUSAL_REFUSAL, HunyuanVideo15ModelConfig, locate_transformer


def load_inference_model(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         shift: float | None = None, role: str = "inference", chunk_size: int | None = None,
                         transformer: torch.nn.Module | None = None, pdd_steps: int | None = None,
                         attention_backend: str = "auto") -> HunyuanVideo15Model:
    """``folder``'s ``HunyuanVideo15Transformer3DModel`` as an eval, gradient-free :class:`HunyuanVideo15Model` on
    ``device`` in ``dtype`` (diffusers' fp32 modules stay fp32) — or, with ``pdd_steps``, as a PDD student whose head
    bank is the folder's (:mod:`.pdd`; :class:`UserError` when it has none). ``chunk_size`` (a causal student) is one
    line (:data:`~.common.CAUSAL_REFUSAL`). ``shift`` None: the scheduler's. ``attention_backend``: ``auto`` and
    ``native`` run diffusers' SDPA dispatch (HunyuanVideo 1.5 offers no other)."""
    device = torch.device(device)
    if chunk_size is not None:
        raise UserError(f"{folder}: {CAUSAL_REFUSAL}")
    if pdd_steps is not None:
        from distillery.models.hunyuan15.pdd import PDDHunyuanVideo15Model, PDDHunyuanVideo15ModelConfig
        from distillery.models.wan.pdd import HEADS_FILE

        if not (locate_transformer(folder)[0] / HEADS_FILE).is_file():
            raise UserError(f"{folder}: no {HEADS_FILE} beside the transformer weights; a PDD sampling contract needs "
                            "the PDD stage's head bank")
        model: HunyuanVideo15Model = PDDHunyuanVideo15Model(
            PDDHunyuanVideo15ModelConfig(init_from=str(folder), trainable=False, shift=shift, pdd_steps=int(pdd_steps)),
            role=role, transformer=transformer)
    else:
        model = HunyuanVideo15Model(HunyuanVideo15ModelConfig(init_from=str(folder), trainable=False, shift=shift),
                                    role=role, transformer=transformer)
    return ready_for_inference(model, device, dtype, attention_backend)
