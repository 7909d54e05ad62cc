"""A frozen Wan model plugin over a plain diffusers folder, for validation and export.

Validate and export sample through the same samplers as training, and samplers only talk to a
model plugin; :func:`load_inference_model` gives them one for any folder :func:`locate_transformer`
accepts (a diffusers Wan folder, or an artifact's ``model/`` with ``transformer/``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from distillery.common.errors import UserError
from distillery.models.base import ready_for_inference
from distillery.models.wan.bidirectional import WanModel
from distillery.models.wan.common import WanModelConfig


def load_inference_model(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         shift: float | None = None, role: str = "inference", chunk_size: int | None = None,
                         transformer: torch.nn.Module | None = None, pdd_steps: int | None = None,
                         attention_backend: str = "auto") -> WanModel:
    """Load ``folder``'s transformer as an eval, gradient-free :class:`WanModel` on ``device`` — or,
    with ``chunk_size``, as a :class:`~distillery.models.wan.causal.CausalWanModel` attending
    block-causally over chunks of that many latent frames (what ``Sampler.model_options()`` asks) — or,
    with ``pdd_steps``, as a :class:`~distillery.models.wan.pdd.PDDWanModel` whose head bank comes from
    the folder's ``pdd_heads.safetensors`` (:class:`UserError` when the folder has no such bank).
    ``transformer``: wrap this already loaded transformer of ``folder`` instead of loading it (it is
    set to eval and frozen in place).

    ``dtype``: the weights' and inputs' dtype (``predict_noise`` still returns float32); the modules
    diffusers keeps in float32 (``_keep_in_fp32_modules``: norms, time embedder, rope) stay float32,
    as ``from_pretrained(torch_dtype=dtype)`` leaves them. ``shift``:
    the flow shift; None reads it from the scheduler config beside the weights (:class:`UserError`
    when there is none). A transformer that trained with sparse attention samples with it (``attention: auto`` reads
    its ``config.json``'s record, :mod:`~distillery.models.wan.sparse`). ``attention_backend``: as
    ``training.model.attention_backend`` (:mod:`.attention`; ``auto``:
    FlashAttention-4 on an SM90+ GPU in bf16/fp16 where ``flash_attn.cute`` imports, else SDPA). Raises
    :class:`UserError` for a folder that holds no Wan transformer.
    """
    device = torch.device(device)
    if pdd_steps is not None:
        from distillery.models.wan.common import locate_transformer
        from distillery.models.wan.pdd import HEADS_FILE, PDDWanModel, PDDWanModelConfig

        if not (locate_transformer(folder)[0] / HEADS_FILE).is_file():
            raise UserError(f"{folder}: no {HEADS_FILE} beside the transformer weights; a PDD sampling contract needs "
                            "the PDD stage's head bank")
        model: WanModel = PDDWanModel(PDDWanModelConfig(init_from=str(folder), trainable=False, shift=shift,
                                                        pdd_steps=int(pdd_steps)), role=role, transformer=transformer)
    elif chunk_size is not None:
        from distillery.models.wan.causal import CausalWanModel, CausalWanModelConfig

        model = CausalWanModel(CausalWanModelConfig(init_from=str(folder), trainable=False, shift=shift,
                                                              chunk_size=int(chunk_size)), role=role, transformer=transformer)
    else:
        model = WanModel(WanModelConfig(init_from=str(folder), trainable=False, shift=shift), role=role, transformer=transformer)
    ready_for_inference(model, device, dtype, attention_backend)
    return model
